"""The learning study: JoyAgents-R1 against its baselines on the built-in suite, per seed, at
an equal sampler-token budget.

Every variant of a seed starts from the same SFT checkpoint (the default's SFT phase, made
once per seed with `joyagents train --config.grpo.steps=0`), then runs GRPO steps until the
rollouts have generated `--tokens` tokens, and is evaluated greedily on all of `test` and
`test_novel` (with its memory when it has one). `sft_only` is the checkpoint itself;
`sft_clean` one trained on the gold demonstrations, the baseline of the imperfect demonstrator.

    python benchmarks/learning_study.py --seeds 0 --variants joyagents   # one run (SFT once)
    python benchmarks/learning_study.py --seeds 0,1,2                     # the study
    python benchmarks/learning_study.py --report                          # table + plot

Runs are cached as JSON under --root (one file per seed and variant), so the study can be run
piece by piece; --report aggregates whatever exists into `<out>.json` (one record per variant
and seed: SFT and final accuracy with and without the memory, LLM calls, tokens, how many `test`
queries GRPO fixed and broke for the policies alone against SFT, on how many it raised and
lowered their LLM calls, and their calls above and below each query's minimum), a Markdown table
(mean +- std over seeds, then each run against the baselines query by query and per domain,
and the questions behind each run's fixed and broken queries) and
`<out>.png` (rollout accuracy, and with --eval_every held-out accuracy without the memory,
against generated tokens). Each run records its device and commit, and is compared (with SFT,
with the baselines) only to runs of its seed on the same device. `--set KEY=VALUE` overrides
apply to every run, and all but `grpo.*` and `memory.*` ones also to the seed's SFT checkpoint
(use a separate --root for each setting). A variant that overrides other keys (`sft_clean`)
trains its own SFT checkpoint per seed; one that overrides a key --set also sets is refused.
"""

from __future__ import annotations

import argparse
import ast
import collections
import glob
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # matplotlib loads only where a figure is drawn
    import matplotlib.figure

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hardware  # noqa: E402
from joyagents_jax import checkpoint, experiment, selection, train, xla_flags  # noqa: E402
from joyagents_jax import config as config_lib  # noqa: E402
from joyagents_jax.data import assistant_suite as suite  # noqa: E402

