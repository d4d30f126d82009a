"""Qwen2 / Qwen2.5 decoder as pure functions over a params pytree.

Params are a nested dict of arrays (no module objects), so `jit`, `vmap` over a stacked agent axis
and sharding rules see plain pytrees. The decoder layers are stacked on a leading layer axis and
run with `lax.scan`, so compile time does not grow with depth; `cfg.remat` rematerializes each
layer in the backward pass.

Layout (HF's [out, in] linear weights become [in, out] kernels; attention kernels keep the head
axis so tensor-parallel rules can split heads):

    embed                      [V, D]
    layers/input_norm/scale    [L, D]
    layers/attn/{q,k,v}/kernel [L, D, N|K, Hd]    layers/attn/{q,k,v}/bias [L, N|K, Hd]
    layers/attn/o/kernel       [L, N, Hd, D]
    layers/post_attn_norm/scale[L, D]
    layers/mlp/{gate,up}/kernel[L, D, F]          layers/mlp/down/kernel   [L, F, D]
    final_norm/scale           [D]
    lm_head/kernel             [D, V]             (untied models only)

`params` may also be `lora.LoRAParams` (a frozen base and one agent's adapters): each targeted
projection then adds its low-rank path, without merging the adapter into the kernel.

Batches are left padded: `mask [B, T]` marks real tokens and `positions [B, T]` are per-row RoPE
positions (`positions_from_mask`). The optional KV cache is an explicit pytree argument; layers
read it without copying and the new keys/values are written once per call after the layer scan
(keys are stored slot-minor, [.., Hd, S], which made decode attention ~3x faster on CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from joyagents_jax.models import lora

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Architecture plus dtype policy. Frozen, so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; norms, softmax and logits are always f32
    remat: bool = False
    scan_layers: bool = True  # lax.scan over layers (compile time flat in depth) or unrolled

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"Qwen2Config.{name} must be >= 1, got {getattr(self, name)}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"Qwen2Config: hidden_size {self.hidden_size} is not divisible by "
                             f"num_heads {self.num_heads}; pick a head count that divides it.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Qwen2Config: num_heads {self.num_heads} is not divisible by "
                             f"num_kv_heads {self.num_kv_heads} (grouped-query attention).")
        if self.head_dim % 2:
            raise ValueError(f"Qwen2Config: head_dim {self.head_dim} must be even for RoPE.")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"Qwen2Config.{name} must be float32, bfloat16 or float16, "
                                 f"got {getattr(self, name)!r}.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **kw) -> "Qwen2Config":
        return dataclasses.replace(self, **kw)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for a fixed number of slots S.

    All rows write the same slot range (left-padded layout), so one scalar `index` says where the
    next tokens go; `mask` marks slots that hold real tokens.
    """

    # [L, B, K, S, Hd] and [L, B, K, Hd, S] (each attention product's contracted axis minor);
    # with unrolled layers, tuples of L per-layer buffers (see `init_cache`).
    k: Any
    v: Any
    mask: jax.Array  # [B, S] bool
    index: jax.Array  # [] int32, next slot to write

    @property
    def length(self) -> int:
        return self.mask.shape[1]


class Output(NamedTuple):
    logits: jax.Array  # [B, T, V] float32
    hidden: jax.Array  # [B, T, D] final-norm hidden states
    cache: KVCache | None


# ----------------------------------------------------------------------------------------------
# Parameters.
# ----------------------------------------------------------------------------------------------

