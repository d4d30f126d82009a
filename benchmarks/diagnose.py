"""Where a trained run's agents fail, and how much a sampler can find: the learning diagnosis.

    python benchmarks/diagnose.py --workdir runs/default --step 900 --samples 4

On a held-out split (`--split`, default test), without the memory:
- greedy episodes: accuracy and LLM calls per query, and each failed episode's first departure
  from its gold trajectory, named by the node where it happens: `routing` (the master calls
  another agent), `sub-query` (the right agent, another sub-query text), `tool name`,
  `tool arguments`, `sub-agent answer`, `final answer` (the master's), or `format`
  (a node that does not parse); `other path` when it fails after a different but valid route;
- `--samples` G episodes per query at the rollout temperature: the mean sampled accuracy and
  pass@G, the share of queries at least one of G samples answers: the headroom GRPO can find.
Per domain as well, and per how often the query's question occurs in `train` (SFT's
demonstrations and GRPO's traffic): what SFT learned is what it saw often. Writes `<workdir>/diagnosis_<step>_T<temperature>_G<samples>.json` and prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from joyagents_jax import evaluate, xla_flags  # noqa: E402
from joyagents_jax.agents.protocol import ParseError  # noqa: E402
from joyagents_jax.data import assistant_suite as suite  # noqa: E402
from joyagents_jax.experiment import task_of  # noqa: E402
from joyagents_jax.rl import rollout  # noqa: E402

_TOOL = re.compile(r'<tool name="(\w+)">')
_CALL = re.compile(r'<call agent="(\w+)"')


def first_error(nodes, gold: tuple[suite.GoldNode, ...]) -> str:
    """The kind of the first node where a failed episode leaves its gold trajectory."""
    for node, want in zip(nodes, gold):
        if node.output == want.output:
            continue
        if isinstance(node.action, ParseError):
            return "format"
        if node.agent != want.agent:
            return "other path"
        if want.output.startswith("<call"):
            same = _CALL.match(node.output) and _CALL.match(node.output).group(1) == \
                _CALL.match(want.output).group(1)
            return "sub-query" if same else "routing"
        if want.output.startswith("<tool"):
            same = _TOOL.match(node.output) and _TOOL.match(node.output).group(1) == \
                _TOOL.match(want.output).group(1)
            return "tool arguments" if same else "tool name"
        return "final answer" if want.agent == suite.MASTER else "sub-agent answer"
    return "stopped early" if len(nodes) < len(gold) else "other path"


FREQUENCY_BINS = ((0, 0), (1, 2), (3, 5), (6, 15), (16, None))  # occurrences in train


def train_counts(exp) -> collections.Counter:
    """How often each question_id occurs in the train split."""
    train = exp.sources["train"]
    return collections.Counter(suite.decode(train[i]).question_id for i in range(len(train)))


def by_frequency(exs, counts, correct: np.ndarray, sampled: np.ndarray) -> dict:
    """Greedy accuracy and pass@G of the queries whose question occurs lo..hi times in train."""
    rows = {}
    for lo, hi in FREQUENCY_BINS:
        idx = [i for i, e in enumerate(exs)
               if lo <= counts[e.question_id] and (hi is None or counts[e.question_id] <= hi)]
        name = f"{lo}+" if hi is None else f"{lo}-{hi}"
        rows[name] = {"queries": len(idx),
                      "greedy_acc": float(correct[idx].mean()) if idx else None,
                      "pass": float(sampled[:, idx].max(0).mean()) if idx else None}
    return rows


def diagnose(workdir: str, step: int | None, split: str, samples: int, examples: int,
             temperature: float | None = None) -> dict:
    exp, run = evaluate.load_run(workdir, step)
    if temperature is not None:  # sample at another temperature than the run's rollouts
        exp.parts = exp.parts._replace(sampling=dataclasses.replace(exp.parts.sampling,
                                                                    temperature=temperature))
    exs, greedy, _ = exp.greedy_episodes(run, split, examples or None, use_memory=False)
    tasks = [task_of(e) for e in exs]
    engine = lambda policy: rollout.Rollout(exp.system, exp.tokenizer, policy, exp.parts.rollout)
    correct = np.array([float(r.r_answer) for r in greedy.rewards])
    sampled = np.stack([[float(r.r_answer) for r in engine(
        exp.policy(run.train, jax.random.key(1 + g))).episodes(tasks).rewards]
        for g in range(samples)])  # [G, Q]
    errors = [None if ok else first_error(t.episode.nodes, e.gold)
              for ok, t, e in zip(correct, greedy.episodes, exs)]
    calls = np.array([t.episode.llm_calls for t in greedy.episodes])
    rows = {}
    for domain in ["all", *sorted({e.domain for e in exs})]:
        idx = [i for i, e in enumerate(exs) if domain in ("all", e.domain)]
        counts = collections.Counter(errors[i] for i in idx if errors[i])
        rows[domain] = {"queries": len(idx), "greedy_acc": float(correct[idx].mean()),
                        "sampled_acc": float(sampled[:, idx].mean()),
                        f"pass@{samples}": float(sampled[:, idx].max(0).mean()),
                        "llm_calls": float(calls[idx].mean()),
                        "gold_llm_calls": float(np.mean([exs[i].min_llm_calls for i in idx])),
                        "errors": dict(counts.most_common())}
    return {"workdir": workdir, "step": int(run.step), "split": split, "samples": samples,
            "temperature": exp.parts.sampling.temperature, "domains": rows,
            "train_frequency": by_frequency(exs, train_counts(exp), correct, sampled)}


def table(result: dict) -> str:
    g = result["samples"]
    kinds = sorted({k for r in result["domains"].values() for k in r["errors"]})
    head = ["domain", "queries", "greedy acc", f"sampled acc (T={result['temperature']})",
            f"pass@{g}", "LLM calls (gold)", *[f"err: {k}" for k in kinds]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for domain, r in result["domains"].items():
        cells = [domain, str(r["queries"]), f"{r['greedy_acc']:.3f}", f"{r['sampled_acc']:.3f}",
                 f"{r[f'pass@{g}']:.3f}", f"{r['llm_calls']:.2f} ({r['gold_llm_calls']:.2f})",
                 *[str(r["errors"].get(k, 0)) for k in kinds]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"| occurrences of the question in train | queries | greedy acc | pass@{g} |",
              "|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"
    for name, r in result["train_frequency"].items():
        lines.append(f"| {name} | {r['queries']} | {fmt(r['greedy_acc'])} | {fmt(r['pass'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    xla_flags.pin_cpu_numerics()  # the numbers `joyagents train` gives (before JAX's backend starts)
    xla_flags.use_compilation_cache()  # as `joyagents` does: later runs load earlier compiles
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None, help="checkpoint (default: latest)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--samples", type=int, default=4, help="G sampled episodes per query")
    parser.add_argument("--examples", type=int, default=0, help="0: the whole split")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: the run's grpo.temperature)")
    args = parser.parse_args(argv)
    result = diagnose(args.workdir, args.step, args.split, args.samples, args.examples,
                      args.temperature)
    name = f"diagnosis_{result['step']}_T{result['temperature']}_G{args.samples}.json"
    with open(os.path.join(args.workdir, name), "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
