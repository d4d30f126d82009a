"""Device mesh, parameter partition rules and batch shardings.

The mesh has four named axes:

    agent   the leading agent axis of a stacked agent group (size 1, the default: replicated)
    data    pure data parallelism (parameters replicated)
    fsdp    data parallelism with parameters and optimizer state split across it
    tensor  tensor parallelism: attention heads, MLP intermediate and vocabulary are split

Parameters get their `PartitionSpec` from an ordered list of rules, `(regex, spec)`: the first
regex found (`re.search`) in a leaf's '/'-joined path wins. The regexes are anchored at the end of
the path, so the same rules place optimizer state (`0/mu/layers/attn/q/kernel`) like its
parameter. A rule describes one agent's tensor; for a stacked group (`stacked=True`) the leading
agent dimension is placed on the `agent` axis. Every placement is validated: a dimension that the
mesh does not divide is an error naming the tensor, the dimension, the axis and its size, unless
`on_indivisible="replicate"` asks to replicate that dimension instead (logged). Error is the
default because a silently replicated tensor shows up later as an out-of-memory on a pod;
replicating is the usual choice for GQA's small KV projections when `tensor` exceeds the KV
heads (Qwen2.5-3B has 2).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from joyagents_jax.models import hf_io, qwen2

MESH_AXES = ("agent", "data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both data-parallel axes

Rules = Sequence[tuple[str, P]]
OnIndivisible = Literal["error", "replicate"]

# Qwen2 layout (see models/qwen2.py); the leading L of `layers/...` is the scanned layer axis,
# never split. Kernels split their input (or hidden) dimension over fsdp and heads, MLP
# intermediate and vocabulary over tensor, so each matmul needs one all-gather over fsdp and
# at most one reduction over tensor.
QWEN2_RULES: Rules = (
    (r"(^|/)embed$", P("tensor", "fsdp")),  # [V, D]
    (r"(^|/)lm_head/kernel$", P("fsdp", "tensor")),  # [D, V]
    (r"(^|/)attn/(q|k|v)/kernel$", P(None, "fsdp", "tensor", None)),  # [L, D, N|K, Hd]
    (r"(^|/)attn/(q|k|v)/bias$", P(None, "tensor", None)),  # [L, N|K, Hd]
    (r"(^|/)attn/o/kernel$", P(None, "tensor", None, "fsdp")),  # [L, N, Hd, D]
    (r"(^|/)mlp/(gate|up)/kernel$", P(None, "fsdp", "tensor")),  # [L, D, F]
    (r"(^|/)mlp/down/kernel$", P(None, "tensor", "fsdp")),  # [L, F, D]
    (r"(^|/)(input_norm|post_attn_norm|final_norm)/scale$", P()),  # [L, D] / [D]: small
    (r"(^|/)(attn|mlp)/\w+/(a|b)$", P()),  # LoRA adapters [L, *in, r], [L, r, *out]: small
)
# Optimizer bookkeeping that has no parameter counterpart (optax step counters).
OPTIMIZER_RULES: Rules = ((r"(^|/)count$", P()),)
DEFAULT_RULES: Rules = QWEN2_RULES + OPTIMIZER_RULES


class ShardingError(ValueError):
    """A mesh, placement or batch that cannot work; the message says what and how to fix it."""


# ----------------------------------------------------------------------------------------------
# Mesh.
# ----------------------------------------------------------------------------------------------

def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,fsdp=-1' -> {'data': 2, 'fsdp': -1} (the command-line form of a mesh)."""
    sizes = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ShardingError(f"Cannot parse mesh item {item!r} in {text!r}; write axis=size "
                                f"pairs such as 'data=2,fsdp=-1,tensor=2'.")
    return sizes