def param_shapes(cfg: Qwen2Config) -> Params:
    """The params pytree as `jax.ShapeDtypeStruct`s (no allocation)."""
    d, f, n, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    L, dt = cfg.num_layers, jnp.dtype(cfg.param_dtype)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
    tree = {
        "embed": s(cfg.vocab_size, d),
        "layers": {
            "input_norm": {"scale": s(L, d)},
            "attn": {
                "q": {"kernel": s(L, d, n, hd), "bias": s(L, n, hd)},
                "k": {"kernel": s(L, d, k, hd), "bias": s(L, k, hd)},
                "v": {"kernel": s(L, d, k, hd), "bias": s(L, k, hd)},
                "o": {"kernel": s(L, n, hd, d)},
            },
            "post_attn_norm": {"scale": s(L, d)},
            "mlp": {"gate": {"kernel": s(L, d, f)}, "up": {"kernel": s(L, d, f)},
                    "down": {"kernel": s(L, f, d)}},
        },
        "final_norm": {"scale": s(d)},
    }
    if not cfg.tie_embeddings:
        tree["lm_head"] = {"kernel": s(d, cfg.vocab_size)}
    return tree


def count_params(cfg: Qwen2Config) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes(cfg)))


def init_params(cfg: Qwen2Config, key: jax.Array, std: float = 0.02) -> Params:
    """Random init as HF does: normal(std) weights, zero biases, unit norm scales."""
    shapes = param_shapes(cfg)
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(paths))

    def one(path, spec, k):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.ones(spec.shape, spec.dtype)
        if "bias" in name:
            return jnp.zeros(spec.shape, spec.dtype)
        return (std * jax.random.normal(k, spec.shape, jnp.float32)).astype(spec.dtype)

    return jax.tree.unflatten(treedef, [one(p, s, k) for (p, s), k in zip(paths, keys)])


def init_cache(cfg: Qwen2Config, batch: int, length: int, dtype: Any = None) -> KVCache:
    """An empty cache with `length` slots (prompt plus new tokens).

    Scanned layers read a stacked [L, ...] cache. Unrolled layers keep one buffer per layer,
    which a decode step's attention reads directly: XLA's CPU backend copies a layer's slice of
    a stacked cache before every read.
    """
    dtype = jnp.dtype(dtype or cfg.dtype)
    k = jnp.zeros((cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim), dtype)
    v = jnp.zeros((cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, length), dtype)
    per_layer = (lambda x: x) if cfg.scan_layers else tuple
    return KVCache(k=per_layer(k), v=per_layer(v), mask=jnp.zeros((batch, length), bool),
                   index=jnp.zeros((), jnp.int32))


def repeat_cache(cache: KVCache, g: int) -> KVCache:
    """Each batch row's cache repeated g times (row r -> rows r * g ... r * g + g - 1)."""
    rep = lambda x: jnp.repeat(x, g, axis=x.ndim - 4)  # the batch axis of [(L,) B, K, ., .]
    return KVCache(k=jax.tree.map(rep, cache.k), v=jax.tree.map(rep, cache.v),
                   mask=jnp.repeat(cache.mask, g, axis=0), index=cache.index)


# ----------------------------------------------------------------------------------------------
# Building blocks.
# ----------------------------------------------------------------------------------------------

