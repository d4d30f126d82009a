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
positions (`positions_from_mask`). KV caches are explicit pytree arguments: `run_layers` reads
any number of them read-only (a cache may hold one row per G query rows: the samples of one
prompt share its keys) and returns the new tokens' keys and values, which `append` writes, or
writes them into one cache that it then reads (`hidden_states`). Keys are stored slot-minor
[.., Hd, S] and values slot-major [.., S, Hd]: a decode step's attention products then sum over
a major axis, vectorised along the minor one (`attention`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

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
    # Attention among new tokens without a cache (training, prefill) goes through
    # jax.nn.dot_product_attention: "xla" everywhere, "cudnn" (flash attention; bf16/f16, GPU).
    attention_impl: str = "xla"

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
        if self.attention_impl not in ("xla", "cudnn"):
            raise ValueError(f"Qwen2Config.attention_impl must be 'xla' or 'cudnn' (GPU), got "
                             f"{self.attention_impl!r}.")
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

    # [L, B, K, Hd, S] and [L, B, K, S, Hd] (each decode product's summed axis major);
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
    k = jnp.zeros((cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, length), dtype)
    v = jnp.zeros((cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim), dtype)
    per_layer = (lambda x: x) if cfg.scan_layers else tuple
    return KVCache(k=per_layer(k), v=per_layer(v), mask=jnp.zeros((batch, length), bool),
                   index=jnp.zeros((), jnp.int32))


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

    Each segment is (k [Bs, K, Hd, S], v [Bs, K, S, Hd], allowed [Bs, T or 1, S]), the cache's
    layout; the softmax runs over all segments together. Decoding attends to read-only caches
    and the new tokens as separate segments, so appending needs no concatenation. Bs may divide
    B: rows r * B / Bs ... (r + 1) * B / Bs - 1 then share segment row r (the G samples of one
    prompt read its prompt's keys once); `allowed` is then [Bs, 1, S].
    """
    b, t, n, hd = q.shape
    kv_heads = segments[0][0].shape[1]
    g = n // kv_heads
    shares = [b // k.shape[0] for k, _, _ in segments]
    scores = []
    for (k, _, allowed), share in zip(segments, shares):
        s = _scores(q.reshape(k.shape[0], share * t, kv_heads, g, hd), k)
        s = jnp.where(allowed[:, None, None], s * (hd ** -0.5), jnp.finfo(jnp.float32).min)
        scores.append(_unshare(s, share, t))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)  # [B, K, g, T, S total]
    out, start = 0, 0
    for (k, v, _), share in zip(segments, shares):
        p = _share(probs[..., start:start + k.shape[-1]], share, t)
        out = out + _mix(p, v).reshape(b, t, kv_heads, g, hd)
        start += k.shape[-1]
    return out.reshape(b, t, n, hd)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [Bs, Q, K, g, Hd] . k [Bs, K, Hd, S] -> f32 scores [Bs, K, g, Q, S].

    One query row (a decode step's) is a multiply-and-sum over Hd, vectorised along S: as a
    dot its g (e.g. 4) rows per head made XLA:CPU's products slow."""
    if q.shape[1] > 1:
        return jnp.einsum("bqkgh,bkhs->bkgqs", q, k, preferred_element_type=jnp.float32)
    f32 = jnp.float32
    return (q[:, 0, :, :, :, None].astype(f32) * k[:, :, None].astype(f32)).sum(-2)[:, :, :, None]


def _mix(p: jax.Array, v: jax.Array) -> jax.Array:
    """probs [Bs, K, g, Q, S] . v [Bs, K, S, Hd] -> [Bs, Q, K, g, Hd] in v's dtype (one query
    row: a multiply-and-sum over S, vectorised along Hd, as in `_scores`)."""
    if p.shape[3] > 1:
        return jnp.einsum("bkgqs,bksh->bqkgh", p.astype(v.dtype), v)
    f32 = jnp.float32
    return (p[:, :, :, 0, :, None] * v[:, :, None].astype(f32)).sum(-2)[:, None].astype(v.dtype)


def _unshare(s: jax.Array, share: int, t: int) -> jax.Array:
    """Scores [Bs, K, g, share * T, S] -> [Bs * share, K, g, T, S] (identity for share 1)."""
    if share == 1:
        return s
    bs, kh, g, _, n = s.shape
    return s.reshape(bs, kh, g, share, t, n).transpose(0, 3, 1, 2, 4, 5).reshape(
        bs * share, kh, g, t, n)


def _share(p: jax.Array, share: int, t: int) -> jax.Array:
    """The inverse of `_unshare`: [Bs * share, K, g, T, S] -> [Bs, K, g, share * T, S]."""
    if share == 1:
        return p
    b, kh, g, _, n = p.shape
    return p.reshape(b // share, share, kh, g, t, n).transpose(0, 2, 3, 1, 4, 5).reshape(
        b // share, kh, g, share * t, n)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [N, K] @ w [K, M] -> [N, M], whose weight gradient transposes the narrower operand.

    Autodiff forms the weight gradient as (g^T x)^T, and XLA's CPU backend then writes g [N, M]
    out transposed (fused with the activation's gradient, at a fraction of memory speed) before
    its matmul: for an MLP input kernel (M = 4 K) that copy is four times x's size.
    """
    return x @ w


def _matmul_fwd(x, w):
    return x @ w, (x, w)


def _matmul_bwd(res, g):
    x, w = res
    k, m = w.shape
    dw = x.T @ g if k <= m else (g.T @ x).T
    return (g @ w.T).astype(x.dtype), dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _dense(x: jax.Array, p: Params, spec: str, dtype) -> jax.Array:
    """x times the kernel (plus bias), plus the low-rank path when `p` carries a LoRA adapter.

    `spec` names the axes ("btd,dnh->btnh"): x ends with the kernel's input axes and the
    kernel's output axes follow them. The product runs as one 2D matmul over the flattened
    axes; as an einsum over the multi-axis kernel, XLA's CPU backend transposed the whole
    attention kernel inside every decode step.
    """
    w = p["kernel"]
    n_in = sum(c in spec.split(",")[0] for c in spec.split(",")[1].split("->")[0])
    lead = x.shape[:x.ndim - n_in]
    w2 = w.reshape(math.prod(w.shape[:n_in]), -1).astype(dtype)
    y = matmul(x.reshape(-1, w2.shape[0]), w2).reshape(*lead, *w.shape[n_in:])
    y = y + p["bias"].astype(dtype) if "bias" in p else y
    return y + lora.low_rank(x, p, spec, dtype) if "lora_a" in p else y


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array,
                    implementation: str = "cudnn") -> jax.Array:
    """q [B, T, N, Hd], k/v [B, T, K, Hd], allowed [B, T, T] -> [B, T, N, Hd] through cuDNN
    flash attention, in the form JAX's cuDNN path accepts when agents are vmapped and trained:
    the mask spans every head (its batching rule reshapes it to [B, N, T, T]), and an odd T gets
    one padding token (cuDNN trains with a mask on even lengths only) that attends to itself
    and is dropped. `implementation="xla"` runs the same padding on any backend (tests)."""
    b, t, n, _ = q.shape
    if t % 2:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (q, k, v))
        allowed = jnp.pad(allowed, ((0, 0), (0, 1), (0, 1))).at[:, t, t].set(True)
    mask = jnp.broadcast_to(allowed[:, None], (b, n) + allowed.shape[1:])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)[:, :t]


def decoder_layer(cfg: Qwen2Config, p: Params, x: jax.Array, rope, allowed: jax.Array,
                  past: Sequence[tuple[jax.Array, jax.Array, jax.Array]] = (), into=None):
    """One pre-norm block. x [B, T, D], allowed [B, T, T] among the new tokens.

    past: this layer's read-only cache segments (k [Bs, K, Hd, S], v [Bs, K, S, Hd], allowed
    [Bs, T or 1, S]), see `attention`. Returns the new x and the new tokens' (k, v) in the
    cache layout for the caller to write. into: (k [B, K, Hd, S], v [B, K, S, Hd], allowed
    [B, T, S], index) that takes the new tokens' k/v at slots [index, index + T) before the
    attention reads it as their segment; the written (k, v) are then returned instead.
    """
    dt = jnp.dtype(cfg.dtype)
    h = rms_norm(x, p["input_norm"]["scale"], cfg.rms_norm_eps)
    a = p["attn"]
    q = apply_rope(_dense(h, a["q"], "btd,dnh->btnh", dt), *rope)
    k = apply_rope(_dense(h, a["k"], "btd,dnh->btnh", dt), *rope)  # [B, T, K, Hd]
    v = _dense(h, a["v"], "btd,dnh->btnh", dt)
    new = (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))
    own = [(*new, allowed)]
    if into is not None:
        ik, iv, into_allowed, index = into
        new = (_write(ik, new[0], 3, index), _write(iv, new[1], 2, index))
        own = [(new[0].astype(dt), new[1].astype(dt), into_allowed)]
    if past or into is not None:
        out = attention(q, own + [(pk.astype(dt), pv.astype(dt), m) for pk, pv, m in past])
    elif cfg.attention_impl == "cudnn":
        out = cudnn_attention(q, k, v, allowed)
    else:
        out = jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation="xla")
    x = x + _dense(out, a["o"], "btnh,nhd->btd", dt)
    h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    m = p["mlp"]
    gated = jax.nn.silu(_dense(h, m["gate"], "btd,df->btf", dt)) * _dense(h, m["up"], "btd,df->btf", dt)
    return x + _dense(gated, m["down"], "btf,fd->btd", dt), new


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

def run_layers(cfg: Qwen2Config, params: Params, tokens: jax.Array, positions: jax.Array,
               mask: jax.Array, past: Sequence[KVCache] = (), rope=None,
               into: KVCache | None = None):
    """Runs every layer on new tokens [B, T] that attend to each other (causally) and to the
    real slots of the read-only caches `past` (each of B or B / G rows, see `attention`).
    `rope`: the positions' (cos, sin) [B, T, Hd / 2] if already made; a decode loop looks them
    up in a table made once, since XLA recomputes them inside every layer's rotation otherwise.

    Returns final-norm hidden [B, T, D] and the new tokens' k [L, B, K, Hd, T] and v
    [L, B, K, T, Hd] (tuples over unrolled layers, as the cache), for the caller to `append`.
    With `into`, each layer first writes them into that cache at [index, index + T) and
    attends to it, and its written k and v are returned instead (`hidden_states`).
    Unrolled layers also accept params whose "layers" is a tuple of per-layer trees
    (`unstack_layers`), which a decode loop slices once instead of at every step.
    """
    dt = jnp.dtype(cfg.dtype)
    params = lora.as_tree(params)
    mask = mask.astype(bool)
    t = tokens.shape[1]
    x = params["embed"].astype(dt)[tokens]
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta) if rope is None else rope
    causal = jnp.tril(jnp.ones((t, t), bool))
    allowed = mask[:, None, :] & causal[None]  # [B, T, T]
    # Every real cache slot precedes the new tokens, so a cache needs only its own mask.
    past_allowed = [c.mask[:, None, :] for c in past]
    if into is not None:  # new token t sees the real slots before index + t + 1
        slots = jnp.arange(into.length)[None, None, :]
        into_allowed = _written_mask(into, mask)[:, None, :] & (
            slots <= into.index + jnp.arange(t)[None, :, None])

    def body(x, layer):
        p, kvs, own = layer
        segments = [(k, v, m) for (k, v), m in zip(kvs, past_allowed)]
        own = None if own is None else (*own, into_allowed, into.index)
        return decoder_layer(cfg, p, x, rope, allowed, segments, own)

    if cfg.remat:
        body = jax.checkpoint(body, prevent_cse=False)
    own = None if into is None else (into.k, into.v)
    if cfg.scan_layers:
        x, (k, v) = jax.lax.scan(body, x, (params["layers"], [(c.k, c.v) for c in past], own))
    else:  # unrolled: faster for shallow models on CPU, same params layout
        layers = params["layers"]
        if not isinstance(layers, tuple):
            layers = unstack_layers(cfg, params)["layers"]
        new = []
        for i in range(cfg.num_layers):
            x, kv = body(x, (layers[i], [(c.k[i], c.v[i]) for c in past],
                             None if own is None else (own[0][i], own[1][i])))
            new.append(kv)
        k, v = (tuple(t) for t in zip(*new))
    return rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps), k, v


def unstack_layers(cfg: Qwen2Config, params: Params | lora.LoRAParams) -> Params:
    """params (LoRA adapters folded in as their own leaves) with "layers" as a tuple of L
    per-layer trees, for unrolled layers."""
    tree = lora.as_tree(params)
    if isinstance(tree["layers"], tuple):
        return tree
    return {**tree, "layers": tuple(jax.tree.map(lambda a: a[i], tree["layers"])
                                    for i in range(cfg.num_layers))}


def per_layer(x: Any, cfg: Qwen2Config) -> tuple:
    """A stacked [L, ...] cache buffer as a tuple of L buffers (tuples pass through)."""
    return x if isinstance(x, tuple) else tuple(x[i] for i in range(cfg.num_layers))


def hidden_states(cfg: Qwen2Config, params: Params, tokens: jax.Array, positions: jax.Array,
                  mask: jax.Array, cache: KVCache | None = None, past: Sequence[KVCache] = (),
                  rope=None) -> tuple[jax.Array, KVCache | None]:
    """tokens/positions/mask [B, T] -> final-norm hidden [B, T, D] and the updated cache.

    Token t attends to real tokens s <= t and to every real slot of the cache and of the
    read-only caches `past`; its keys and values are written at slots [index, index + T) of
    the cache, inside each layer before its attention reads the cache, so that in a decode
    loop XLA updates the cache in place instead of copying it. `rope`: see `run_layers`.
    """
    hidden, k, v = run_layers(cfg, params, tokens, positions, mask, past, rope, cache)
    if cache is None:
        return hidden, None
    return hidden, KVCache(k=k, v=v, mask=_written_mask(cache, mask),
                           index=cache.index + tokens.shape[1])


def append(cache: KVCache, k: Any, v: Any, mask: jax.Array) -> KVCache:
    """cache with T new slots written at [index, index + T): k [(L,) B, K, Hd, T] and
    v [(L,) B, K, T, Hd] in the cache's form (stacked or per layer), mask [B, T]."""
    i = cache.index
    return KVCache(k=jax.tree.map(lambda c, x: _write(c, x, c.ndim - 1, i), cache.k, k),
                   v=jax.tree.map(lambda c, x: _write(c, x, c.ndim - 2, i), cache.v, v),
                   mask=_written_mask(cache, mask), index=i + mask.shape[1])


def grow(cache: KVCache, length: int) -> KVCache:
    """cache with empty slots added after its last one, up to `length` slots."""
    extra = length - cache.length
    if extra == 0:
        return cache
    pad = lambda x, axis: jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])
    return KVCache(k=jax.tree.map(lambda x: pad(x, x.ndim - 1), cache.k),
                   v=jax.tree.map(lambda x: pad(x, x.ndim - 2), cache.v),
                   mask=pad(cache.mask, 1), index=cache.index)


def _written_mask(cache: KVCache, mask: jax.Array) -> jax.Array:
    """cache.mask [B, S] with mask [B, T] written at slots [index, index + T)."""
    return jax.lax.dynamic_update_slice(cache.mask, mask.astype(bool), (0, cache.index))


def _write(cache: jax.Array, new: jax.Array, axis: int, index: jax.Array) -> jax.Array:
    """cache with `new` written at slots [index, index + T) of its slot `axis`."""
    start = [0] * cache.ndim
    start[axis] = index
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


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