# name: (description, config overrides) on top of the embedded default.
VARIANTS = {
    "sft_only": ("SFT only", {}),
    "sft_clean": ("SFT only on the gold demonstrations (the default before the imperfect "
                  "demonstrator)", {"sft.demo_redundant_call": 0.0, "max_len": 384}),
    "default": ("the README default (JoyAgents-R1 as `joyagents train` runs it)", {}),
    "lr_5e-5": ("the default at the previous learning rate 5e-5", {"grpo.learning_rate": 5e-5}),
    "cosine": ("the default with its learning rate decayed by a cosine from 6e-5 to 0 over its "
               "steps (a mean of 3e-5)", {"grpo.schedule": "cosine", "grpo.learning_rate": 6e-5}),
    "trajectory": ("trajectory GRPO, all groups, no memory",
                   {"grpo.mode": "trajectory", "grpo.topk": 0, "memory.enabled": False}),
    "nodewise_all": ("node-wise, all groups, no memory",
                     {"grpo.topk": 0, "memory.enabled": False}),
    "nodewise_topk": ("node-wise, top-K (K=5), no memory",
                      {"grpo.topk": 5, "memory.enabled": False}),
    "joyagents": ("JoyAgents-R1: node-wise, top-K (K=5), memory",
                  {"grpo.topk": 5, "memory.enabled": True}),
    "k1": ("JoyAgents-R1, K=1", {"grpo.topk": 1, "memory.enabled": True}),
    "k2": ("JoyAgents-R1, K=2", {"grpo.topk": 2, "memory.enabled": True}),
    "kall": ("JoyAgents-R1, K=all", {"grpo.topk": 0, "memory.enabled": True}),
    "g8_kall": ("JoyAgents-R1, G=8, K=all", {"grpo.group_size": 8, "grpo.topk": 0}),
    "questions": ("the default, GRPO queries over distinct train questions",
                  {"grpo.query_order": "questions"}),
    "grounding": ("the default with R_G (w_grounding=0.2): grounded copies rewarded",
                  {"grpo.w_grounding": 0.2}),
    "grounding_kall": ("R_G (w_grounding=0.2) and every node group with a reward spread (K=all)",
                       {"grpo.w_grounding": 0.2, "grpo.topk": 0}),
    "memory_branches": ("node groups also at memory-answered nodes (the stored output beside "
                        "G - 1 policy samples; the default since session 40)",
                        {"grpo.memory_branches": True}),
    "no_memory_branches": ("the default without node groups at memory-answered nodes (the "
                           "default of session 39)", {"grpo.memory_branches": False}),
    "gold_branches": ("the default, the gold output a member of node groups where a rollout "
                      "leaves the gold trajectory (off-policy guidance)",
                      {"grpo.gold_branches": True}),
    "gold_kall": ("gold_branches and every node group with a reward spread (K=all)",
                  {"grpo.gold_branches": True, "grpo.topk": 0}),
    "gold_kall_lr5e-5": ("gold_kall at learning rate 5e-5",
                         {"grpo.gold_branches": True, "grpo.topk": 0, "grpo.learning_rate": 5e-5}),
    "grounding_chars": ("R_G (w_grounding=0.2) with partial credit for near copies",
                        {"grpo.w_grounding": 0.2, "grpo.grounding_match": "chars"}),
    "self_imitation": ("the default with a supervised step on 8 best memory entries per agent "
                       "after each GRPO step", {"grpo.self_imitation": 8}),
    "subagent_credit": ("the default, a sub-agent's nodes scored by its own answer against the "
                        "gold trajectory's", {"grpo.subagent_credit": True}),
    # sub_branches was the default of session 57, named so that its records stay apart from
    # the previous default's (all_branches) and the next one's (master_memory_eval).
    "sub_branches": ("node groups at the sub-agents' nodes only, the master writing no memory "
                     "entries (the default of session 57)",
                     {"grpo.branch_agents": "qa,efc,gfc,math", "grpo.unbranched_memory": "off"}),
    "all_branches": ("node groups at every agent's nodes (the default until 2026-12-02 and "
                     "since session 64)", {"grpo.branch_agents": ""}),
    "bytes": ("the byte-tokenizer default of sessions 57-63 (config.byte_default())",
              dict(config_lib.BYTE_DEFAULT)),
    "min_change_0.05": ("the default, branching only where a sample differs from tau0's output "
                        "with chance >= 0.05", {"grpo.branch_min_change": 0.05}),
    "min_change_q54": ("min_change_0.05 with 54 queries per step (the tokens it saves spent on "
                       "wider steps, not more of them)",
                       {"grpo.branch_min_change": 0.05, "grpo.queries": 54}),
    "master_memory": ("the default, the master's tau0 outputs written to the memory and reused "
                      "in GRPO's rollouts too (it still trains nothing)",
                      {"grpo.unbranched_memory": "all"}),
    "master_memory_eval": ("the master's tau0 outputs written to the memory and reused at "
                           "evaluation only (the default since session 59)",
                           {"grpo.unbranched_memory": "eval"}),
    "no_std": ("the default with Dr. GRPO's advantages (r - group mean, not divided by the std)",
               {"grpo.advantage": "no_std"}),
    "neg_0.25": ("the default with negative advantages scaled by 0.25 (leaning on the samples "
                 "that beat their group)", {"grpo.neg_weight": 0.25}),
    "no_share": ("the default with every alternative completed, equal outputs too (the "
                 "default of session 43)", {"grpo.share_identical": False}),
    "suffix": ("the default, each alternative's nodes after its branch trained too with its "
               "advantage (trajectory credit for the suffix)", {"grpo.suffix_credit": True}),
    "greedy_completions": ("the default, tau0 and each alternative's later nodes decoded "
                           "greedily", {"grpo.greedy_completions": True}),
    "greedy_t06": ("greedy_completions, the branch node's alternatives sampled at temperature "
                   "0.6", {"grpo.greedy_completions": True, "grpo.temperature": 0.6}),
    "replay": ("the default, each step re-asking up to 12 of the previous step's queries that "
               "had a node group with a reward spread (the default since session 70)",
               {"grpo.replay": 12}),
    "no_replay": ("the default without replay, every query fresh (the default of sessions "
                  "64-69)", {"grpo.replay": 0}),
    "trajectory_replay": ("trajectory GRPO (no memory) re-asking up to 12 of the previous "
                          "step's queries that had a reward spread",
                          {"grpo.mode": "trajectory", "grpo.topk": 0, "memory.enabled": False,
                           "grpo.replay": 12}),
    "replay_k5": ("the default with replay (12) and top-K (K=5) instead of every node group "
                  "with a reward spread", {"grpo.replay": 12, "grpo.topk": 5}),
    "deep": ("the default with 4-layer agents (model deep-bpe) instead of 2",
             {"groups.all.model": "deep-bpe"}),
}
MAIN = ("sft_only", "trajectory", "nodewise_all", "nodewise_topk", "joyagents")
SPLITS = {"test": 200, "test_novel": 50}
# The baselines for JoyAgents-R1; `trajectory` and `trajectory_replay` run one config
# since replay is the default (session 70), and the records since then name the latter.
PAIRED_BASELINES = ("trajectory", "trajectory_replay", "nodewise_all")


def parse_overrides(items: list[str]) -> dict:
    """["grpo.topk=2", "grpo.mode=trajectory", "grpo.gold_branches=true"] -> {"grpo.topk": 2,
    "grpo.mode": "trajectory", "grpo.gold_branches": True}: booleans in any case, as
    `joyagents train --config.KEY=VALUE` reads them."""
    def value(v: str):
        if v.lower() in ("true", "false"):
            return v.lower() == "true"
        return ast.literal_eval(v) if v[:1] in "0123456789-.[(" else v
    return {k: value(v) for k, _, v in (item.partition("=") for item in items)}


def config_for(seed: int, overrides: dict) -> "config_lib.ml_collections.ConfigDict":
    c = config_lib.override(config_lib.get_config(), overrides)
    c.seed = seed
    return c


def is_sft(name: str) -> bool:
    """Variants that evaluate an SFT checkpoint as it is (no GRPO steps)."""
    return name.startswith("sft_")


def sft_overrides(overrides: dict) -> dict:
    """The overrides that change the SFT phase: all but `grpo.*` and `memory.*`."""
    return {k: v for k, v in overrides.items() if not k.startswith(("grpo.", "memory."))}