def positions_from_mask(mask: jax.Array) -> jax.Array:
    """mask [B, T] -> positions [B, T]: real tokens count 0, 1, ... (left padding gets 0)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """w * x / sqrt(mean(x^2) + eps), computed in f32 (HF casts back before the scale)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> (cos, sin) [B, T, Hd / 2] in f32, one angle per rotated pair."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, Hd] rotated by (cos, sin) [B, T, Hd / 2]: the split-half rotation of HF.

    Computing each half directly (not rotate_half on a concatenated table) halves the
    transcendental work; on CPU it made a tiny model's train step ~1.5x faster.
    """
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    c, s = cos[:, :, None], sin[:, :, None]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention(q: jax.Array, segments: list[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """Grouped-query attention of q [B, T, N, Hd] over key/value segments -> [B, T, N, Hd].

    Each segment is (k [B, K, S, Hd], v [B, K, Hd, S], allowed [B, T, S]), the cache's layout;
    the softmax runs over all segments together. Decoding attends to the read-only cache and
    the new tokens as two segments, so appending needs no concatenation of the cache.
    """
    b, t, n, hd = q.shape
    kv_heads = segments[0][0].shape[1]
    q = q.reshape(b, t, kv_heads, n // kv_heads, hd)
    scores = []
    for k, _, allowed in segments:
        s = jnp.einsum("btkgh,bksh->bkgts", q, k, preferred_element_type=jnp.float32)
        scores.append(jnp.where(allowed[:, None, None], s * (hd ** -0.5), jnp.finfo(jnp.float32).min))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out, start = 0, 0
    for k, v, _ in segments:
        p = probs[..., start:start + k.shape[-2]].astype(v.dtype)
        out = out + jnp.einsum("bkgts,bkhs->btkgh", p, v)
        start += k.shape[-2]
    return out.reshape(b, t, n, hd)


def _dense(x: jax.Array, p: Params, spec: str, dtype) -> jax.Array:
    """x times the kernel (plus bias), plus the low-rank path when `p` carries a LoRA adapter."""
    y = jnp.einsum(spec, x, p["kernel"].astype(dtype))
    y = y + p["bias"].astype(dtype) if "bias" in p else y
    return y + lora.low_rank(x, p, spec, dtype) if "lora_a" in p else y


def decoder_layer(cfg: Qwen2Config, p: Params, x: jax.Array, rope, allowed: jax.Array,
                  past: tuple[jax.Array, jax.Array, jax.Array] | None = None):
    """One pre-norm block. x [B, T, D], allowed [B, T, T] among the new tokens.

    past: this layer's cache (k [B, K, S, Hd], v [B, K, Hd, S], allowed [B, T, S]) or None.
    Returns the new x and the new tokens' (k, v) in the cache layout for the caller to write.
    """
    dt = jnp.dtype(cfg.dtype)
    h = rms_norm(x, p["input_norm"]["scale"], cfg.rms_norm_eps)
    a = p["attn"]
    q = apply_rope(_dense(h, a["q"], "btd,dnh->btnh", dt), *rope)
    k = apply_rope(_dense(h, a["k"], "btd,dnh->btnh", dt), *rope)
    k = k.transpose(0, 2, 1, 3)  # [B, K, T, Hd]
    v = _dense(h, a["v"], "btd,dnh->btnh", dt).transpose(0, 2, 3, 1)  # [B, K, Hd, T]
    segments = [(k, v, allowed)]
    if past is not None:
        segments.append((past[0].astype(dt), past[1].astype(dt), past[2]))
    x = x + _dense(attention(q, segments), a["o"], "btnh,nhd->btd", dt)
    h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    m = p["mlp"]
    gated = jax.nn.silu(_dense(h, m["gate"], "btd,df->btf", dt)) * _dense(h, m["up"], "btd,df->btf", dt)
    return x + _dense(gated, m["down"], "btf,fd->btd", dt), (k, v)


def unembed(cfg: Qwen2Config, params: Params | lora.LoRAParams, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> logits [..., V] in f32 (tied: hidden @ embed^T)."""
    dt = jnp.dtype(cfg.dtype)
    params = lora.as_tree(params)
    if cfg.tie_embeddings:
        return jnp.einsum("...d,vd->...v", hidden.astype(dt), params["embed"].astype(dt),
                          preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden.astype(dt), params["lm_head"]["kernel"].astype(dt),
                      preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# The model.
# ----------------------------------------------------------------------------------------------

def _layers(cfg: Qwen2Config, params: Params, tokens: jax.Array, positions: jax.Array,
            mask: jax.Array, past: KVCache | None):
    """Runs every layer; returns final-norm hidden [B, T, D] and the new tokens' k
    [L, B, K, T, Hd] and v [L, B, K, Hd, T] (tuples over unrolled layers, as the cache)."""
    dt = jnp.dtype(cfg.dtype)
    params = lora.as_tree(params)
    mask = mask.astype(bool)
    t = tokens.shape[1]
    x = params["embed"].astype(dt)[tokens]
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    causal = jnp.tril(jnp.ones((t, t), bool))
    allowed = mask[:, None, :] & causal[None]  # [B, T, T]
    # Every real cache slot precedes the new tokens, so the cache needs only its own mask.
    past_allowed = None if past is None else jnp.broadcast_to(past.mask[:, None, :], (
        mask.shape[0], t, past.length))

    def body(x, layer):
        p, kv = layer
        return decoder_layer(cfg, p, x, rope, allowed, None if kv is None else (*kv, past_allowed))

    if cfg.remat:
        body = jax.checkpoint(body, prevent_cse=False)
    if cfg.scan_layers:
        past_kv = None if past is None else (past.k, past.v)
        x, (k, v) = jax.lax.scan(body, x, (params["layers"], past_kv))
    else:  # unrolled: faster for shallow models on CPU, same params layout
        new = []
        for i in range(cfg.num_layers):
            kv = None if past is None else (past.k[i], past.v[i])
            x, kv = body(x, (jax.tree.map(lambda a: a[i], params["layers"]), kv))
            new.append(kv)
        k, v = (tuple(t) for t in zip(*new))
    return rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps), k, v


