"""Sub-agent credit: a sub-agent's nodes scored by its own answer against the gold trajectory.

Node-wise GRPO gives a node's alternatives the finished episode's reward. When the master
repairs a sub-agent's wrong answer (it re-reads the user query and answers right anyway), the
sub-agent's right and wrong alternatives earn the same reward: its node group has no spread, so
GRPO cannot correct the sub-agent, and the memory stores the wrong answer as a best one. Once the
master starts relaying the sub-agent's answer, the whole question breaks (benchmarks/RESULTS.md,
"The master's repairs hide the sub-agents' errors"). With `grpo.subagent_credit`, R_A of a
sub-agent node is its call's own answer checked against the answer of the gold trajectory's call
it corresponds to (the j-th call to the same agent); R_F and R_E stay the episode's.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Sequence
from typing import NamedTuple

from joyagents_jax.agents import protocol
from joyagents_jax.agents.system import Node
from joyagents_jax.rl import rewards

_ONE_NUMBER = re.compile(r"\s*[-+]?(\d+(\.\d*)?|\.\d+)\s*")


class SubCall(NamedTuple):
    """One call of the master to a sub-agent: its nodes in the episode and the answer it returned
    (None when the episode ended inside the call)."""
    agent: str
    nodes: tuple[int, ...]
    answer: str | None


def sub_calls(nodes: Sequence[Node]) -> list[SubCall]:
    """The episode's sub-agent calls in order; a call is a run of sub-agent nodes between master
    nodes, closed by the sub-agent's answer."""
    calls: list[SubCall] = []
    for i, node in enumerate(nodes):
        if node.agent == protocol.MASTER:
            continue
        if i == 0 or nodes[i - 1].agent == protocol.MASTER:
            calls.append(SubCall(node.agent, (), None))
        call = calls[-1]
        answer = node.action.text if isinstance(node.action, protocol.Answer) else call.answer
        calls[-1] = call._replace(nodes=call.nodes + (i,), answer=answer)
    return calls


def answer_kind(gold: str) -> rewards.AnswerKind:
    """The checker a gold sub-answer calls for: `call` for a JSON object, `number` for a lone
    number, else `text`."""
    try:
        if isinstance(json.loads(gold), dict):
            return "call"
    except (ValueError, RecursionError):
        pass
    return "number" if _ONE_NUMBER.fullmatch(gold) else "text"


def node_scores(nodes: Sequence[Node], gold_nodes: Sequence[Node],
                cfg: rewards.RewardConfig = rewards.RewardConfig()) -> dict[int, float]:
    """R_A (0 or 1) of each sub-agent node whose call has a gold counterpart with an answer,
    keyed by node index. A call without an answer scores 0; a call the gold trajectory does not
    make (a redundant or misrouted one) is left out: its nodes keep the episode's R_A."""
    gold = collections.defaultdict(list)
    for call in sub_calls(gold_nodes):
        gold[call.agent].append(call.answer)
    seen, scores = collections.Counter(), {}
    for call in sub_calls(nodes):
        j, seen[call.agent] = seen[call.agent], seen[call.agent] + 1
        want = gold[call.agent][j] if j < len(gold[call.agent]) else None
        if want is None:
            continue
        score = (0.0 if call.answer is None
                 else rewards.check_answer(call.answer, want, answer_kind(want), cfg))
        scores.update({i: score for i in call.nodes})
    return scores


def credited(parts: rewards.RewardParts, score: float | None) -> rewards.RewardParts:
    """`parts` with R_A replaced by `score` (the total and the memory's reward move with it);
    unchanged for None."""
    if score is None:
        return parts
    delta = score - float(parts.r_answer)
    return parts._replace(r_answer=parts.r_answer + delta, total=parts.total + delta,
                          memory_reward=parts.memory_reward + delta)
