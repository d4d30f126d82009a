"""Sampler speed: our tokens/s vs transformers `generate` (PyTorch CPU) and google-tunix's
sampler (JAX, in its own virtualenv: `tunix_peer.py`) on the same weights and prompts, and our
fraction of this machine's roofline.

Setting (the sampler issue's): 8 prompts x G = 8 samples, 128 new tokens, temperature 1, no stop
token, so every row generates all 128 tokens in both systems. HF gets the group through
`num_return_sequences` (its standard GRPO path: one prefill per copy), tunix G copies of each
prompt (as its GRPO learner does); we share one prefill per prompt. Tunix's greedy tokens are
compared with ours (`tunix_greedy_match`) to show it runs the same model. Roofline: model FLOPs
per generated token (2 x matmul params + attention over the cache) times tokens/s, against
min(measured matmul peak, the rate that memory bandwidth allows when every decode step streams
the weights and the KV cache once).

    python benchmarks/sampling.py [--sizes tiny,small-30m] [--prompt-len 64] [--repeats 3]
    python benchmarks/sampling.py --sizes base-120m --repeats 2
    python benchmarks/sampling.py --tunix-venv none      # without tunix (no venv is made)
    python benchmarks/sampling.py --sizes qwen2.5-0.5b,qwen2.5-1.5b --dtype bfloat16 \
        --tunix-venv none                                # on a GPU: HF runs there too

`--dtype` sets our weights, KV cache and compute and HF's weights alike; the peak is measured in
that dtype. On a machine with a GPU, HF generates on it (CUDA) as we do.

Each row is also merged into `benchmarks/results/sampling.json` (one record per model, device,
dtype, prompts and prompt length).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hardware  # noqa: E402
import tunix_peer  # noqa: E402

from joyagents_jax.models import hf_io, presets, qwen2  # noqa: E402
from joyagents_jax.sampling import Sampler, SamplingConfig  # noqa: E402

GROUP, NEW = 8, 128
# A record's key beside model and device, with the values of older records that lack a field.
SETTING = {"dtype": "float32", "prompts": 8, "prompt_len": 64}


def flops_per_token(cfg: qwen2.Qwen2Config, context: float) -> float:
    """Forward FLOPs of one decoded token at mean context length `context`."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    kv = cfg.num_kv_heads * cfg.head_dim
    matmul_params = L * (2 * d * d + 2 * d * kv + 3 * d * f) + d * cfg.vocab_size
    attention = L * 4 * context * d  # q.k and p.v over the cache
    return 2 * matmul_params + attention


def bytes_per_step(cfg: qwen2.Qwen2Config, rows: int, cache_len: int) -> float:
    """Bytes one decode step must stream: every weight once plus every row's KV cache."""
    kv = 2 * cfg.num_layers * rows * cache_len * cfg.num_kv_heads * cfg.head_dim
    return (qwen2.count_params(cfg) * np.dtype(jnp.dtype(cfg.param_dtype)).itemsize
            + kv * np.dtype(jnp.dtype(cfg.dtype)).itemsize)


def ours(cfg, params, prompts, repeats):
    sampler = Sampler(cfg, pad_id=0)
    scfg = SamplingConfig(NEW, temperature=1.0)
    run = lambda seed: sampler.generate(params, prompts, key=jax.random.key(seed), scfg=scfg,
                                        group_size=GROUP)
    run(0)  # compile
    times = []
    for seed in range(1, repeats + 1):
        start = time.perf_counter()
        out = run(seed)
        times.append(time.perf_counter() - start)
    assert out.lengths.min() == NEW
    return min(times)


def greedy_tokens(cfg, params, prompts, steps: int = 16) -> np.ndarray:
    """[P, steps] our greedy tokens (compared with tunix's)."""
    out = Sampler(cfg, pad_id=0).generate(params, prompts, key=jax.random.key(0),
                                          scfg=SamplingConfig(steps, greedy=True), group_size=1)
    return np.asarray(out.tokens)[:, 0, :steps]


