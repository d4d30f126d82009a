"""Chosen questions through a GRPO run, step by step: when their greedy answers flip, and why.

    python benchmarks/question_trace.py --root R --seed 4 --questions gfc-0001
    python benchmarks/question_trace.py --root R --seed 4 --questions gfc-0001 \
        --variant nodewise_all --tokens 391297

Reruns a `learning_study.py` variant (`--variant`, `--set`) from the root's end-of-SFT
checkpoint of the seed (trained there first when missing), with the CPU numerics pinned as the
study pins them, so its steps are the study's run of that seed and variant. After every GRPO
step it answers the questions' `test` queries greedily with the policies alone and keeps the
step's node groups with a reward spread (trajectory mode: (query, agent) groups) that belong to
a train query of the questions: each member's reward and whether it is the memory's stored
output; where a question's right answers change, its first test query's episode before and
after. A popular question can move a seed's accuracy by 2-4 points when it flips; this shows
whether its own groups were contested before (the policy's samples split between the right
output and another) and whether the run settled them. Writes `<root>/trace_<variant>_s<seed>.json`
and prints one line per step and, per (question, agent, node), the contest's summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import learning_study as ls  # noqa: E402
from joyagents_jax import batching, checkpoint, experiment, train, xla_flags  # noqa: E402
from joyagents_jax.data import assistant_suite as suite  # noqa: E402
from joyagents_jax.rl import rollout  # noqa: E402


def question_groups(samples: list[rollout.Sample], questions: list[str | None]
                    ) -> list[dict]:
    """The informative node groups among `samples` whose query's question (questions[query],
    None: not traced) is traced: {"question", "agent", "node", "rewards", "memory"} each, the
    members in rollout order."""
    groups = collections.defaultdict(list)
    for s in batching.informative(samples):
        if questions[s.query] is not None:
            groups[s.group].append(s)
    return [{"question": questions[m[0].query], "agent": m[0].agent, "node": int(m[0].node),
             "rewards": [round(float(s.reward), 4) for s in m],
             "memory": [bool(s.from_memory) for s in m]} for _, m in sorted(groups.items())]


def contests(steps: list[dict]) -> dict[tuple[str, str, int], dict]:
    """Per (question, agent, node): the steps whose groups there had a reward spread, and how many
    of their policy samples (not the memory's) scored below their group's best: the samples that
    left the right output."""
    out = {}
    for step in steps:
        for g in step["groups"]:
            key = (g["question"], g["agent"], g["node"])
            c = out.setdefault(key, {"steps": [], "behind": 0, "samples": 0})
            if step["step"] not in c["steps"]:
                c["steps"].append(step["step"])
            best = max(g["rewards"])
            own = [r for r, m in zip(g["rewards"], g["memory"]) if not m]
            c["behind"] += sum(r < best for r in own)
            c["samples"] += len(own)
    return out


def flips(steps: list[dict], question: str, start: int) -> list[tuple[int, int, int]]:
    """(step, before, after): the steps where the question's test queries answered right alone
    changed, from `start` (the SFT policies') on."""
    out, before = [], start
    for step in steps:
        now = step["alone"][question]
        if now != before:
            out.append((step["step"], before, now))
        before = now
    return out


class TracedExperiment(experiment.Experiment):
    """An `Experiment` that keeps each GRPO step's rollout (`last_rollout`)."""

    last_rollout: rollout.RolloutResult | None = None
    last_tasks: list[rollout.Task] | None = None

    def _rollout(self, run, k, tasks):
        result, refills = super()._rollout(run, k, tasks)
        self.last_rollout, self.last_tasks = result, tasks
        return result, refills


def answered(exp: experiment.Experiment, run, exs: list[suite.Example]
             ) -> tuple[int, list[str]]:
    """The examples the policies alone answer right greedily, and the first example's episode
    ("agent: output" per node)."""
    engine = rollout.Rollout(exp.system, exp.tokenizer, exp.policy(
        run.train, jax.random.key(0), greedy=True), exp.parts.rollout, None)
    result = engine.episodes([experiment.task_of(e) for e in exs])
    episode = [f"{n.agent}: {n.output}" for n in result.episodes[0].episode.nodes]
    return int(sum(float(p.r_answer) for p in result.rewards)), episode


def trace(root: str, seed: int, questions: list[str], variant: str, extra: dict, tokens: int,
          max_steps: int) -> dict:
    """The variant's GRPO run of the seed until `tokens` sampler tokens or `max_steps` steps,
    one record per step (see the module's docstring)."""
    data_dir = os.path.join(root, "data")
    overrides = {**ls.VARIANTS[variant][1], **extra}
    c = ls.config_for(seed, {**overrides, "data_dir": data_dir})
    sources = experiment.load_sources(c, root)  # built on first use, as the study builds it
    test = [suite.decode(sources["test"][i]) for i in range(ls.SPLITS["test"])]
    exs = {q: [e for e in test if e.question_id == q] for q in questions}
    missing = [q for q, e in exs.items() if not e]
    if missing:
        raise SystemExit(f"No test query of question(s) {missing} among the first "
                         f"{ls.SPLITS['test']}; pick questions that `test` holds.")
    tag = variant if ls.sft_overrides(ls.VARIANTS[variant][1]) else ""
    sft_dir = ls.sft_checkpoint(root, seed, data_dir, overrides, tag)
    exp = TracedExperiment(c, os.path.join(root, f"trace_{variant}_s{seed}"))
    with checkpoint.Checkpointer(os.path.join(sft_dir, "checkpoints"), read_only=True) as ckpt:
        run = train.restore(exp, ckpt)
    source = exp.sources["train"]
    of_query = {e.query: e.question_id for e in (suite.decode(source[i])
                                                 for i in range(len(source)))}
    episodes = {q: answered(exp, run, e) for q, e in exs.items()}
    start = {q: n for q, (n, _) in episodes.items()}
    print(f"SFT: {start} right of {({q: len(e) for q, e in exs.items()})}", flush=True)
    run, steps, generated = exp.start_grpo(run), [], 0
    for k in range(max_steps):
        if generated >= tokens:
            break
        run, m = exp.grpo_iteration(run)
        generated += int(m["rollout/generated_tokens"])
        traced = [of_query.get(t.query) if of_query.get(t.query) in exs else None
                  for t in exp.last_tasks]
        step = {"step": k + 1, "tokens": generated,
                "queries": {q: traced.count(q) for q in questions},
                "groups": question_groups(exp.last_rollout.samples, traced)}
        now = {q: answered(exp, run, e) for q, e in exs.items()}
        step["alone"] = {q: n for q, (n, _) in now.items()}
        step["flipped"] = {q: {"before": episodes[q][1], "after": ep} for q, (n, ep) in now.items()
                           if n != episodes[q][0]}  # the first test query's episode, alone
        episodes = now
        steps.append(step)
        print(json.dumps(step), flush=True)
    return {"seed": seed, "variant": variant, "overrides": extra, "questions": questions,
            "test_queries": {q: len(e) for q, e in exs.items()}, "sft_alone": start,
            "steps": steps}


def report(out: dict) -> str:
    """Per traced (question, agent, node) its contest, per question its flips."""
    lines = []
    for (q, agent, node), c in sorted(contests(out["steps"]).items()):
        lines.append(f"{q} {agent} node {node}: contested at steps {c['steps']}, "
                     f"{c['behind']} of {c['samples']} policy samples behind their group's best")
    for q in out["questions"]:
        lines.append(f"{q}: {out['test_queries'][q]} test queries, right alone at SFT "
                     f"{out['sft_alone'][q]}, flips (step, before, after) "
                     f"{flips(out['steps'], q, out['sft_alone'][q])}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="a learning_study root (its data and SFT runs)")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--questions", required=True, help="comma list of question ids, e.g. gfc-0001")
    p.add_argument("--variant", default="default", choices=sorted(ls.VARIANTS))
    p.add_argument("--set", action="append", default=[], help="config override KEY=VALUE")
    p.add_argument("--tokens", type=int, default=10**12, help="sampler-token budget")
    p.add_argument("--max_steps", type=int, default=44)
    args = p.parse_args()
    if ls.is_sft(args.variant):
        raise SystemExit(f"{args.variant} runs no GRPO step: trace a GRPO variant.")
    extra = ls.parse_overrides(args.set)
    if clash := ls.conflicts(args.variant, extra):
        raise SystemExit(f"--set overrides {clash}, which variant {args.variant!r} sets "
                         f"itself; drop them or trace another variant.")
    xla_flags.pin_cpu_numerics()  # the study's numbers (before JAX's backend starts)
    out = trace(args.root, args.seed, args.questions.split(","), args.variant, extra,
                args.tokens, args.max_steps)
    path = os.path.join(args.root, f"trace_{args.variant}_s{args.seed}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(report(out))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
