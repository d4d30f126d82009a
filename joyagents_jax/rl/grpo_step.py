"""The jitted GRPO step: all agents at once, the marginal-benefit top-K mask, mu inner steps.

Batch layout. Each agent group has a `Rollouts` of per-agent samples [A, B, T] (row a holds agent
a's nodes, padded to B samples and T tokens). Every sample names its node group with a batch-wide
id in [0, G) (-1 for padding samples), and `group_agent [G]` names the global agent (see
`train_state.agent_offsets`) that owns each node group; all samples of a node group sit in its
owner's row. So advantages, reward variances and the top-K choice span every node group of every
agent in every group, and are computed inside jit with a static K.

One step:
  1. advantages per node group, top-K node groups (or agents) by reward variance, per-sample
     weights and the per-agent update mask;
  2. a forward of the reference policies (logp_ref, when beta > 0);
  3. mu optimizer steps over the same batch (`lax.scan`), each agent vmapped (or in passes of
     `agents_per_pass` agents), unselected agents keeping params and optimizer state bit for
     bit. With `micro_batch`, each agent's gradient (and the reference forward) runs over
     micro-batches of rows and accumulates to the full-batch gradient, bounding activation
     memory. logp_old is the first inner step's own forward (taken before any update, so it
     is the rollout policy's log-prob) and is kept for the later inner steps: no extra
     forward pass;
  4. a non-finite loss or gradient in any inner step drops the whole step (counted).

Sharded: `make_grpo_step(cfg, in_shardings=(state_sh, batch_shardings(batch, mesh)),
out_shardings=(state_sh, None))` with `state_sh = train_state.state_shardings(state, mesh)`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from joyagents_jax import train_state as ts
from joyagents_jax.models import qwen2
from joyagents_jax.rl import grpo
from joyagents_jax.sft import next_token_logits


@dataclasses.dataclass(frozen=True)
class GRPOStepConfig:
    """Step hyperparameters; frozen, so the jitted step can close over it."""

    loss: grpo.GRPOConfig = grpo.GRPOConfig()
    inner_steps: int = 2  # mu: optimizer steps per rollout batch
    topk: int | None = None  # None keeps every node group with reward spread (plain GRPO)
    select: Literal["groups", "agents"] = "groups"
    # "given": rewards already are advantages (trajectory-mode rollouts normalize per episode).
    advantage: Literal["std", "no_std", "loo", "given"] = "std"
    neg_weight: float = 1.0  # scale of negative advantages (grpo.weight_negatives); 1: GRPO
    # Rows per agent in one forward/backward; gradients accumulate over the batch's
    # micro-batches to exactly the full-batch gradient. None: the whole batch at once.
    micro_batch: int | None = None
    # Agents of a group in one vmapped gradient (and reference) pass; the passes run one after
    # another (`lax.map`). None: every agent of a group in one pass. Fewer bounds activation
    # memory to that many agents and, on CPU, runs unbatched matmul kernels: at 30M
    # parameters one agent per pass made the 5-agent step 1.38x faster (benchmarks/RESULTS.md,
    # "One agent per pass"). The agents' results are the same up to rounding.
    agents_per_pass: int | None = None

    def __post_init__(self):
        if self.agents_per_pass is not None and self.agents_per_pass < 1:
            raise ValueError(f"agents_per_pass must be >= 1 (or None: all agents in one pass), "
                             f"got {self.agents_per_pass}.")


@flax.struct.dataclass
class Rollouts:
    """One agent group's samples. Per-token arrays are aligned with `tokens`."""

    tokens: jax.Array  # [A, B, T] int32: context and the agent's output, padded
    mask: jax.Array  # [A, B, T] bool: real tokens; RoPE positions are cumsum(mask) - 1
    loss_mask: jax.Array  # [A, B, T] bool: tokens this agent generated
    sampler_logp: jax.Array  # [A, B, T] f32: the sampler's log-prob of each generated token
    # (NaN for an output the memory supplied: only the log-prob gap metric reads it)
    rewards: jax.Array  # [A, B] f32
    group_ids: jax.Array  # [A, B] int32: node group in [0, G); -1 marks a padding sample


@flax.struct.dataclass
class GRPOBatch:
    rollouts: dict[str, Rollouts]  # one entry per agent group of the state
    group_agent: jax.Array  # [G] int32: global owner agent of each node group; -1 pads


