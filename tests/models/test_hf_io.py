"""HF folder <-> params: exact round trips, transformers loads our export, clear errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from joyagents_jax.models import hf_io, qwen2
from tests.models.conftest import TINY_CONFIGS, build_hf_qwen2


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_load_export_load_is_exact_and_transformers_agrees(hf_model, tmp_path):
    folder, model, kw = hf_model
    params, cfg = hf_io.load_params(folder)
    out = str(tmp_path / "export")
    hf_io.save_params(out, cfg, params)
    again, cfg2 = hf_io.load_params(out)
    assert cfg2 == cfg
    _assert_trees_equal(params, again)

    # Tensor by tensor, our export equals the original checkpoint.
    original = load_file(os.path.join(folder, "model.safetensors"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    if kw["tie"]:
        original.pop("lm_head.weight", None)
    assert sorted(original) == sorted(exported)
    for name in original:
        np.testing.assert_array_equal(original[name], exported[name])

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokens = np.random.default_rng(0).integers(0, kw["vocab"], (2, 7))
    with torch.no_grad():
        ref = reloaded(input_ids=torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(qwen2.forward(cfg, params, jnp.asarray(tokens, jnp.int32)).logits)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_sharded_index_checkpoint_loads(tmp_path):
    kw = TINY_CONFIGS["untied_kv2"]
    build_hf_qwen2(tmp_path / "one", **kw)
    build_hf_qwen2(tmp_path / "many", **kw, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "many" / hf_io.INDEX)
    one, _ = hf_io.load_params(str(tmp_path / "one"))
    many, _ = hf_io.load_params(str(tmp_path / "many"))
    _assert_trees_equal(one, many)


def test_sharded_export_and_bf16(tmp_path):
    cfg = qwen2.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, tie_embeddings=False)
    params = qwen2.init_params(cfg, jax.random.key(0))
    out = str(tmp_path / "sharded")
    hf_io.save_params(out, cfg, params, dtype="bfloat16", max_shard_bytes=4096)
    with open(os.path.join(out, hf_io.INDEX)) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 1
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"
    loaded, cfg2 = hf_io.load_params(out, dtype="bfloat16")
    assert cfg2.param_dtype == "bfloat16"
    _assert_trees_equal(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), loaded)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_export_replaces_folder_atomically(tmp_path):
    cfg = qwen2.Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1)
    out = str(tmp_path / "m")
    hf_io.save_params(out, cfg, qwen2.init_params(cfg, jax.random.key(0)))
    hf_io.save_params(out, cfg, qwen2.init_params(cfg, jax.random.key(1)))
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no temporary folders left behind
    loaded, _ = hf_io.load_params(out)
    _assert_trees_equal(loaded, qwen2.init_params(cfg, jax.random.key(1)))


def test_loads_into_given_shardings(hf_model):
    folder, _, _ = hf_model
    params, cfg = hf_io.load_params(folder)
    device = jax.devices()[0]
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), params)
    placed, _ = hf_io.load_params(folder, shardings=shardings)
    _assert_trees_equal(params, placed)
    assert all(x.sharding == jax.sharding.SingleDeviceSharding(device) for x in jax.tree.leaves(placed))


# ---------------------------------------------------------------------------------------------
# Errors name the problem.
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny"
    build_hf_qwen2(folder, **TINY_CONFIGS["tied_kv1"])
    return folder


def _edit_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_error_missing_folder(tmp_path):
    with pytest.raises(hf_io.CheckpointError, match="does not exist"):
        hf_io.load_params(str(tmp_path / "nope"))


def test_error_missing_config(tiny_folder):
    os.remove(tiny_folder / "config.json")
    with pytest.raises(hf_io.CheckpointError, match="config.json not found"):
        hf_io.load_params(str(tiny_folder))


def test_error_wrong_model_type(tiny_folder):
    cfg = json.load(open(tiny_folder / "config.json"))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(tiny_folder / "config.json", "w"))
    with pytest.raises(hf_io.CheckpointError, match="model_type is 'llama'.*only 'qwen2'"):
        hf_io.load_params(str(tiny_folder))


def test_error_only_pytorch_bin(tiny_folder):
    os.remove(tiny_folder / "model.safetensors")
    (tiny_folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(hf_io.CheckpointError, match="never unpickles.*safe_serialization=True"):
        hf_io.load_params(str(tiny_folder))


def test_error_no_weights(tiny_folder):
    os.remove(tiny_folder / "model.safetensors")
    with pytest.raises(hf_io.CheckpointError, match="No model.safetensors"):
        hf_io.load_params(str(tiny_folder))


def test_error_tensor_missing(tiny_folder):
    _edit_weights(tiny_folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(hf_io.CheckpointError, match=r"lacks 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        hf_io.load_params(str(tiny_folder))


def test_error_tensor_extra(tiny_folder):
    _edit_weights(tiny_folder, lambda t: t.update({"model.layers.9.extra": np.zeros(3, np.float32)}))
    with pytest.raises(hf_io.CheckpointError, match=r"does not use.*model.layers.9.extra"):
        hf_io.load_params(str(tiny_folder))


def test_error_shape_mismatch(tiny_folder):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 32), np.float32)
    _edit_weights(tiny_folder, edit)
    with pytest.raises(hf_io.CheckpointError,
                       match=r"model.layers.0.self_attn.k_proj.weight .* shape \(16, 32\).*needs \(8, 32\)"):
        hf_io.load_params(str(tiny_folder))


def test_error_missing_shard(tmp_path):
    folder = tmp_path / "many"
    build_hf_qwen2(folder, **TINY_CONFIGS["untied_kv2"], max_shard_size="20KB")
    victim = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    os.remove(folder / victim)
    with pytest.raises(hf_io.CheckpointError, match=f"names shard {victim}, which is missing"):
        hf_io.load_params(str(folder))


def test_error_rope_scaling(tiny_folder):
    cfg = json.load(open(tiny_folder / "config.json"))
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    json.dump(cfg, open(tiny_folder / "config.json", "w"))
    with pytest.raises(hf_io.CheckpointError, match="rope type 'yarn' is not supported"):
        hf_io.load_params(str(tiny_folder))
