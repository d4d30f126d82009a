"""`joyagents eval --workdir DIR [--step N]`: held-out accuracy of a trained run.

Per-domain accuracy on `test` and `test_novel`, mean reward parts, LLM calls per query, memory
hit rate, tokens and seconds per query, with and without the memory; a finished run's chosen
policies where `grpo.select_every` chose them. Writes `eval_<step>.json`
and `eval_<step>.md` into the workdir and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import ml_collections

from joyagents_jax import checkpoint, distributed, experiment, train
from joyagents_jax import config as config_lib
from joyagents_jax.run_state import RunState


def load_run(workdir: str, step: int | None = None) -> tuple[experiment.Experiment, RunState]:
    """(experiment, run state) restored from a workdir's config and checkpoint (default: the
    latest step)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: is {workdir} the --workdir of a `joyagents train` run?")
    with open(path) as f:
        config = _merged(config_lib.get_config(), json.load(f))
    exp = experiment.Experiment(config, workdir)
    # Read only: beside a run still training here, opening must not remove its save in progress.
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True) as ckpt:
        if ckpt.latest_step() is None:
            raise ValueError(f"No checkpoint in {workdir}/checkpoints: train first.")
        if step is not None and step not in ckpt.all_steps():
            raise ValueError(f"no checkpoint step {step} in {workdir}/checkpoints; the steps "
                             f"there are {ckpt.all_steps()} (default: the latest).")
        fresh = exp.init_run()
        abstract = functools.partial(train.abstract_run, exp, fresh)  # of the step's metadata
        run, _ = ckpt.restore_newest(abstract) if step is None else ckpt.restore(abstract, step)
    return exp, exp.attach_bases(run, fresh)


def _merged(base: ml_collections.ConfigDict, saved: dict) -> ml_collections.ConfigDict:
    """The saved run config over today's defaults, so fields added since keep their default."""
    for key, value in saved.items():
        if isinstance(value, dict) and key != "groups" and isinstance(base.get(key), ml_collections.ConfigDict):
            _merged(base[key], value)
        else:
            base[key] = value
    return base


def table(results: dict[str, dict[str, float]]) -> str:
    """Markdown: one row per (split, memory), accuracy per domain and the cost columns."""
    domains = sorted({k.split("/")[-1] for r in results.values() for k in r
                      if "/accuracy/" in k})
    head = ["run", "accuracy", *domains, "reward", "LLM calls/query", "memory hit rate",
            "tokens/query", "s/query"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        p = "/".join(next(iter(r)).split("/")[:2])  # eval/<split>
        cells = [name, f"{r[f'{p}/accuracy']:.3f}"]
        cells += [f"{r.get(f'{p}/accuracy/{d}', float('nan')):.3f}" for d in domains]
        cells += [f"{r[f'{p}/total']:.3f}", f"{r[f'{p}/llm_calls_per_query']:.2f}",
                  f"{r[f'{p}/memory_hit_rate']:.3f}", f"{r[f'{p}/tokens_per_query']:.1f}",
                  f"{r[f'{p}/seconds_per_query']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="joyagents eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--examples", type=int, default=0, help="per split (0: all)")
    args = parser.parse_args(argv)
    distributed.initialize()
    try:
        exp, run = load_run(args.workdir, args.step)
    except ValueError as e:
        print(f"joyagents eval: {e}", file=sys.stderr)
        return 2
    policies_step, run = exp.chosen_step(run), exp.chosen(run)
    results = {}
    for split in ("test", "test_novel"):
        for name, use_memory in (("memory", True), ("no memory", False)):
            if name == "memory" and not run.memory:
                continue
            results[f"{split}, {name}"] = exp.evaluate(run, split, args.examples or None,
                                                       use_memory)
    if not distributed.is_primary():  # every process evaluated; process 0 writes and prints
        return 0
    out = os.path.join(args.workdir, f"eval_{int(run.step)}")
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=2)
    md = table(results)
    if policies_step != int(run.step):
        md += (f"\n\nThe policies of step {policies_step}, chosen on the training traffic "
               f"(config.grpo.select_every); the memory of step {int(run.step)}.")
    with open(out + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    return 0
