"""Adaptive memory evolution: a device-resident table per agent, fed by GRPO rewards.

Each agent keeps a fixed-capacity table of (key, request, prompt, response, reward, step, hits).
The prompt is the node's whole hint-free input, what self-imitation trains on. Keys are
mean-pooled final hidden states of the agent's frozen reference policy over the node's prompt
(rendered without a hint), L2-normalized, so they stay stable while the policies move.

  lookup  (each rollout wave; reads only): best cosine similarity s per node. s >= tau_reuse
          with a stored reward >= reuse_min_reward: reuse the stored response (no LLM call);
          s >= tau_hint: show the stored request and response as an experience hint.
  update  (each training step; jitted, fixed shapes, the old table donated): lo / hi =
          mu -/+ z sigma of the batch's R_A + R_F (hi capped at the best attainable reward).
          Entries whose reuse led to r <= lo are deleted and the step's reuses counted; then
          each candidate with r >= hi, in order, replaces a near duplicate (similarity >=
          tau_dup) if r is at least its reward, else fills the first empty slot, else evicts
          the lowest retention alpha exp(-(t - t_j) / T) + beta (r_j - mu). Nothing is written
          or deleted when every reward in the batch is equal (sigma = 0).

The tables live in the run state (`RunState.memory`); `memory_hook` connects them to rollouts.
Shape letters: A agents, C capacity, d key size, L response tokens, Lq request tokens,
P stored prompt tokens, N candidates, M hit records, B queries, T prompt tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from joyagents_jax.models import qwen2
from joyagents_jax.rl import rewards as rw


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """Table sizes, thresholds and retention weights. Frozen: a static jit argument."""

    capacity: int = 256  # C entries per agent
    response_length: int = 64  # L: longer responses are never stored (Limits.max_tokens_per_node)
    request_length: int = 128  # Lq: the node's (sub-)query tokens kept for hints (cut beyond)
    prompt_length: int = 511  # P: the node's prompt tokens kept (the run's max_len - 1)
    # Mean-pooled keys of one agent's prompts are close (shared system prompt): a random tiny
    # model already puts different requests at cosine 0.7-0.995, so the thresholds sit high.
    tau_reuse: float = 0.999
    tau_hint: float = 0.95
    reuse_min_reward: float = 1.0  # only correct answers (R_A = 1) are reused verbatim
    tau_dup: float = 0.999
    z: float = 1.96
    best_reward: float = rw.RewardConfig().best_memory_reward  # hi <= this: a perfect r enters
    alpha: float = 1.0
    beta: float = 1.0
    decay_steps: float = 100.0  # T of the retention's recency term
    reuse: bool = True
    hints: bool = True
    embed_batch: int = 32  # rows per embedding call

    def __post_init__(self):
        for name in ("capacity", "response_length", "request_length", "prompt_length",
                     "embed_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"MemoryConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if not self.decay_steps > 0:
            raise ValueError(f"MemoryConfig.decay_steps must be > 0, got {self.decay_steps}.")
        if self.tau_hint > self.tau_reuse:
            raise ValueError(f"MemoryConfig needs tau_hint <= tau_reuse, got tau_hint "
                             f"{self.tau_hint} > tau_reuse {self.tau_reuse}.")


# ----------------------------------------------------------------------------------------------
# The table and what goes into it.
# ----------------------------------------------------------------------------------------------

@flax.struct.dataclass
class MemoryTable:
    """One agent's memory; a stacked group's tables have a leading [A] axis on every leaf."""

    key: jax.Array  # [C, d] f32, unit norm
    response: jax.Array  # [C, L] int32
    length: jax.Array  # [C] int32
    request: jax.Array  # [C, Lq] int32, the node's (sub-)query
    request_length: jax.Array  # [C] int32
    prompt: jax.Array  # [C, P] int32, the node's hint-free prompt
    prompt_length: jax.Array  # [C] int32, its full length (longer than P: cut)
    reward: jax.Array  # [C] f32, R_A + R_F of the episode that wrote it
    step: jax.Array  # [C] int32, step of the last write
    hits: jax.Array  # [C] int32, reuses since the last write
    valid: jax.Array  # [C] bool


@flax.struct.dataclass
class Candidates:
    """Finished samples of one training step. `valid` marks real rows (all enter mu and sigma);
    a row is written only if its `length` fits in L."""

    key: jax.Array  # [N, d]
    response: jax.Array  # [N, L] int32
    length: jax.Array  # [N] int32, the full response length (may exceed L)
    request: jax.Array  # [N, Lq] int32
    request_length: jax.Array  # [N] int32
    prompt: jax.Array  # [N, P] int32
    prompt_length: jax.Array  # [N] int32, the full prompt length (may exceed P)
    reward: jax.Array  # [N] f32, R_A + R_F
    valid: jax.Array  # [N] bool


@flax.struct.dataclass
class HitRecords:
    """Reuses of this step's rollout: the slot reused and its episode's R_A + R_F."""

    slot: jax.Array  # [M] int32
    reward: jax.Array  # [M] f32
    valid: jax.Array  # [M] bool


@flax.struct.dataclass
class Thresholds:
    mu: jax.Array  # [] f32
    lo: jax.Array  # [] f32
    hi: jax.Array  # [] f32
    active: jax.Array  # [] bool: the rewards are not all equal (sigma > 0)


def init_table(cfg: MemoryConfig, d: int) -> MemoryTable:
    c = cfg.capacity
    zeros = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
    return MemoryTable(key=zeros(c, d, dtype=jnp.float32), response=zeros(c, cfg.response_length),
                       length=zeros(c), request=zeros(c, cfg.request_length),
                       request_length=zeros(c), prompt=zeros(c, cfg.prompt_length),
                       prompt_length=zeros(c), reward=zeros(c, dtype=jnp.float32), step=zeros(c),
                       hits=zeros(c), valid=zeros(c, dtype=bool))


def init_tables(cfg: MemoryConfig, d: int, num_agents: int) -> MemoryTable:
    """Stacked empty tables [A, ...] for an agent group."""
    return jax.vmap(lambda _: init_table(cfg, d))(jnp.arange(num_agents))


@jax.jit
def _moments(reward: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean, standard deviation and whether they spread, of the valid finite rewards [N].
    Jitted: one small program per N instead of a dozen eager ops, with the same values bit for
    bit (N is not padded: padded sums round differently)."""
    valid = valid & jnp.isfinite(reward)
    reward = jnp.where(valid, reward, 0.0)
    w = valid.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    mu = (reward * w).sum() / n
    sigma = jnp.sqrt((jnp.square(reward - mu) * w).sum() / n)
    # Exact test for sigma = 0 (a rounded f32 sigma of equal rewards need not be 0).
    spread = jnp.where(valid, reward, -jnp.inf).max() > jnp.where(valid, reward, jnp.inf).min()
    return mu, sigma, spread


