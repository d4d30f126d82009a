"""Hugging Face checkpoint folders <-> our params pytree (safetensors only, both directions).

Loading reads `config.json` and `model.safetensors` (or the shards named by
`model.safetensors.index.json`) through safetensors' memory-mapped reader, one layer tensor at a
time, and builds each leaf with `jax.make_array_from_callback`, so with `shardings` every device
receives only its own slice and the whole model is never materialized on one device.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from joyagents_jax.models import lora
from joyagents_jax.models.qwen2 import Params, Qwen2Config, param_shapes

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read as a Qwen2 model; the message says why and how."""


# ----------------------------------------------------------------------------------------------
# Config.
# ----------------------------------------------------------------------------------------------

def config_from_hf(folder: str, **overrides) -> Qwen2Config:
    """Reads `folder/config.json` into a `Qwen2Config` (dtype fields via `overrides`)."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} not found: a Hugging Face model folder needs config.json "
                              f"next to its *.safetensors files.")
    with open(path) as f:
        c = json.load(f)
    if c.get("model_type") != "qwen2":
        raise CheckpointError(f"{path}: model_type is {c.get('model_type')!r}, but joyagents-jax "
                              f"loads only 'qwen2' (Qwen2 / Qwen2.5) checkpoints.")
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise CheckpointError(f"{path}: rope type {rope_type!r} is not supported; only the "
                              f"default RoPE of Qwen2.5 is. Remove rope scaling from the config.")
    if c.get("use_sliding_window"):
        raise CheckpointError(f"{path}: use_sliding_window=true is not supported; Qwen2.5 "
                              f"checkpoints ship it false.")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise CheckpointError(f"{path}: head_dim {c['head_dim']} != hidden_size / "
                              f"num_attention_heads; Qwen2 derives head_dim from them.")
    return Qwen2Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=c.get("max_position_embeddings", 32768), **overrides)


def config_to_hf(cfg: Qwen2Config) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "use_sliding_window": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": cfg.param_dtype, "dtype": cfg.param_dtype,
    }


# ----------------------------------------------------------------------------------------------
# Name mapping: each leaf of our tree <-> HF tensor names and layout transforms.
# ----------------------------------------------------------------------------------------------

# our per-layer leaf -> (HF name inside model.layers.{i}, kind); kinds say how to transform.
_LAYER_LEAVES = {
    ("input_norm", "scale"): ("input_layernorm.weight", "copy"),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", "copy"),
    ("attn", "q", "kernel"): ("self_attn.q_proj.weight", "in_heads"),
    ("attn", "k", "kernel"): ("self_attn.k_proj.weight", "in_heads"),
    ("attn", "v", "kernel"): ("self_attn.v_proj.weight", "in_heads"),
    ("attn", "q", "bias"): ("self_attn.q_proj.bias", "heads"),
    ("attn", "k", "bias"): ("self_attn.k_proj.bias", "heads"),
    ("attn", "v", "bias"): ("self_attn.v_proj.bias", "heads"),
    ("attn", "o", "kernel"): ("self_attn.o_proj.weight", "heads_out"),
    ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", "transpose"),
    ("mlp", "up", "kernel"): ("mlp.up_proj.weight", "transpose"),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight", "transpose"),
}
_TOP_LEAVES = {
    ("embed",): ("model.embed_tokens.weight", "copy"),
    ("final_norm", "scale"): ("model.norm.weight", "copy"),
    ("lm_head", "kernel"): ("lm_head.weight", "transpose"),
}


def _to_ours(hf: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor -> our layout of `shape` (one layer's shape for layer leaves)."""
    if kind in ("copy", "heads"):
        return hf.reshape(shape)
    if kind == "transpose":
        return hf.T
    if kind == "in_heads":  # [N*Hd, D] -> [D, N, Hd]
        return hf.T.reshape(shape)
    if kind == "heads_out":  # [D, N*Hd] -> [N, Hd, D]
        return hf.T.reshape(shape)
    raise AssertionError(kind)


def _to_hf(ours: np.ndarray, kind: str) -> np.ndarray:
    if kind == "copy":
        return ours
    if kind == "heads":
        return ours.reshape(-1)
    if kind == "transpose":
        return ours.T
    if kind == "in_heads":  # [D, N, Hd] -> [N*Hd, D]
        return ours.reshape(ours.shape[0], -1).T
    if kind == "heads_out":  # [N, Hd, D] -> [D, N*Hd]
        return ours.reshape(-1, ours.shape[-1]).T
    raise AssertionError(kind)