def tunix(folder, cfg, params, prompts, repeats, venv) -> dict:
    """Tunix's tokens/s and greedy agreement, or the error that stopped it (tok/s None)."""
    try:
        r = tunix_peer.tokens_per_s(folder, prompts, GROUP, NEW, repeats, venv)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        print(f"# tunix could not run: {e}", flush=True)
        return {"tunix_tok_s": None, "tunix_error": str(e)[-2000:]}
    match = float(np.mean(greedy_tokens(cfg, params, prompts) == np.asarray(r["greedy"])))
    return {"tunix_tok_s": r["tok_s"], "tunix_greedy_match": match,
            "tunix_version": r["tunix"], "tunix_jax": r["jax"]}


def hf(folder, prompts, repeats, dtype: str):
    """HF `generate`'s best time, in `dtype`, on the GPU if torch sees one, else the CPU."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    times = []
    for seed in range(repeats + 1):  # the first run warms up
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW,
                                 min_new_tokens=NEW, num_return_sequences=GROUP, pad_token_id=0,
                                 eos_token_id=None)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    assert out.shape == (len(prompts) * GROUP, len(prompts[0]) + NEW)
    return min(times[1:])


def _tok_s(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _ratio(ours_tok_s, peer_tok_s) -> str:
    return "-" if peer_tok_s is None else f"{ours_tok_s / peer_tok_s:.1f}x"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,small-30m")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call (x G = 8 rows)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tunix-venv", default=tunix_peer.DEFAULT_VENV,
                        help="virtualenv for google-tunix (made if missing); 'none' skips tunix")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "sampling.json"))
    args = parser.parse_args()

    peak = hardware.matmul_peak(jnp.dtype(args.dtype))
    bandwidth = hardware.memory_bandwidth()
    print(f"# devices {jax.devices()}; {args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s; "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| model | params | ours tok/s | HF tok/s | ours / HF | tunix tok/s | ours / tunix "
          "| GFLOP/s | roofline GFLOP/s | % of roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    rows = GROUP * args.prompts
    tokens = rows * NEW
    for size in args.sizes.split(","):
        cfg = presets.get_preset(size, param_dtype=args.dtype, dtype=args.dtype)
        params = qwen2.init_params(cfg, jax.random.key(0))
        prompts = rng.integers(1, cfg.vocab_size, (args.prompts, args.prompt_len)).tolist()
        with tempfile.TemporaryDirectory() as folder:
            hf_io.save_params(folder, cfg, params)
            t_hf = hf(folder, prompts, args.repeats, args.dtype)
            peer = ({"tunix_tok_s": None, "tunix_error": "skipped (--tunix-venv none)"}
                    if args.tunix_venv == "none"
                    else tunix(folder, cfg, params, prompts, args.repeats, args.tunix_venv))
        t_ours = ours(cfg, params, prompts, args.repeats)
        flops = flops_per_token(cfg, args.prompt_len + NEW / 2) * tokens / t_ours
        cache_len = 16 * -(-args.prompt_len // 16) + NEW
        bw_bound = bandwidth / bytes_per_step(cfg, rows, cache_len) * rows
        roof = min(peak, bw_bound * flops_per_token(cfg, args.prompt_len + NEW / 2))
        print(f"| {size} | {qwen2.count_params(cfg) / 1e6:.2f}M | {tokens / t_ours:,.0f} | "
              f"{tokens / t_hf:,.0f} | {t_hf / t_ours:.1f}x | {_tok_s(peer['tunix_tok_s'])} | "
              f"{_ratio(tokens / t_ours, peer['tunix_tok_s'])} | {flops / 1e9:.1f} | "
              f"{roof / 1e9:.1f} | {100 * flops / roof:.0f}% |", flush=True)
        hardware.record_results(args.out, [{
            "model": size, "params": qwen2.count_params(cfg), "ours_tok_s": tokens / t_ours,
            "hf_tok_s": tokens / t_hf, "ours_over_hf": t_hf / t_ours, **peer,
            "gflop_s": flops / 1e9, "roofline_gflop_s": roof / 1e9, "roofline_frac": flops / roof,
            "matmul_peak_gflop_s": peak / 1e9, "dtype": args.dtype, "prompts": args.prompts,
            "group": GROUP, "prompt_len": args.prompt_len, "new_tokens": NEW}], SETTING)


if __name__ == "__main__":
    main()