def thresholds(reward: jax.Array, valid: jax.Array, cfg: MemoryConfig) -> Thresholds:
    """lo / hi = mu -/+ z sigma of the valid finite rewards [N]; hi capped at cfg.best_reward.
    The scalar arithmetic stays outside the jit, where XLA would fuse z * sigma into an FMA."""
    mu, sigma, spread = _moments(reward, valid)
    hi = jnp.minimum(mu + cfg.z * sigma, jnp.float32(cfg.best_reward))
    return Thresholds(mu=mu, lo=mu - cfg.z * sigma, hi=hi, active=spread)


# ----------------------------------------------------------------------------------------------
# Embedding and lookup.
# ----------------------------------------------------------------------------------------------

def embed(model_cfg: qwen2.Qwen2Config, ref_params: qwen2.Params, tokens: jax.Array,
          mask: jax.Array) -> jax.Array:
    """tokens/mask [B, T] (left padded) -> [B, d]: mean final hidden state over real tokens,
    L2-normalized. Jittable; vmap it over a stacked group's [A] axis."""
    hidden, _ = qwen2.hidden_states(model_cfg, ref_params, tokens, qwen2.positions_from_mask(mask),
                                    mask)
    w = mask.astype(jnp.float32)[..., None]
    pooled = (hidden.astype(jnp.float32) * w).sum(1) / jnp.maximum(w.sum(1), 1.0)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def _similarity(table: MemoryTable, queries: jax.Array) -> jax.Array:
    """queries [B, d] -> cosine similarity [B, C] to every entry; -inf at empty slots."""
    return jnp.where(table.valid, queries @ table.key.T, -jnp.inf)


