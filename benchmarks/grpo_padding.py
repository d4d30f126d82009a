"""What padding rows cost the default's GRPO update: a batch laid out as a real step's against
the same shape with every row real.

The default's jitted GRPO step (`grpo_step` as `components.build` configures it: micro-batches
of 16 rows, 2 inner steps, the reference forward, agents one per pass) on the tiny agents, one
group of 5 agents with B rows of T tokens each. In the padded batch an agent has only its
`--rows` real samples (node groups of 4, lengths drawn from `--lengths`, the last 40 tokens
its output) and the rest of the B rows are padding, as `batching.grpo_batch` pads every agent
to the group's largest count; the first agent (the master, which the default does not branch)
has none. The full batch fills every row. Both are timed alternately in one process; a step
that skips padding costs about the real rows' share of the full step, one that computes it the
full step.

    python benchmarks/grpo_padding.py --rows 0,40,24,30,20 --batch 64 --seq 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from joyagents_jax import xla_flags  # noqa: E402

xla_flags.pin_cpu_numerics()  # the XLA flags `joyagents train` runs under

import jax  # noqa: E402

from joyagents_jax import components  # noqa: E402
from joyagents_jax import config as config_lib  # noqa: E402
from joyagents_jax import train_state as ts  # noqa: E402
from joyagents_jax.models import presets  # noqa: E402
from joyagents_jax.rl import grpo_step  # noqa: E402

OUTPUT = 40  # generated tokens per sample


def batch(rows: list[int], b: int, t: int, lengths: tuple[int, int], seed: int = 0
          ) -> grpo_step.GRPOBatch:
    """rows[a] real samples of agent a (the rest padding), node groups of 4 samples."""
    rng = np.random.default_rng(seed)
    a = len(rows)
    tokens = rng.integers(0, 264, (a, b, t)).astype(np.int32)
    mask, loss_mask = np.zeros((a, b, t), bool), np.zeros((a, b, t), bool)
    group_ids, owners = np.full((a, b), -1, np.int32), []
    for agent, count in enumerate(rows):
        for row in range(count):
            n = int(rng.integers(*lengths))
            mask[agent, row, :n], loss_mask[agent, row, n - OUTPUT:n] = True, True
            group_ids[agent, row] = len(owners) + row // 4
        owners += [agent] * (-(-count // 4))
    group_agent = np.full(a * b, -1, np.int32)
    group_agent[:len(owners)] = owners
    rollouts = grpo_step.Rollouts(tokens=tokens, mask=mask, loss_mask=loss_mask,
                                  sampler_logp=np.zeros((a, b, t), np.float32),
                                  rewards=rng.random((a, b)).astype(np.float32),
                                  group_ids=group_ids)
    return grpo_step.GRPOBatch(rollouts={"all": rollouts}, group_agent=group_agent)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="0,40,24,30,20", help="real samples per agent")
    parser.add_argument("--batch", type=int, default=64, help="rows per agent (B)")
    parser.add_argument("--seq", type=int, default=512, help="T (the default's max_len)")
    parser.add_argument("--lengths", default="120,400", help="sample lengths: low,high")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    lengths = tuple(int(x) for x in args.lengths.split(","))
    config = config_lib.get_config()
    parts = components.build(config)
    step = grpo_step.make_grpo_step(parts.grpo_step)
    model = presets.get_preset(config.groups.all.model)
    batches = {"padded": batch(rows, args.batch, args.seq, lengths),
               "full": batch([args.batch] * len(rows), args.batch, args.seq, lengths)}
    states = {k: ts.create({"all": ts.init_random_group(model, parts.grpo_optim, len(rows),
                                                        jax.random.key(0))}) for k in batches}
    times = {k: [] for k in batches}
    for i in range(args.repeats + 1):  # the first call of each compiles
        for name, data in batches.items():
            start = time.perf_counter()
            states[name] = jax.block_until_ready(step(states[name], data)[0])
            if i:
                times[name].append(time.perf_counter() - start)
    real = sum(rows) / (len(rows) * args.batch)
    print(f"| batch | real rows | step s (best of {args.repeats}) |")
    print("|---|---|---|")
    for name in batches:
        share = real if name == "padded" else 1.0
        print(f"| {name} {len(rows)}x{args.batch}x{args.seq} | {share:.3f} | "
              f"{min(times[name]):.2f} |")
    print(f"padded / full step time {min(times['padded']) / min(times['full']):.3f} "
          f"(real rows {real:.3f})")


if __name__ == "__main__":
    main()
