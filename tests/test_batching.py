"""Host-side batch assembly: layouts, bucketing, errors, and dropping uninformative groups."""

import jax
import numpy as np
import pytest

from joyagents_jax import batching
from joyagents_jax import train_state as ts
from joyagents_jax.models import qwen2
from joyagents_jax.rl import grpo_step, rollout

SLOTS = {"master": ("m", 0), "qa": ("subs", 0), "math": ("subs", 1)}
SIZES = {"m": 1, "subs": 2}
OFFSETS = {"m": 0, "subs": 1}


def _sample(agent, group, reward, prompt=(1, 2, 3), output=(4, 5)):
    return rollout.Sample(agent, list(prompt), np.asarray(output, np.int32),
                          np.full(len(output), -0.5, np.float32), reward, reward, group, 0, 0)


# Groups: 7 master [1, 0] | 3 qa [1, 1] (no spread) | 5 qa [0, 1, 1] | 9 math [2] (singleton)
SAMPLES = [_sample("master", 7, 1.0), _sample("qa", 3, 1.0), _sample("master", 7, 0.0),
           _sample("qa", 5, 0.0, output=(4, 5, 6, 7)), _sample("qa", 3, 1.0),
           _sample("qa", 5, 1.0), _sample("math", 9, 2.0), _sample("qa", 5, 1.0)]


