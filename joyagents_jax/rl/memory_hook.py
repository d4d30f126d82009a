"""The memory in a run: read-only lookups during rollouts, and one update per GRPO step.

`MemoryView(ctx, tables, models)` is the rollout's `Memory`: each wave it embeds the pending
nodes' prompts with the agent's frozen reference policy and decides reuse, hint or nothing; it
never writes, so training rollouts and evaluation read the same tables the same way.
`update(ctx, tables, models, result, step)` turns a GRPO step's rollout into candidates and hit
records and returns the new tables (the old ones are donated) with the step's memory metrics.
The tables themselves are `RunState.memory`: {group: stacked [A, ...] `MemoryTable`}.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from joyagents_jax import distributed
from joyagents_jax.agents import protocol
from joyagents_jax.agents.system import AgentSystem, Request
from joyagents_jax.models import lora, qwen2
from joyagents_jax.rl import memory as mem
from joyagents_jax.rl import rollout


class Context(NamedTuple):
    """What the memory needs of a run besides its tables: settings, prompts, agent slots."""

    system: AgentSystem
    tokenizer: Any
    slots: Mapping[str, tuple[str, int]]  # agent -> (group, index in the group's stacked axis)
    cfg: mem.MemoryConfig


class GroupModel(NamedTuple):
    """An agent group's frozen reference policy, which embeds its agents' keys."""

    model: qwen2.Qwen2Config
    ref_params: qwen2.Params | lora.LoRAParams  # stacked [A, ...] (LoRA: the adapters)


def group_models(train_state) -> dict[str, GroupModel]:
    """Each agent group's model config and frozen reference params (the embedder)."""
    return {g: GroupModel(group.model, group.references)
            for g, group in train_state.groups.items()}


def init_tables(cfg: mem.MemoryConfig, models: Mapping[str, GroupModel]
                ) -> dict[str, mem.MemoryTable]:
    """Empty stacked tables for every agent group."""
    return {g: mem.init_tables(cfg, m.model.hidden_size, lora.num_agents(m.ref_params))
            for g, m in models.items()}


# ----------------------------------------------------------------------------------------------
# Lookup.
# ----------------------------------------------------------------------------------------------

class MemoryView:
    """The rollout's read-only `Memory` over a run's tables.

    Tables and embedder are fixed for the view's life (one rollout with its refills, or one
    evaluation), so a prompt's best match is too: each wave searches only the prompts no
    earlier wave of this view asked about, each once (the G branches of a node group mostly
    ask the same), with one device call and one host transfer per agent and chunk.
    """

    def __init__(self, ctx: Context, tables: Mapping[str, mem.MemoryTable],
                 models: Mapping[str, GroupModel], agents: Sequence[str] = ()):
        self.ctx, self.tables, self.models = ctx, tables, models
        self._entries = {g: np.array(distributed.to_host(t.valid.sum(-1)))
                         for g, t in tables.items()}
        for name in set(ctx.slots) - set(agents or ctx.slots):  # agents: only theirs is read
            group, index = ctx.slots[name]
            self._entries[group][index] = 0
        self._found: dict[tuple[str, int, tuple[int, ...]], tuple[float, int, Any] | None] = {}

    def lookup(self, requests: Sequence[Request]) -> list[rollout.Reuse | protocol.Hint | None]:
        asked = [(*self.ctx.slots[r.agent], _prompt_ids(self.ctx, r)) for r in requests]
        new = collections.defaultdict(list)
        for group, agent, prompt in dict.fromkeys(asked):
            if (group, agent, prompt) in self._found:
                continue
            if self._entries[group][agent]:
                new[group, agent].append(prompt)
            else:
                self._found[group, agent, prompt] = None
        for (group, agent), prompts in new.items():
            sim, slot, rows = _search(self.ctx, self.models[group], self.tables[group], agent,
                                      prompts)
            for k, prompt in enumerate(prompts):
                self._found[group, agent, prompt] = (float(sim[k]), int(slot[k]), _pick(rows, k))
        return [None if self._found[a] is None else self._decide(*self._found[a]) for a in asked]

    def _decide(self, sim: float, slot: int, row: mem.MemoryTable
                ) -> rollout.Reuse | protocol.Hint | None:
        cfg, decode = self.ctx.cfg, self.ctx.tokenizer.decode
        response = row.response[:row.length]
        if cfg.reuse and sim >= cfg.tau_reuse and row.reward >= cfg.reuse_min_reward:
            gen = rollout.Generation(decode(response), response,
                                     np.zeros(len(response), np.float32), False)
            return rollout.Reuse(gen, slot)
        if cfg.hints and sim >= cfg.tau_hint:  # a close match that may not be reused verbatim
            return protocol.Hint(decode(row.request[:row.request_length]), decode(response))
        return None