def _leaf_specs(cfg: Qwen2Config):
    """Yields (our path tuple, HF names (one per layer, or one), kind, stacked?)."""
    for path, (name, kind) in _TOP_LEAVES.items():
        if path[0] == "lm_head" and cfg.tie_embeddings:
            continue
        yield path, [name], kind, False
    for path, (name, kind) in _LAYER_LEAVES.items():
        names = [f"model.layers.{i}.{name}" for i in range(cfg.num_layers)]
        yield ("layers",) + path, names, kind, True


def _get(tree: dict, path: tuple[str, ...]):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


# ----------------------------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------------------------

def _weight_files(folder: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {n: os.path.join(folder, fn) for n, fn in weight_map.items()}
        for path in sorted(set(files.values())):
            if not os.path.isfile(path):
                raise CheckpointError(f"{index} names shard {os.path.basename(path)}, which is "
                                      f"missing from {folder}; re-download the checkpoint.")
        return files
    single = os.path.join(folder, SINGLE)
    if os.path.isfile(single):
        with safe_open(single, "np") as f:
            return {n: single for n in f.keys()}
    if any(fn.endswith((".bin", ".pt", ".pth")) for fn in os.listdir(folder)):
        raise CheckpointError(
            f"{folder} has only PyTorch pickle weights (e.g. pytorch_model.bin); joyagents-jax "
            f"never unpickles. Convert once with transformers: "
            f"AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
            f"safe_serialization=True).")
    raise CheckpointError(f"No {SINGLE} or {INDEX} in {folder}: nothing to load.")


def load_params(folder: str, cfg: Qwen2Config | None = None, dtype: Any = None,
                shardings: Any = None) -> tuple[Params, Qwen2Config]:
    """Loads an HF Qwen2 folder into (params, cfg).

    dtype: target param dtype (default: `cfg.param_dtype`). shardings: an optional pytree of
    `jax.sharding.Sharding` matching the params; each device then reads only its own slice.
    """
    if not os.path.isdir(folder):
        raise CheckpointError(f"Checkpoint folder {folder} does not exist.")
    cfg = cfg or config_from_hf(folder)
    if dtype is not None:
        cfg = cfg.replace(param_dtype=jnp.dtype(dtype).name)
    target = jnp.dtype(cfg.param_dtype)
    files = _weight_files(folder)
    shapes = param_shapes(cfg)
    specs = list(_leaf_specs(cfg))

    expected = {n for _, names, _, _ in specs for n in names}
    if cfg.tie_embeddings:
        expected.add("lm_head.weight")  # tied checkpoints may store it; we ignore it
    missing = sorted(n for _, names, _, _ in specs for n in names if n not in files)
    extra = sorted(n for n in files if n not in expected and "rotary_emb" not in n)
    if missing:
        raise CheckpointError(f"{folder} lacks {len(missing)} tensor(s) the config needs, e.g. "
                              f"{missing[:3]}; is config.json from the same model as the weights?")
    if extra:
        raise CheckpointError(f"{folder} has {len(extra)} tensor(s) a Qwen2 model of this config "
                              f"does not use, e.g. {extra[:3]}; is config.json from the same model?")

    params: dict = {}
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, "np")) for p in sorted(set(files.values()))}

        def read(name: str, kind: str, shape: tuple[int, ...]) -> np.ndarray:
            return _to_ours(handles[files[name]].get_tensor(name), kind, shape).astype(target)

        for path, names, kind, stacked in specs:
            spec = _get(shapes, path)
            layer_shape = spec.shape[1:] if stacked else spec.shape
            for name in names:  # check every shape before any device work
                read_shape = tuple(handles[files[name]].get_slice(name).get_shape())
                want = _to_hf(np.empty(layer_shape, np.bool_), kind).shape
                if read_shape != want:
                    raise CheckpointError(f"Tensor {name} in {folder} has shape {read_shape}, but "
                                          f"the config needs {want}.")
            sharding = _get(shardings, path) if shardings is not None else None
            _set(params, path, _build_leaf(spec.shape, target, sharding, names, kind, stacked,
                                           lambda n, s=layer_shape, k=kind: read(n, k, s)))
    return params, cfg


