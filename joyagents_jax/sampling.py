"""Jitted generation: one prefill per prompt, then a KV-cache decode loop over G samples each.

`generate_arrays` is the pure, jitted core: prefill the [B, P] prompts once, then decode all
B*G rows in `lax.while_loop`s that exit as soon as every row has stopped, the G samples of a
prompt reading its one prompt cache. It returns the chosen tokens with their log-probs under
the sampling distribution (temperature, top-k, top-p) and under the raw policy (what GRPO
needs).

`Sampler` is the host wrapper: it left-pads prompts into power-of-two buckets (bounded
recompiles, counted in `Sampler.compiles`), validates input, applies stop strings that token
matching cannot see, and picks or vmaps (or maps, in passes) agents of a stacked agent group.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from joyagents_jax import distributed, sharding
from joyagents_jax import train_state as ts
from joyagents_jax.models import lora, qwen2
from joyagents_jax.models.qwen2 import Params, Qwen2Config

NO_TOKEN = -1  # padding in stop tables; never a real token id
BLOCK = 16  # decode steps between appends to the generated tokens' cache
PHASES = 4  # sizes of the generated tokens' cache that decoding grows through


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn. Frozen: a static argument of the jitted core."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    greedy: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got "
                             f"{self.temperature}.")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={self.top_k}, "
                             f"top_p={self.top_p}.")


class Samples(NamedTuple):
    """Per prompt b and sample g; positions past `lengths` hold `pad_id` and log-prob 0."""

    tokens: jax.Array  # [B, G, N] int32
    lengths: jax.Array  # [B, G] int32, generated tokens including the stop token
    logp_sample: jax.Array  # [B, G, N] f32, under the sampling distribution
    logp_policy: jax.Array  # [B, G, N] f32, under the raw policy (temperature 1, no filter)
    stopped: jax.Array  # [B, G] bool, ended by a stop token or stop sequence


# ----------------------------------------------------------------------------------------------
# Token choice.
# ----------------------------------------------------------------------------------------------

def filter_logits(logits: jax.Array, scfg: SamplingConfig) -> jax.Array:
    """logits [R, V] -> the sampling distribution's logits: temperature, then top-k, then top-p."""
    x = logits / scfg.temperature
    neg = jnp.finfo(x.dtype).min
    if scfg.top_k:
        kth = jax.lax.top_k(x, scfg.top_k)[0][:, -1:]
        x = jnp.where(x < kth, neg, x)
    if scfg.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # keep a token while the mass before it < p
        cutoff = jnp.min(jnp.where(mass_before < scfg.top_p, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, neg, x)
    return x


def choose_tokens(logits: jax.Array, key: jax.Array, scfg: SamplingConfig):
    """logits [R, V] f32 -> (tokens [R], logp_sample [R], logp_policy [R])."""
    policy = jax.nn.log_softmax(logits, axis=-1)
    if scfg.greedy:
        tokens = jnp.argmax(logits, axis=-1)
        logp_sample = jnp.zeros(tokens.shape, jnp.float32)  # a point mass
    else:
        filtered = jax.nn.log_softmax(filter_logits(logits, scfg), axis=-1)
        tokens = draw(key, filtered)
        logp_sample = jnp.take_along_axis(filtered, tokens[:, None], axis=-1)[:, 0]
    logp_policy = jnp.take_along_axis(policy, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), logp_sample, logp_policy


def draw(key: jax.Array, logp: jax.Array) -> jax.Array:
    """One token per row of log-probs [R, V] by inverting the CDF with one uniform per row:
    R random numbers instead of the R x V of Gumbel-max (`jax.random.categorical`), whose
    bits were a fifth of a small model's decode step on CPU. u is in (0, 1], so the first
    index whose CDF reaches u * total always has positive mass."""
    cdf = jnp.cumsum(jnp.exp(logp), axis=-1)
    u = 1.0 - jax.random.uniform(key, (logp.shape[0], 1), jnp.float32)
    index = jnp.sum(cdf < u * cdf[:, -1:], axis=-1)
    return jnp.minimum(index, logp.shape[-1] - 1)


def _ends_with(history: jax.Array, seqs: jax.Array) -> jax.Array:
    """history [R, W] (latest last), seqs [R, M, W] right-aligned, NO_TOKEN-padded -> [R] bool."""
    care = seqs != NO_TOKEN
    match = jnp.all((history[:, None, :] == seqs) | ~care, axis=-1) & jnp.any(care, axis=-1)
    return jnp.any(match, axis=-1)


# ----------------------------------------------------------------------------------------------
# The jitted core.
# ----------------------------------------------------------------------------------------------

def generate_arrays(cfg: Qwen2Config, scfg: SamplingConfig, group_size: int, params: Params,
                    tokens: jax.Array, mask: jax.Array, stop_ids: jax.Array, stop_seqs: jax.Array,
                    key: jax.Array, pad_id: int = 0, vocab_limit: int | None = None,
                    block: int = BLOCK, phases: int = PHASES) -> Samples:
    """Pure generation for left-padded prompts.

    tokens/mask [B, P]; stop_ids [B, S] and stop_seqs [B, M, W] (NO_TOKEN padded, stop_seqs
    right-aligned) end a row when its newest token is in stop_ids or its newest tokens spell
    one of stop_seqs. Ids >= vocab_limit (embedding rows the tokenizer does not use, e.g.
    Qwen2.5's 151936-row embedding over 151665 tokens) are never drawn. Returns `Samples` with
    N = scfg.max_new_tokens.

    Decoding copies no cache (XLA copies a buffer that a step reads and then writes): the B*G
    rows read the prompts' cache (one per prompt, shared by its G samples) and the cache of the
    tokens generated before the current block of `block` steps, both read-only inside the
    block; each step writes its keys and values into the block's small buffer before reading
    it (`qwen2.hidden_states`), and the buffer is appended to the generated cache when the block
    ends. That cache grows through `phases` sizes, one decode loop each, so early steps do not
    read the slots of tokens still to come. Layers are unrolled with per-layer weights and
    caches, so no step slices a stacked buffer; RoPE angles are tabled once for all positions.
    """
    b, p = tokens.shape
    g, n = group_size, scfg.max_new_tokens
    rows, width = b * g, min(block, n)
    window = stop_seqs.shape[-1]
    dcfg = cfg.replace(scan_layers=False)
    layers = qwen2.unstack_layers(cfg, params)

    # Prefill once per prompt; only the last position's logits are needed.
    positions = qwen2.positions_from_mask(mask)
    hidden, k, v = qwen2.run_layers(cfg, params, tokens, positions, mask)
    prompt = qwen2.KVCache(k=qwen2.per_layer(k, cfg), v=qwen2.per_layer(v, cfg),
                           mask=mask.astype(bool), index=jnp.asarray(p, jnp.int32))
    logits = qwen2.unembed(cfg, params, hidden[:, -1])  # [B, V]
    limit = lambda x: x if vocab_limit is None else x.at[:, vocab_limit:].set(jnp.finfo(x.dtype).min)

    # Row r = prompt r // G, sample r % G.
    repeat = lambda x: jnp.repeat(x, g, axis=0)
    logits, stop_ids, stop_seqs = repeat(logits), repeat(stop_ids), repeat(stop_seqs)
    next_pos = repeat(positions[:, -1] + 1)
    table = qwen2.rope_tables(jnp.arange(p + n), cfg.head_dim, cfg.rope_theta)  # [P + N, Hd / 2]
    cache_dtype = prompt.k[0].dtype
    blocks = -(-n // width)
    ends = sorted({-(-blocks * (i + 1) // phases) * width for i in range(phases)})

    def running(step, done):
        return (step < n) & ~jnp.all(done)

    def decode(state, generated):
        step, out, lp_s, lp_p, history, done, lengths, blk, logits, pos, key = state
        key, sub = jax.random.split(key)
        tok, ls, lpol = choose_tokens(limit(logits), sub, scfg)
        live = ~done
        tok = jnp.where(live, tok, pad_id)
        out = out.at[:, step].set(tok)
        lp_s = lp_s.at[:, step].set(jnp.where(live, ls, 0.0))
        lp_p = lp_p.at[:, step].set(jnp.where(live, lpol, 0.0))
        history = jnp.concatenate([history[:, 1:], tok[:, None]], axis=1)
        hit = live & (jnp.any(tok[:, None] == stop_ids, axis=-1) | _ends_with(history, stop_seqs))
        lengths = jnp.where(hit, step + 1, lengths)
        hidden, blk = qwen2.hidden_states(dcfg, layers, tok[:, None], pos[:, None], live[:, None],
                                          blk, (prompt, generated), [t[pos][:, None] for t in table])
        logits = qwen2.unembed(cfg, params, hidden[:, 0])
        return step + 1, out, lp_s, lp_p, history, done | hit, lengths, blk, logits, pos + 1, key

    def decode_block(state):
        generated, rest = state[0], state[1:]
        inner = (*rest[:7], qwen2.init_cache(dcfg, rows, width, cache_dtype), *rest[7:])
        inner = jax.lax.while_loop(lambda s: running(s[0], s[5]) & (s[7].index < width),
                                   lambda s: decode(s, generated), inner)
        blk = inner[7]
        generated = qwen2.append(generated, blk.k, blk.v, blk.mask)
        return (generated, *inner[:7], *inner[8:])

    zeros = jnp.zeros((rows, n), jnp.float32)
    state = (qwen2.init_cache(dcfg, rows, ends[0], cache_dtype), jnp.zeros((), jnp.int32),
             jnp.full((rows, n), pad_id, jnp.int32), zeros, zeros,
             jnp.full((rows, window), NO_TOKEN, jnp.int32), jnp.zeros((rows,), bool),
             jnp.full((rows,), n, jnp.int32), logits, next_pos, key)
    for end in ends:  # each phase attends to a generated cache of `end` slots
        state = (qwen2.grow(state[0], end), *state[1:])
        state = jax.lax.while_loop(lambda s: running(s[1], s[6]) & (s[0].index < end),
                                   decode_block, state)
    _, _, out, lp_s, lp_p, _, done, lengths, _, _, _ = state

    shape = lambda x: x.reshape((b, g) + x.shape[1:])
    return Samples(tokens=shape(out), lengths=shape(lengths), logp_sample=shape(lp_s),
                   logp_policy=shape(lp_p), stopped=shape(done))


# ----------------------------------------------------------------------------------------------
# Host wrapper: buckets, validation, stop strings, agents.
# ----------------------------------------------------------------------------------------------

def bucket(n: int, minimum: int = 1) -> int:
    """The power of two >= max(n, minimum): bounds the number of compiled shapes."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


class Sampler:
    """Generates for one agent's params or for every agent of a stacked group.

    Holds only static settings and compiled functions; params and PRNG keys are passed per call.
    `compiles` counts traces of the jitted core (one per new bucket shape or sampling config).
    """

    def __init__(self, cfg: Qwen2Config, *, pad_id: int, tokenizer=None,
                 max_cache_length: int | None = None, min_prompt_bucket: int = 16,
                 min_batch_bucket: int = 1, mesh: jax.sharding.Mesh | None = None,
                 decode_block: int = BLOCK, decode_phases: int = PHASES,
                 agents_per_pass: int | None = None):
        """tokenizer: needed for stop strings; its vocab_size also bounds the drawn ids.
        mesh: prompts are split over its data-parallel axes and the samples come back
        replicated, so every process reads them all (params keep their own shardings).
        decode_block: decode steps between appends to the generated cache (`generate_arrays`).
        decode_phases: sizes the generated cache grows through (`generate_arrays`): more
        phases read fewer empty slots but compile one more decode loop each, and each growth
        copies the cache into a larger buffer (both briefly live).
        agents_per_pass: agents of a stacked group decoded in one vmapped pass by
        `generate_per_agent`, the passes one after another (None: all agents at once)."""
        self.cfg, self.pad_id, self.tokenizer = cfg, pad_id, tokenizer
        for name, value in (("decode_block", decode_block), ("decode_phases", decode_phases)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Sampler {name} must be an integer >= 1, got {value!r}.")
        self.decode_block, self.decode_phases = decode_block, decode_phases
        self.max_cache_length = max_cache_length or cfg.max_position_embeddings
        self.mesh, self.data_parallel = mesh, 1
        if mesh is not None:
            self.data_parallel = sharding.data_parallel_size(dict(mesh.shape))
        self.min_prompt_bucket, self.min_batch_bucket = min_prompt_bucket, min_batch_bucket
        vocab_limit = getattr(tokenizer, "vocab_size", None)
        if vocab_limit is not None and vocab_limit > cfg.vocab_size:
            raise ValueError(f"Tokenizer has {vocab_limit} tokens but the model only "
                             f"{cfg.vocab_size}: the tokenizer does not belong to this model.")
        vocab_limit = None if vocab_limit == cfg.vocab_size else vocab_limit
        self.compiles = 0
        self.prefill_shapes: list[tuple[int, int]] = []  # [B, P] of each traced prefill

        def core(scfg, group_size, params, tokens, mask, stop_ids, stop_seqs, key):
            self.compiles += 1
            self.prefill_shapes.append(tuple(tokens.shape[-2:]))
            return generate_arrays(cfg, scfg, group_size, params, tokens, mask, stop_ids,
                                   stop_seqs, key, pad_id, vocab_limit, decode_block,
                                   decode_phases)

        out = {} if mesh is None else {"out_shardings": NamedSharding(mesh, P())}
        self._one = jax.jit(core, static_argnums=(0, 1), **out)
        def per_agent(scfg, group_size, params, *args):  # only LoRA adapters carry the axis
            return ts.over_agents(lambda *a: core(scfg, group_size, *a), agents_per_pass,
                                  params, *args)

        self._per_agent = jax.jit(per_agent, static_argnums=(0, 1), **out)

    def generate(self, params: Params, prompts: Sequence[Sequence[int]], *, key: jax.Array,
                 scfg: SamplingConfig, group_size: int = 1, stop_ids=(), stop_strings=(),
                 agent: int | None = None) -> Samples:
        """G samples for each prompt (token id lists); `agent` picks one agent of a stacked group.

        stop_ids / stop_strings: shared by all prompts, or one list per prompt. Stop strings
        need a tokenizer. Returns numpy `Samples` of the B real prompts.
        """
        if agent is not None:
            params = lora.pick(params, agent)
        arrays = self._prepare([prompts], scfg, group_size, stop_ids, stop_strings)
        out = self._one(scfg, group_size, params, *self._place([a[0] for a in arrays]), key)
        return self._finish(out, self._per_prompt(stop_strings, [prompts])[0])

    def generate_per_agent(self, params: Params, prompts: Sequence[Sequence[Sequence[int]]], *,
                           key: jax.Array, scfg: SamplingConfig, group_size: int = 1,
                           stop_ids=(), stop_strings=()) -> list[Samples]:
        """Each agent a of a stacked group [A, ...] samples for its own prompt list prompts[a].

        All agents run in one call (vmap over the agent axis). stop_ids / stop_strings: shared,
        or per agent a list with one entry per prompt.
        """
        num_agents = lora.num_agents(params)
        if len(prompts) != num_agents:
            raise ValueError(f"generate_per_agent got {len(prompts)} prompt lists for "
                             f"{num_agents} stacked agents; pass one list per agent.")
        arrays = self._prepare(prompts, scfg, group_size, stop_ids, stop_strings)
        keys = jax.random.split(key, num_agents)
        out = self._per_agent(scfg, group_size, params, *self._place(arrays, stacked=True),
                              keys)
        strings = self._per_prompt(stop_strings, prompts)
        out = distributed.to_host(out)  # sliced on the host: no compile per output shape
        return [self._finish(jax.tree.map(lambda x: x[a], out), strings[a])
                for a in range(num_agents)]

    # -- input -----------------------------------------------------------------------------------

    def _prepare(self, prompt_lists, scfg, group_size, stop_ids, stop_strings):
        """Validated, bucketed numpy arrays with a leading list axis: tokens, mask, stops."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}.")
        lengths = []
        for prompts in prompt_lists:
            if len(prompts) == 0:
                raise ValueError("No prompts given: pass at least one token list.")
            for i, p in enumerate(prompts):
                if len(p) == 0:
                    raise ValueError(f"Prompt {i} is empty: every prompt needs at least one "
                                     f"token (e.g. a BOS or chat-template header).")
                self._check_ids(p, f"prompt {i}")
                lengths.append(len(p))
        p_len = bucket(max(lengths), self.min_prompt_bucket)
        if max(lengths) + scfg.max_new_tokens > self.max_cache_length:
            raise ValueError(f"Prompt of {max(lengths)} tokens + max_new_tokens "
                             f"{scfg.max_new_tokens} exceeds the cache length "
                             f"{self.max_cache_length}; shorten the prompt or lower max_new_tokens.")
        p_len = min(p_len, self.max_cache_length - scfg.max_new_tokens)
        b = bucket(max(len(p) for p in prompt_lists), self.min_batch_bucket)
        b = -(-b // self.data_parallel) * self.data_parallel  # splits over the mesh

        stop_rows = self._stop_ids(stop_ids, prompt_lists)
        strings = self._per_prompt(stop_strings, prompt_lists)
        seqs = {s: self._encode_stop(s) for rows in strings for row in rows for s in row}
        # Stop tables are bucketed too (min 4 strings of 8 tokens, 4 ids): roles with different
        # stop lists then share one compiled shape.
        max_m = bucket(max([len(row) for rows in strings for row in rows] + [1]), 4)
        max_w = bucket(max([len(t) for t in seqs.values()] + [1]), 8)
        n_lists = len(prompt_lists)
        tokens = np.full((n_lists, b, p_len), self.pad_id, np.int32)
        mask = np.zeros((n_lists, b, p_len), bool)
        width = bucket(max([len(r) for rows in stop_rows for r in rows] + [1]), 4)
        stops = np.full((n_lists, b, width), NO_TOKEN, np.int32)
        for a, prompts in enumerate(prompt_lists):
            mask[a, :, -1] = True  # padding rows hold one pad token: finite, then discarded
            for i, p in enumerate(prompts):
                tokens[a, i, p_len - len(p):] = p
                mask[a, i, p_len - len(p):] = True
                stops[a, i, :len(stop_rows[a][i])] = stop_rows[a][i]
        stop_seqs = np.full((n_lists, b, max_m, max_w), NO_TOKEN, np.int32)
        for a, rows in enumerate(strings):
            for i, row in enumerate(rows):  # right-aligned token sequences
                for m, s in enumerate(row):
                    stop_seqs[a, i, m, max_w - len(seqs[s]):] = seqs[s]
        return tokens, mask, stops, stop_seqs

    def _place(self, arrays, stacked: bool = False):
        """Host arrays [(A,) B, ...] split over the data-parallel axes (as is without a mesh)."""
        if self.mesh is None:
            return arrays
        return jax.device_put(arrays, sharding.batch_sharding(self.mesh, stacked))

    def _check_ids(self, ids, what):
        bad = [t for t in ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{what} has token ids outside [0, {self.cfg.vocab_size}): "
                             f"{bad[:5]}; is the tokenizer the model's?")

    @staticmethod
    def _per_prompt(value, prompt_lists) -> list[list[tuple]]:
        """Shared items, or one list per prompt (per prompt list) -> [list][prompt] tuples."""
        per_prompt = len(value) > 0 and all(isinstance(v, (list, tuple)) for v in value)
        if not per_prompt:
            return [[tuple(value)] * len(prompts) for prompts in prompt_lists]
        if len(prompt_lists) > 1:  # generate_per_agent: one entry per agent
            return [[tuple(r) for r in v] for v in value]
        if len(value) != len(prompt_lists[0]):
            raise ValueError(f"Per-prompt stop lists: {len(value)} lists for "
                             f"{len(prompt_lists[0])} prompts.")
        return [[tuple(r) for r in value]]

    def _stop_ids(self, stop_ids, prompt_lists):
        """Per list, per prompt: a tuple of stop ids (shared ids are repeated)."""
        rows = self._per_prompt(stop_ids, prompt_lists)
        for r in (r for lists in rows for r in lists):
            bad = [t for t in r if not 0 <= int(t) < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"Unknown stop token id(s) {bad}: the vocabulary has ids "
                                 f"0..{self.cfg.vocab_size - 1}.")
        return rows

    def _encode_stop(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass Sampler(..., tokenizer=...).")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError(f"Stop string {text!r} encodes to no tokens.")
        return ids

    # -- output ----------------------------------------------------------------------------------

    def _finish(self, out: Samples, stop_strings: list[tuple[str, ...]]) -> Samples:
        """Drops padding rows; cuts at stop strings that the token tail did not spell exactly."""
        out = Samples(*(np.array(x[:len(stop_strings)]) for x in distributed.to_host(out)))
        for b, g in np.ndindex(out.lengths.shape):
            if stop_strings[b]:
                self._cut_at_stop_string(out, b, g, stop_strings[b])
        return out

    def _cut_at_stop_string(self, out: Samples, b: int, g: int, stop_strings) -> None:
        n = int(out.lengths[b, g])
        ids = out.tokens[b, g, :n].tolist()
        spelled = lambda k: any(s in self.tokenizer.decode(ids[:k]) for s in stop_strings)
        if not spelled(n):
            return
        # The fewest tokens that spell a stop string, by bisection (log n decodes, not n): a
        # prefix's text is the longer text's prefix, so spelling one is monotone in k.
        lo, k = 0, n
        while k - lo > 1:
            mid = (lo + k) // 2
            lo, k = (lo, mid) if spelled(mid) else (mid, k)
        if k < n or not out.stopped[b, g]:
            out.tokens[b, g, k:] = self.pad_id
            out.logp_sample[b, g, k:] = 0.0
            out.logp_policy[b, g, k:] = 0.0
            out.lengths[b, g] = k
            out.stopped[b, g] = True
