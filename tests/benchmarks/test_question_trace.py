"""The question trace's pure helpers: traced node groups, their contests, the answers' flips."""

import importlib.util
import pathlib

import numpy as np

from joyagents_jax.rl import rollout

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "question_trace.py"
_SPEC = importlib.util.spec_from_file_location("question_trace", _PATH)
qt = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(qt)


def _sample(group, query, reward, node=1, agent="gfc", memory=False):
    return rollout.Sample(agent, [1, 2], np.array([3]), np.array([0.0]), reward, reward, group,
                          query, node, from_memory=memory)


def test_question_groups_keep_traced_queries_groups_with_a_spread():
    samples = [_sample(0, 0, 1.1, memory=True), _sample(0, 0, 0.1), _sample(0, 0, 1.1),
               _sample(1, 1, 1.1), _sample(1, 1, 0.1),  # query 1 is not traced
               _sample(2, 2, 1.1, node=0, agent="master"), _sample(2, 2, 1.1, node=0,
                                                                  agent="master")]  # no spread
    groups = qt.question_groups(samples, ["gfc-0001", None, "gfc-0001"])
    assert groups == [{"question": "gfc-0001", "agent": "gfc", "node": 1,
                       "rewards": [1.1, 0.1, 1.1], "memory": [True, False, False]}]


def _step(k, groups, alone):
    return {"step": k, "groups": groups, "alone": alone}


def _group(rewards, memory, q="q", node=1):
    return {"question": q, "agent": "gfc", "node": node, "rewards": rewards, "memory": memory}


def test_contests_count_policy_samples_behind_the_groups_best():
    steps = [_step(3, [_group([1.1, 0.1, 1.1], [True, False, False]),
                       _group([0.1, 0.1, 1.1, 0.1], [False] * 4)], {"q": 4}),
             _step(4, [], {"q": 4}),
             _step(5, [_group([1.1, 0.1, 0.1, 1.1], [True, False, False, False])], {"q": 0})]
    assert qt.contests(steps) == {("q", "gfc", 1): {"steps": [3, 5], "behind": 6, "samples": 9}}


def test_flips_list_the_steps_where_the_right_answers_change():
    steps = [_step(1, [], {"q": 4}), _step(2, [], {"q": 2}), _step(3, [], {"q": 2}),
             _step(4, [], {"q": 0})]
    assert qt.flips(steps, "q", start=4) == [(2, 4, 2), (4, 2, 0)]
    assert qt.flips(steps[:1], "q", start=4) == []
