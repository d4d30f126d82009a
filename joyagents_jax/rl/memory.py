"""Adaptive memory evolution: a device-resident table per agent, fed by GRPO rewards.

Each agent keeps a fixed-capacity table of (key, request, response, reward, step, hits). Keys are
mean-pooled final hidden states of the agent's frozen reference policy over the node's prompt
(rendered without a hint), L2-normalized, so they stay stable while the policies move.

  lookup  (each rollout wave): best cosine similarity s per node. s >= tau_reuse with a stored
          reward >= reuse_min_reward: reuse the stored response (no LLM call); s >= tau_hint:
          show the stored request and response as an experience hint; else nothing.
  update  (each training step, jitted, fixed shapes): lo / hi = mu -/+ z sigma of the batch's
          R_A + R_F (hi capped at the best attainable reward). Entries whose reuse led to
          r <= lo are deleted first; then each candidate with r >= hi, in order, replaces a near
          duplicate (similarity >= tau_dup) if r is at least its reward, else fills the first
          empty slot, else evicts the lowest retention alpha exp(-(t - t_j) / T) +
          beta (r_j - mu). Nothing changes when every reward in the batch is equal (sigma = 0).

Shape letters: A agents, C capacity, d key size, L response tokens, Lq request tokens,
N candidates, M hit records, B queries, T prompt tokens.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from joyagents_jax.agents import protocol
from joyagents_jax.agents.system import AgentSystem, Request
from joyagents_jax.models import qwen2
from joyagents_jax.rl import rewards as rw
from joyagents_jax.rl import rollout



@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """Table sizes, thresholds and retention weights. Frozen: a static jit argument."""

    capacity: int = 256  # C entries per agent
    response_length: int = 64  # L: longer responses are never stored (Limits.max_tokens_per_node)
    request_length: int = 128  # Lq: the node's (sub-)query tokens kept for hints (cut beyond)
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
        for name in ("capacity", "response_length", "request_length", "embed_batch"):
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
                       request_length=zeros(c), reward=zeros(c, dtype=jnp.float32), step=zeros(c),
                       hits=zeros(c), valid=zeros(c, dtype=bool))


def init_tables(cfg: MemoryConfig, d: int, num_agents: int) -> MemoryTable:
    """Stacked empty tables [A, ...] for an agent group."""
    return jax.vmap(lambda _: init_table(cfg, d))(jnp.arange(num_agents))


def thresholds(reward: jax.Array, valid: jax.Array, cfg: MemoryConfig) -> Thresholds:
    """lo / hi = mu -/+ z sigma of the valid finite rewards [N]; hi capped at cfg.best_reward."""
    valid = valid & jnp.isfinite(reward)
    reward = jnp.where(valid, reward, 0.0)
    w = valid.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    mu = (reward * w).sum() / n
    sigma = jnp.sqrt((jnp.square(reward - mu) * w).sum() / n)
    # Exact test for sigma = 0 (a rounded f32 sigma of equal rewards need not be 0).
    spread = jnp.where(valid, reward, -jnp.inf).max() > jnp.where(valid, reward, jnp.inf).min()
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


def _record_hits(table: MemoryTable, slot: jax.Array) -> MemoryTable:
    drop = table.valid.shape[0]  # out of range: ignored
    return table.replace(hits=table.hits.at[jnp.where(slot < 0, drop, slot)].add(1, mode="drop"))


@functools.partial(jax.jit, donate_argnums=0)
def record_hits(table: MemoryTable, slot: jax.Array) -> MemoryTable:
    """Adds one hit per reused slot [M] (-1 entries are ignored); the table is donated."""
    return _record_hits(table, slot)


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
        reward=put(table.reward, cand.reward), step=put(table.step, step),
        hits=put(table.hits, 0), valid=put(table.valid, True))


def _update(table: MemoryTable, cands: Candidates, hits: HitRecords, th: Thresholds,
            step: jax.Array, cfg: MemoryConfig) -> tuple[MemoryTable, dict[str, jax.Array]]:
    """One training step's memory update (see the module docstring)."""
    table, deletions = _delete_bad_hits(table, hits, th)
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

    Bad hits are deleted first; then candidates are applied one after another in row order,
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
# The rollout's memory hook.
# ----------------------------------------------------------------------------------------------