@jax.jit
def lookup(table: MemoryTable, queries: jax.Array) -> tuple[jax.Array, jax.Array]:
    """queries [B, d] -> (best similarity [B], its slot [B]); (-inf, -1) for an empty table."""
    sim = _similarity(table, queries)
    slot = jnp.argmax(sim, axis=-1).astype(jnp.int32)
    best = jnp.take_along_axis(sim, slot[:, None], axis=-1)[:, 0]
    return best, jnp.where(table.valid.any(), slot, -1)


# ----------------------------------------------------------------------------------------------
# Update.
# ----------------------------------------------------------------------------------------------

NONE, INSERT, REPLACE, EVICT = range(4)  # what a candidate did


def _delete_bad_hits(table: MemoryTable, hits: HitRecords, th: Thresholds
                     ) -> tuple[MemoryTable, jax.Array]:
    """Deletes every entry whose reuse led to r <= lo; returns the table and the count."""
    bad = hits.valid & (hits.reward <= th.lo) & th.active
    c = table.valid.shape[0]
    doomed = jnp.zeros(c, bool).at[jnp.where(bad, hits.slot, c)].set(True, mode="drop")
    doomed &= table.valid
    return table.replace(valid=table.valid & ~doomed), doomed.sum()


def _count_hits(table: MemoryTable, hits: HitRecords) -> MemoryTable:
    """Adds one hit per valid record to its slot (an entry's reuses since it was written)."""
    slot = jnp.where(hits.valid, hits.slot, table.valid.shape[0])  # out of range: dropped
    return table.replace(hits=table.hits.at[slot].add(1, mode="drop"))


def _place(table: MemoryTable, cand: Candidates, th: Thresholds, step: jax.Array,
           cfg: MemoryConfig) -> tuple[jax.Array, jax.Array]:
    """Where one candidate goes: (slot, NONE | INSERT | REPLACE | EVICT)."""
    sim = _similarity(table, cand.key[None])[0]
    dup = jnp.argmax(sim)
    empty = jnp.argmin(table.valid.astype(jnp.int32))  # the first empty slot, if any
    retention = (cfg.alpha * jnp.exp(-(step - table.step) / cfg.decay_steps)
                 + cfg.beta * (table.reward - th.mu))
    victim = jnp.argmin(retention)
    is_dup, has_empty = sim[dup] >= cfg.tau_dup, ~table.valid[empty]
    slot = jnp.where(is_dup, dup, jnp.where(has_empty, empty, victim))
    kind = jnp.where(is_dup, jnp.where(cand.reward >= table.reward[dup], REPLACE, NONE),
                     jnp.where(has_empty, INSERT, EVICT))
    enters = (cand.valid & (cand.length <= cfg.response_length) & (cand.reward >= th.hi)
              & th.active)
    return slot, jnp.where(enters, kind, NONE)


