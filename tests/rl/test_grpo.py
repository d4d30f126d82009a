"""Tests for joyagents_jax.rl.grpo against plain-NumPy loop references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from joyagents_jax.rl import grpo

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def _rng(seed=0):
    return np.random.default_rng(seed)


def _loss_batch(seed=0, B=6, T=7):
    """Random log-probs plus a mask with a padding row (all masked) and ragged lengths."""
    rng = _rng(seed)
    logp = np.log(rng.uniform(0.05, 1.0, (B, T))).astype(np.float32)
    logp_old = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    logp_ref = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    lengths = rng.integers(1, T + 1, B)
    lengths[2] = 0  # an all-masked row
    mask = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):
        mask[b, T - n :] = 1.0  # any layout works; use right-aligned tokens
    return logp, logp_old, logp_ref, adv, mask


# ---------------------------------------------------------------- advantages


def _advantages_ref(rewards, group_ids, valid, mode, eps=1e-6):
    out = np.zeros(len(rewards))
    for i, (r, g) in enumerate(zip(rewards, group_ids)):
        if g < 0 or not valid[i]:
            continue
        members = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g and valid[j]]
        if len(members) < 2:
            continue
        mean = sum(members) / len(members)
        if mode == "std":
            std = (sum((m - mean) ** 2 for m in members) / len(members)) ** 0.5
            out[i] = (r - mean) / (std + eps)
        elif mode == "no_std":
            out[i] = r - mean
        else:
            others = list(members)
            others.remove(r)
            out[i] = r - sum(others) / len(others)
    return out


@pytest.mark.parametrize("mode", ["std", "no_std", "loo"])
def test_group_advantages_matches_reference(mode):
    rng = _rng(1)
    num_groups = 5
    # group 3 is a singleton, group 4 is empty, -1 are padding samples.
    group_ids = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, -1, -1, 0, 2])
    rewards = rng.uniform(size=len(group_ids)).astype(np.float32)
    rewards[7:9] = 0.5  # group 2 (before the invalid sample 13) has no spread
    valid = np.ones(len(group_ids), bool)
    valid[13] = False
    fn = jax.jit(grpo.group_advantages, static_argnums=2, static_argnames="mode")
    got = fn(rewards, group_ids, num_groups, valid=valid, mode=mode)
    chex.assert_shape(got, (len(group_ids),))
    want = _advantages_ref(rewards, group_ids, valid, mode)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[[7, 8, 9, 10, 11, 13]] == 0.0)


def test_group_advantages_vmaps_over_agents():
    rewards = jnp.array([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 3.0]])
    ids = jnp.array([[0, 0, 1, 1], [0, 0, 1, 1]])
    got = jax.vmap(lambda r, g: grpo.group_advantages(r, g, 2, mode="no_std"))(rewards, ids)
    np.testing.assert_allclose(got, [[0.5, -0.5, 0.0, 0.0], [0.0, 0.0, -1.0, 1.0]])


@pytest.mark.parametrize("neg_weight", [0.0, 0.25, 1.0, 2.0])
def test_weight_negatives_scales_only_negative_advantages(neg_weight):
    adv = jnp.array([[1.5, -0.5, 0.0], [-2.0, 0.25, -0.0]])
    got = jax.jit(grpo.weight_negatives)(adv, neg_weight)
    chex.assert_shape(got, adv.shape)
    np.testing.assert_allclose(got, [[1.5, -0.5 * neg_weight, 0.0], [-2.0 * neg_weight, 0.25, 0.0]])


# ---------------------------------------------------------------- logits -> per-token values


def test_token_logprobs_and_entropy():
    rng = _rng(2)
    B, T, V = 3, 4, 11
    logits = (3 * rng.normal(size=(B, T, V))).astype(np.float32)
    targets = rng.integers(0, V, (B, T))
    logp = grpo.token_logprobs(jnp.asarray(logits, jnp.bfloat16), targets)
    chex.assert_shape(logp, (B, T))
    chex.assert_type(logp, jnp.float32)
    want_logp, want_ent = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            z = logits[b, t].astype(np.float64)
            p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            want_logp[b, t] = np.log(p[targets[b, t]])
            want_ent[b, t] = -(p * np.log(p)).sum()
    np.testing.assert_allclose(grpo.token_logprobs(logits, targets), want_logp, rtol=1e-5)
    np.testing.assert_allclose(logp, want_logp, rtol=0.05, atol=0.1)  # bf16 input
    ent = grpo.token_entropy(logits)
    chex.assert_shape(ent, (B, T))
    np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- loss terms


def test_clipped_surrogate_matches_reference():
    logp, logp_old, _, adv, mask = _loss_batch(3)
    logp[0, -1] = 300.0  # garbage that would overflow exp(logp - logp_old) if not masked ...
    mask[0, -1] = 0.0  # ... so it is masked
    loss, clipped = grpo.clipped_surrogate(logp, logp_old, adv, mask, 0.2, 0.28)
    chex.assert_shape([loss, clipped], logp.shape)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                assert loss[b, t] == 0.0 and not clipped[b, t]
                continue
            r, a = np.exp(float(logp[b, t]) - float(logp_old[b, t])), float(adv[b])
            bounded = min(max(r, 0.8), 1.28)
            np.testing.assert_allclose(loss[b, t], -min(r * a, bounded * a), rtol=1e-5)
            assert bool(clipped[b, t]) == (bounded * a < r * a)  # the clipped branch won
    grads = jax.grad(lambda lp: grpo.clipped_surrogate(lp, logp_old, adv, mask, 0.2, 0.28)[0].sum())
    assert np.all(np.isfinite(grads(logp)))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty(kind):
    logp, _, logp_ref, _, _ = _loss_batch(4)
    got = grpo.kl_penalty(logp, logp_ref, kind)
    chex.assert_shape(got, logp.shape)
    want = np.zeros(logp.shape)
    for idx in np.ndindex(logp.shape):
        log_ratio = float(logp[idx]) - float(logp_ref[idx])  # log p / p_ref
        want[idx] = {
            "k1": log_ratio,
            "k2": log_ratio**2 / 2,
            "k3": 1 / np.exp(log_ratio) + log_ratio - 1,
        }[kind]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if kind == "k3":
        assert np.all(np.asarray(got) >= 0)


# ---------------------------------------------------------------- aggregation


def _aggregate_ref(x, mask, mode, weights, max_len):
    """The loss as a weighted average over what counts (tokens or sequences)."""
    B = x.shape[0]
    if mode == "token_mean":
        num = sum(weights[b] * x[b, t] for b in range(B) for t in range(x.shape[1]) if mask[b, t])
        den = sum(weights[b] * mask[b].sum() for b in range(B))
        return num, den
    num = den = 0.0
    for b in range(B):
        tokens = [x[b, t] for t in range(x.shape[1]) if mask[b, t]]
        if not tokens or weights[b] == 0:
            continue
        per_seq = np.mean(tokens) if mode == "seq_mean_token_mean" else np.sum(tokens) / max_len
        num, den = num + weights[b] * per_seq, den + weights[b]
    return num, den


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_matches_reference(mode):
    _, _, _, _, mask = _loss_batch(5)
    x = _rng(5).normal(size=mask.shape).astype(np.float32)
    x[mask == 0] = np.nan  # values outside the mask must not leak
    weights = np.array([1.0, 0.0, 1.0, 0.5, 1.0, 2.0], np.float32)
    num, den = jax.jit(grpo.aggregate, static_argnums=2)(x, mask, mode, weights=weights, max_len=9)
    chex.assert_shape([num, den], ())
    want_num, want_den = _aggregate_ref(x, mask, mode, weights, 9)
    np.testing.assert_allclose([num, den], [want_num, want_den], rtol=1e-5)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_is_exact_across_micro_batches(mode):
    _, _, _, _, mask = _loss_batch(6)
    x = _rng(6).normal(size=mask.shape).astype(np.float32)
    full = grpo.aggregate(x, mask, mode, max_len=7)
    halves = [grpo.aggregate(x[s], mask[s], mode, max_len=7) for s in (slice(0, 3), slice(3, 6))]
    np.testing.assert_allclose(np.sum(halves, axis=0), full, rtol=1e-6)


# ---------------------------------------------------------------- the GRPO loss


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_grpo_loss_gradient_at_ratio_one(mode):
    """At logp_old == logp and beta = 0: d loss / d logp = -A * mask * weight / denominator."""
    logp, _, _, adv, mask = _loss_batch(7)
    weights = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 1.0], np.float32)
    cfg = grpo.GRPOConfig(beta=0.0, aggregation=mode, max_len=10)
    loss_fn = lambda lp: grpo.grpo_loss(lp, logp, None, adv, mask, weights, cfg)[0]
    grad = jax.jit(jax.grad(loss_fn))(logp)
    chex.assert_shape(grad, logp.shape)

    lengths = mask.sum(-1)
    rows = (weights > 0) & (lengths > 0)
    if mode == "token_mean":
        denom = np.full(lengths.shape, (mask * weights[:, None]).sum())
    elif mode == "seq_mean_token_mean":
        denom = rows.sum() * np.maximum(lengths, 1)
    else:
        denom = np.full(lengths.shape, rows.sum() * 10.0)
    want = -adv[:, None] * mask * weights[:, None] / denom[:, None]
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_grpo_loss_matches_parts_and_metrics():
    logp, logp_old, logp_ref, adv, mask = _loss_batch(8)
    logp_ref[1, -1] = 200.0  # masked garbage in the reference must not matter
    mask[1, -1] = 0.0
    cfg = grpo.GRPOConfig(eps_low=0.2, eps_high=0.28, beta=0.1, aggregation="token_mean")
    loss, metrics = jax.jit(grpo.grpo_loss, static_argnums=6)(
        logp, logp_old, logp_ref, adv, mask, None, cfg
    )
    chex.assert_shape(loss, ())
    surrogate, clipped = grpo.clipped_surrogate(logp, logp_old, adv, mask, 0.2, 0.28)
    kl = np.where(mask > 0, grpo.kl_penalty(logp, logp_ref), 0.0)
    n = mask.sum()
    np.testing.assert_allclose(metrics["pg_loss"], np.sum(surrogate) / n, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl_loss"], kl.sum() / n, rtol=1e-5)
    np.testing.assert_allclose(loss, np.sum(surrogate) / n + 0.1 * kl.sum() / n, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl"], kl.sum() / n, rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_frac"], np.sum(clipped) / n, rtol=1e-5)
    ratio = np.exp(logp - logp_old)[mask > 0]
    np.testing.assert_allclose(metrics["ratio_mean"], ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_max"], ratio.max(), rtol=1e-5)
    np.testing.assert_allclose(metrics["denom"], n)
    grad = jax.grad(lambda lp: grpo.grpo_loss(lp, logp_old, logp_ref, adv, mask, None, cfg)[0])
    assert np.all(np.isfinite(grad(logp)))


def test_grpo_loss_fully_masked_is_zero_with_finite_gradient():
    logp, logp_old, logp_ref, adv, mask = _loss_batch(9)
    cfg = grpo.GRPOConfig()
    fn = lambda lp: grpo.grpo_loss(lp, logp_old, logp_ref, adv, mask, np.zeros(6), cfg)[0]
    assert fn(logp) == 0.0
    np.testing.assert_array_equal(jax.grad(fn)(logp), 0.0)


def test_grpo_loss_requires_reference_when_beta_positive():
    logp, logp_old, _, adv, mask = _loss_batch(10)
    with pytest.raises(ValueError, match="logp_ref"):
        grpo.grpo_loss(logp, logp_old, None, adv, mask, None, grpo.GRPOConfig(beta=0.04))


# ---------------------------------------------------------------- marginal benefit (top-K)

# Rewards per group (members in columns); variances: g0 0.25, g1 0, g2 1.0, g3 0.25, g4 0
# (one valid member), g5 ~0.0556 (masked member ignored), g6 0 (all equal after masking).
GROUP_REWARDS = np.array(
    [
        [0.0, 1.0, 0.0, 1.0],
        [0.7, 0.7, 0.7, 0.7],
        [-1.0, 1.0, -1.0, 1.0],
        [1.0, 0.0, 1.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [0.0, 0.5, 0.5, 9.0],
        [0.1, 0.1, 0.1, 5.0],
    ],
    np.float32,
)
GROUP_VALID = np.array([[1, 1, 1, 1]] * 4 + [[1, 0, 0, 0]] + [[1, 1, 1, 0]] * 2, bool)


def _variance_ref(rewards, valid):
    out = []
    for r, v in zip(rewards, valid):
        members = [float(x) for x, ok in zip(r, v) if ok]
        out.append(np.var(members) if len(set(members)) > 1 else 0.0)
    return np.array(out)


def _variance(rewards, valid):
    """`grpo.segment_reward_variance` of a [G, M] table of groups (members flattened)."""
    groups = rewards.shape[0]
    ids = jnp.where(valid, jnp.arange(groups)[:, None], -1).reshape(-1)
    return grpo.segment_reward_variance(jnp.reshape(rewards, -1), ids, groups)


def _select_groups(rewards, valid, k):
    return grpo.top_k_positive(_variance(rewards, valid), k)


def test_segment_reward_variance_of_a_group_table():
    got = _variance(GROUP_REWARDS, GROUP_VALID)
    chex.assert_shape(got, (7,))
    np.testing.assert_allclose(got, _variance_ref(GROUP_REWARDS, GROUP_VALID), rtol=1e-6)
    assert np.all(np.asarray(got)[[1, 4, 6]] == 0.0)  # exactly zero, not merely tiny


@pytest.mark.parametrize(
    "k, expected",
    [
        (0, []),
        (1, [2]),
        (2, [0, 2]),  # g0 and g3 tie at 0.25: the lower index wins
        (3, [0, 2, 3]),
        (4, [0, 2, 3, 5]),
        (5, [0, 2, 3, 5]),  # only four groups have a non-zero variance
        (100, [0, 2, 3, 5]),
        (None, [0, 2, 3, 5]),
    ],
)
def test_select_groups(k, expected):
    kept = jax.jit(_select_groups, static_argnums=2)(GROUP_REWARDS, GROUP_VALID, k)
    chex.assert_shape(kept, (7,))
    np.testing.assert_array_equal(np.flatnonzero(kept), expected)


def test_select_groups_random_matches_reference():
    rng = _rng(11)
    rewards = rng.integers(0, 3, (40, 5)).astype(np.float32)  # many ties and zero variances
    valid = rng.uniform(size=(40, 5)) < 0.8
    var = _variance_ref(rewards, valid)
    order = sorted((i for i in range(40) if var[i] > 0), key=lambda i: (-var[i], i))
    for k in (1, 5, 13, 40):
        kept = _select_groups(rewards, valid, k)
        np.testing.assert_array_equal(np.flatnonzero(kept), sorted(order[:k]))


def test_sample_weights_and_agent_update_mask():
    kept = jnp.array([True, False, True, False])
    group_ids = jnp.array([0, 0, 1, 1, 2, 3, -1])
    np.testing.assert_array_equal(grpo.sample_weights(kept, group_ids), [1, 1, 0, 0, 1, 0, 0])
    group_agent = jnp.array([2, 0, 2, -1])  # agent 1 owns nothing; the last group is padding
    chex.assert_shape(grpo.agent_update_mask(kept, group_agent, 3), (3,))
    np.testing.assert_array_equal(grpo.agent_update_mask(kept, group_agent, 3), [0, 0, 1])
    only_padding = jnp.array([False, False, False, True])
    np.testing.assert_array_equal(grpo.agent_update_mask(only_padding, group_agent, 3), [0, 0, 0])


def test_select_agents():
    var = _variance(GROUP_REWARDS, GROUP_VALID)  # [.25, 0, 1, .25, 0, .056, 0]
    group_agent = np.array([0, 0, 1, 2, 3, 3, -1])
    # Mean group variance per agent: a0 0.125, a1 1.0, a2 0.25, a3 0.028, a4 (no groups) 0.
    select = jax.jit(grpo.select_agents, static_argnums=(2, 3))
    np.testing.assert_array_equal(np.flatnonzero(select(var, group_agent, 5, 1)), [1])
    np.testing.assert_array_equal(np.flatnonzero(select(var, group_agent, 5, 2)), [1, 2])
    np.testing.assert_array_equal(np.flatnonzero(select(var, group_agent, 5, 9)), [0, 1, 2, 3])
    # Ties between agents go to the lower index; an agent whose groups all have zero
    # variance is never selected.
    tied, owners = np.array([0.5, 0.5, 0.0, 0.0], np.float32), np.array([1, 0, 2, 2])
    np.testing.assert_array_equal(np.flatnonzero(select(tied, owners, 3, 1)), [0])
    np.testing.assert_array_equal(np.flatnonzero(select(tied, owners, 3, 3)), [0, 1])


def test_selection_vmaps_over_agents():
    rewards = np.stack([GROUP_REWARDS, GROUP_REWARDS[::-1]])
    valid = np.stack([GROUP_VALID, GROUP_VALID[::-1]])
    kept = jax.jit(jax.vmap(lambda r, v: _select_groups(r, v, 2)))(rewards, valid)
    chex.assert_shape(kept, (2, 7))
    np.testing.assert_array_equal(np.flatnonzero(kept[0]), [0, 2])
    np.testing.assert_array_equal(np.flatnonzero(kept[1]), [3, 4])  # 3 wins its tie with 6


def test_grpo_loss_vmaps_over_agents():
    batches = [_loss_batch(seed) for seed in (12, 13)]
    stacked = [np.stack(parts) for parts in zip(*batches)]  # each [A=2, ...]
    cfg = grpo.GRPOConfig(aggregation="seq_mean_token_sum_norm", max_len=7)
    loss_fn = lambda lp, old, ref, adv, mask: grpo.grpo_loss(lp, old, ref, adv, mask, None, cfg)
    losses, metrics = jax.jit(jax.vmap(loss_fn))(*stacked)
    chex.assert_shape([losses, metrics["clip_frac"]], (2,))
    for a, batch in enumerate(batches):
        np.testing.assert_allclose(losses[a], loss_fn(*batch)[0], rtol=1e-6)
