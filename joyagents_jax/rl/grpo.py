"""GRPO building blocks: advantages, token log-probs, the clipped loss, top-K selection.

Every function is pure and shape-static, so it runs under `jax.jit` and `jax.vmap` (the train
step vmaps over a leading agent axis). Shape letters: N samples, G groups, M members per group,
A agents, B sequences, T tokens, V vocabulary.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

# --------------------------------------------------------------------------------------------
# Group-relative advantages.
# --------------------------------------------------------------------------------------------


def group_advantages(
    rewards: jax.Array,  # [N]
    group_ids: jax.Array,  # [N] int; -1 marks a padding sample
    num_groups: int,
    *,
    valid: jax.Array | None = None,  # [N] bool
    mode: Literal["std", "no_std", "loo"] = "std",
    eps: float = 1e-6,
) -> jax.Array:  # [N] float32
    """Advantage of each sample relative to its group, via segment sums (no per-group loop).

    `std`: (r - mean) / (std + eps) with the population std (GRPO). `no_std`: r - mean
    (Dr. GRPO). `loo`: r - mean of the *other* members (leave-one-out baseline).
    Padding samples (invalid, or group id outside [0, num_groups)), samples with a non-finite
    reward (left out of their group's statistics) and members of singleton groups get 0.
    """
    rewards = rewards.astype(jnp.float32)
    ok = (group_ids >= 0) & (group_ids < num_groups) & jnp.isfinite(rewards)
    if valid is not None:
        ok &= valid
    ids = jnp.where(ok, group_ids, 0)
    rewards = jnp.where(ok, rewards, 0.0)  # a non-finite reward must not reach any sum

    def per_group_sum(x):  # [N] -> [N]: the sum of x over each sample's group.
        return jax.ops.segment_sum(jnp.where(ok, x, 0.0), ids, num_groups)[ids]

    count = per_group_sum(jnp.ones_like(rewards))
    centered = rewards - per_group_sum(rewards) / jnp.maximum(count, 1.0)
    if mode == "std":
        std = jnp.sqrt(per_group_sum(centered**2) / jnp.maximum(count, 1.0))
        adv = centered / (std + eps)
    elif mode == "no_std":
        adv = centered
    elif mode == "loo":  # r - (sum - r) / (n - 1) == n / (n - 1) * (r - mean).
        adv = centered * count / jnp.maximum(count - 1.0, 1.0)
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; expected std, no_std or loo")
    return jnp.where(ok & (count > 1), adv, 0.0)


def weight_negatives(adv: jax.Array, neg_weight: float) -> jax.Array:  # [N] -> [N]
    """Negative advantages scaled by `neg_weight`: 1 is GRPO; below 1 the update leans on the
    samples that beat their group (0: only those are reinforced, as in rejection-sampling
    fine-tuning), meant to sharpen the greedy answer; above 1 it leans on pushing failures
    down."""
    return jnp.where(adv < 0, neg_weight * adv, adv)


# --------------------------------------------------------------------------------------------
# Per-token quantities from logits.
# --------------------------------------------------------------------------------------------


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) per token, in float32. logits: [B, T, V], targets: [B, T] -> [B, T].

    Equal to take_along_axis(log_softmax(logits), targets) but gathers one logit per token
    before subtracting the log-normalizer, so no second [B, T, V] array is materialized.
    """
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of the next-token distribution, in float32. logits: [B, T, V] -> [B, T]."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(probs * logits, axis=-1)


# --------------------------------------------------------------------------------------------
# Per-token loss terms.
# --------------------------------------------------------------------------------------------


def clipped_surrogate(
    logp: jax.Array,  # [B, T]
    logp_old: jax.Array,  # [B, T]
    advantages: jax.Array,  # [B]
    mask: jax.Array,  # [B, T]
    eps_low: float,
    eps_high: float,
) -> tuple[jax.Array, jax.Array]:  # ([B, T] float32 loss, [B, T] bool clipped)
    """PPO clipped surrogate -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = p / p_old.

    Returns the per-token loss (0 where mask is 0) and where clipping is active, i.e. where the
    token gets no gradient because its ratio already moved past the trust region. The log-ratio
    is zeroed outside the mask first, so garbage log-probs at padding cannot overflow `exp` and
    turn gradients into NaN.
    """
    mask = mask.astype(bool)
    ratio = jnp.exp(jnp.where(mask, logp - logp_old, 0.0))
    adv = advantages[:, None].astype(jnp.float32)
    loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
    clipped = ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
    return jnp.where(mask, loss, 0.0), clipped & mask


_KL_ESTIMATORS = {
    "k1": lambda d: -d,  # logp - ref
    "k2": lambda d: 0.5 * d**2,
    "k3": lambda d: jnp.exp(d) - d - 1.0,  # unbiased, low variance, always >= 0
}


def kl_penalty(
    logp: jax.Array, logp_ref: jax.Array, kind: Literal["k1", "k2", "k3"] = "k3"
) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from sampled tokens. [B, T] -> [B, T].

    With d = logp_ref - logp: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (Schulman's estimators).
    """
    if kind not in _KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(_KL_ESTIMATORS)}")
    return _KL_ESTIMATORS[kind](logp_ref - logp)


# --------------------------------------------------------------------------------------------
# Aggregation and the GRPO loss.
# --------------------------------------------------------------------------------------------

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def aggregate(
    per_token: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T]
    mode: Aggregation,
    *,
    weights: jax.Array | None = None,  # [B]
    max_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:  # (numerator [], denominator [])
    """Reduces a per-token loss to (numerator, denominator); the loss is their quotient.

    Keeping both lets micro-batches be summed separately and divided once, so gradient
    accumulation gives exactly the full-batch loss. Modes:
      token_mean               (DAPO)     sum over all tokens / number of tokens
      seq_mean_token_mean      (GRPO)     mean over sequences of each sequence's token mean
      seq_mean_token_sum_norm  (Dr. GRPO) mean over sequences of token sum / max_len
    max_len is the constant generation budget (defaults to T). Sample weights scale a row's
    numerator and denominator alike; rows with weight 0 or no unmasked token count as nothing.
    """
    mask = mask.astype(jnp.float32)
    w = jnp.ones(per_token.shape[:1], jnp.float32) if weights is None else weights
    w = w.astype(jnp.float32)
    row_sum = jnp.sum(jnp.where(mask > 0, per_token, 0.0) * mask, axis=-1)  # [B]
    row_sum = jnp.where(w > 0, row_sum, 0.0)  # a dropped row's value never reaches the sum
    row_len = jnp.sum(mask, axis=-1)  # [B]
    if mode == "token_mean":
        return jnp.sum(w * row_sum), jnp.sum(w * row_len)
    rows = w * (row_len > 0)
    if mode == "seq_mean_token_mean":
        return jnp.sum(rows * row_sum / jnp.maximum(row_len, 1.0)), jnp.sum(rows)
    if mode == "seq_mean_token_sum_norm":
        max_len = per_token.shape[-1] if max_len is None else max_len
        return jnp.sum(rows * row_sum) / max_len, jnp.sum(rows)
    raise ValueError(f"unknown aggregation {mode!r}")


def safe_divide(num: jax.Array, denom: jax.Array) -> jax.Array:
    """num / denom, and 0 (with finite gradients) where denom is 0, e.g. a fully masked batch."""
    return num / jnp.where(denom > 0, denom, 1.0)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Loss hyperparameters; frozen (hashable) so it can be a static argument of `jax.jit`."""

    eps_low: float = 0.2
    eps_high: float = 0.2  # DAPO's clip-higher uses 0.28.
    beta: float = 0.04  # KL weight; 0 drops the reference model.
    kl: Literal["k1", "k2", "k3"] = "k3"
    aggregation: Aggregation = "seq_mean_token_mean"
    max_len: int | None = None  # Dr. GRPO's constant normalizer; None uses T.
    # The policy the loss scores: softmax(logits / temperature). The rollout's temperature
    # makes the ratio, KL and entropy those of the distribution the samples were drawn from.
    temperature: float = 1.0


def grpo_loss(
    logp: jax.Array,  # [B, T] current policy
    logp_old: jax.Array,  # [B, T] policy that produced the advantages (no gradient)
    logp_ref: jax.Array | None,  # [B, T] frozen reference; may be None when beta == 0
    advantages: jax.Array,  # [B]
    mask: jax.Array,  # [B, T] the agent's own generated tokens
    weights: jax.Array | None,  # [B] sample weights, e.g. the top-K mask
    cfg: GRPOConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate + beta * KL, aggregated per `cfg.aggregation`.

    metrics["denom"] is the aggregation's denominator: weighting a micro-batch's loss (and
    gradient) by it, summing, and dividing by the summed denom reproduces the full batch.
    The other metrics are means over the tokens that carry loss.
    """
    logp_old = jax.lax.stop_gradient(logp_old)
    weights = jnp.ones(mask.shape[:1], jnp.float32) if weights is None else weights
    agg = lambda x: aggregate(x, mask, cfg.aggregation, weights=weights, max_len=cfg.max_len)

    surrogate, clipped = clipped_surrogate(
        logp, logp_old, advantages, mask, cfg.eps_low, cfg.eps_high
    )
    pg_num, denom = agg(surrogate)
    pg_loss = safe_divide(pg_num, denom)
    if logp_ref is not None:
        # Outside the mask, substitute logp for the reference so the KL term is exactly 0 there.
        logp_ref = jnp.where(mask.astype(bool), jax.lax.stop_gradient(logp_ref), logp)
        kl = kl_penalty(logp, logp_ref, cfg.kl)
        kl_loss = safe_divide(agg(kl)[0], denom)
    elif cfg.beta:
        raise ValueError("grpo_loss needs logp_ref when cfg.beta > 0")
    else:
        kl = kl_loss = jnp.zeros((), jnp.float32)
    loss = pg_loss + cfg.beta * kl_loss

    # Metrics: plain means over the tokens that carry loss (in the mask, sample weight > 0).
    live = (mask * weights[:, None]) > 0
    mean = lambda x: safe_divide(jnp.sum(jnp.where(live, x, 0.0)), jnp.sum(live))
    ratio = jax.lax.stop_gradient(jnp.exp(jnp.where(live, logp - logp_old, 0.0)))
    metrics = {
        "loss": loss,
        "pg_loss": pg_loss,
        "kl_loss": kl_loss,  # aggregated like the loss
        "kl": mean(jax.lax.stop_gradient(kl)),  # token mean, comparable across aggregations
        "clip_frac": mean(clipped),
        "ratio_mean": mean(ratio),
        "ratio_max": jnp.max(jnp.where(live, ratio, 0.0)),
        "denom": denom,
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Marginal benefit: update only the K most informative groups (or agents).
# --------------------------------------------------------------------------------------------


def segment_reward_variance(
    rewards: jax.Array,  # [N]
    group_ids: jax.Array,  # [N] int; -1 marks a padding sample
    num_groups: int,
) -> jax.Array:  # [G] float32
    """Population reward variance of each node group; a sample names its group, so a group's
    members may sit anywhere in the batch (the train step's layout).

    Exactly 0 (not merely tiny) for groups with < 2 samples or no reward spread, so they are
    never kept. Samples with a non-finite reward are left out: one bad reward cannot poison
    the batch.
    """
    r = rewards.astype(jnp.float32)
    ok = (group_ids >= 0) & (group_ids < num_groups) & jnp.isfinite(r)
    ids = jnp.where(ok, group_ids, 0)
    r = jnp.where(ok, r, 0.0)
    seg = lambda x: jax.ops.segment_sum(jnp.where(ok, x, 0.0), ids, num_groups)
    n = seg(jnp.ones_like(r))
    mean = seg(r) / jnp.maximum(n, 1.0)
    var = seg((r - mean[ids]) ** 2) / jnp.maximum(n, 1.0)
    hi = jax.ops.segment_max(jnp.where(ok, r, -jnp.inf), ids, num_groups)
    lo = jax.ops.segment_min(jnp.where(ok, r, jnp.inf), ids, num_groups)
    return jnp.where((hi > lo) & (n >= 2), var, 0.0)


def top_k_positive(scores: jax.Array, k: int | None) -> jax.Array:
    """[X] -> [X] bool: the k largest strictly positive scores; ties go to the lower index.

    k is static (None: all); zero, negative and NaN scores are never kept.
    """
    k = scores.shape[0] if k is None else min(k, scores.shape[0])
    if k <= 0:
        return jnp.zeros(scores.shape, bool)
    _, idx = jax.lax.top_k(jnp.where(scores > 0, scores, -jnp.inf), k)  # stable on ties
    return jnp.zeros(scores.shape, bool).at[idx].set(True) & (scores > 0)


def select_agents(
    variances: jax.Array,  # [G] from segment_reward_variance
    group_agent: jax.Array,  # [G] int; -1 marks a padding group
    num_agents: int,
    k: int | None,
) -> jax.Array:  # [A] bool
    """The `select = agents` variant: the K agents with the largest mean group variance.

    An agent without a non-zero-variance group is never selected. The kept groups are then
    those of the selected agents with non-zero variance: `selected[group_agent] & (var > 0)`.
    """
    ok = (group_agent >= 0) & (group_agent < num_agents)
    ids = jnp.where(ok, group_agent, 0)
    total = jax.ops.segment_sum(jnp.where(ok, variances, 0.0), ids, num_agents)
    count = jax.ops.segment_sum(ok.astype(jnp.float32), ids, num_agents)
    return top_k_positive(total / jnp.maximum(count, 1.0), k)


def sample_weights(kept: jax.Array, group_ids: jax.Array) -> jax.Array:
    """Per-sample loss weight: 1 for samples of kept groups, 0 otherwise. [G], [N] -> [N] f32."""
    ok = (group_ids >= 0) & (group_ids < kept.shape[0])
    return (kept[jnp.where(ok, group_ids, 0)] & ok).astype(jnp.float32)


def agent_update_mask(kept: jax.Array, group_agent: jax.Array, num_agents: int) -> jax.Array:
    """Which agents update this step: those owning at least one kept group. -> [A] bool."""
    ok = kept & (group_agent >= 0) & (group_agent < num_agents)
    owned = jax.ops.segment_sum(ok.astype(jnp.int32), jnp.where(ok, group_agent, 0), num_agents)
    return owned > 0
