"""Which GRPO iterate each selection rule chooses, and what its policies score on `test`.

    python benchmarks/selection_rules.py --root R --seeds 0,1,2,3,4
    python benchmarks/selection_rules.py --root R --seeds 0,1,2,3,4 --report

Reruns a `learning_study.py` variant (default: the README default) from the root's end-of-SFT
checkpoint of each seed, with the CPU numerics pinned as the study pins them, so its steps are
the study's. Every `--every` GRPO steps and after the last it keeps the policies' greedy
answers alone on `test` and on the union of the selection slices (`selection.slice_rows`) of
every size in `--sizes`. Evaluations change nothing the run trains, so one run replays every
rule offline (`grpo.select_every` x `grpo.select_examples`, the latest step on ties): the
chosen step and its `test` accuracy, beside the last step's and the best test step's (the
oracle no rule can see). Writes `<root>/rules_<variant>_s<seed>.json`; `--report` prints the
table from them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import learning_study as ls  # noqa: E402
from joyagents_jax import checkpoint, experiment, selection, train, xla_flags  # noqa: E402


def candidates(steps: list[int], every: int, last: int) -> list[int]:
    """The recorded steps a rule scoring every `every` steps and after `last` sees."""
    return [s for s in steps if selection.due(s, every, s == last)]


def choose(train_answers: dict[int, list[float]], positions: list[int], every: int,
           last: int) -> int:
    """The step whose answers at `positions` (a slice of the recorded train records) are
    right most often among the rule's candidates; the latest on ties, as `selection.keep`."""
    steps = candidates(sorted(train_answers), every, last)
    score = {s: sum(train_answers[s][i] for i in positions) for s in steps}
    return max(steps, key=lambda s: (score[s], s))


def record(root: str, seed: int, variant: str, every: int, sizes: list[int]) -> dict:
    """The variant's run of the seed: per recorded step the answers alone on `test` and on the
    union of the slices (`rows`, sorted train record indices)."""
    data_dir = os.path.join(root, "data")
    overrides = ls.VARIANTS[variant][1]
    c = ls.config_for(seed, {**overrides, "data_dir": data_dir})
    tag = variant if ls.sft_overrides(overrides) else ""
    sft_dir = ls.sft_checkpoint(root, seed, data_dir, overrides, tag)
    exp = experiment.Experiment(c, os.path.join(root, f"rules_{variant}_s{seed}"))
    with checkpoint.Checkpointer(os.path.join(sft_dir, "checkpoints"), read_only=True) as ckpt:
        run = train.restore(exp, ckpt)
    source = exp.sources["train"]
    rows = sorted(set().union(*(selection.slice_rows(len(source), n) for n in sizes)))
    exp.sources["rules"] = [source[i] for i in rows]

    def answers(split, n=None):
        result = exp.greedy_episodes(run, split, n, use_memory=False)[1]
        return [float(p.r_answer) for p in result.rewards]

    out = {"seed": seed, "variant": variant, "num_train": len(source), "rows": rows,
           "test": {}, "train": {}}
    run = exp.start_grpo(run)
    for k in range(1, c.grpo.steps + 1):
        run, _ = exp.grpo_iteration(run)
        if selection.due(k, every, k == c.grpo.steps):
            out["test"][k] = answers("test", ls.SPLITS["test"])
            out["train"][k] = answers("rules")
            print(f"step {k}: test {statistics.mean(out['test'][k]):.3f}", flush=True)
    out["last"] = c.grpo.steps
    return out


def sign_p(won: int, lost: int) -> float:
    """Two-sided sign test."""
    n, k = won + lost, min(won, lost)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def rule_table(runs: list[dict], rules: list[tuple[int, int]]) -> str:
    """Markdown: per rule (every, slice size) the chosen steps, test accuracies alone and their
    mean, and test queries won / lost against the last step; the last step's and the oracle's
    rows beside them."""
    lines = ["| rule | chosen steps | test accuracy alone per seed | mean | against the last "
             "step: won / lost (p) |", "|---|---|---|---|---|"]
    picks = {"the last step": [r["last"] for r in runs],
             "the best test step (oracle)": [max(r["test"], key=lambda s: (
                 sum(r["test"][s]), s)) for r in runs]}
    for every, size in rules:
        picks[f"every {every}, {size} records"] = [
            choose(r["train"], [r["rows"].index(i) for i in
                                selection.slice_rows(r["num_train"], size)], every, r["last"])
            for r in runs]
    for name, steps in picks.items():
        accs = [statistics.mean(r["test"][s]) for r, s in zip(runs, steps)]
        won = sum(a > b for r, s in zip(runs, steps) for a, b in zip(r["test"][s],
                                                                      r["test"][r["last"]]))
        lost = sum(a < b for r, s in zip(runs, steps) for a, b in zip(r["test"][s],
                                                                       r["test"][r["last"]]))
        lines.append(f"| {name} | {' / '.join(map(str, steps))} | "
                     f"{' / '.join(f'{a:.3f}' for a in accs)} | {statistics.mean(accs):.3f} | "
                     f"{won} / {lost} ({sign_p(won, lost):.3f}) |")
    return "\n".join(lines)


def load(path: str) -> dict:
    """A record with its step keys back as ints."""
    with open(path) as f:
        r = json.load(f)
    return {**r, "test": {int(k): v for k, v in r["test"].items()},
            "train": {int(k): v for k, v in r["train"].items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="a learning_study root (its data and SFT runs)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variant", default="default", choices=sorted(ls.VARIANTS))
    p.add_argument("--every", type=int, default=2, help="record every N GRPO steps")
    p.add_argument("--sizes", default="120,360", help="slice sizes the rules score on")
    p.add_argument("--report", action="store_true", help="only the table of the records")
    a = p.parse_args()
    seeds, sizes = [int(s) for s in a.seeds.split(",")], [int(n) for n in a.sizes.split(",")]
    path = lambda s: os.path.join(a.root, f"rules_{a.variant}_s{s}.json")
    if not a.report:
        xla_flags.pin_cpu_numerics()  # the study's numbers (before JAX's backend starts)
        for s in seeds:
            if not os.path.exists(path(s)):
                with open(path(s), "w") as f:
                    json.dump(record(a.root, s, a.variant, a.every, sizes), f)
    every = sorted({a.every, 2 * a.every})
    print(rule_table([load(path(s)) for s in seeds],
                     [(e, n) for e in every for n in sizes]))


if __name__ == "__main__":
    main()