def _pick(tree: Any, index: jax.Array | int) -> Any:
    return jax.tree.map(lambda x: x[index], tree)


@functools.partial(jax.jit, static_argnums=0)
def _embed_agent(model_cfg, params, agent, tokens, mask):
    return mem.embed(model_cfg, lora.pick(params, agent), tokens, mask)


@functools.partial(jax.jit, static_argnums=0)
def _search_agent(model_cfg, params, tables: mem.MemoryTable, agent, tokens, mask):
    """Prompts [B, T] -> best (similarity [B], slot [B]) in one agent's table, with the rows at
    those slots (keys left out): embedding and search in one device call."""
    table = _pick(tables, agent)
    sim, slot = mem.lookup(table, mem.embed(model_cfg, lora.pick(params, agent), tokens, mask))
    return sim, slot, _pick(table.replace(key=None), slot)


def _search(ctx: Context, model: GroupModel, tables: mem.MemoryTable, agent: int,
            prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, mem.MemoryTable]:
    """Token rows -> (similarity, slot, row) per row, on the host."""
    return _chunked(ctx, prompts, functools.partial(
        _search_agent, model.model, model.ref_params, tables, agent))


def _prompt_ids(ctx: Context, request) -> tuple[int, ...]:
    """The node's prompt without a hint (a `Request` or a `Node`): what keys embed."""
    spec = ctx.system.specs[request.agent]
    return tuple(ctx.tokenizer.encode(
        protocol.render_prompt(ctx.tokenizer, spec, request.query, request.turns)))


def _embed(ctx: Context, model: GroupModel, agent: int, rows: Sequence[Sequence[int]]
           ) -> np.ndarray:
    """Token rows -> unit keys [len(rows), d] with the agent's reference policy."""
    return _chunked(ctx, rows, functools.partial(
        _embed_agent, model.model, model.ref_params, agent))


def _chunked(ctx: Context, rows: Sequence[Sequence[int]], fn) -> Any:
    """fn(tokens, mask) over token rows in left-padded chunks of `embed_batch` rows, one device
    call and one host transfer each -> its outputs for the rows, concatenated [len(rows), ...].
    Every chunk has `embed_batch` rows: a few prompt-length shapes compile, not one per count."""
    size, out = ctx.cfg.embed_batch, []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        found = distributed.to_host(fn(*_left_pad(chunk, ctx.tokenizer.pad_id, size)))
        out.append(jax.tree.map(lambda x: x[:len(chunk)], found))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *out)


def _bucket(n: int) -> int:
    """The next power of two >= n: padded shapes keep the number of compilations small."""
    return 1 << max(n - 1, 0).bit_length()


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int, b: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """At most b token rows -> tokens, mask [b, bucket(T)], left padded."""
    t = _bucket(max(len(r) for r in rows))
    tokens, mask = np.full((b, t), pad_id, np.int32), np.zeros((b, t), bool)
    for i, row in enumerate(rows):
        tokens[i, t - len(row):], mask[i, t - len(row):] = row, True
    return tokens, mask


# ----------------------------------------------------------------------------------------------
# Update.
# ----------------------------------------------------------------------------------------------

def update(ctx: Context, tables: Mapping[str, mem.MemoryTable],
           models: Mapping[str, GroupModel], result: rollout.RolloutResult, step: int
           ) -> tuple[dict[str, mem.MemoryTable], dict[str, float]]:
    """The step's new tables (the old ones are donated) and memory metrics.

    Candidates are the rollout's LLM-generated samples (not the memory's own outputs or gold
    ones in node groups, `Sample.from_memory`, `Sample.from_gold`), hit records its reuses.
    Thresholds come from the R_A + R_F of those samples, every agent together; a rollout without
    them (all answered from memory) only counts its reuses. Rates count this rollout's lookups.
    """
    tables, totals = dict(tables), collections.Counter()
    generated = _generated(result)
    rewards = np.array([s.memory_reward for s in generated] or [0.0], np.float32)
    th = mem.thresholds(rewards, np.full(len(rewards), bool(generated)),
                        ctx.cfg)  # no samples: inactive, nothing is written or deleted
    members, hits = _members(ctx, result), _hits(ctx, result)
    for group, stacked in tables.items():
        agents = range(stacked.valid.shape[0])
        if not any(members[group, a] or hits[group, a] for a in agents):
            continue
        cands = _stack([_candidates(ctx, models[group], a, members[group, a]) for a in agents])
        records = _stack([_hit_records(hits[group, a]) for a in agents])
        tables[group], metrics = mem.update_stacked(
            stacked, cands, records, th, jnp.asarray(step, jnp.int32), ctx.cfg)
        totals.update({k: int(v.sum()) for k, v in distributed.to_host(metrics).items()
                       if k != "entries"})
    c = result.counters
    lookups = max(c.memory_lookups, 1)
    entries = sum(int(distributed.to_host(t.valid.sum())) for t in tables.values())
    return tables, {"entries": entries, "inserts": 0,
                    "replacements": 0, "evictions": 0, "deletions": 0, **totals,
                    "hit_rate": c.memory_hits / lookups, "hint_rate": c.memory_hints / lookups,
                    "llm_calls_saved": c.memory_hits}