# ----------------------------------------------------------------------------------------------
# Marginal benefit: advantages, kept node groups, sample weights, agents to update.
# ----------------------------------------------------------------------------------------------


def _flat(rollouts: dict[str, Rollouts], field: str) -> jax.Array:
    """A per-sample field of every group, concatenated in sorted group order. -> [N]."""
    return jnp.concatenate([getattr(rollouts[n], field).reshape(-1) for n in sorted(rollouts)])


def _unflat(flat: jax.Array, rollouts: dict[str, Rollouts]) -> dict[str, jax.Array]:
    """The inverse of `_flat`: [N] -> {group: [A, B]}."""
    out, start = {}, 0
    for name in sorted(rollouts):
        shape = rollouts[name].rewards.shape
        out[name] = flat[start:start + shape[0] * shape[1]].reshape(shape)
        start += shape[0] * shape[1]
    return out


def marginal_benefit(batch: GRPOBatch, num_agents: int, cfg: GRPOStepConfig
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Node-group reward variances [G], the kept node groups [G] bool (top-K by variance, or
    the groups of the top-K agents) and the agents to update [A] bool (owners of a kept group).

    Groups without an owner (padding) get variance 0, so they are never kept.
    """
    owner = batch.group_agent
    var = grpo.segment_reward_variance(_flat(batch.rollouts, "rewards"),
                                       _flat(batch.rollouts, "group_ids"), owner.shape[0])
    var = jnp.where(owner >= 0, var, 0.0)
    if cfg.select == "groups":
        kept = grpo.top_k_positive(var, cfg.topk)
    elif cfg.select == "agents":
        chosen = grpo.select_agents(var, owner, num_agents, cfg.topk)
        kept = chosen[jnp.maximum(owner, 0)] & (var > 0)
    else:
        raise ValueError(f"unknown select {cfg.select!r}; expected groups or agents")
    return var, kept, grpo.agent_update_mask(kept, owner, num_agents)


def offpolicy_groups(batch: GRPOBatch) -> jax.Array:
    """[G] bool: node groups holding a member the policy did not sample (a memory or gold
    output, marked by NaN sampler log-probs on its targets): with `marginal_benefit`'s kept
    groups it tells how much of an update imitates stored answers."""
    flags = jnp.concatenate([
        jnp.any(jnp.isnan(r.sampler_logp[..., 1:]) & r.loss_mask[..., 1:], -1).reshape(-1)
        for _, r in sorted(batch.rollouts.items())])
    ids, num_groups = _flat(batch.rollouts, "group_ids"), batch.group_agent.shape[0]
    hits = jax.ops.segment_sum(flags.astype(jnp.int32), jnp.where(ids >= 0, ids, num_groups),
                               num_groups + 1)
    return hits[:num_groups] > 0


def advantages(batch: GRPOBatch, cfg: GRPOStepConfig) -> dict[str, jax.Array]:
    """Group-relative advantage of every sample, negatives scaled by cfg.neg_weight:
    {group: [A, B]}."""
    if cfg.advantage == "given":
        return {n: grpo.weight_negatives(
                    jnp.where((r.group_ids >= 0) & jnp.isfinite(r.rewards), r.rewards, 0.0),
                    cfg.neg_weight) for n, r in batch.rollouts.items()}
    adv = grpo.group_advantages(_flat(batch.rollouts, "rewards"),
                                _flat(batch.rollouts, "group_ids"),
                                batch.group_agent.shape[0], mode=cfg.advantage)
    return _unflat(grpo.weight_negatives(adv, cfg.neg_weight), batch.rollouts)


# ----------------------------------------------------------------------------------------------
# Per-agent quantities (each function sees one agent; the step vmaps it).
# ----------------------------------------------------------------------------------------------


def _logits(model: qwen2.Qwen2Config, params: qwen2.Params, tokens: jax.Array,
            mask: jax.Array, temperature: float) -> jax.Array:
    """Next-token logits of the policy the loss scores. tokens, mask: [B, T] -> [B, T-1, V]."""
    return next_token_logits(model, params, tokens, mask) / temperature


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return grpo.safe_divide(jnp.sum(jnp.where(mask, x, 0.0)), jnp.sum(mask))


def agent_loss(model: qwen2.Qwen2Config, cfg: grpo.GRPOConfig,
               first: jax.Array,  # [] bool: the first inner step, before any update
               params: qwen2.Params,
               logp_old: jax.Array,  # [B, T-1]; ignored when `first`
               tokens: jax.Array,  # [B, T]
               mask: jax.Array,  # [B, T]
               targets: jax.Array,  # [B, T-1] bool: loss_mask[:, 1:]
               logp_ref: jax.Array | None,  # [B, T-1]
               adv: jax.Array,  # [B]
               weights: jax.Array,  # [B]
               ) -> tuple[jax.Array, tuple[dict[str, jax.Array], jax.Array]]:
    """One agent's GRPO loss, its metrics (entropy over all its generated tokens) and logp_old.

    In the first inner step the params are still the rollout policy's, so logp_old is this
    forward's own log-prob (without gradient). Metrics keep the counts that weight them when
    micro-batches are combined: "denom" (the loss's), "live" and "generated" tokens.
    """
    logits = _logits(model, params, tokens, mask, cfg.temperature)
    logp = grpo.token_logprobs(logits, tokens[:, 1:])
    logp_old = jnp.where(first, jax.lax.stop_gradient(logp), logp_old)
    loss, metrics = grpo.grpo_loss(logp, logp_old, logp_ref, adv, targets, weights, cfg)
    entropy = grpo.token_entropy(jax.lax.stop_gradient(logits))
    metrics.update(entropy=_masked_mean(entropy, targets), generated=jnp.sum(targets),
                   live=jnp.sum(targets & (weights[:, None] > 0)))
    return loss, (metrics, logp_old)


def _micro_size(rows: int, micro_batch: int | None) -> int:
    size = rows if micro_batch is None else min(micro_batch, rows)
    if rows % size:
        raise ValueError(f"config micro_batch {micro_batch} does not divide the batch's "
                         f"{rows} rows per agent; use a power of two.")
    return size


def _micro(x: jax.Array | None, size: int) -> jax.Array | None:
    """[B, ...] -> [B / size, size, ...]."""
    return None if x is None else x.reshape(x.shape[0] // size, size, *x.shape[1:])


def _combine_micro(m: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-micro-batch metrics [n] -> the full batch's: losses weighted by their denominators,
    token means by their token counts, ratio_max the max."""
    weighted = lambda v, w: grpo.safe_divide(jnp.sum(v * w), jnp.sum(w))
    by = {"loss": "denom", "pg_loss": "denom", "kl_loss": "denom", "kl": "live",
          "clip_frac": "live", "ratio_mean": "live", "entropy": "generated"}
    out = {k: weighted(m[k], m[w].astype(jnp.float32)) for k, w in by.items()}
    out["ratio_max"] = jnp.max(m["ratio_max"])
    return out


def agent_grads(model: qwen2.Qwen2Config, cfg: grpo.GRPOConfig, micro_batch: int | None,
                skip_empty: bool, first: jax.Array, view, params: qwen2.Params,
                logp_old: jax.Array, *inputs):
    """One agent's loss gradient over its batch, accumulated over micro-batches of rows.

    view: trainable params -> the policy (`AgentGroup.view`: the params, or a LoRA base with
    these adapters); gradients are taken for the trainable params only. skip_empty: skip
    micro-batches without target tokens (`_unless_empty`; only where the agent is not vmapped).

    Each micro-batch's loss is rescaled by its share of the full batch's aggregation
    denominator (param-independent), so the summed gradient is the full-batch gradient.
    inputs: tokens, mask, targets, logp_ref, adv, weights as in `agent_loss` ([B, ...]).
    Returns (grads, metrics, logp_old [B, T-1]).
    """
    rows = inputs[0].shape[0]
    size = _micro_size(rows, micro_batch)
    loss_fn = lambda params, *rest: agent_loss(model, cfg, first, view(params), *rest)
    if size == rows:
        (_, (metrics, logp_old)), grads = _unless_empty(
            skip_empty, jax.value_and_grad(loss_fn, has_aux=True), inputs[2], params, logp_old,
            *inputs)
        return grads, {k: v for k, v in metrics.items()
                       if k not in ("denom", "live", "generated")}, logp_old
    targets, weights = inputs[2], inputs[5]
    total = grpo.aggregate(jnp.zeros(targets.shape), targets, cfg.aggregation, weights=weights,
                           max_len=cfg.max_len)[1]

    def scaled(params, *mb):
        loss, (metrics, old) = loss_fn(params, *mb)
        return loss * grpo.safe_divide(metrics["denom"], total), (metrics, old)

    def body(acc, mb):  # mb: logp_old, tokens, mask, targets, ...
        (_, (metrics, old)), grads = _unless_empty(
            skip_empty, jax.value_and_grad(scaled, has_aux=True), mb[3], params, *mb)
        return jax.tree.map(jnp.add, acc, grads), (metrics, old)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (metrics, old) = jax.lax.scan(
        body, zeros, tuple(_micro(x, size) for x in (logp_old, *inputs)))
    return grads, _combine_micro(metrics), old.reshape(rows, -1)


def _unless_empty(skip: bool, fn, targets: jax.Array, *args):
    """fn(*args), or with `skip` zeros shaped as its outputs when `targets` [B, T-1] holds no
    target token.

    Rows without targets are padding (an agent's rows are bucketed to the group's largest
    count, and an agent without samples has only padding): their loss, gradient, metrics and
    metric weights are all zero, so skipping them (`lax.cond` runs one branch) changes nothing
    but the time the empty micro-batches and agents took. Only for an agent that is not
    vmapped (agents one per pass): under vmap the cond becomes a select that computes both
    branches, and the LoRA 3B+3B step's compiled temporaries grew from 24.5 to 131 GiB with it
    (benchmarks/RESULTS.md, "Memory: the paper's five 3B agents on one accelerator").
    """
    if not skip:
        return fn(*args)
    zeros = lambda *a: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fn, *a))
    return jax.lax.cond(jnp.any(targets), fn, zeros, *args)


