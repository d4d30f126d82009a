"""GRPO train-step FLOP utilization: model FLOPs per step / step time / this CPU's matmul peak.

One jitted step of every agent (A stacked agents, B samples of T tokens each, mu inner updates
plus the reference forward), on random weights and tokens, at the CPU default's size and at
~30M parameters; ~120M runs with one agent to fit the 10-minute budget. FLOPs: 6 x matmul
params x tokens per inner step (forward + backward) plus 2 x matmul params x tokens for the
reference forward, plus attention (4 L T D per token forward, x3 with the backward). The
reference forward (log pi_ref of every sample, the step's only no-gradient pass) is also timed
alone, as its share of the step; the rollout and memory shares of a real step are in
`metrics.jsonl` (`rollout/seconds`, `time/update_seconds`, `time/memory_update_seconds`).

    python benchmarks/train_step.py [--sizes tiny,small-30m] [--agents 5] [--batch 16] [--seq 256]
    python benchmarks/train_step.py --sizes base-120m --agents 1
    python benchmarks/train_step.py --lora-rank 8    # also the step of rank-8 LoRA agents
    python benchmarks/train_step.py --agents-per-pass 1   # agents one after another
    python benchmarks/train_step.py --sizes qwen2.5-0.5b --dtype bfloat16   # on a GPU: MFU

`--dtype` sets the weights, optimizer moments and compute (the Qwen configs' bf16 policy); the
peak is a square matmul in that dtype on the same device, probed right before each timed step
(the best step/probe pair is reported), so on a GPU the ratio is the MFU against the chip's
measured, not its datasheet, peak. `--attention cudnn` trains with cuDNN
flash attention (GPU only).

Each row is also merged into `benchmarks/results/train_step.json` (one record per model, device
and setting: agents, batch, seq, inner steps, dtype, attention, remat).
With --lora-rank, the same step also runs with each agent as LoRA adapters (all projections)
over one shared frozen base, on the same batch: its time and its ratio to full fine-tuning.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hardware  # noqa: E402

from joyagents_jax import sft  # noqa: E402
from joyagents_jax import train_state as ts  # noqa: E402
from joyagents_jax.models import lora, presets, qwen2  # noqa: E402
from joyagents_jax.rl import grpo, grpo_step  # noqa: E402


# A record's key beside model and device, with the values of older records that lack a field.
SETTING = {"agents": 5, "batch": 16, "seq": 256, "inner_steps": 2, "dtype": "float32",
           "attention": "xla", "remat": False, "agents_per_pass": None}


def matmul_params(cfg: qwen2.Qwen2Config) -> int:
    d, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (2 * d * d + 2 * d * kv + 3 * d * f) + d * cfg.vocab_size


def step_flops(cfg, agents, batch, seq, inner) -> float:
    tokens = agents * batch * seq
    attention = 4 * cfg.num_layers * seq / 2 * cfg.hidden_size  # causal: half the pairs
    per_token_fwd = 2 * matmul_params(cfg) + attention
    return tokens * per_token_fwd * (3 * inner + 1)


def batch(cfg, agents, b, t, seed=0) -> grpo_step.GRPOBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (agents, b, t)).astype(np.int32)
    loss_mask = np.zeros((agents, b, t), bool)
    loss_mask[..., t // 2:] = True  # second half: the agents' outputs
    groups = np.arange(agents * b).reshape(agents, b) // 4  # node groups of 4 samples
    rollouts = grpo_step.Rollouts(tokens=tokens, mask=np.ones((agents, b, t), bool),
                                  loss_mask=loss_mask, sampler_logp=np.zeros((agents, b, t), np.float32),
                                  rewards=rng.random((agents, b)).astype(np.float32),
                                  group_ids=groups.astype(np.int32))
    owner = np.repeat(np.arange(agents), b // 4).astype(np.int32)
    return grpo_step.GRPOBatch(rollouts={"all": rollouts}, group_agent=owner)


def timed_calls(fn, carry, repeats: int, before=lambda: None) -> list[tuple[float, object]]:
    """Wall time of each of `repeats` calls `carry = fn(carry)` after a warm-up (compile) call,
    each with what `before()` returned right before it. Threading the carry lets fn donate its
    input (the GRPO step donates the state)."""
    carry = jax.block_until_ready(fn(carry))
    calls = []
    for _ in range(repeats):
        seen = before()
        start = time.perf_counter()
        carry = jax.block_until_ready(fn(carry))
        calls.append((time.perf_counter() - start, seen))
    return calls


def best_time(fn, carry, repeats: int) -> float:
    """Min wall time of `carry = fn(carry)` over `timed_calls`."""
    return min(t for t, _ in timed_calls(fn, carry, repeats))


def reference_forward(cfg: qwen2.Qwen2Config, per_pass: int | None):
    """log pi_ref of every sample of every agent: params [A, ...], tokens/mask [A, B, T]."""
    def one_agent(params, tokens, mask):
        return grpo.token_logprobs(sft.next_token_logits(cfg, params, tokens, mask), tokens[:, 1:])
    return jax.jit(lambda *args: ts.over_agents(one_agent, per_pass, *args))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,small-30m")
    parser.add_argument("--agents", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--inner", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention", default="xla", choices=["xla", "cudnn"])
    parser.add_argument("--remat", action="store_true", help="rematerialize each layer (the "
                        "Qwen configs' setting); MFU still counts model FLOPs only")
    parser.add_argument("--agents-per-pass", type=int, default=0,
                        help="config.agents_per_pass: agents per vmapped pass (0: all in one)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "train_step.json"))
    args = parser.parse_args()
    peak = hardware.matmul_peak(jnp.dtype(args.dtype))
    print(f"# devices {jax.devices()}; {args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s; "
          f"agents per pass: {args.agents_per_pass or 'all'}")
    lora_cols = (f" LoRA r{args.lora_rank} step s | LoRA / full |", "---|---|") \
        if args.lora_rank else ("", "")
    print("| model | params | agents x batch x seq | step s | GFLOP/step | GFLOP/s | % of peak "
          "| reference forward s | share of step |" + lora_cols[0])
    print("|---|---|---|---|---|---|---|---|---|" + lora_cols[1])
    for size in args.sizes.split(","):
        cfg = presets.get_preset(size, param_dtype=args.dtype, dtype=args.dtype,
                                 attention_impl=args.attention, remat=args.remat)
        group = ts.init_random_group(cfg, ts.OptimConfig(learning_rate=1e-4), args.agents,
                                     jax.random.key(0))
        state = ts.create({"all": group})
        step = grpo_step.make_grpo_step(grpo_step.GRPOStepConfig(
            loss=grpo.GRPOConfig(beta=0.04), inner_steps=args.inner,
            agents_per_pass=args.agents_per_pass or None))
        data = batch(cfg, args.agents, args.batch, args.seq)
        r, ref = data.rollouts["all"], reference_forward(cfg, args.agents_per_pass or None)
        t_ref = best_time(lambda _: ref(group.params, r.tokens, r.mask), None, args.repeats)
        flops = step_flops(cfg, args.agents, args.batch, args.seq, args.inner)
        # Each step right after its own peak probe: a drifting host is compared with itself
        # (one of this project's CPU hosts moved by a third within an hour).
        calls = timed_calls(lambda s: step(s, data)[0], state, args.repeats,
                            lambda: hardware.matmul_peak(jnp.dtype(args.dtype)))
        t = min(t_i for t_i, _ in calls)
        frac, step_peak = max((flops / t_i / p, p) for t_i, p in calls)
        lora_cells = ""
        if args.lora_rank:
            t_lora = best_time(lambda s: step(s, data)[0], lora_state(cfg, args), args.repeats)
            lora_cells = f" {t_lora:.3f} | {t_lora / t:.2f} |"
        print(f"| {size} | {qwen2.count_params(cfg) / 1e6:.2f}M | {args.agents}x{args.batch}x"
              f"{args.seq} | {t:.3f} | {flops / 1e9:.1f} | {flops / t / 1e9:.1f} | "
              f"{100 * frac:.0f}% (of {step_peak / 1e9:.1f}) | {t_ref:.3f} | "
              f"{100 * t_ref / t:.0f}% |"
              + lora_cells, flush=True)
        hardware.record_results(args.out, [{
            "model": size, "params": qwen2.count_params(cfg), "agents": args.agents,
            "batch": args.batch, "seq": args.seq, "inner_steps": args.inner, "step_s": t,
            "gflop_per_step": flops / 1e9, "gflop_s": flops / t / 1e9, "peak_frac": frac,
            "matmul_peak_gflop_s": step_peak / 1e9, "dtype": args.dtype, "attention": args.attention,
            "remat": args.remat, "agents_per_pass": args.agents_per_pass or None,
            "reference_forward_s": t_ref,
            "lora_step_s": t_lora if args.lora_rank else None}], SETTING)


def lora_state(cfg: qwen2.Qwen2Config, args) -> ts.TrainState:
    """`args.agents` rank-`args.lora_rank` adapters over one random base."""
    lcfg = lora.LoRAConfig(args.lora_rank)
    base = qwen2.init_params(cfg, jax.random.key(1))
    adapters = ts.stack_agents([lora.init_adapters(base, lcfg, k)
                                for k in jax.random.split(jax.random.key(2), args.agents)])
    return ts.create({"all": ts.init_group(cfg, ts.OptimConfig(learning_rate=1e-4), adapters,
                                           base=base, lora=lcfg)})


if __name__ == "__main__":
    main()
