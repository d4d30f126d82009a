"""Tests for joyagents_jax.selection: the slice, the cadence, keeping the best iterate."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from joyagents_jax import selection
from joyagents_jax import train_state as ts
from joyagents_jax.models import qwen2

SUB = qwen2.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2)
OPTIM = ts.OptimConfig(learning_rate=1e-2, schedule="constant")


def _train(seed: int) -> ts.TrainState:
    return ts.create({"subs": ts.init_random_group(SUB, OPTIM, 2, jax.random.key(seed))})


def _params(train: ts.TrainState):
    return train.groups["subs"].params


def test_slice_rows_are_one_sorted_draw_of_distinct_train_records():
    rows = selection.slice_rows(1000, 120)
    assert rows == sorted(set(rows)) and len(rows) == 120 and 0 <= rows[0] and rows[-1] < 1000
    assert rows == selection.slice_rows(1000, 120)
    assert selection.slice_rows(1000, 60) != rows[:60]  # a draw of its own size, not a prefix
    assert selection.slice_rows(5, 120) == [0, 1, 2, 3, 4]


def test_due_every_n_steps_and_after_the_last():
    assert [k for k in range(1, 11) if selection.due(k, 4, k == 10)] == [4, 8, 10]
    assert [k for k in range(1, 9) if selection.due(k, 4, k == 8)] == [4, 8]
    assert not any(selection.due(k, 0, k == 10) for k in range(1, 11))


def test_start_chooses_nothing_and_apply_then_changes_nothing():
    train = _train(0)
    chosen = selection.start(train)
    assert int(chosen.step) == -1 and float(chosen.accuracy) == -1.0
    assert selection.apply(train, chosen) is train
    chex.assert_trees_all_equal(chosen.params["subs"], _params(train))


def test_keep_takes_the_best_and_the_latest_on_ties():
    first, second, third = _train(0), _train(1), _train(2)
    chosen = selection.keep(selection.start(first), first, 14, 0.55)
    chosen = selection.keep(chosen, second, 18, 0.60)
    assert int(chosen.step) == 18
    chex.assert_trees_all_close(float(chosen.accuracy), 0.60)
    assert int(selection.keep(chosen, third, 22, 0.59).step) == 18
    tie = selection.keep(chosen, third, 26, 0.60)
    assert int(tie.step) == 26
    chex.assert_trees_all_equal(selection.apply(first, tie).groups["subs"].params,
                                _params(third))


def test_kept_policies_are_copies_that_outlive_donated_buffers():
    train = _train(0)
    expected = jax.tree.map(np.asarray, _params(train))
    chosen = selection.keep(selection.start(train), train, 4, 0.5)
    jax.tree.map(lambda x: x.delete(), _params(train))  # what a donating GRPO step does
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, chosen.params["subs"]), expected)


def test_apply_swaps_only_the_policies():
    train, other = _train(0), _train(1)
    chosen = selection.keep(selection.start(other), other, 8, 0.7)
    applied = selection.apply(train, chosen)
    chex.assert_trees_all_equal(applied.groups["subs"].params, _params(other))
    assert applied.groups["subs"].opt_state is train.groups["subs"].opt_state
    assert applied.groups["subs"].ref_params is train.groups["subs"].ref_params
    assert applied.step is train.step
