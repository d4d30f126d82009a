"""Tests for joyagents_jax.agents.demonstrator: detours that still reach the gold answer."""

import random

import pytest

from joyagents_jax.agents import demonstrator, system
from joyagents_jax.agents.demonstrator import DemoErrors
from joyagents_jax.data import assistant_suite as suite


@pytest.fixture(scope="module")
def train():
    return [suite.decode(r) for r in suite.generate_splits(suite.TINY)["train"][:200]]


@pytest.fixture(scope="module")
def sys_():
    return system.make_system(suite.suite_world(suite.TINY))


def _replay(sys_, ex, errors, seed=0):
    gold = [(n.agent, n.output) for n in ex.gold]
    outputs = demonstrator.outputs(sys_, gold, errors, random.Random(seed))
    return outputs, system.demonstration(sys_, ex.query, outputs)


def test_no_detours_is_the_gold_trajectory(sys_, train):
    for ex in train:
        outputs, _ = _replay(sys_, ex, DemoErrors())
        assert outputs == [n.output for n in ex.gold]


@pytest.mark.parametrize("errors, extra", [(DemoErrors(wrong_route=1.0), 2),
                                           (DemoErrors(redundant_call=1.0), 1),
                                           (DemoErrors(wrong_tool=1.0), 1)])
def test_every_detour_costs_calls_and_keeps_the_answer(sys_, train, errors, extra):
    detoured = 0
    for ex in train:
        outputs, episode = _replay(sys_, ex, errors)
        parts = episode.reward(ex.answer, ex.answer_kind, ex.min_llm_calls)
        assert float(parts.r_answer) == 1.0 and episode.done
        added = episode.llm_calls - ex.min_llm_calls
        assert added % extra == 0 and episode.llm_calls <= sys_.limits.max_nodes
        if added:
            detoured += 1
            assert float(parts.r_efficiency) > 0  # R_E charges the detour
    assert detoured > len(train) // 4


def test_detours_are_seeded_and_follow_their_rate(sys_, train):
    errors = DemoErrors(wrong_route=0.3)
    draw = lambda seed: [len(_replay(sys_, ex, errors, f"{seed}/{i}")[0])
                         for i, ex in enumerate(train)]  # one seeded draw per example
    assert draw(1) == draw(1) and draw(1) != draw(2)
    single = [i for i, ex in enumerate(train) if ex.domain != "cooperation"]  # one master call
    routed = [(draw(1)[i] - len(train[i].gold)) // 2 for i in single]
    assert set(routed) == {0, 1} and 0.2 < sum(routed) / len(single) < 0.4


def test_rates_outside_zero_one_are_refused():
    with pytest.raises(ValueError, match="wrong_tool"):
        DemoErrors(wrong_tool=1.5)