def _write(table: MemoryTable, slot: jax.Array, cand: Candidates, step: jax.Array) -> MemoryTable:
    """Row `slot` <- the candidate (an out-of-range slot writes nothing)."""
    put = lambda x, v: x.at[slot].set(v, mode="drop")
    return table.replace(
        key=put(table.key, cand.key), response=put(table.response, cand.response),
        length=put(table.length, cand.length), request=put(table.request, cand.request),
        request_length=put(table.request_length, cand.request_length),
        prompt=put(table.prompt, cand.prompt),
        prompt_length=put(table.prompt_length, cand.prompt_length),
        reward=put(table.reward, cand.reward), step=put(table.step, step),
        hits=put(table.hits, 0), valid=put(table.valid, True))


def _update(table: MemoryTable, cands: Candidates, hits: HitRecords, th: Thresholds,
            step: jax.Array, cfg: MemoryConfig) -> tuple[MemoryTable, dict[str, jax.Array]]:
    """One training step's memory update (see the module docstring)."""
    table, deletions = _delete_bad_hits(table, hits, th)
    table = _count_hits(table, hits)
    c = table.valid.shape[0]

    def one(table, cand):
        slot, kind = _place(table, cand, th, step, cfg)
        return _write(table, jnp.where(kind == NONE, c, slot), cand, step), kind

    table, kinds = jax.lax.scan(one, table, cands)
    count = lambda k: (kinds == k).sum()
    return table, dict(entries=table.valid.sum(), inserts=count(INSERT),
                       replacements=count(REPLACE), evictions=count(EVICT), deletions=deletions)


@functools.partial(jax.jit, static_argnames="cfg", donate_argnums=0)
def update(table: MemoryTable, cands: Candidates, hits: HitRecords, th: Thresholds,
           step: jax.Array, cfg: MemoryConfig) -> tuple[MemoryTable, dict[str, jax.Array]]:
    """Applies one step's hits [M] and candidates [N] to a table (donated); returns metrics.

    Bad hits are deleted first and the step's reuses counted; then candidates are applied one after another in row order,
    each seeing the writes of those before it. So colliding candidates resolve by their order:
    a near duplicate of an earlier candidate replaces it when its reward is at least as high
    (the later one wins ties), and a second eviction takes the next lowest retention score.
    """
    return _update(table, cands, hits, th, step, cfg)


@functools.partial(jax.jit, static_argnames="cfg", donate_argnums=0)
def update_stacked(tables: MemoryTable, cands: Candidates, hits: HitRecords, th: Thresholds,
                   step: jax.Array, cfg: MemoryConfig) -> tuple[MemoryTable, dict[str, jax.Array]]:
    """`update` over a group's stacked [A] tables, candidates and hits; one batch's thresholds."""
    return jax.vmap(lambda t, c, h: _update(t, c, h, th, step, cfg))(tables, cands, hits)


# ----------------------------------------------------------------------------------------------
# Inspection.
# ----------------------------------------------------------------------------------------------

def agent_tables(tables: Mapping[str, MemoryTable], slots: Mapping[str, tuple[str, int]]
                 ) -> dict[str, MemoryTable]:
    """{stack: [A, ...] tables} -> {agent: its own table}, by the agents' (stack, index) slots."""
    return {a: jax.tree.map(lambda x: x[i], tables[g]) for a, (g, i) in slots.items()}


def dump(tables: Mapping[str, MemoryTable], tokenizer, path) -> int:
    """Writes every valid entry as a JSON line (agent, slot, reward, step, hits, decoded request
    and response); returns the number of lines."""
    lines = 0
    with open(path, "w") as f:
        for agent, table in tables.items():
            t = jax.device_get(table)
            for slot in np.flatnonzero(t.valid):
                f.write(json.dumps({
                    "agent": agent, "slot": int(slot), "reward": float(t.reward[slot]),
                    "step": int(t.step[slot]), "hits": int(t.hits[slot]),
                    "request": tokenizer.decode(t.request[slot, :t.request_length[slot]]),
                    "response": tokenizer.decode(t.response[slot, :t.length[slot]]),
                }) + "\n")
                lines += 1
    return lines
