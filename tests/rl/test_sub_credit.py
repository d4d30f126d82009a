"""Sub-agent credit: calls found in episodes, matched to the gold trajectory's, scored alone."""

import json

import chex
import numpy as np
import pytest

from joyagents_jax.agents import system
from joyagents_jax.data import assistant_suite as suite
from joyagents_jax.rl import rewards, sub_credit


@pytest.fixture(scope="module")
def sys_():
    return system.make_system(suite.suite_world(suite.TINY))


@pytest.fixture(scope="module")
def examples():
    out = {}
    for record in suite.generate_splits(suite.TINY)["train"]:
        ex = suite.decode(record)
        out.setdefault(ex.domain, ex)
    return out


def _episode(sys_, ex, outputs):
    return system.demonstration(sys_, ex.query, outputs).nodes


def _gold(ex):
    return [n.output for n in ex.gold]


def test_sub_calls_of_gold_trajectories(sys_, examples):
    coop = examples["cooperation"]  # qa (tool, answer), then gfc (tool, answer)
    calls = sub_credit.sub_calls(_episode(sys_, coop, _gold(coop)))
    gold_answers = [o[len("<answer>"):-len("</answer>")] for n, o in
                    zip(coop.gold, _gold(coop)) if n.agent != "master" and o.startswith("<answer>")]
    assert [(c.agent, c.nodes) for c in calls] == [("qa", (1, 2)), ("gfc", (4, 5))]
    assert [c.answer for c in calls] == gold_answers
    efc = examples["efc"]
    (call,) = sub_credit.sub_calls(_episode(sys_, efc, _gold(efc)))
    assert call == sub_credit.SubCall("efc", (1,), efc.answer)
    assert sub_credit.sub_calls(_episode(sys_, efc, [])) == []


def test_a_call_cut_short_has_no_answer(sys_, examples):
    qa = examples["qa"]
    nodes = _episode(sys_, qa, _gold(qa)[:2] + ["<answer>unclosed"])  # malformed: ends there
    assert sub_credit.sub_calls(nodes) == [sub_credit.SubCall("qa", (1, 2), None)]
    assert sub_credit.node_scores(nodes, _episode(sys_, qa, _gold(qa))) == {1: 0.0, 2: 0.0}


@pytest.mark.parametrize("gold,kind", [('{"name":"f","arguments":{}}', "call"), ("18", "number"),
                                       (" -2.5 ", "number"), ("green", "text"),
                                       ("3 kg", "text"), ("[1, 2]", "text"), ("{", "text")])
def test_answer_kind(gold, kind):
    assert sub_credit.answer_kind(gold) == kind


def test_node_scores_judge_the_sub_agent_not_the_master(sys_, examples):
    """A wrong sub-agent answer the master repairs scores 0 at the sub-agent's node; a right
    one 1 (structural equality for a call, numbers by value); the master's nodes get no score."""
    efc = examples["efc"]
    gold = _episode(sys_, efc, _gold(efc))
    call = json.loads(efc.answer)
    wrong = json.dumps({**call, "arguments": {**call["arguments"], "order_id": "Q000"}})
    repaired = _episode(sys_, efc, [_gold(efc)[0], f"<answer>{wrong}</answer>", _gold(efc)[2]])
    assert sub_credit.node_scores(repaired, gold) == {1: 0.0}
    spaced = efc.answer.replace(",", ", ")  # the same call, other spacing
    assert sub_credit.node_scores(
        _episode(sys_, efc, [_gold(efc)[0], f"<answer>{spaced}</answer>"]), gold) == {1: 1.0}
    math = examples["math"]
    as_float = _gold(math)[:2] + [f"<answer>{float(math.answer)}</answer>"]
    assert sub_credit.node_scores(_episode(sys_, math, as_float),
                                  _episode(sys_, math, _gold(math))) == {1: 1.0, 2: 1.0}


def test_calls_without_a_gold_counterpart_are_left_out(sys_, examples):
    """A redundant second call to the same agent, or a call to an agent gold never calls, keeps
    the episode's R_A; with no gold trajectory nothing is scored."""
    efc = examples["efc"]
    call, answer = _gold(efc)[:2]
    twice = _episode(sys_, efc, [call, answer, call, answer, _gold(efc)[2]])
    assert sub_credit.node_scores(twice, _episode(sys_, efc, _gold(efc))) == {1: 1.0}
    misrouted = _episode(sys_, efc, ['<call agent="qa"/>', "<answer>x</answer>"])
    assert sub_credit.node_scores(misrouted, _episode(sys_, efc, _gold(efc))) == {}
    assert sub_credit.node_scores(twice, []) == {}


def test_credited_replaces_the_answer_reward_only():
    parts = rewards.reward_parts(1.0, 3, 3, 4, 3)  # right, well formed, one extra call
    down = sub_credit.credited(parts, 0.0)
    chex.assert_trees_all_close(
        tuple(down), (0.0, parts.r_format, parts.r_efficiency, parts.r_grounding,
                      parts.total - 1.0, parts.memory_reward - 1.0), rtol=1e-6)
    assert sub_credit.credited(parts, None) is parts
    chex.assert_trees_all_close(tuple(sub_credit.credited(parts, 1.0)), tuple(parts))
    assert np.asarray(down.total).dtype == np.asarray(parts.total).dtype