def mesh_shape(sizes: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Resolves axis sizes for a device count: one axis may be -1 (the rest of the devices).

    Axes left out have size 1, except fsdp, which takes the rest when no axis is -1.
    """
    sizes = dict(sizes or {})
    resolved = {"agent": 1, "data": 1, "fsdp": 1, "tensor": 1}
    if -1 not in sizes.values() and "fsdp" not in sizes:
        resolved["fsdp"] = -1
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ShardingError(f"Unknown mesh axes {unknown}; the axes are {list(MESH_AXES)}.")
    resolved.update(sizes)
    bad = {k: v for k, v in resolved.items() if v == 0 or v < -1}
    if bad:
        raise ShardingError(f"Mesh axis sizes must be positive or -1 (the rest), got {bad}.")
    rest = [k for k, v in resolved.items() if v == -1]
    if len(rest) > 1:
        raise ShardingError(f"Only one mesh axis may be -1 (the rest of the devices); got {rest}.")
    fixed = math.prod(v for v in resolved.values() if v != -1)
    if fixed > num_devices:
        raise ShardingError(f"Mesh {_describe(resolved)} needs {fixed} devices, but only "
                            f"{num_devices} are available.")
    if rest:
        if num_devices % fixed:
            raise ShardingError(
                f"Cannot give mesh axis {rest[0]!r} the rest of the devices: {num_devices} "
                f"devices are not divisible by the other axes' product {fixed} "
                f"({_describe(resolved)}).")
        resolved[rest[0]] = num_devices // fixed
    total = math.prod(resolved.values())
    if total < num_devices:
        raise ShardingError(f"Mesh {_describe(resolved)} uses {total} of {num_devices} devices; "
                            f"set one axis to -1 to use the rest, or pass the devices to use.")
    return resolved


def make_mesh(sizes: Mapping[str, int] | str | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` over `devices` (default: all, every process) with axes `MESH_AXES`.

    Axes are Auto: jit's in/out shardings fix the placement of arguments and results and the
    compiler propagates it to intermediates (`jax.make_mesh` would default to Explicit axes).
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(sizes, str):
        sizes = parse_mesh(sizes)
    shape = mesh_shape(sizes, len(devices))
    grid = mesh_utils.create_device_mesh(tuple(shape.values()), devices,
                                         allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _describe(sizes: Mapping[str, int]) -> str:
    return " × ".join(f"{k}={v}" for k, v in sizes.items())


# ----------------------------------------------------------------------------------------------
# Parameter placement.
# ----------------------------------------------------------------------------------------------

def path_str(path: tuple[Any, ...]) -> str:
    """A jax tree path as the rules see it: 'layers/attn/q/kernel', '0/mu/embed'."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def spec_for(path: str, shape: Sequence[int], rules: Rules = DEFAULT_RULES,
             stacked: bool = False) -> P:
    """The first matching rule's spec, with the agent axis in front for stacked leaves."""
    if not shape:
        return P()  # scalars are always replicated
    for pattern, spec in rules:
        if re.search(pattern, path):
            break
    else:
        raise ShardingError(
            f"No partition rule matches {path} {list(shape)}; add a (regex, PartitionSpec) rule "
            f"for it. Rules tried, in order: {[pattern for pattern, _ in rules]}.")
    spec = P("agent", *spec) if stacked else spec
    if len(spec) > len(shape):
        raise ShardingError(f"Rule {pattern!r} gives {path} {list(shape)} the spec {spec}, which "
                            f"has more entries than the tensor has dimensions"
                            f"{' (stacked adds the agent axis)' if stacked else ''}.")
    return spec


def fit_spec(path: str, shape: Sequence[int], spec: P, mesh_sizes: Mapping[str, int],
             on_indivisible: OnIndivisible = "error") -> P:
    """Checks that every split dimension divides by its mesh axes; fixes or raises if not."""
    fitted = []
    for dim, axes in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        missing = [a for a in names if a not in mesh_sizes]
        if missing:
            raise ShardingError(f"{path}: spec {spec} names mesh axes {missing}, which the mesh "
                                f"({_describe(mesh_sizes)}) does not have.")
        n = math.prod(mesh_sizes[a] for a in names)
        if shape[dim] % n:
            where = (f"{path} {list(shape)}: dimension {dim} (size {shape[dim]}) is not "
                     f"divisible by mesh axis {'×'.join(names)} of size {n}")
            if on_indivisible != "replicate":
                raise ShardingError(
                    f"Cannot shard {where}. Choose a mesh whose {'×'.join(names)} size divides "
                    f"{shape[dim]}, or set on_indivisible='replicate' to replicate it.")
            logging.warning("Replicating %s.", where)
            axes = None
        fitted.append(axes)
    while fitted and fitted[-1] is None:
        fitted.pop()
    return P(*fitted)