def conflicts(name: str, extra: dict) -> list[str]:
    """Keys that both variant `name` and the --set overrides set, to different values."""
    own = VARIANTS[name][1]
    return sorted(k for k in own.keys() & extra.keys() if own[k] != extra[k])


def sft_checkpoint(root: str, seed: int, data_dir: str, extra: dict, tag: str = "") -> str:
    """The seed's SFT workdir (`sft_s<seed>`, or `sft_<tag>_s<seed>` for a variant with SFT
    overrides of its own), trained (SFT phase only, with `sft_overrides(extra)`, e.g. the
    demonstrator's rates or max_len) unless its end-of-SFT checkpoint exists (e.g. copied from a
    default run of that seed: the SFT phases are identical)."""
    workdir = os.path.join(root, f"sft_{tag}_s{seed}" if tag else f"sft_s{seed}")
    sft = sft_overrides(extra)
    c = config_for(seed, {**sft, "grpo.steps": 0, "data_dir": data_dir})
    if not os.path.isdir(os.path.join(workdir, "checkpoints", str(c.sft.steps))):
        train.train(c, workdir)
    return workdir


def evaluate(exp: experiment.Experiment, run) -> tuple[dict[str, float], dict[str, list]]:
    """Greedy evaluation on every split; with a memory also without it (prefix eval_nomem/),
    which separates what the GRPO updates did from what the memory does. Also returns each
    `test` query's answer reward (1 or 0), LLM calls and its gold trajectory's calls (the
    minimum) for the policies alone: which queries GRPO fixed and which it broke against SFT
    (`records`), and where its calls moved."""
    out, per_query = {}, {}
    for split, n in SPLITS.items():
        for use_memory in (True, False) if run.memory else (False,):
            exs, result, seconds = exp.greedy_episodes(run, split, n, use_memory)
            prefix = "eval_nomem/" if run.memory and not use_memory else "eval/"
            out.update(experiment.summarize(exs, result, seconds, prefix + split))
            if split == "test" and not use_memory:
                per_query = {
                    "test_answers_no_memory": [float(p.r_answer) for p in result.rewards],
                    "test_calls_no_memory": [int(t.episode.llm_calls) for t in result.episodes],
                    "test_min_calls": [int(e.min_llm_calls) for e in exs]}
    return out, per_query


def run_variant(root: str, seed: int, name: str, tokens: int, max_steps: int,
                extra: dict | None = None, eval_every: int = 0) -> dict:
    """GRPO from the seed's SFT checkpoint until `tokens` generated tokens (or `max_steps`);
    evaluation. `extra`: config overrides on top of the variant's. Every `eval_every` steps
    (0: never) the policies are also evaluated on `test` without the memory, for the curve of
    held-out accuracy against sampler tokens. As in `joyagents train`, every
    `grpo.select_every` steps and after the last (here: the step that spends the token budget)
    the policies alone are scored on the selection slice of train records, and the final
    evaluation scores the best such step's policies beside the last memory (`--set
    grpo.select_every=0`: the last step's). Evaluations change nothing the run trains."""
    data_dir = os.path.join(root, "data")
    overrides = {**VARIANTS[name][1], **(extra or {})}
    tag = name if sft_overrides(VARIANTS[name][1]) else ""
    sft_dir = sft_checkpoint(root, seed, data_dir, overrides, tag)
    c = config_for(seed, {**overrides, "data_dir": data_dir})
    exp = experiment.Experiment(c, os.path.join(root, f"{name}_s{seed}"))
    with checkpoint.Checkpointer(os.path.join(sft_dir, "checkpoints"), read_only=True) as ckpt:
        run = train.restore(exp, ckpt)
    if (int(run.step), run.phase) != (c.sft.steps, "sft"):
        raise RuntimeError(f"{sft_dir} holds step {int(run.step)} ({run.phase}), not the end "
                           f"of SFT.")
    start, curve, generated, dev_curve = time.time(), [], 0, []
    if not is_sft(name):
        run = exp.start_grpo(run)
        for k in range(max_steps):
            if generated >= tokens:
                break
            run, m = exp.grpo_iteration(run)
            generated += int(m["rollout/generated_tokens"])
            point = {"step": k + 1, "tokens": generated, "accuracy": m["grpo/accuracy"],
                     "reward": m["grpo/reward"], "grounding": m["grpo/grounding"],
                     "mixed_groups": m["grpo/mixed_groups"], "kept_groups": m["grpo/kept_groups"],
                     "offpolicy_mixed_groups": m["grpo/offpolicy_mixed_groups"],
                     "offpolicy_kept_groups": m["grpo/offpolicy_kept_groups"],
                     "updated_agents": m["grpo/updated_agents"]}
            if eval_every and (k + 1) % eval_every == 0:
                point["test_acc_no_memory"] = exp.evaluate(run, "test", SPLITS["test"],
                                                           use_memory=False)["eval/test/accuracy"]
            curve.append(point)
            last = generated >= tokens or k + 1 == max_steps
            if run.selects and selection.due(k + 1, c.grpo.select_every, last):
                run, chosen = exp.select(run)
                dev_curve.append((k + 1, chosen["select/accuracy"]))
    selects = bool(dev_curve)
    if selects:
        run = run.replace(train=selection.apply(run.train, run.selected))
    ev, per_query = evaluate(exp, run)
    alone = lambda key: ev.get(key.replace("eval/", "eval_nomem/", 1), ev[key])
    return {"seed": seed, "variant": name, "steps": len(curve), "generated_tokens": generated,
            "seconds": time.time() - start, "curve": curve, "eval": ev,
            "test_acc": ev["eval/test/accuracy"],
            "test_acc_no_memory": alone("eval/test/accuracy"),
            "llm_calls_no_memory": alone("eval/test/llm_calls_per_query"),
            **per_query, "overrides": extra or {}, "device": hardware.device_name(),
            "commit": hardware.git_commit(),
            **({"select_every": c.grpo.select_every, "select_examples": c.grpo.select_examples,
                "selected_step": int(run.selected.step) - c.sft.steps, "dev_curve": dev_curve}
               if selects else {})}