def hidden_states(cfg: Qwen2Config, params: Params, tokens: jax.Array, positions: jax.Array,
                  mask: jax.Array, cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
    """tokens/positions/mask [B, T] -> final-norm hidden [B, T, D] and the updated cache.

    Token t attends to real tokens s <= t and, with a cache, to every real cache slot; its
    keys and values are then written at slots [index, index + T).
    """
    hidden, k, v = _layers(cfg, params, tokens, positions, mask, cache)
    if cache is None:
        return hidden, None
    i = cache.index
    return hidden, KVCache(
        k=jax.tree.map(lambda c, x: _write(c, x, c.ndim - 2, i), cache.k, k),
        v=jax.tree.map(lambda c, x: _write(c, x, c.ndim - 1, i), cache.v, v),
        mask=jax.lax.dynamic_update_slice(cache.mask, mask.astype(bool), (0, cache.index)),
        index=cache.index + tokens.shape[1])


def _write(cache: jax.Array, new: jax.Array, axis: int, index: jax.Array) -> jax.Array:
    """cache with `new` written at slots [index, index + T) of its slot `axis`."""
    start = [0] * cache.ndim
    start[axis] = index
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def prefill(cfg: Qwen2Config, params: Params, tokens: jax.Array, positions: jax.Array,
            mask: jax.Array, length: int, dtype: Any = None) -> tuple[jax.Array, KVCache]:
    """Like `hidden_states` into an empty cache of `length` slots, without attending to it."""
    hidden, k, v = _layers(cfg, params, tokens, positions, mask, None)
    extra = length - tokens.shape[1]
    dtype = jnp.dtype(dtype or cfg.dtype)
    pad = lambda x, axis: jnp.pad(x.astype(dtype), [(0, extra if a == x.ndim + axis else 0)
                                                    for a in range(x.ndim)])
    return hidden, KVCache(k=jax.tree.map(lambda x: pad(x, -2), k),
                           v=jax.tree.map(lambda x: pad(x, -1), v),
                           mask=jnp.pad(mask.astype(bool), ((0, 0), (0, extra))),
                           index=jnp.asarray(tokens.shape[1], jnp.int32))


def forward(cfg: Qwen2Config, params: Params, tokens: jax.Array, positions: jax.Array | None = None,
            mask: jax.Array | None = None, cache: KVCache | None = None) -> Output:
    """Full forward: logits [B, T, V] (f32), hidden [B, T, D], updated cache.

    `mask` defaults to all real tokens and `positions` to `positions_from_mask(mask)`; with a
    cache, pass the positions that continue each row.
    """
    if mask is None:
        mask = jnp.ones(tokens.shape, bool)
    if positions is None:
        positions = positions_from_mask(mask)
    hidden, cache = hidden_states(cfg, params, tokens, positions, mask, cache)
    return Output(logits=unembed(cfg, params, hidden), hidden=hidden, cache=cache)