def _reduce_inner(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """[mu, A] per inner step -> [A]: the max for ratio_max, the mean otherwise."""
    return {k: v.max(0) if k == "ratio_max" else v.mean(0) for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------
# The step.
# ----------------------------------------------------------------------------------------------


def _check_batch(state: ts.TrainState, batch: GRPOBatch) -> None:
    if set(batch.rollouts) != set(state.groups):
        raise ValueError(f"GRPO batch groups {sorted(batch.rollouts)} differ from the state's "
                         f"{sorted(state.groups)}; every agent group needs a Rollouts entry.")
    for name, group in state.groups.items():
        if batch.rollouts[name].tokens.shape[0] != group.num_agents:
            raise ValueError(f"Rollouts of group {name!r} have agent axis "
                             f"{batch.rollouts[name].tokens.shape[0]}, the group has "
                             f"{group.num_agents} agents.")


def _reference_logprobs(group: ts.AgentGroup, r: Rollouts, loss: grpo.GRPOConfig,
                        micro_batch: int | None = None, per_pass: int | None = None
                        ) -> jax.Array | None:
    """logp_ref of every sample [A, B, T-1] (micro-batch by micro-batch), or None when the KL
    term is off."""
    if not loss.beta:
        return None
    references = group.references
    if references is None:
        raise ValueError("beta > 0 needs reference params (init_group(..., reference=True); "
                         "a run freezes them when GRPO starts).")
    rows = r.tokens.shape[1]
    size = _micro_size(rows, micro_batch)

    def one_agent(params, tokens, mask, targets):  # [B, T] -> [B, T-1]
        logprobs = lambda tokens, mask: grpo.token_logprobs(
            _logits(group.model, params, tokens, mask, loss.temperature), tokens[:, 1:])
        per_micro = lambda tmt: _unless_empty(per_pass == 1, logprobs, tmt[2], *tmt[:2])
        return jax.lax.map(per_micro, tuple(_micro(x, size) for x in (tokens, mask, targets))
                           ).reshape(rows, -1)

    return ts.over_agents(one_agent, per_pass, references, r.tokens, r.mask,
                          r.loss_mask[..., 1:].astype(bool))


def _inner_step(cfg: GRPOStepConfig, inputs: dict, updates: dict[str, jax.Array], carry,
                first: jax.Array):
    """One optimizer step of every agent on the whole batch (the body of the mu-step scan).

    carry: ({group: AgentGroup}, {group: logp_old [A, B, T-1]}); first: [] bool.
    Returns the new carry and ({group: metrics [A]}, [] bool all losses and gradients finite).
    """
    groups, logp_old = carry
    new_groups, new_old, metrics, ok = {}, {}, {}, jnp.array(True)
    for name, group in groups.items():
        grad_fn = functools.partial(agent_grads, group.model, cfg.loss, cfg.micro_batch,
                                    cfg.agents_per_pass == 1, first, group.view)
        grads, metrics[name], new_old[name] = ts.over_agents(
            grad_fn, cfg.agents_per_pass, group.params, logp_old[name], *inputs[name])
        metrics[name]["grad_norm"] = norms = ts.global_norms(grads)
        new_groups[name] = ts.apply_gradients(group, grads, updates[name])
        ok &= jnp.all(jnp.isfinite(metrics[name]["loss"]) & jnp.isfinite(norms))
    return (new_groups, new_old), (metrics, ok)


def grpo_step(state: ts.TrainState, batch: GRPOBatch, cfg: GRPOStepConfig
              ) -> tuple[ts.TrainState, dict]:
    """One GRPO update of every agent; see the module docstring.

    Metrics: {"kept_groups", "mixed_groups", "offpolicy_kept_groups", "offpolicy_mixed_groups"
              (those holding a memory or gold member), "updated_agents", "skipped": [],
              "agents": {group: {loss, pg_loss, kl_loss, kl, clip_frac, ratio_mean, ratio_max,
                                 entropy, grad_norm, kept_groups, updated, mean_reward,
                                 logprob_gap: [A]}}}.
    Loss metrics are means over the inner steps (ratio_max: the max).
    """
    _check_batch(state, batch)
    offsets, total = ts.agent_offsets(state.groups), ts.num_agents(state.groups)
    var, kept, update = marginal_benefit(batch, total, cfg)
    adv = advantages(batch, cfg)
    owned = jax.ops.segment_sum(kept.astype(jnp.int32), jnp.maximum(batch.group_agent, 0), total)

    inputs, targets, updates, logp_old, agents = {}, {}, {}, {}, {}
    for name, group in state.groups.items():
        r = batch.rollouts[name]
        rows = slice(offsets[name], offsets[name] + group.num_agents)
        targets[name] = r.loss_mask[..., 1:].astype(bool)
        inputs[name] = (r.tokens, r.mask, targets[name],
                        _reference_logprobs(group, r, cfg.loss, cfg.micro_batch,
                                            cfg.agents_per_pass), adv[name],
                        grpo.sample_weights(kept, r.group_ids))
        updates[name] = update[rows]
        logp_old[name] = jnp.zeros(targets[name].shape, jnp.float32)  # set by the first step
        agents[name] = {"kept_groups": owned[rows], "updated": update[rows],
                        "mean_reward": jax.vmap(_masked_mean)(r.rewards, r.group_ids >= 0)}

    body = functools.partial(_inner_step, cfg, inputs, updates)
    first = jnp.arange(cfg.inner_steps) == 0
    (groups, logp_old), (inner, oks) = jax.lax.scan(body, (state.groups, logp_old), first)
    ok = jnp.all(oks)
    for name in state.groups:
        sampled = jnp.isfinite(batch.rollouts[name].sampler_logp[..., 1:])  # NaN: memory's
        gap = jnp.abs(jnp.where(sampled, batch.rollouts[name].sampler_logp[..., 1:], 0.0)
                      - logp_old[name])
        agents[name] = {**_reduce_inner(inner[name]), **agents[name],
                        "logprob_gap": jax.vmap(_masked_mean)(gap, targets[name] & sampled)}
    new = ts.commit(state, groups, ok)
    offpolicy = offpolicy_groups(batch)
    metrics = {"kept_groups": jnp.sum(kept), "mixed_groups": jnp.sum(var > 0),
               "offpolicy_kept_groups": jnp.sum(kept & offpolicy),
               "offpolicy_mixed_groups": jnp.sum((var > 0) & offpolicy),
               "updated_agents": jnp.sum(update), "skipped": new.skipped > state.skipped,
               "agents": agents}
    return new, metrics


def batch_shardings(batch: GRPOBatch, mesh: Mesh) -> GRPOBatch:
    """Rollouts split over agents and samples; the small `group_agent` table replicated."""
    return GRPOBatch(rollouts=ts.agent_batch_shardings(batch.rollouts, mesh),
                     group_agent=NamedSharding(mesh, P()))


def make_grpo_step(cfg: GRPOStepConfig, *, in_shardings=None, out_shardings=None):
    """`grpo_step` jitted with the state donated; shardings as in `train_state.jit_step`."""
    return ts.jit_step(functools.partial(grpo_step, cfg=cfg), in_shardings=in_shardings,
                       out_shardings=out_shardings)
