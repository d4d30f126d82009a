"""LoRA: per-agent low-rank adapters over one frozen base, never merged while training.

A targeted kernel W [L, *in, *out] (see `qwen2.param_shapes`) gets an adapter
a [L, *in, r] (random) and b [L, r, *out] (zero), and the layer computes
x W + (alpha / r) (x a) b, so a zero b gives the base's output exactly. Adapters of the agents of
a group are stacked on a leading agent axis [A, ...] while the base is stored once:
`LoRAParams(base, adapters)` is what the model, the sampler and the losses take in place of a
params tree, and `agent_axes` tells `vmap` that only the adapters carry the agent axis.

Adapter layout mirrors the params tree: {"layers": {"attn": {"q": {"a", "b"}, ...},
"mlp": {"gate": {"a", "b"}, ...}}}.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

Params = dict[str, Any]

# Projection name -> (params-tree section, number of input axes of its kernel after L).
PROJECTIONS = {"q": ("attn", 1), "k": ("attn", 1), "v": ("attn", 1), "o": ("attn", 2),
               "gate": ("mlp", 1), "up": ("mlp", 1), "down": ("mlp", 1)}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha (the update is scaled by alpha / r) and `targets`, a regex that must match
    a projection's whole name (q, k, v, o, gate, up, down)."""

    rank: int
    alpha: float = 16.0
    targets: str = "q|k|v|o|gate|up|down"

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1 for adapters (0 means full fine-tuning), "
                             f"got {self.rank}.")
        if not self.projections:
            raise ValueError(f"lora.targets {self.targets!r} matches none of the projections "
                             f"{sorted(PROJECTIONS)}; e.g. 'q|v' or 'q|k|v|o|gate|up|down'.")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def projections(self) -> tuple[str, ...]:
        return tuple(p for p in PROJECTIONS if re.fullmatch(self.targets, p))


@flax.struct.dataclass
class LoRAParams:
    """A policy: the frozen base [...] and its adapters ([A, ...] when stacked)."""

    base: Params
    adapters: Params
    scale: float = flax.struct.field(pytree_node=False, default=1.0)


# ----------------------------------------------------------------------------------------------
# Shapes and init.
# ----------------------------------------------------------------------------------------------

def adapter_shapes(kernels: Params, cfg: LoRAConfig) -> Params:
    """Adapter `ShapeDtypeStruct`s (f32) for the base's `layers` kernels (shapes or arrays)."""
    out: Params = {}
    for name in cfg.projections:
        section, n_in = PROJECTIONS[name]
        shape = kernels["layers"][section][name]["kernel"].shape  # [L, *in, *out]
        layers, ins, outs = shape[0], shape[1:1 + n_in], shape[1 + n_in:]
        out.setdefault(section, {})[name] = {
            "a": jax.ShapeDtypeStruct((layers, *ins, cfg.rank), jnp.float32),
            "b": jax.ShapeDtypeStruct((layers, cfg.rank, *outs), jnp.float32)}
    return {"layers": out}


def init_adapters(base: Params, cfg: LoRAConfig, key: jax.Array) -> Params:
    """a ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's default), b = 0: the base's function."""
    shapes = adapter_shapes(base, cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))

    def one(path, spec, k):
        if path[-1].key == "b":
            return jnp.zeros(spec.shape, spec.dtype)
        bound = 1.0 / math.sqrt(math.prod(spec.shape[1:-1]))
        return jax.random.uniform(k, spec.shape, spec.dtype, -bound, bound)

    return jax.tree.unflatten(treedef, [one(p, s, k) for (p, s), k in zip(leaves, keys)])


# ----------------------------------------------------------------------------------------------
# Using adapters.
# ----------------------------------------------------------------------------------------------

def as_tree(params: Params | LoRAParams) -> Params:
    """The params tree the model reads: the base's kernels with `lora_a` and `lora_b` (scaled)
    beside them. Plain params pass through."""
    if not isinstance(params, LoRAParams):
        return params
    layers = dict(params.base["layers"])
    for section, projections in params.adapters["layers"].items():
        layers[section] = dict(layers[section])
        for name, ab in projections.items():
            layers[section][name] = {**layers[section][name], "lora_a": ab["a"],
                                     "lora_b": ab["b"] * params.scale}
    return {**params.base, "layers": layers}


def low_rank(x: jax.Array, p: Params, spec: str, dtype) -> jax.Array:
    """(x a) b for the dense einsum `spec` of the kernel `p` ("btd,dnh->btnh": x [B, T, D])."""
    inputs, out = spec.split("->")
    lhs, kernel = inputs.split(",")
    ins = "".join(c for c in kernel if c in lhs)
    outs = "".join(c for c in kernel if c not in lhs)
    batch = "".join(c for c in lhs if c not in kernel)
    h = jnp.einsum(f"{lhs},{ins}r->{batch}r", x, p["lora_a"].astype(dtype))
    return jnp.einsum(f"{batch}r,r{outs}->{out}", h, p["lora_b"].astype(dtype))


def merge(base: Params, adapters: Params, scale: float) -> Params:
    """One agent's params with every adapter folded into its kernel: W + scale a b (for export;
    training never materializes this)."""
    layers = dict(base["layers"])
    for section, projections in adapters["layers"].items():
        layers[section] = dict(layers[section])
        for name, ab in projections.items():
            kernel = layers[section][name]["kernel"]
            a = ab["a"].reshape(ab["a"].shape[0], -1, ab["a"].shape[-1])  # [L, in, r]
            b = ab["b"].reshape(ab["b"].shape[0], ab["b"].shape[1], -1)  # [L, r, out]
            delta = scale * jnp.einsum("lir,lro->lio", a, b).reshape(kernel.shape)
            merged = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
            layers[section][name] = {**layers[section][name], "kernel": merged}
    return {**base, "layers": layers}


# ----------------------------------------------------------------------------------------------
# The agent axis.
# ----------------------------------------------------------------------------------------------

def agent_axes(params: Params | LoRAParams) -> Any:
    """`vmap` in_axes for stacked params: 0 everywhere, or only on the adapters."""
    if isinstance(params, LoRAParams):
        return LoRAParams(base=None, adapters=0, scale=params.scale)
    return 0


def pick(params: Params | LoRAParams, index: Any) -> Params | LoRAParams:
    """Agent `index` of stacked params (the base is shared)."""
    if isinstance(params, LoRAParams):
        return params.replace(adapters=jax.tree.map(lambda x: x[index], params.adapters))
    return jax.tree.map(lambda x: x[index], params)


def num_agents(params: Params | LoRAParams) -> int:
    """Length of the agent axis of stacked params."""
    tree = params.adapters if isinstance(params, LoRAParams) else params
    return jax.tree.leaves(tree)[0].shape[0]