class GroupModel(NamedTuple):
    """An agent group's frozen reference policy, which embeds its agents' keys."""

    model: qwen2.Qwen2Config
    ref_params: qwen2.Params  # stacked [A, ...]


def _pick(tree: Any, agent: jax.Array | int) -> Any:
    return jax.tree.map(lambda x: x[agent], tree)


@functools.partial(jax.jit, static_argnums=0)
def _embed_agent(model_cfg, params, agent, tokens, mask):
    return embed(model_cfg, _pick(params, agent), tokens, mask)


@jax.jit
def _lookup_agent(tables: MemoryTable, agent, queries):
    """Best (similarity, slot) per query [B, d] in one agent's table, with that slot's row."""
    table = _pick(tables, agent)
    sim, slot = lookup(table, queries)
    return sim, slot, _pick(table.replace(key=None), slot)


_record_hits_stacked = jax.jit(jax.vmap(_record_hits), donate_argnums=0)


def _bucket(n: int) -> int:
    """The next power of two >= n: padded shapes keep the number of compilations small."""
    return 1 << max(n - 1, 0).bit_length()


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows -> tokens, mask [bucket(B), bucket(T)], left padded."""
    b, t = _bucket(len(rows)), _bucket(max(len(r) for r in rows))
    tokens, mask = np.full((b, t), pad_id, np.int32), np.zeros((b, t), bool)
    for i, row in enumerate(rows):
        tokens[i, t - len(row):], mask[i, t - len(row):] = row, True
    return tokens, mask


def _right_pad(rows: Sequence[Sequence[int]], n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows -> their first `width` tokens [n, width] and their full lengths [n]."""
    out, lengths = np.zeros((n, width), np.int32), np.zeros(n, np.int32)
    for i, row in enumerate(rows):
        out[i, :min(len(row), width)], lengths[i] = row[:width], len(row)
    return out, lengths