def _generated(result: rollout.RolloutResult) -> list[rollout.Sample]:
    """The node-group members the policies generated: neither the memory's nor gold outputs
    (nor `suffix_credit`'s later nodes, which are not node-group members)."""
    return [s for s in result.samples if not (s.from_memory or s.from_gold or s.suffix)]


def _members(ctx: Context, result: rollout.RolloutResult) -> dict[tuple[str, int], list]:
    """(group, agent index) -> [(node, sample)]; samples are LLM-generated nodes only.

    A sample's node is found through its prompt tokens in the returned traces (equal prompts
    mean equal agent, query and turns): it renders the hint-free prompt to embed and holds the
    query for hints. Samples off the returned traces (full_tree's inner branches; full_tree
    never consults the memory) are skipped.
    """
    nodes = {}
    for trace in result.episodes:
        for node_input, node in zip(trace.inputs, trace.episode.nodes):
            nodes.setdefault(tuple(node_input.prompt_ids), node)
    members = collections.defaultdict(list)
    for sample in _generated(result):
        node = nodes.get(tuple(sample.prompt_ids))
        if node is not None:
            members[ctx.slots[sample.agent]].append((node, sample))
    return members


def _hits(ctx: Context, result: rollout.RolloutResult) -> dict[tuple[str, int], list]:
    """(group, agent index) -> [(slot, R_A + R_F of the episode that reused it)]."""
    hits = collections.defaultdict(list)
    for trace, parts in zip(result.episodes, result.rewards):
        for k, slot in trace.memory_slots.items():
            agent = ctx.slots[trace.episode.nodes[k].agent]
            hits[agent].append((slot, float(parts.memory_reward)))
    return hits


def _candidates(ctx: Context, model: GroupModel, agent: int, members: list) -> mem.Candidates:
    """One agent's candidates [n] as NumPy arrays; identical prompts are embedded once."""
    cfg, n = ctx.cfg, len(members)
    prompts = [_prompt_ids(ctx, node) for node, _ in members]
    unique = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    keys = (_embed(ctx, model, agent, list(unique)) if n else
            np.zeros((0, model.model.hidden_size), np.float32))
    rewards = np.array([s.memory_reward for _, s in members], np.float32).reshape(n)
    response, length = _right_pad([s.output_ids for _, s in members], n, cfg.response_length)
    request, request_length = _right_pad(
        [ctx.tokenizer.encode(node.query) for node, _ in members], n, cfg.request_length)
    prompt, prompt_length = _right_pad(prompts, n, cfg.prompt_length)
    return mem.Candidates(key=keys[[unique[p] for p in prompts]],
                          response=response, length=length, request=request,
                          request_length=np.minimum(request_length, cfg.request_length),
                          prompt=prompt, prompt_length=prompt_length, **_finite_rewards(rewards))


def _right_pad(rows: Sequence[Sequence[int]], n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows -> their first `width` tokens [n, width] and their full lengths [n]."""
    out, lengths = np.zeros((n, width), np.int32), np.zeros(n, np.int32)
    for i, row in enumerate(rows):
        out[i, :min(len(row), width)], lengths[i] = row[:width], len(row)
    return out, lengths


def _hit_records(hits: Sequence[tuple[int, float]]) -> mem.HitRecords:
    """A non-finite reward is no evidence against an entry: that hit is left out."""
    reward = np.array([r for _, r in hits], np.float32).reshape(-1)
    return mem.HitRecords(slot=np.array([s for s, _ in hits], np.int32).reshape(-1),
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
