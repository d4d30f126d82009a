"""How much of the default's GRPO phase is XLA compiling: every compile of its first steps,
counted and timed per jitted function.

    python benchmarks/compiles.py --root R --seed 0 --steps 12
    python benchmarks/compiles.py --root R --set agents_per_pass=0   # the GRPO phase otherwise

From the seed's end-of-SFT checkpoint (`R/sft_s<seed>`, trained first when missing, as
`learning_study.py` does; `R/data` holds the suite), runs `--steps` GRPO iterations of the
default, then one greedy evaluation of the policies alone on `test`, with `jax_log_compiles`
on. Reports per jitted function the compiles, their distinct argument shapes (a function
compiled twice for one shape wastes a compile) and XLA compile seconds; per step the wall
time, rollout, update and new compiles, with the step's training accuracy and reward, so two
commits can be checked for equal numbers as well as compared for time. Merges the record
into `benchmarks/results/compiles.json` (one per device, seed, step count, commit and cache).

The persistent compilation cache is off unless `--cache-dir DIR` is given; run twice with one
DIR to measure what a rerun or the next seed of `joyagents train` (which keeps a cache) saves:
the record's `cache` is "empty" the first time and "warm" the second, whose compiles are then
mostly cache loads (`cache_hits`), timed as XLA reports them.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from joyagents_jax import xla_flags  # noqa: E402

xla_flags.pin_cpu_numerics()

import jax  # noqa: E402

import hardware  # noqa: E402
import learning_study  # noqa: E402
from joyagents_jax import checkpoint, experiment, train  # noqa: E402

_FINISHED = re.compile(r"Finished XLA compilation of jit\((\w+)\) in ([\d.e+-]+) ?s")
_TRACED = re.compile(r"Finished tracing (\w+) for jit in ([\d.e+-]+) ?s")
_LOWERED = re.compile(r"Finished jaxpr to MLIR module conversion jit\((\w+)\) in ([\d.e+-]+) ?s")
_HIT = re.compile(r"Persistent compilation cache hit for 'jit_(\w+)'")
_COMPILING = re.compile(r"Compiling jit\((\w+)\) with global shapes and types (.*?)\. Argument")


class CompileLog(logging.Handler):
    """Collects jax's compile log lines: seconds and argument shapes per jitted function."""

    def __init__(self):
        super().__init__()
        self.seconds = collections.defaultdict(list)
        self.shapes = collections.defaultdict(list)
        self.hits = 0
        self.staging = collections.defaultdict(float)  # tracing + lowering seconds

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if m := _FINISHED.search(message):
            self.seconds[m.group(1)].append(float(m.group(2)))
        elif m := _COMPILING.search(message):
            self.shapes[m.group(1)].append(m.group(2))
        elif m := _TRACED.search(message) or _LOWERED.search(message):
            self.staging[m.group(1)] += float(m.group(2))
        elif _HIT.search(message):
            self.hits += 1

    def count(self) -> int:
        return sum(len(v) for v in self.seconds.values())

    def table(self) -> dict[str, dict]:
        return {name: {"compiles": len(s), "distinct_shapes": len(set(self.shapes[name])),
                       "seconds": round(sum(s), 2),
                       "trace_lower_seconds": round(self.staging[name], 2)}
                for name, s in sorted(self.seconds.items(), key=lambda kv: -sum(kv[1]))}


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def measure(root: str, seed: int, steps: int, cache: str, overrides: list[str]) -> dict:
    data_dir = os.path.join(root, "data")
    sft_dir = learning_study.sft_checkpoint(root, seed, data_dir, {})
    config = learning_study.config_for(seed, {"data_dir": data_dir,
                                              **learning_study.parse_overrides(overrides)})
    exp = experiment.Experiment(config, os.path.join(root, f"compiles_s{seed}"))
    with checkpoint.Checkpointer(os.path.join(sft_dir, "checkpoints"), read_only=True) as ckpt:
        run = train.restore(exp, ckpt)
    log = CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(log)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    jax.config.update("jax_log_compiles", True)
    start = time.time()
    run, per_step = exp.start_grpo(run), []
    for k in range(steps):
        t, before = time.time(), log.count()
        run, m = exp.grpo_iteration(run)
        per_step.append({"step": k + 1, "wall_s": round(time.time() - t, 2),
                         "rollout_s": round(m["rollout/seconds"], 2),
                         "update_s": round(m["time/update_seconds"], 2),
                         "compiles": log.count() - before, "accuracy": m["grpo/accuracy"],
                         "reward": m["grpo/reward"]})
    grpo_wall = time.time() - start
    accuracy = exp.evaluate(run, "test", learning_study.SPLITS["test"],
                            use_memory=False)["eval/test/accuracy"]
    jax.config.update("jax_log_compiles", False)
    table = log.table()
    return {"model": "default", "seed": seed, "steps": steps, "commit": _commit(),
            "wall_s": round(time.time() - start, 1), "grpo_wall_s": round(grpo_wall, 1),
            "compile_s": round(sum(v["seconds"] for v in table.values()), 1),
            "compiles": sum(v["compiles"] for v in table.values()),
            "trace_lower_s": round(sum(log.staging.values()), 1),
            "cache": cache, "cache_hits": log.hits, "overrides": " ".join(sorted(overrides)),
            "test_acc_no_memory": accuracy, "per_function": table, "per_step": per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="holds data/ and sft_s<seed>/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cache-dir", default="", help="persistent compilation cache ('': off)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the GRPO phase (the SFT checkpoint is "
                             "the default's), e.g. agents_per_pass=0")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(
        __file__)), "results", "compiles.json"))
    args = parser.parse_args()
    os.environ[xla_flags.CACHE_DIR] = args.cache_dir
    xla_flags.use_compilation_cache()
    warm = os.path.isdir(args.cache_dir) and os.listdir(args.cache_dir)
    cache = "off" if not args.cache_dir else "warm" if warm else "empty"
    record = measure(args.root, args.seed, args.steps, cache, args.set)
    hardware.record_results(args.out, [record], {"seed": 0, "steps": 12, "commit": None,
                                                 "cache": "off", "overrides": ""})
    print(f"commit {record['commit']}{' with ' + record['overrides'] if args.set else ''}: "
          f"{record['steps']} GRPO steps + one evaluation in "
          f"{record['wall_s']} s, {record['compiles']} XLA compiles ({record['cache_hits']} "
          f"cache loads) taking {record['compile_s']} s; test accuracy alone "
          f"{record['test_acc_no_memory']}")
    print(f"tracing and lowering to XLA: {record['trace_lower_s']} s")
    print("| function | compiles | distinct shapes | compile s | trace + lower s |\n"
          "|---|---|---|---|---|")
    for name, row in list(record["per_function"].items())[:8]:
        print(f"| {name} | {row['compiles']} | {row['distinct_shapes']} | {row['seconds']} | "
              f"{row['trace_lower_seconds']} |")
    print("| step | wall s | rollout s | update s | compiles | accuracy | reward |\n"
          "|---|---|---|---|---|---|---|")
    for s in record["per_step"]:
        print(f"| {s['step']} | {s['wall_s']} | {s['rollout_s']} | {s['update_s']} | "
              f"{s['compiles']} | {s['accuracy']:.4f} | {s['reward']:.6f} |")


if __name__ == "__main__":
    main()