def param_specs(tree: Any, mesh_sizes: Mapping[str, int], rules: Rules = DEFAULT_RULES, *,
                stacked: bool = False, on_indivisible: OnIndivisible = "error") -> Any:
    """A validated `PartitionSpec` per leaf of `tree` (arrays or `ShapeDtypeStruct`s)."""

    def one(path, leaf):
        name = path_str(path)
        spec = spec_for(name, leaf.shape, rules, stacked)
        return fit_spec(name, leaf.shape, spec, mesh_sizes, on_indivisible)

    return jax.tree_util.tree_map_with_path(one, tree)


def param_shardings(mesh: Mesh, tree: Any, rules: Rules = DEFAULT_RULES, *,
                    stacked: bool = False, on_indivisible: OnIndivisible = "error") -> Any:
    """`NamedSharding`s for `tree` on `mesh`: the in/out shardings of a jitted step."""
    specs = param_specs(tree, mesh.shape, rules, stacked=stacked, on_indivisible=on_indivisible)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def abstract(tree: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s carrying their shardings: for `.lower()` and `jax.eval_shape`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def shard_params(params: Any, shardings: Any) -> Any:
    """Moves (or reshards) a params pytree onto its shardings."""
    return place(params, shardings)


def place(tree: Any, shardings: Any) -> Any:
    """`tree` (global arrays, one-device arrays, host values) on `shardings`, a tree like it.

    In a multi-process job the leaves that are not yet global arrays go through a jitted copy:
    `jax.device_put` built global arrays whose shards could not be read from a jit output that
    depends on no input value (optax's zero moments) when each process had one device (jax
    0.10.2; orbax then failed to save them). Global arrays are resharded with `device_put`.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    is_global = [isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves]
    out = [jax.device_put(x, s) if g else None for x, s, g in zip(leaves, targets, is_global)]
    local = [i for i, g in enumerate(is_global) if not g]
    if local:
        copied = jax.jit(lambda xs: xs, out_shardings=[targets[i] for i in local])(
            [leaves[i] for i in local])
        for i, x in zip(local, copied):
            out[i] = x
    return treedef.unflatten(out)


def init_params(cfg: qwen2.Qwen2Config, key: jax.Array, mesh: Mesh, rules: Rules = DEFAULT_RULES,
                *, on_indivisible: OnIndivisible = "error") -> Any:
    """Random params created directly in their shardings (never whole on one device)."""
    shardings = param_shardings(mesh, qwen2.param_shapes(cfg), rules,
                                on_indivisible=on_indivisible)
    return jax.jit(lambda k: qwen2.init_params(cfg, k), out_shardings=shardings)(key)


def load_hf_params(folder: str, mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
                   cfg: qwen2.Qwen2Config | None = None, dtype: Any = None,
                   on_indivisible: OnIndivisible = "error") -> tuple[Any, qwen2.Qwen2Config]:
    """Loads an HF Qwen2 folder straight into shardings: each device reads only its slices."""
    cfg = cfg or hf_io.config_from_hf(folder)
    if dtype is not None:
        cfg = cfg.replace(param_dtype=jnp.dtype(dtype).name)
    shardings = param_shardings(mesh, qwen2.param_shapes(cfg), rules,
                                on_indivisible=on_indivisible)
    return hf_io.load_params(folder, cfg, shardings=shardings)


# ----------------------------------------------------------------------------------------------
# Batches.
# ----------------------------------------------------------------------------------------------

def replicate(tree: Any, mesh: Mesh | None) -> Any:
    """`tree` replicated on every device of `mesh` (as it is without a mesh): host values,
    one-device arrays and sharded global arrays alike, so jitted steps over the mesh accept it."""
    if mesh is None:
        return tree
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))(tree)


def data_parallel_size(mesh_sizes: Mapping[str, int]) -> int:
    return math.prod(mesh_sizes[a] for a in BATCH_AXES)


def check_batch(mesh_sizes: Mapping[str, int], batch_size: int, what: str = "Batch size") -> None:
    """Raises unless `batch_size` splits evenly over the data-parallel axes."""
    n = data_parallel_size(mesh_sizes)
    if batch_size % n:
        raise ShardingError(
            f"{what} {batch_size} is not divisible by the data-parallel size {n} (mesh axes "
            f"data={mesh_sizes['data']} × fsdp={mesh_sizes['fsdp']}); use a multiple of {n}.")


def batch_spec(stacked: bool = False) -> P:
    """[B, ...] -> batch over data×fsdp; stacked [A, B, ...] also puts A on the agent axis."""
    return P("agent", BATCH_AXES) if stacked else P(BATCH_AXES)


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(stacked))