class MemoryHook:
    """The rollout's `Memory` over the per-agent tables of one or more agent groups.

    The rollout calls `lookup` once per wave; the trainer calls `update_from_rollout(result,
    step)` once per step, after the rollout, and logs the metrics it returns. `tables`
    ({group: stacked MemoryTable}) is the state to checkpoint.
    """

    def __init__(self, system: AgentSystem, tokenizer, models: Mapping[str, GroupModel],
                 agent_slots: Mapping[str, tuple[str, int]], cfg: MemoryConfig = MemoryConfig()):
        self.system, self.tokenizer, self.models, self.cfg = system, tokenizer, models, cfg
        self.agent_slots = agent_slots  # agent -> (group, index in the group's stacked axis)
        self.tables = {g: init_tables(cfg, m.model.hidden_size,
                                      jax.tree.leaves(m.ref_params)[0].shape[0])
                       for g, m in models.items()}
        self.stats = collections.Counter()  # lookups, reuses, hints since the last update
        self.record = True  # lookups count hits in the tables and stats (False: a read-only view)

    def frozen(self) -> MemoryHook:
        """A read-only view for evaluation: the same tables and thresholds, but lookups record
        no hits and no stats, so evaluating never changes the training run's memory."""
        view = copy.copy(self)
        view.record, view.stats = False, collections.Counter()
        return view

    def set_state(self, state) -> None:
        """Embeds with `state`'s reference params from now on (a train step donates the old)."""
        self.models = group_models(state)

    def lookup(self, requests: Sequence[Request]) -> list[rollout.Reuse | protocol.Hint | None]:
        out: list[rollout.Reuse | protocol.Hint | None] = [None] * len(requests)
        by_agent = collections.defaultdict(list)
        for i, request in enumerate(requests):
            by_agent[self.agent_slots[request.agent]].append(i)
        entries = {g: np.asarray(t.valid.sum(-1)) for g, t in self.tables.items()}
        reused = {g: [[] for _ in range(len(entries[g]))] for g in self.tables}
        for (group, agent), idx in by_agent.items():
            if not entries[group][agent]:
                continue
            queries = self._embed(group, agent, [self._prompt_ids(requests[i]) for i in idx])
            sim, slot, rows = jax.device_get(_lookup_agent(self.tables[group], agent, queries))
            for k, i in enumerate(idx):
                out[i] = self._decide(float(sim[k]), int(slot[k]), _pick(rows, k))
                if isinstance(out[i], rollout.Reuse):
                    reused[group][agent].append(int(slot[k]))
        if not self.record:
            return out
        for group, slots in reused.items():
            if any(slots):
                width = _bucket(max(map(len, slots)))
                padded = np.array([s + [-1] * (width - len(s)) for s in slots], np.int32)
                self.tables[group] = _record_hits_stacked(self.tables[group], padded)
        self.stats.update(lookups=len(requests),
                          reuses=sum(isinstance(o, rollout.Reuse) for o in out),
                          hints=sum(isinstance(o, protocol.Hint) for o in out))
        return out

    def _decide(self, sim: float, slot: int, row: MemoryTable
                ) -> rollout.Reuse | protocol.Hint | None:
        cfg, decode = self.cfg, self.tokenizer.decode
        response = row.response[:row.length]
        if cfg.reuse and sim >= cfg.tau_reuse and row.reward >= cfg.reuse_min_reward:
            gen = rollout.Generation(decode(response), response,
                                     np.zeros(len(response), np.float32), False)
            return rollout.Reuse(gen, slot)
        if cfg.hints and sim >= cfg.tau_hint:  # a close match that may not be reused verbatim
            return protocol.Hint(decode(row.request[:row.request_length]), decode(response))
        return None

    def _prompt_ids(self, request) -> tuple[int, ...]:
        """The node's prompt without a hint (a `Request` or a `Node`): what keys embed."""
        spec = self.system.specs[request.agent]
        return tuple(self.tokenizer.encode(
            protocol.render_prompt(self.tokenizer, spec, request.query, request.turns)))

    def _embed(self, group: str, agent: int, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Token rows -> unit keys [len(rows), d] with the agent's reference policy."""
        m, size, out = self.models[group], self.cfg.embed_batch, []
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            tokens, mask = _left_pad(chunk, self.tokenizer.pad_id)
            keys = _embed_agent(m.model, m.ref_params, agent, tokens, mask)
            out.append(np.asarray(keys)[:len(chunk)])
        return np.concatenate(out)

    def update_from_rollout(self, result: rollout.RolloutResult, step: int) -> dict[str, float]:
        """Writes this step's rewarded samples, deletes entries whose reuse failed, and returns
        the step's memory metrics (lookup counts are those since the previous update).

        Thresholds come from the R_A + R_F of all the rollout's samples, every agent together;
        a rollout without samples (all answered from memory) changes nothing.
        """
        totals = collections.Counter()
        if result.samples:
            rewards = np.array([s.memory_reward for s in result.samples], np.float32)
            th = thresholds(jnp.asarray(rewards), jnp.ones(len(rewards), bool), self.cfg)
            members, hits = self._members(result), self._hits(result)
            for group, tables in self.tables.items():
                agents = range(tables.valid.shape[0])
                if not any(members[group, a] or hits[group, a] for a in agents):
                    continue
                cands = _stack([self._candidates(group, a, members[group, a]) for a in agents])
                records = _stack([_hit_records(hits[group, a]) for a in agents])
                self.tables[group], metrics = update_stacked(
                    tables, cands, records, th, jnp.asarray(step, jnp.int32), self.cfg)
                totals.update({k: int(v.sum()) for k, v in metrics.items() if k != "entries"})
        lookups = max(self.stats["lookups"], 1)
        out = {"entries": sum(int(t.valid.sum()) for t in self.tables.values()), "inserts": 0,
               "replacements": 0, "evictions": 0, "deletions": 0, **totals,
               "hit_rate": self.stats["reuses"] / lookups,
               "hint_rate": self.stats["hints"] / lookups,
               "llm_calls_saved": self.stats["reuses"]}
        self.stats.clear()
        return out

    def _members(self, result: rollout.RolloutResult) -> dict[tuple[str, int], list]:
        """(group, agent index) -> [(node, sample)]; samples are LLM-generated nodes only.

        A sample's node is found through its prompt tokens in the returned traces (equal
        prompts mean equal agent, query and turns): it renders the hint-free prompt to embed
        and holds the query for hints. Samples off the returned traces (full_tree's inner
        branches; full_tree never consults the memory) are skipped.
        """
        nodes = {}
        for trace in result.episodes:
            for node_input, node in zip(trace.inputs, trace.episode.nodes):
                nodes.setdefault(tuple(node_input.prompt_ids), node)
        members = collections.defaultdict(list)
        for sample in result.samples:
            node = nodes.get(tuple(sample.prompt_ids))
            if node is not None:
                members[self.agent_slots[sample.agent]].append((node, sample))
        return members

    def _hits(self, result: rollout.RolloutResult) -> dict[tuple[str, int], list]:
        """(group, agent index) -> [(slot, R_A + R_F of the episode that reused it)]."""
        hits = collections.defaultdict(list)
        for trace, parts in zip(result.episodes, result.rewards):
            for k, slot in trace.memory_slots.items():
                agent = self.agent_slots[trace.episode.nodes[k].agent]
                hits[agent].append((slot, float(parts.memory_reward)))
        return hits

    def _candidates(self, group: str, agent: int, members: list) -> Candidates:
        """One agent's candidates [n] as NumPy arrays; identical prompts are embedded once."""
        cfg, n = self.cfg, len(members)
        prompts = [self._prompt_ids(node) for node, _ in members]
        unique = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        keys = (self._embed(group, agent, list(unique)) if n else
                np.zeros((0, self.models[group].model.hidden_size), np.float32))
        rewards = np.array([s.memory_reward for _, s in members], np.float32).reshape(n)
        response, length = _right_pad([s.output_ids for _, s in members], n, cfg.response_length)
        request, request_length = _right_pad(
            [self.tokenizer.encode(node.query) for node, _ in members], n, cfg.request_length)
        return Candidates(key=keys[[unique[p] for p in prompts]],
                          response=response, length=length, request=request,
                          request_length=np.minimum(request_length, cfg.request_length),
                          **_finite_rewards(rewards))

    def agent_tables(self) -> dict[str, MemoryTable]:
        """agent -> its own table (sliced from its group's stack)."""
        return {a: _pick(self.tables[g], i) for a, (g, i) in self.agent_slots.items()}


def from_experiment(exp, state) -> MemoryHook:
    """The hook of a training run: `exp.parts.memory` settings, the agent groups' reference
    params of `state` (set them before GRPO), and the run's system, tokenizer and agent slots."""
    return MemoryHook(exp.system, exp.tokenizer, group_models(state), exp.slots, exp.parts.memory)


def group_models(state) -> dict[str, GroupModel]:
    """Each agent group's model config and frozen reference params (the embedder)."""
    return {g: GroupModel(group.model, group.ref_params) for g, group in state.groups.items()}


def _hit_records(hits: Sequence[tuple[int, float]]) -> HitRecords:
    """A non-finite reward is no evidence against an entry: that hit is left out."""
    reward = np.array([r for _, r in hits], np.float32).reshape(-1)
    return HitRecords(slot=np.array([s for s, _ in hits], np.int32).reshape(-1),
                      **_finite_rewards(reward))


def _finite_rewards(reward: np.ndarray) -> dict[str, np.ndarray]:
    """reward [n] -> {reward, valid}: non-finite rewards zeroed and marked invalid."""
    valid = np.isfinite(reward)
    return {"reward": np.where(valid, reward, 0.0).astype(np.float32), "valid": valid}


def _stack(items: Sequence[Any]) -> Any:
    """Per-agent NumPy pytrees with leading [n_a] -> one [A, bucket(max n_a), ...] (zero padded,
    so padding rows are invalid)."""
    n = _bucket(max(len(item.valid) for item in items))
    pad = lambda x: np.pad(x, [(0, n - len(x))] + [(0, 0)] * (x.ndim - 1))
    return jax.tree.map(lambda *xs: np.stack([pad(x) for x in xs]), *items)


# ----------------------------------------------------------------------------------------------
# Inspection.
# ----------------------------------------------------------------------------------------------

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
