"""Tests for joyagents_jax.train_state: stacked agents, per-agent optimizers, masked updates."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from joyagents_jax import train_state as ts
from joyagents_jax.models import lora, qwen2

SUB = qwen2.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2)
MASTER = SUB.replace(hidden_size=48, intermediate_size=96, tie_embeddings=False)
OPTIM = ts.OptimConfig(learning_rate=1e-2, schedule="constant", weight_decay=0.1, clip_norm=1.0)


def _toy_params(num_agents=3, seed=0):
    """A small stacked tree with the leaf names the decay mask looks at."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal((num_agents, *shape)), jnp.float32)
    return {"embed": normal(5, 3), "dense": {"kernel": normal(3, 2), "bias": normal(2)}}


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_init_group_stacks_agents_and_copies_reference():
    group = ts.init_random_group(SUB, OPTIM, 3, jax.random.key(0))
    assert group.num_agents == 3
    for leaf, spec in zip(jax.tree.leaves(group.params),
                          jax.tree.leaves(qwen2.param_shapes(SUB)), strict=True):
        assert leaf.shape == (3, *spec.shape)
    assert all(x.shape[0] == 3 for x in jax.tree.leaves(group.opt_state))
    agents = ts.unstack_agents(group.params)
    assert not np.array_equal(agents[0]["embed"], agents[1]["embed"])  # independent inits
    _assert_bitwise_equal(ts.stack_agents(agents), group.params)
    _assert_bitwise_equal(group.ref_params, group.params)
    ref_ptr = group.ref_params["embed"].unsafe_buffer_pointer()
    assert ref_ptr != group.params["embed"].unsafe_buffer_pointer()  # donation-safe copy
    unfrozen = ts.init_random_group(SUB, OPTIM, 3, jax.random.key(0), reference=False)
    assert unfrozen.ref_params is None


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_learning_rate_schedule(schedule):
    cfg = ts.OptimConfig(learning_rate=1.0, schedule=schedule, warmup_steps=4, total_steps=12,
                         end_lr_ratio=0.1)
    lr = ts.learning_rate_schedule(cfg)
    np.testing.assert_allclose([lr(0), lr(2), lr(4)], [0.0, 0.5, 1.0], atol=1e-6)
    if schedule == "cosine":  # halfway through the decay: floor + (peak - floor) / 2
        np.testing.assert_allclose([lr(8), lr(12), lr(100)], [0.55, 0.1, 0.1], atol=1e-6)
    else:
        np.testing.assert_allclose([lr(8), lr(100)], [1.0, 1.0])
    with pytest.raises(ValueError, match="unknown schedule"):
        ts.learning_rate_schedule(ts.OptimConfig(schedule="linear"))
    with pytest.raises(ValueError, match="total_steps 4 must exceed warmup_steps 4"):
        ts.learning_rate_schedule(ts.OptimConfig(warmup_steps=4, total_steps=4))


def test_apply_gradients_equals_independent_optimizers_and_masks_bitwise():
    params = _toy_params()
    group = ts.init_group(SUB, OPTIM, params)
    # Agent 0's gradient is far above the clip norm, agent 1's below: clipping must be per agent.
    scale = np.array([100.0, 0.01, 1.0])
    grads = jax.tree.map(lambda x: x * scale.reshape(3, *[1] * (x.ndim - 1)), _toy_params(seed=1))
    update = jnp.array([True, True, False])
    before = _host(group)
    for _ in range(3):  # several steps, so moments and counts matter
        group = jax.jit(ts.apply_gradients)(group, grads, update)

    tx = ts.make_optimizer(OPTIM)

    @jax.jit
    def single_agent(p, g):  # the plain optax loop for one agent
        state = tx.init(p)
        for _ in range(3):
            upd, state = tx.update(g, state, p)
            p = optax.apply_updates(p, upd)
        return p

    for a in range(2):
        p = single_agent(*jax.tree.map(lambda x: x[a], (params, grads)))
        got = jax.tree.map(lambda x: x[a], group.params)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), got, p)
    pick = lambda tree: jax.tree.map(lambda x: np.asarray(x)[2], tree)
    _assert_bitwise_equal(pick(group.params), pick(before.params))
    _assert_bitwise_equal(pick(group.opt_state), pick(before.opt_state))


