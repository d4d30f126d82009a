"""Supervised warm start: teacher-forced cross-entropy on each agent's own output tokens.

Every agent of every group trains in one jitted step (vmap over the agent axis, or passes of
`agents_per_pass` agents); each agent sees only its own demonstrations. Prompt and observation
tokens are context, not targets: the loss mask selects the tokens the agent itself would
generate.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import flax.struct
import jax
import jax.numpy as jnp

from joyagents_jax import train_state as ts
from joyagents_jax.models import qwen2
from joyagents_jax.rl import grpo


@flax.struct.dataclass
class SFTBatch:
    """One group's demonstrations. Per-token arrays are aligned with `tokens`."""

    tokens: jax.Array  # [A, B, T] int32: prompt, the agent's output, observations; padded
    mask: jax.Array  # [A, B, T] bool: real tokens (padding is False)
    loss_mask: jax.Array  # [A, B, T] bool: the agent's own output tokens, the targets


def next_token_logits(model: qwen2.Qwen2Config, params: qwen2.Params, tokens: jax.Array,
                      mask: jax.Array) -> jax.Array:
    """Teacher-forced logits: tokens/mask [B, T] -> logits [B, T-1, V] predicting tokens[:, 1:]."""
    return qwen2.forward(model, params, tokens[:, :-1], mask=mask[:, :-1]).logits


def sft_loss(model: qwen2.Qwen2Config, params: qwen2.Params, tokens: jax.Array, mask: jax.Array,
             loss_mask: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-mean cross-entropy of one agent on its target tokens. tokens etc.: [B, T]."""
    logits = next_token_logits(model, params, tokens, mask)
    targets, live = tokens[:, 1:], loss_mask[:, 1:].astype(bool)
    logp = grpo.token_logprobs(logits, targets)
    count = jnp.sum(live)
    loss = grpo.safe_divide(-jnp.sum(jnp.where(live, logp, 0.0)), count)
    hits = jnp.sum(live & (jnp.argmax(logits, axis=-1) == targets))
    return loss, {"loss": loss, "accuracy": grpo.safe_divide(hits, count), "tokens": count}


def sft_step(state: ts.TrainState, batch: Mapping[str, SFTBatch], shared: bool = False,
             agents_per_pass: int | None = None) -> tuple[ts.TrainState, dict]:
    """One AdamW step of every agent in `batch` (groups absent from it are left alone).

    shared: every agent of a group takes the group's mean gradient, so agents that start equal
    stay equal: one base policy learns from all agents' demonstrations (the role a common
    pretrained checkpoint plays for real Qwen2.5 agents) before they specialize.
    agents_per_pass: agents of a group per vmapped pass (`train_state.over_agents`; None: all).

    An agent without target tokens keeps its params and optimizer state. A non-finite loss or
    gradient anywhere skips the whole step (counted in `state.skipped`).
    Metrics: {"skipped": [], "agents": {group: {loss, accuracy, tokens, grad_norm: [A]}}}.
    """
    groups, agents, ok = dict(state.groups), {}, jnp.array(True)
    for name, data in batch.items():
        group = groups[name]
        loss_fn = lambda params, *data: sft_loss(group.model, group.view(params), *data)
        (loss, metrics), grads = ts.over_agents(
            jax.value_and_grad(loss_fn, has_aux=True), agents_per_pass, group.params,
            data.tokens, data.mask, data.loss_mask)
        if shared:
            grads = jax.tree.map(lambda g: jnp.broadcast_to(g.mean(0), g.shape), grads)
        norms = ts.global_norms(grads)
        update = jnp.full_like(metrics["tokens"] > 0, jnp.any(metrics["tokens"] > 0)) if shared \
            else metrics["tokens"] > 0
        groups[name] = ts.apply_gradients(group, grads, update)
        ok &= jnp.all(jnp.isfinite(loss) & jnp.isfinite(norms))
        agents[name] = {**metrics, "grad_norm": norms}
    new = ts.commit(state, groups, ok)
    return new, {"skipped": new.skipped > state.skipped, "agents": agents}


def make_sft_step(*, shared: bool = False, agents_per_pass: int | None = None,
                  in_shardings=None, out_shardings=None):
    """The jitted `sft_step` with the state donated; shardings as in `train_state.jit_step`."""
    return ts.jit_step(functools.partial(sft_step, shared=shared, agents_per_pass=agents_per_pass),
                       in_shardings=in_shardings, out_shardings=out_shardings)