def test_grpo_batch_layout():
    b = batching.grpo_batch(SAMPLES, SLOTS, SIZES, OFFSETS, max_len=64)
    subs, m = b.rollouts["subs"], b.rollouts["m"]
    assert subs.tokens.shape == (2, 8, 64) and m.tokens.shape == (1, 2, 64)  # 5 qa rows -> 8
    # Dense node-group ids in order of appearance, owners as global agent indices.
    np.testing.assert_array_equal(m.group_ids, [[0, 0]])
    np.testing.assert_array_equal(subs.group_ids[0], [1, 2, 1, 2, 2, -1, -1, -1])
    np.testing.assert_array_equal(subs.group_ids[1], [3, -1, -1, -1, -1, -1, -1, -1])
    # One group_agent entry per row (1 x 2 + 2 x 8): its shape follows B's; padding owns nothing.
    np.testing.assert_array_equal(b.group_agent, [0, 1, 1, 2] + [-1] * 14)
    np.testing.assert_array_equal(subs.rewards[0, :5], [1, 0, 1, 1, 1])
    # Row 1 of qa: context 1 2 3, output 4 5 6 7 with its sampler log-probs.
    np.testing.assert_array_equal(subs.tokens[0, 1, :8], [1, 2, 3, 4, 5, 6, 7, 0])
    np.testing.assert_array_equal(subs.loss_mask[0, 1, :8], [0, 0, 0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(subs.mask[0, 1, :8], [1] * 7 + [0])
    np.testing.assert_allclose(subs.sampler_logp[0, 1, 3:7], -0.5)


def test_length_bucketing_and_errors():
    assert batching.grpo_batch(SAMPLES, SLOTS, SIZES, OFFSETS, 384).rollouts["m"].tokens.shape[-1] == 64
    fixed = batching.grpo_batch(SAMPLES, SLOTS, SIZES, OFFSETS, 384, fixed_len=True)
    assert fixed.rollouts["m"].tokens.shape[-1] == 384
    assert batching.grpo_batch(SAMPLES, SLOTS, SIZES, OFFSETS, 64, min_rows=4).rollouts[
        "m"].tokens.shape[1] == 4
    with pytest.raises(ValueError, match="7 tokens, more than max_len 6"):
        batching.grpo_batch(SAMPLES, SLOTS, SIZES, OFFSETS, 6)
    with pytest.raises(ValueError, match="Node group 7 mixes agents"):
        batching.grpo_batch(SAMPLES + [_sample("qa", 7, 0.0)], SLOTS, SIZES, OFFSETS, 64)


def test_sft_batch_layout():
    demos = [("qa", [1, 2], [3]), ("master", [1], [2, 3, 4]), ("qa", [5], [6, 7])]
    b = batching.sft_batch(demos, SLOTS, SIZES, max_len=64)
    assert b["subs"].tokens.shape == (2, 2, 64) and b["m"].tokens.shape == (1, 1, 64)
    np.testing.assert_array_equal(b["subs"].tokens[0, :, :3], [[1, 2, 3], [5, 6, 7]])
    np.testing.assert_array_equal(b["subs"].loss_mask[0, :, :3], [[0, 0, 1], [0, 1, 1]])
    assert not b["subs"].mask[1].any()  # math has no demonstration: an all-padding row


def test_sorted_passes_order_rows_by_length_and_weight_each_agent_equally():
    demos = [("qa", [1, 2], [3]), ("master", [1], [2, 3, 4]), ("qa", [5] * 70, [6, 7]),
             ("math", [4], [5, 6]), ("qa", [], [8, 9]), ("math", [1, 1, 1], [2])]
    p = batching.sorted_passes(demos, SLOTS, SIZES, rows=2, max_len=128)
    subs, m = p["subs"], p["m"]
    assert len(subs) == 3 and len(m) == 1 and m[0].tokens.shape == (2, 64)
    # Lengths 3, 2, 3, 4, 72 (qa, qa, math, math, qa) sorted: passes [2, 3], [3, 4], [72, pad].
    assert [b.tokens.shape for b in subs] == [(2, 64), (2, 64), (2, 128)]
    np.testing.assert_array_equal(subs[0].tokens[:, :3], [[8, 9, 0], [1, 2, 3]])
    np.testing.assert_array_equal([b.agent for b in subs], [[0, 0], [1, 1], [0, 0]])
    # Targets are the outputs' tokens but a sequence's first: qa 1 + 1 + 2 = 4, math 2 + 1 = 3.
    np.testing.assert_allclose([b.weight for b in subs], [[1 / 8, 1 / 8], [1 / 6, 1 / 6],
                                                         [1 / 8, 0]])
    np.testing.assert_allclose(m[0].weight, [1 / 3, 0])
    assert not subs[2].mask[1].any() and not m[0].loss_mask[1].any()  # padding rows
    with pytest.raises(ValueError, match="72 tokens, more than max_len 64"):
        batching.sorted_passes(demos, SLOTS, SIZES, rows=2, max_len=64)


def test_informative_keeps_groups_with_a_reward_spread():
    kept = batching.informative(SAMPLES)
    assert sorted({s.group for s in kept}) == [5, 7]
    assert len(kept) == 5 and [s.group for s in kept] == [7, 7, 5, 5, 5]  # order preserved


def test_for_agent_selection_keeps_one_member_of_each_group_without_a_spread():
    kept = batching.for_agent_selection(SAMPLES)
    assert [s.group for s in kept] == [7, 3, 7, 5, 5, 9, 5]  # group 3's second member left out
    assert kept[1] is SAMPLES[1] and kept[5] is SAMPLES[6]


def _state():
    cfg = qwen2.Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1)
    optim = ts.OptimConfig(learning_rate=1e-2, schedule="constant", eps=1e-4)
    stack = lambda n, seed: jax.tree.map(
        lambda *x: np.stack(x), *[qwen2.init_params(cfg, jax.random.key(seed + i)) for i in range(n)])
    return ts.create({"m": ts.init_group(cfg, optim, stack(1, 0)),
                      "subs": ts.init_group(cfg, optim, stack(2, 5))})


@pytest.mark.parametrize("topk", [None, 1])
def test_dropping_uninformative_groups_changes_no_update(topk):
    """The step on all samples and on `informative` ones: the same params (and kept groups).
    Both batches are padded to 8 rows per agent: one shape, so the step compiles once."""
    step = grpo_step.make_grpo_step(grpo_step.GRPOStepConfig(topk=topk, inner_steps=2))
    batch = lambda samples: batching.grpo_batch(samples, SLOTS, SIZES, OFFSETS, 64, min_rows=8)
    full, full_m = step(_state(), batch(SAMPLES))
    part, part_m = step(_state(), batch(batching.informative(SAMPLES)))
    assert int(full_m["kept_groups"]) == int(part_m["kept_groups"]) == (2 if topk is None else 1)
    for a, b in zip(jax.tree.leaves(full.groups), jax.tree.leaves(part.groups), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_agent_selection_rows_change_no_update():
    """select = agents ranks agents by mean group variance, groups without a spread counted:
    qa's groups [0, 1] and [1, 1] average 0.125, under the master's [0, 1, 1, 1] (0.1875), so
    K = 1 updates the master; dropping qa's flat group (`informative`) would pick qa."""
    samples = [_sample("master", 1, r) for r in (0.0, 1.0, 1.0, 1.0)] + [
        _sample("qa", 2, 0.0), _sample("qa", 2, 1.0), _sample("qa", 3, 1.0),
        _sample("qa", 3, 1.0), _sample("math", 4, 0.0), _sample("math", 4, 0.0)]
    step = grpo_step.make_grpo_step(grpo_step.GRPOStepConfig(topk=1, select="agents"))
    batch = lambda rows: batching.grpo_batch(rows, SLOTS, SIZES, OFFSETS, 64, min_rows=8)
    full, _ = step(_state(), batch(samples))
    part, _ = step(_state(), batch(batching.for_agent_selection(samples)))
    spread, _ = step(_state(), batch(batching.informative(samples)))
    start = _state()
    for a, b in zip(jax.tree.leaves(full.groups), jax.tree.leaves(part.groups), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    moved = lambda s, g, i: not np.array_equal(
        np.asarray(jax.tree.leaves(s.groups[g].params)[0][i]),
        np.asarray(jax.tree.leaves(start.groups[g].params)[0][i]))
    assert moved(part, "m", 0) and not moved(part, "subs", 0)  # the master, not qa
    assert moved(spread, "subs", 0) and not moved(spread, "m", 0)
