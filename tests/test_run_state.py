"""RunState's pytree: the replay and selected nodes exist only when on, so older checkpoints
(saved before they existed) keep their tree structure."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from joyagents_jax import checkpoint, selection
from joyagents_jax.run_state import OFF, RunState


def _run(replay=OFF, selected=OFF) -> RunState:
    return RunState(train={"w": jnp.arange(3.0)}, memory={}, step=jnp.asarray(7, jnp.int32),
                    replay=replay, selected=selected, phase="grpo")


def _selected(step: int, accuracy: float) -> selection.Selected:
    return selection.Selected({"g": {"w": jnp.full(3, float(step))}},
                              jnp.asarray(step, jnp.int32), jnp.asarray(accuracy, jnp.float32))


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


def test_selected_is_a_node_only_when_set():
    run = _run(selected=_selected(4, 0.5))
    assert run.selects and not _run().selects
    assert _paths(run) == [".train['w']", ".step", ".selected.params['g']['w']",
                           ".selected.step", ".selected.accuracy"]
    assert jax.tree.map(lambda x: x, run).selected.step == 4


def test_a_checkpoint_with_a_chosen_iterate_round_trips(tmp_path):
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, _run(selected=_selected(4, 0.5)), {"step": 7, "phase": "grpo"})
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(_run(selected=_selected(-1, -1.0)))
    chex.assert_trees_all_equal(restored.selected, _selected(4, 0.5))
