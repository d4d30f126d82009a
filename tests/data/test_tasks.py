"""Tests for joyagents_jax.data.tasks: each domain's draws and their gold trajectories."""

import random

import pytest

from joyagents_jax.data import assistant_suite as suite
from joyagents_jax.data import tasks


@pytest.mark.parametrize("domain", sorted(tasks.TASKS))
def test_a_draw_is_seeded_and_ends_with_the_masters_answer(domain):
    world = suite.suite_world(suite.TINY)
    draw = lambda seed: [tasks.TASKS[domain](random.Random(seed), world, suite.TINY)
                         for _ in range(5)]
    first = draw(0)
    assert first == draw(0) and first != draw(1)
    for task in first:
        assert task.gold[0]["agent"] == tasks.MASTER and task.gold[0]["output"].startswith("<call")
        assert task.gold[-1] == {"agent": tasks.MASTER, "output": f"<answer>{task.answer}</answer>"}
        assert task.kind in suite.ANSWER_KINDS
        assert bool(task.sub_queries) == (domain == "cooperation")
        for node in task.gold:  # a tool node carries its observation on the world
            assert ("observation" in node) == node["output"].startswith("<tool")
