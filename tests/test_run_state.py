"""RunState's pytree: the replay node exists only with replay on, so older checkpoints (saved
before it existed) keep their tree structure."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from joyagents_jax import checkpoint
from joyagents_jax.run_state import OFF, RunState


def _run(replay=OFF) -> RunState:
    return RunState(train={"w": jnp.arange(3.0)}, memory={}, step=jnp.asarray(7, jnp.int32),
                    replay=replay, phase="grpo")


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_replay_is_a_node_only_when_set():
    assert _paths(_run()) == [".train['w']", ".step"]
    assert _paths(_run(jnp.array([4, -1], jnp.int32))) == [".train['w']", ".step", ".replay"]


def test_tree_map_keeps_the_phase_and_the_replay():
    run = jax.tree.map(lambda x: x + 1, _run(jnp.array([4, -1], jnp.int32)))
    assert run.phase == "grpo" and isinstance(run, RunState)
    chex.assert_trees_all_equal(run.replay, np.array([5, 0], np.int32))
    assert not jax.tree.map(lambda x: x, _run()).replays


def test_a_checkpoint_without_replay_restores_and_one_with_it_round_trips(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "a") as ckpt:
        ckpt.save(7, _run(), {"step": 7, "phase": "grpo"})
    with checkpoint.Checkpointer(tmp_path / "a") as ckpt:
        restored, _ = ckpt.restore(_run())
    assert not restored.replays and int(restored.step) == 7
    with checkpoint.Checkpointer(tmp_path / "b") as ckpt:
        ckpt.save(7, _run(jnp.array([4, -1], jnp.int32)), {"step": 7, "phase": "grpo"})
    with checkpoint.Checkpointer(tmp_path / "b") as ckpt:
        restored, _ = ckpt.restore(_run(jnp.zeros(2, jnp.int32)))
    chex.assert_trees_all_equal(restored.replay, np.array([4, -1], np.int32))