def _build_leaf(shape, dtype, sharding, names, kind, stacked,
                read: Callable[[str], np.ndarray]) -> jax.Array:
    """One params leaf, assembled per device slice from the per-layer HF tensors."""
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    cache: dict[str, np.ndarray] = {}

    def layer(name):  # a layer tensor is read once even if several devices need it
        if name not in cache:
            cache[name] = read(name)
        return cache[name]

    def slice_for(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            return layer(names[0])[index]
        rows = range(shape[0])[index[0]]
        return np.stack([layer(names[i])[index[1:]] for i in rows]).astype(dtype, copy=False)

    return jax.make_array_from_callback(shape, sharding, slice_for)


# ----------------------------------------------------------------------------------------------
# Export.
# ----------------------------------------------------------------------------------------------

def to_hf_tensors(cfg: Qwen2Config, params: Params, dtype: Any = None) -> dict[str, np.ndarray]:
    """Our params -> HF-named numpy tensors (contiguous), optionally cast."""
    out = {}
    for path, names, kind, stacked in _leaf_specs(cfg):
        leaf = np.asarray(jax.device_get(_get(params, path)))
        if dtype is not None:
            leaf = leaf.astype(jnp.dtype(dtype))
        layers = list(leaf) if stacked else [leaf]
        for name, x in zip(names, layers):
            out[name] = np.ascontiguousarray(_to_hf(x, kind))
    return out


def save_params(folder: str, cfg: Qwen2Config, params: Params, dtype: Any = None,
                max_shard_bytes: int = 4 << 30, generation_config: dict | None = None) -> None:
    """Writes an HF folder transformers loads: config.json, generation_config.json, safetensors.

    Above `max_shard_bytes` the weights are split into `model-0000i-of-0000n.safetensors` with an
    index. Files are written to a temporary folder that replaces `folder` only when complete,
    so an interrupted export never leaves a half-written checkpoint.
    """
    tensors = to_hf_tensors(cfg, params, dtype)
    saved_dtype = str(np.dtype(next(iter(tensors.values())).dtype))
    tmp = folder.rstrip("/") + ".tmp-export"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)

    shards, current, size = [], {}, 0
    for name, x in tensors.items():
        if current and size + x.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = x
        size += x.nbytes
    shards.append(current)

    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(tmp, SINGLE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(tmp, fn), metadata=meta)
            weight_map.update({n: fn for n in shard})
        total = sum(x.nbytes for x in tensors.values())
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    hf_cfg = config_to_hf(cfg)
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = saved_dtype
    with open(os.path.join(tmp, CONFIG), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(generation_config or {}, f, indent=2)

    _replace_folder(tmp, folder)


def _replace_folder(tmp: str, folder: str) -> None:
    """Moves the complete folder `tmp` to `folder`, replacing what was there."""
    if os.path.exists(folder):
        old = folder.rstrip("/") + ".tmp-old"
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    else:
        os.replace(tmp, folder)


def save_peft_adapter(folder: str, adapters: Params, cfg: lora.LoRAConfig, base: str,
                      dtype: Any = None) -> None:
    """One agent's LoRA adapters as a PEFT folder (adapter_config.json and
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained` puts on the HF base
    folder `base`. Written whole or not at all, as `save_params`."""
    tensors = {}
    for section, projections in adapters["layers"].items():
        for name, ab in projections.items():
            module = _LAYER_LEAVES[(section, name, "kernel")][0].removesuffix(".weight")
            a, b = (np.asarray(jax.device_get(ab[k])) for k in ("a", "b"))
            for i in range(a.shape[0]):
                prefix = f"base_model.model.model.layers.{i}.{module}"
                lora_a = a[i].reshape(-1, cfg.rank).T  # [r, in]
                lora_b = b[i].reshape(cfg.rank, -1).T  # [out, r]
                for key, x in ((f"{prefix}.lora_A.weight", lora_a),
                               (f"{prefix}.lora_B.weight", lora_b)):
                    x = x if dtype is None else x.astype(jnp.dtype(dtype))
                    tensors[key] = np.ascontiguousarray(x)
    modules = sorted({_LAYER_LEAVES[(lora.PROJECTIONS[p][0], p, "kernel")][0].split(".")[1]
                      for p in cfg.projections})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank,
              "lora_alpha": cfg.alpha, "target_modules": modules, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "inference_mode": True, "base_model_name_or_path": os.path.abspath(base)}
    tmp = folder.rstrip("/") + ".tmp-export"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _replace_folder(tmp, folder)