def run_key(run: dict) -> tuple[int, str | None]:
    """(seed, device): runs compare query by query only on one host, since a seed's numbers
    may differ between CPUs (benchmarks/RESULTS.md, "What the CPU still chose"). Runs cached
    before the device was recorded have None."""
    return run["seed"], run.get("device")


def flip_masks(run: dict, sft: dict | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(fixed, broken) [Q] bool: `test` queries the policies alone answer after GRPO and did not
    at the end of SFT, and the reverse; None without both runs' per-query answers."""
    after, before = run.get("test_answers_no_memory"), (sft or {}).get("test_answers_no_memory")
    if not after or not before:
        return None
    a, b = np.asarray(after) > 0, np.asarray(before) > 0
    return a & ~b, b & ~a


def flips(run: dict, sft: dict | None) -> tuple[int, int] | None:
    """(fixed, broken) counts of `flip_masks`."""
    masks = flip_masks(run, sft)
    return None if masks is None else (int(masks[0].sum()), int(masks[1].sum()))


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven if either run were
    as likely as the other to answer a disputed query right."""
    n, k = wins + losses, min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def question_flips(run: dict, base: dict | None, qid: list[str]) -> tuple[int, int] | None:
    """(won, lost): questions whose `test` queries `run` answers more (fewer) of than `base`
    (policies alone), qid[i] the question of query i. Greedy decoding answers a question's
    recurring queries alike, so these, not the queries, are the independent paired draws."""
    masks = flip_masks(run, base)
    if masks is None:
        return None
    net = collections.Counter()
    for sign, mask in zip((1, -1), masks):
        for i in np.flatnonzero(mask):
            net[qid[i]] += sign
    return sum(v > 0 for v in net.values()), sum(v < 0 for v in net.values())


def paired(runs: list[dict], baselines: list[dict],
           qid: list[str] | None = None) -> tuple[list[int], int, int] | None:
    """(seeds, wins, losses) over the seeds both hold, on the same device, with per-query
    answers: `test` queries the policies alone answer and the baseline's do not, and the reverse
    (`flips` with the baseline in SFT's place), or with `qid` the questions (`question_flips`,
    one per seed and question); None when no seed pairs up."""
    base = {run_key(r): r for r in baselines}
    count = flips if qid is None else lambda r, b: question_flips(r, b, qid)
    pairs = [(r["seed"], count(r, base.get(run_key(r)))) for r in runs]
    pairs = sorted((seed, f) for seed, f in pairs if f)
    if not pairs:
        return None
    return [seed for seed, _ in pairs], sum(f[0] for _, f in pairs), sum(f[1] for _, f in pairs)


def paired_table(by_variant: dict[str, list[dict]], qid: list[str] | None = None,
                 baselines=PAIRED_BASELINES) -> str:
    """Markdown: each GRPO variant against each baseline, query by query (policies alone), and
    with `qid` question by question: popular questions recur in `test` and are answered alike,
    so the sign test over queries overstates the evidence; the one over questions does not.
    "" when nothing pairs up."""
    by_question = ["questions won / lost", "sign test p over questions"] if qid else []
    head = ["variant", "against", "seeds", "queries won / lost", "net points per seed",
            "sign test p", *by_question]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for base in baselines:
        for name in VARIANTS:
            if name not in by_variant or name == base or is_sft(name):
                continue
            got = paired(by_variant[name], by_variant.get(base, []))
            if not got:
                continue
            seeds, won, lost = got
            cells = [name, base, ",".join(map(str, seeds)), f"{won} / {lost}",
                     f"{100 * (won - lost) / SPLITS['test'] / len(seeds):+.1f}",
                     f"{sign_test_p(won, lost):.3f}"]
            if qid:
                _, q_won, q_lost = paired(by_variant[name], by_variant[base], qid)
                cells += [f"{q_won} / {q_lost}", f"{sign_test_p(q_won, q_lost):.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def against_table(by_variant: dict[str, list[dict]], reference: dict[str, list[dict]],
                  baselines=PAIRED_BASELINES) -> str:
    """Markdown: each GRPO variant's runs here against the reference root's runs of the same
    variant and of the baselines, on the seeds both hold (one device), policies alone: a
    screen's `--set` runs against the study they change. "" when nothing pairs up."""
    head = ["variant", "against (reference)", "seeds", "alone here / there",
            "queries won / lost", "net points per seed", "sign test p"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in VARIANTS:
        if name not in by_variant or is_sft(name):
            continue
        for base in dict.fromkeys((name, *baselines)):
            got = paired(by_variant[name], reference.get(base, []))
            if not got:
                continue
            seeds, won, lost = got
            there = {run_key(r): r["test_acc_no_memory"] for r in reference[base]}
            pairs = [(r["test_acc_no_memory"], there[run_key(r)]) for r in by_variant[name]
                     if r["seed"] in seeds and run_key(r) in there]
            here_acc, there_acc = np.mean(pairs, axis=0)
            lines.append("| " + " | ".join([
                name, base, ",".join(map(str, seeds)), f"{here_acc:.3f} / {there_acc:.3f}",
                f"{won} / {lost}", f"{100 * (won - lost) / SPLITS['test'] / len(seeds):+.1f}",
                f"{sign_test_p(won, lost):.3f}"]) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def question_spread(answers: np.ndarray, qid: list[str]) -> tuple[float, float]:
    """answers: [S, N] each seed's 0/1 answer to the N `test` queries. Returns the sd (ddof 1)
    of the seeds' accuracies, and the sd that per-question variation alone would give: each
    question's share of its records answered varying across seeds independently of the other
    questions. Their gap is a seed-wide level, which no larger test split would remove."""
    _, index = np.unique(np.asarray(qid), return_inverse=True)
    records = np.bincount(index)
    shares = np.stack([np.bincount(index, weights=a) / records for a in answers])  # [S, Q]
    by_question = float((records**2 * shares.var(0, ddof=1)).sum()) / answers.shape[1] ** 2
    return float(answers.mean(1).std(ddof=1)), by_question**0.5


def spread_table(by_variant: dict[str, list[dict]], qid: list[str]) -> str:
    """Markdown: per variant with two or more seeds' answers (one device), the seed spread of
    the policies alone on `test` against what independent questions alone would give; ""
    when no variant has two."""
    lines = ["| variant | seeds | sd of the seeds' accuracy alone | sd from independent "
             "questions |", "|---|---|---|---|"]
    for name in VARIANTS:
        rs = [r for r in by_variant.get(name, []) if r.get("test_answers_no_memory")]
        if len({r.get("device") for r in rs}) != 1 or len(rs) < 2:
            continue
        rs = sorted(rs, key=lambda r: r["seed"])
        sd, sd_q = question_spread(np.array([r["test_answers_no_memory"] for r in rs]), qid)
        lines.append(f"| {name} | {','.join(str(r['seed']) for r in rs)} | {100 * sd:.2f} | "
                     f"{100 * sd_q:.2f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def call_moves(run: dict, sft: dict | None) -> tuple[int, int] | None:
    """(more, fewer): `test` queries on which the policies alone make more LLM calls after GRPO
    than at the end of SFT, and fewer; None without both runs' per-query calls. The mean calls
    per query hide which way single queries moved (a fixed query may need a call SFT skipped)."""
    after, before = run.get("test_calls_no_memory"), (sft or {}).get("test_calls_no_memory")
    if not after or not before:
        return None
    delta = np.asarray(after) - np.asarray(before)
    return int((delta > 0).sum()), int((delta < 0).sum())


def calls_against_minimum(run: dict) -> tuple[float, float] | None:
    """(above, below): the policies alone's LLM calls per `test` query above its gold
    trajectory's (redundant calls, what R_E penalizes) and below it (episodes that ended early:
    a malformed output, an answer before the needed sub-agents); None without per-query calls."""
    calls, least = run.get("test_calls_no_memory"), run.get("test_min_calls")
    if not calls or not least:
        return None
    over = np.asarray(calls) - np.asarray(least)
    return float(np.maximum(over, 0).mean()), float(np.maximum(-over, 0).mean())


def records(runs: list[dict]) -> list[dict]:
    """One record per (variant, seed): accuracy and LLM calls after GRPO, with and without the
    memory, beside the same seed's end-of-SFT figures (from its `sft_only` run), the test
    queries GRPO fixed and broke for the policies alone, and those whose calls it moved."""
    sft = {run_key(r): r for r in runs if r["variant"] == "sft_only"}
    out = []
    for r in runs:
        base = sft.get(run_key(r))
        fixed, broken = flips(r, base) or (None, None)
        more, fewer = call_moves(r, base) or (None, None)
        above, below = calls_against_minimum(r) or (None, None)
        out.append({"variant": r["variant"], "seed": r["seed"],
                    "sft_test_acc": base["test_acc"] if base else None,
                    "test_acc": r["test_acc"], "test_acc_no_memory": r["test_acc_no_memory"],
                    "sft_llm_calls": base["llm_calls_no_memory"] if base else None,
                    "llm_calls_no_memory": r["llm_calls_no_memory"],
                    "fixed_no_memory": fixed, "broken_no_memory": broken,
                    "more_calls_no_memory": more, "fewer_calls_no_memory": fewer,
                    "calls_above_min_no_memory": above, "calls_below_min_no_memory": below,
                    "generated_tokens": r["generated_tokens"], "steps": r["steps"],
                    "overrides": r.get("overrides", {}), "device": r.get("device")})
    return out


def question_ids(root: str, runs: list[dict]
                 ) -> tuple[list[str], collections.Counter, list[str]] | None:
    """The question of each `test` query, each question's records in `train`, and each `test`
    query's domain, from the suite in `root`; None when no run has per-query answers."""
    answered = [r for r in runs if r.get("test_answers_no_memory")]
    if not answered:
        return None
    overrides = {**answered[0].get("overrides", {}), "data_dir": os.path.join(root, "data")}
    sources = experiment.load_sources(config_for(0, overrides), root)
    test = [suite.decode(sources["test"][i]) for i in range(SPLITS["test"])]
    train = collections.Counter(suite.decode(sources["train"][i]).question_id
                                for i in range(len(sources["train"])))
    return [x.question_id for x in test], train, [x.domain for x in test]


def domain_table(by_variant: dict[str, list[dict]], domains: list[str],
                 baselines=PAIRED_BASELINES) -> str:
    """Markdown: per variant, the policies alone's `test` accuracy in each domain (over its seeds
    with per-query answers), then each GRPO variant's queries won / lost per domain against
    each baseline on the same seeds: where a lead lives. "" when no run has per-query answers."""
    dom = np.asarray(domains)
    names = sorted(set(domains))
    cols = [f"{d} ({(dom == d).sum()})" for d in names]
    acc = ["| variant | seeds | " + " | ".join(cols) + " |", "|" + "---|" * (2 + len(names))]
    for name in VARIANTS:
        rs = [r for r in by_variant.get(name, []) if r.get("test_answers_no_memory")]
        if rs:
            right = np.mean([np.asarray(r["test_answers_no_memory"]) > 0 for r in rs], 0)  # [Q]
            acc.append(f"| {name} | {','.join(str(r['seed']) for r in rs)} | "
                       + " | ".join(f"{right[dom == d].mean():.3f}" for d in names) + " |")
    if len(acc) == 2:
        return ""
    won_lost = ["| variant | against | seeds | " + " | ".join(cols) + " |",
                "|" + "---|" * (3 + len(names))]
    for base in baselines:
        base_runs = {run_key(r): r for r in by_variant.get(base, [])}
        for name in VARIANTS:
            if name not in by_variant or name == base or is_sft(name):
                continue
            pairs = [(r["seed"], flip_masks(r, base_runs.get(run_key(r))))
                     for r in by_variant[name]]
            pairs = [(seed, m) for seed, m in pairs if m]
            if pairs:
                won = sum(m[0] for _, m in pairs)  # [Q] seeds on which the variant alone won
                lost = sum(m[1] for _, m in pairs)
                won_lost.append(
                    f"| {name} | {base} | {','.join(str(seed) for seed, _ in pairs)} | "
                    + " | ".join(f"{won[dom == d].sum()} / {lost[dom == d].sum()}"
                                 for d in names) + " |")
    return "\n".join(acc) + ("\n\n" + "\n".join(won_lost) if len(won_lost) > 2 else "")


def flip_listing(runs: list[dict], qid: list[str], train: collections.Counter) -> str:
    """A Markdown table of the questions behind each GRPO run's fixed and broken `test` queries
    (`q xN (fM)`: N of its queries, M records of it in `train`), most first; "" when no run has
    per-query answers. Popular questions recur in `test`, so one question can move the accuracy
    by several points."""
    sft = {run_key(r): r for r in runs if r["variant"] == "sft_only"}
    pairs = [(r, sft[run_key(r)]) for r in runs
             if not is_sft(r["variant"]) and flips(r, sft.get(run_key(r)))]
    if not pairs:
        return ""
    names = lambda mask: ", ".join(f"{q} x{n} (f{train[q]})" for q, n in collections.Counter(
        qid[i] for i in np.flatnonzero(mask)).most_common()) or "-"
    lines = ["| variant | seed | fixed (questions) | broken (questions) |", "|---|---|---|---|"]
    for r, base in sorted(pairs, key=lambda p: (p[0]["variant"], p[0]["seed"])):
        fixed, broken = flip_masks(r, base)
        lines.append(f"| {r['variant']} | {r['seed']} | {names(fixed)} | {names(broken)} |")
    return "\n".join(lines)


def popularity_table(runs: list[dict], qid: list[str], train: collections.Counter,
                     popular: int = 20) -> str:
    """A Markdown table of each GRPO variant's `test` queries fixed / broken against SFT (summed
    over its seeds) on popular questions (at least `popular` records in `train`) and on rare
    ones; "" when no run has per-query answers. A popular question recurs in `test`, so one
    flip of it moves several queries at once, a rare one a single query."""
    sft = {run_key(r): r for r in runs if r["variant"] == "sft_only"}
    pop = np.array([train[q] >= popular for q in qid])
    sums: dict[str, np.ndarray] = {}
    for r in runs:
        masks = None if is_sft(r["variant"]) else flip_masks(r, sft.get(run_key(r)))
        if masks:
            fixed, broken = masks
            sums[r["variant"]] = sums.get(r["variant"], 0) + np.array(
                [(fixed & pop).sum(), (broken & pop).sum(), (fixed & ~pop).sum(),
                 (broken & ~pop).sum(), 1])
    if not sums:
        return ""
    lines = [f"| variant | seeds | popular (>= {popular} train records, {pop.sum()} of "
             f"{len(qid)} test queries): fixed / broken | rare: fixed / broken | net |",
             "|---|---|---|---|---|"]
    for name, (fp, bp, fr, br, n) in sorted(sums.items()):
        lines.append(f"| {name} | {n} | {fp} / {bp} | {fr} / {br} | {fp - bp + fr - br:+d} |")
    return "\n".join(lines)


def cached_runs(root: str) -> list[dict]:
    """The runs cached in `root` (its result_<variant>_s<seed>.json files)."""
    return [json.load(open(os.path.join(root, f))) for f in sorted(os.listdir(root))
            if f.startswith("result_") and f.endswith(".json")]


def by_variant_of(runs: list[dict]) -> dict[str, list[dict]]:
    """{variant: its runs}, in the order given."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(r["variant"], []).append(r)
    return out


def report(root: str, out_md: str, out_png: str, against: str | None = None) -> str:
    """The study's tables (markdown, also returned), its records (.json) and plot (.png); with
    `against` a reference root, each variant here against that root's runs too."""
    runs = cached_runs(root)
    with open(out_md.removesuffix(".md") + ".json", "w") as f:
        json.dump(records(runs), f, indent=1)
    by_variant = by_variant_of(runs)
    unknown = sorted(set(by_variant) - set(VARIANTS))
    if unknown:  # results of another version of this script in the same root
        print(f"# left out of the table and plot (not variants of this script): {unknown}")
    domains = sorted({k.rsplit("/", 1)[1] for r in runs for k in r["eval"]
                      if k.startswith("eval/test/accuracy/")})
    stat = lambda xs, f=".3f": (f"{np.mean(xs):{f}} +- {np.std(xs):{f}}" if len(xs) > 1
                                else f"{xs[0]:{f}}")
    sft_runs = {run_key(r): r for r in by_variant.get("sft_only", [])}
    gain = lambda rs: stat([r["eval"]["eval/test/accuracy"] - sft_runs[run_key(r)]["test_acc"]
                            for r in rs if run_key(r) in sft_runs] or [float("nan")])
    vs_sft = lambda rs, pair: [c for c in (pair(r, sft_runs.get(run_key(r))) for r in rs) if c]
    joined = lambda tuples, f: (" / ".join(stat(list(x), f) for x in zip(*tuples))
                                if tuples else "-")
    head = ["variant", "seeds", "test acc", "gain over SFT", *domains, "test acc without memory",
            "test queries fixed / broken without memory", "test_novel acc",
            "LLM calls / query", "test queries with more / fewer calls without memory",
            "calls / query above / below the minimum without memory", "memory hit rate",
            "GRPO steps", "generated tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in VARIANTS:
        rs = by_variant.get(name)
        if not rs:
            continue
        ev = lambda key: [r["eval"][key] for r in rs]
        cells = [VARIANTS[name][0], ",".join(str(r["seed"]) for r in rs),
                 stat(ev("eval/test/accuracy")), gain(rs),
                 *[stat(ev(f"eval/test/accuracy/{d}")) for d in domains],
                 stat([r["eval"].get("eval_nomem/test/accuracy", r["eval"]["eval/test/accuracy"])
                       for r in rs]),
                 joined(vs_sft(rs, flips), ".1f"), stat(ev("eval/test_novel/accuracy")),
                 stat(ev("eval/test/llm_calls_per_query")), joined(vs_sft(rs, call_moves), ".1f"),
                 joined([c for c in map(calls_against_minimum, rs) if c], ".3f"),
                 stat(ev("eval/test/memory_hit_rate")),
                 stat([r["steps"] for r in rs], ".1f"),
                 stat([r["generated_tokens"] for r in rs], ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    qid, train, domains = question_ids(root, runs) or (None, None, None)
    pairs = paired_table(by_variant, qid)
    if pairs:
        table += ("\n\nEach run against the baselines on the same seeds, query by query and "
                  "question by question:\n\n" + pairs)
    versus = against_table(by_variant, by_variant_of(cached_runs(against))) if against else ""
    if versus:
        table += (f"\n\nEach run against the runs in {against} on the same seeds, query by "
                  "query:\n\n" + versus)
    spreads = spread_table(by_variant, qid) if qid else ""
    if spreads:
        table += ("\n\nThe seed spread of the policies alone (points) against what the test "
                  "questions alone would give:\n\n" + spreads)
    listing = flip_listing(runs, qid, train) if qid else ""
    if listing:
        table += "\n\nTest queries fixed and broken by GRPO, by question:\n\n" + listing
    by_domain = domain_table(by_variant, domains) if qid else ""
    if by_domain:
        table += ("\n\nThe policies alone per domain (accuracy; then test queries won / lost "
                  "against the baselines):\n\n" + by_domain)
    popularity = popularity_table(runs, qid, train) if qid else ""
    if popularity:
        table += ("\n\nTest queries fixed and broken by GRPO on popular and rare questions:"
                  "\n\n" + popularity)
    with open(out_md, "w") as f:
        f.write(table + "\n")
    study_figure(by_variant).savefig(out_png, dpi=120)
    return table


def heldout_points(run: dict, sft_acc: float | None) -> list[tuple[int, float]]:
    """(generated tokens, test accuracy of the policies alone): SFT's at 0 tokens, each
    `--eval_every` evaluation, and the final evaluation where the run ran past the last one (a
    token budget seldom ends on a multiple of eval_every; for a run never evaluated along the
    way, the only point after SFT's)."""
    held = [(p["tokens"], p["test_acc_no_memory"]) for p in run["curve"]
            if "test_acc_no_memory" in p]
    if not run["curve"] or "test_acc_no_memory" not in run["curve"][-1]:
        held.append((run["generated_tokens"], run["test_acc_no_memory"]))
    return ([(0, sft_acc)] if sft_acc is not None else []) + held


def variant_colors(names: list[str]) -> dict[str, str]:
    """A distinct colour per plotted variant, in the given order (tab10, tab20 past ten; only
    past twenty do colours repeat)."""
    from matplotlib import colormaps, colors

    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: colors.to_hex(cmap(i % cmap.N)) for i, name in enumerate(names)}


def study_figure(by_variant: dict[str, list[dict]]) -> matplotlib.figure.Figure:
    """Left: rollout accuracy against generated tokens. Right: held-out test accuracy of the
    policies without the memory against generated tokens, from SFT on (solid with --eval_every,
    dotted from SFT to the final evaluation without).
    One legend below both panels, so that it hides no curve; token ticks in engineering
    notation (350k), since raw counts run into each other."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(11, 5), layout="constrained")
    rollout_ax, heldout_ax = fig.subplots(1, 2)
    sft = {run_key(r): r["test_acc"] for r in by_variant.get("sft_only", [])}
    names = [n for n in VARIANTS if n in by_variant]
    for name, color in variant_colors(names).items():
        rs = by_variant[name]
        if is_sft(name) and name != "sft_only":  # another SFT's accuracy: a baseline at 0 tokens
            heldout_ax.scatter([0] * len(rs), [r["test_acc_no_memory"] for r in rs],
                               color=color, marker="x", label=VARIANTS[name][0])
        for i, r in enumerate(rs):
            if not r["curve"]:
                continue
            label = VARIANTS[name][0] if i == 0 else None
            x = [p["tokens"] for p in r["curve"]]
            acc = [p["accuracy"] for p in r["curve"]]
            y = [np.mean(acc[max(0, t - 2):t + 1]) for t in range(len(acc))]  # trailing mean
            rollout_ax.plot(x, y, color=color, alpha=0.7, lw=1, label=label)
            held = heldout_points(r, sft.get(run_key(r)))
            along = any("test_acc_no_memory" in p for p in r["curve"])
            hx, hy = zip(*held)  # dotted: SFT and the final evaluation only, nothing between
            heldout_ax.plot(hx, hy, color=color, alpha=0.7, lw=1, marker=".",
                            ls="-" if along else ":")
    for ax in (rollout_ax, heldout_ax):
        ax.set_xlabel("generated tokens (sampler budget)")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    rollout_ax.set_ylabel("rollout accuracy (trailing 3-step mean)")
    heldout_ax.set_ylabel("test accuracy, policies without memory (greedy)")
    handles = [h for ax in (rollout_ax, heldout_ax) for h in ax.get_legend_handles_labels()[0]]
    if handles:
        ncols = 1 if max(len(h.get_label()) for h in handles) > 80 else 2  # 2 wide ones overflow
        fig.set_size_inches(11, 4.5 + 0.15 * math.ceil(len(handles) / ncols))  # room for it
        fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=7)
    return fig


def main() -> None:
    xla_flags.pin_cpu_numerics()  # the numbers `joyagents train` gives (before JAX's backend starts)
    xla_flags.use_compilation_cache()  # as `joyagents` does: later runs load earlier compiles
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="runs/learning_study")
    p.add_argument("--seeds", default="0")
    p.add_argument("--variants", default=",".join(MAIN))
    p.add_argument("--tokens", type=int, default=60_000, help="sampler-token budget per run")
    p.add_argument("--max_steps", type=int, default=60)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run, e.g. grpo.learning_rate=1e-4 (use a "
                        "separate --root: results are cached by seed and variant)")
    p.add_argument("--eval_every", type=int, default=0,
                   help="evaluate test without the memory every N GRPO steps (0: at the end)")
    p.add_argument("--report", action="store_true", help="only aggregate the cached runs")
    p.add_argument("--against", default=None, metavar="ROOT",
                   help="also compare each variant with the same variant and the baselines "
                        "cached in ROOT, seed by seed (a screen's --set runs against the study)")
    p.add_argument("--out", default=None, help="report path without extension (default: "
                   "<root>/study; benchmarks/learning_study is the recorded study)")
    a = p.parse_args()
    if a.against and not glob.glob(os.path.join(a.against, "result_*.json")):
        raise SystemExit(f"--against {a.against}: no result_<variant>_s<seed>.json there; give "
                         f"the --root of an earlier study.")
    os.makedirs(a.root, exist_ok=True)
    extra = parse_overrides(a.set)
    names = a.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {list(VARIANTS)}")
        if clash := conflicts(name, extra):
            raise SystemExit(f"--set overrides {clash}, which variant {name!r} "
                             f"sets itself; drop them or run another variant.")
    out = a.out or os.path.join(a.root, "study")
    if not a.report:
        for seed in map(int, a.seeds.split(",")):
            for name in names:
                path = os.path.join(a.root, f"result_{name}_s{seed}.json")
                if os.path.exists(path):
                    continue
                result = run_variant(a.root, seed, name, a.tokens, a.max_steps, extra,
                                     a.eval_every)
                with open(path, "w") as f:
                    json.dump(result, f, indent=1)
                print(name, seed, {k: round(v, 3) for k, v in result["eval"].items()
                                   if k.endswith("accuracy") or "llm_calls" in k}, flush=True)
    print(report(a.root, out + ".md", out + ".png", a.against))


if __name__ == "__main__":
    main()
