"""The default's shared SFT step: one padded [A, B, T] batch against length-sorted passes.

Builds the embedded default (`--set key=value` overrides it), then runs its SFT iterations in
one process on two copies of the fresh state, padded (`sft.sorted_passes=False`) and sorted
(`True`) alternating step by step, so both see the same demonstrations and the same load on
the CPU. The first `--warmup` steps of each (the compiles: one per pass length for the
sorted step) are timed apart; reported: mean seconds per step after them, the speed-up, the
share of padded tokens in each layout, and the last step's losses of both (equal up to
rounding: the same gradient). Merges the record into `benchmarks/results/sft_step.json`.

    python benchmarks/sft_step.py --workdir /tmp/sft_bench --steps 60
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hardware  # noqa: E402

import learning_study  # noqa: E402

from joyagents_jax import batching  # noqa: E402
from joyagents_jax import experiment  # noqa: E402

SETTING = {"steps": 60, "warmup": 10, "seed": 0, "overrides": ""}


def padded_share(exp: experiment.Experiment, step: int) -> tuple[float, float]:
    """Real tokens / padded tokens of step `step`'s batch in the two layouts."""
    rng = np.random.default_rng([exp.config.seed, step])
    demos = [(a, *exp.demos[a][j]) for a in exp.config.agents
             for j in rng.integers(0, len(exp.demos[a]), exp.config.sft.batch_per_agent)]
    real = sum(len(c) + len(o) for _, c, o in demos)
    padded = sum(b.tokens.size for b in batching.sft_batch(
        demos, exp.slots, exp.group_sizes, exp.config.max_len).values())
    passes = batching.sorted_passes(demos, exp.slots, exp.group_sizes,
                                    exp.config.sft.batch_per_agent, exp.config.max_len)
    return real / padded, real / sum(b.tokens.size for g in passes.values() for b in g)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="where the suite is built")
    parser.add_argument("--steps", type=int, default=SETTING["steps"])
    parser.add_argument("--warmup", type=int, default=SETTING["warmup"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "sft_step.json"))
    args = parser.parse_args()
    config = learning_study.config_for(args.seed, learning_study.parse_overrides(args.set))
    exp = experiment.Experiment(config, args.workdir)
    if args.steps > config.sft.shared_steps:
        raise SystemExit(f"--steps {args.steps}: only the {config.sft.shared_steps} shared SFT "
                         f"steps have a sorted layout; use at most that many.")
    runs = {False: exp.init_run(), True: exp.init_run()}
    seconds = {False: [], True: []}
    losses = {}
    for step in range(args.steps):
        for flag in (False, True):
            exp.config.sft.sorted_passes = flag
            start = time.perf_counter()
            runs[flag], metrics = exp.sft_iteration(runs[flag])  # metrics on the host: synced
            seconds[flag].append(time.perf_counter() - start)
            losses[flag] = metrics["sft/loss"]
    warm = {f: float(np.mean(s[args.warmup:])) for f, s in seconds.items()}
    first = {f: float(np.sum(s[:args.warmup])) for f, s in seconds.items()}
    shares = np.mean([padded_share(exp, s) for s in range(args.steps)], axis=0)
    print(f"| layout | s/step (steps {args.warmup + 1}-{args.steps}) | first {args.warmup} "
          f"steps s | real / padded tokens | loss at step {args.steps} |")
    print("|---|---|---|---|---|")
    for flag, name in ((False, "padded"), (True, "sorted passes")):
        print(f"| {name} | {warm[flag]:.3f} | {first[flag]:.1f} | {shares[int(flag)]:.3f} | "
              f"{losses[flag]:.5f} |")
    print(f"speed-up {warm[False] / warm[True]:.2f}x")
    hardware.record_results(args.out, [{
        "model": config.groups[next(iter(config.groups))].model, "steps": args.steps,
        "warmup": args.warmup, "seed": args.seed, "overrides": " ".join(args.set),
        "padded_step_s": warm[False], "sorted_step_s": warm[True],
        "speedup": warm[False] / warm[True], "padded_warmup_s": first[False],
        "sorted_warmup_s": first[True], "padded_token_share": float(shares[0]),
        "sorted_token_share": float(shares[1]), "padded_loss": losses[False],
        "sorted_loss": losses[True], "commit": hardware.git_commit()}], SETTING)


if __name__ == "__main__":
    main()
