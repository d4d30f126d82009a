"""google-tunix's sampler as the sampler benchmark's JAX peer, in a virtualenv of its own.

`tokens_per_s` (called from `sampling.py` in our environment) makes the virtualenv once
(`python -m venv`, `pip install google-tunix==VERSION`), so tunix's dependency pins never touch
ours, and runs this file there as `worker`: tunix's Qwen2 loads the exported safetensors with
its own loader and its `Sampler` generates from the same prompt ids as ours. Tunix takes one
row per sample (its GRPO learner repeats each prompt G times), so a group costs G prefills.
The worker imports only tunix, jax and numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VERSION = "0.1.7"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "joyagents-jax", f"tunix-{VERSION}")


def ensure_venv(venv: str, version: str = VERSION) -> str:
    """The venv's python, with google-tunix==version installed (made on first use)."""
    python = os.path.join(venv, "bin", "python")
    probe = [python, "-c", "import importlib.metadata as m; print(m.version('google-tunix'))"]
    if os.path.exists(python):
        found = subprocess.run(probe, capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.strip() == version:
            return python
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", f"google-tunix=={version}"],
                   check=True)
    return python


def tokens_per_s(folder: str, prompts: list[list[int]], group: int, new_tokens: int,
                 repeats: int, venv: str = DEFAULT_VENV) -> dict:
    """Runs the worker in tunix's venv on the HF folder `folder`; its JSON result."""
    python = ensure_venv(venv)
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = os.path.join(tmp, "prompts.json"), os.path.join(tmp, "out.json")
        with open(spec, "w") as f:
            json.dump(prompts, f)
        cmd = [python, os.path.abspath(__file__), "worker", "--folder", folder, "--prompts", spec,
               "--group", str(group), "--new", str(new_tokens), "--repeats", str(repeats),
               "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"tunix worker failed (exit {done.returncode}):\n"
                               f"{done.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


class _IdTokenizer:
    """Prompts as space-separated token ids; no BOS; an EOS id outside the vocabulary, so every
    row generates all its tokens (as in the other systems of the benchmark)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(map(str, ids))

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return self.vocab_size

    def pad_id(self) -> int:
        return 0


def _worker(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen2 import model as model_lib
    from tunix.models.qwen2 import params as params_lib

    with open(os.path.join(args.folder, "config.json")) as f:
        hf = json.load(f)
    theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    dtype = jnp.bfloat16 if hf.get("dtype", hf.get("torch_dtype")) == "bfloat16" else jnp.float32
    cfg = model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(theta),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"],
        dtype=dtype, param_dtype=dtype)  # compute and KV cache in the exported dtype, as ours
    model = params_lib.create_model_from_safe_tensors(args.folder, cfg, dtype=dtype)
    with open(args.prompts) as f:
        prompts = json.load(f)
    prompt_len = max(map(len, prompts))
    sampler = sampler_lib.Sampler(model, _IdTokenizer(cfg.vocab_size), sampler_lib.CacheConfig(
        cache_size=prompt_len + args.new, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
    rows = [" ".join(map(str, p)) for p in prompts for _ in range(args.group)]

    def run(seed: int, steps: int, **sampling):
        out = sampler(rows, max_generation_steps=steps, max_prompt_length=prompt_len,
                      seed=seed, **sampling)
        jax.block_until_ready(out.tokens)
        return out

    greedy = run(0, 16)  # greedy: comparable with our sampler's greedy tokens
    run(0, args.new, temperature=1.0, top_p=1.0)  # compile
    times = []
    for seed in range(1, args.repeats + 1):
        start = time.perf_counter()
        out = run(seed, args.new, temperature=1.0, top_p=1.0)
        times.append(time.perf_counter() - start)
    lengths = [len(t) for t in out.tokens]
    if min(lengths) != args.new:
        raise RuntimeError(f"tunix generated {min(lengths)}..{max(lengths)} tokens, not {args.new}")
    with open(args.out, "w") as f:
        json.dump({"seconds": min(times), "tokens": len(rows) * args.new,
                   "tok_s": len(rows) * args.new / min(times),
                   "greedy": [np.asarray(t).tolist() for t in greedy.tokens[::args.group]],
                   "jax": jax.__version__, "tunix": VERSION}, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["worker"])
    p.add_argument("--folder", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--new", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--out", required=True)
    _worker(p.parse_args())