def test_sgd_is_heavy_ball_momentum_on_clipped_gradients():
    """kind="sgd": v <- b1 v + g, p <- p - lr v, after clipping the global norm to clip_norm."""
    cfg = ts.OptimConfig(learning_rate=0.1, kind="sgd", schedule="constant", b1=0.5, clip_norm=1.0)
    params = _toy_params(num_agents=1)
    group = ts.init_group(SUB, cfg, params, reference=False)
    grads = jax.tree.map(lambda x: 10.0 * jnp.ones_like(x), params)
    clipped = jax.tree.map(lambda g: g / optax.tree.norm(grads), grads)  # global norm 1
    for _ in range(2):
        group = ts.apply_gradients(group, grads, jnp.array([True]))
    want = jax.tree.map(lambda p, g: p - 0.1 * (g + (0.5 * g + g)), params, clipped)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
                 group.params, want)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        ts.make_optimizer(ts.OptimConfig(kind="lion"))


def test_weight_decay_skips_biases():
    params = _toy_params(num_agents=1)
    group = ts.init_group(SUB, OPTIM, params, reference=False)
    zero = jax.tree.map(jnp.zeros_like, params)
    new = ts.apply_gradients(group, zero, jnp.array([True])).params
    np.testing.assert_array_equal(new["dense"]["bias"], params["dense"]["bias"])
    np.testing.assert_allclose(new["dense"]["kernel"], params["dense"]["kernel"] * (1 - 1e-3),
                               rtol=1e-6)
    np.testing.assert_allclose(new["embed"], params["embed"] * (1 - 1e-3), rtol=1e-6)


def test_heterogeneous_state_and_commit():
    state = ts.create({"subs": ts.init_random_group(SUB, OPTIM, 3, jax.random.key(1)),
                       "master": ts.init_random_group(MASTER, OPTIM, 1, jax.random.key(2))})
    assert ts.agent_offsets(state.groups) == {"master": 0, "subs": 1}
    assert ts.num_agents(state.groups) == 4
    assert state.groups["master"].params["lm_head"]["kernel"].shape == (1, 48, 32)

    bumped = {n: g.replace(params=jax.tree.map(lambda x: x + 1.0, g.params))
              for n, g in state.groups.items()}
    commit = jax.jit(ts.commit)
    before = _host(state.groups)
    skipped = commit(state, bumped, jnp.array(False))
    _assert_bitwise_equal(skipped.groups, before)
    assert (int(skipped.step), int(skipped.skipped)) == (0, 1)
    applied = commit(skipped, bumped, jnp.array(True))
    _assert_bitwise_equal(applied.groups["subs"].params, bumped["subs"].params)
    assert (int(applied.step), int(applied.skipped)) == (1, 1)
    # A step whose new params (or optimizer state) are not finite is never committed.
    poisoned = dict(bumped, subs=bumped["subs"].replace(params=jax.tree.map(
        lambda x: x.at[(0,) * x.ndim].set(jnp.inf), bumped["subs"].params)))
    before = _host(applied.groups)
    rejected = commit(applied, poisoned, jnp.array(True))
    _assert_bitwise_equal(rejected.groups, before)
    assert (int(rejected.step), int(rejected.skipped)) == (1, 2)


@pytest.mark.parametrize("per_pass", [None, 1, 2, 5])
@pytest.mark.parametrize("as_lora", [False, True])
def test_over_agents_maps_every_agent_in_passes_as_one_vmapped_pass(per_pass, as_lora):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32)  # [A, D, E]
    rows = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)  # [A, B, D]
    base = jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)
    params = lora.LoRAParams(base=base, adapters=w, scale=2.0) if as_lora else w

    def fn(p, x, none):  # one agent: p [D, E] (or a base + adapter), x [B, D]
        assert none is None
        k = p.base + p.scale * p.adapters if as_lora else p
        return {"y": x @ k, "sum": jnp.sum(x)}

    got = ts.over_agents(fn, per_pass, params, rows, None)
    k = base + 2.0 * w if as_lora else w
    chex.assert_trees_all_close(got, {"y": jnp.einsum("abd,ade->abe", rows, k),
                                      "sum": jnp.sum(rows, axis=(1, 2))}, rtol=1e-6)


def test_jit_step_donates_the_state():
    state = ts.create({"subs": ts.init_group(SUB, OPTIM, _toy_params())})

    def step(state, batch):
        return state.replace(step=state.step + batch), {}

    new, _ = ts.jit_step(step)(state, jnp.int32(2))
    assert int(new.step) == 2
    assert state.step.is_deleted()
