"""`joyagents plan`: per-device memory of a multi-agent system on a mesh, before any launch.

Nothing is allocated: params and optimizer state are `jax.eval_shape` results placed by the
partition rules, the KV cache is sized from its shape, and activations come from the compiled
memory analysis of the real GRPO train step over every agent group, lowered for this machine's
devices (use `--cpu-devices N` to plan an N-device pod from a laptop).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from joyagents_jax import distributed, sharding
from joyagents_jax import train_state as ts
from joyagents_jax.models import hf_io, presets, qwen2
from joyagents_jax.models import lora as lora_lib
from joyagents_jax.rl import grpo, grpo_step

# Named systems: groups of (preset, agents). Agents that share an architecture form one
# stacked group: the paper's master + qa/efc/gfc/math sub-agents.
SYSTEMS: dict[str, tuple[tuple[str, int], ...]] = {
    "3b+3b": (("qwen2.5-3b", 5),),
    "7b+3b": (("qwen2.5-7b", 1), ("qwen2.5-3b", 4)),
    "tiny": (("tiny", 5),),
}
ROWS = ("params", "optimizer", "reference", "chosen", "base", "kv_cache", "activations")
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What to plan. Batch sizes are global sequences per agent."""

    groups: tuple[tuple[str, int], ...]
    mesh: str = "fsdp=-1"
    param_dtype: str = "float32"  # trained weights and AdamW moments
    compute_dtype: str = "bfloat16"
    ref_dtype: str = "bfloat16"  # the frozen KL reference policy
    train_batch: int = 8  # sequences per agent in one train step
    micro_batch: int = 0  # rows per agent in one forward/backward (grpo.micro_batch; 0: all)
    agents_per_pass: int = 0  # agents of a group in one gradient pass (config.agents_per_pass)
    seq_len: int = 1024
    rollout_batch: int = 64  # sequences per agent decoded together
    cache_len: int = 2048
    remat: bool = True
    on_indivisible: sharding.OnIndivisible = "error"
    lora_rank: int = 0  # > 0: per-agent adapters (f32) over one frozen base (compute dtype)
    lora_alpha: float = 16.0
    lora_targets: str = "q|k|v|o|gate|up|down"
    select: bool = True  # a copy of the trained weights for the chosen iterate (grpo.select_every)

    @property
    def lora(self) -> lora_lib.LoRAConfig | None:
        return (lora_lib.LoRAConfig(self.lora_rank, self.lora_alpha, self.lora_targets)
                if self.lora_rank else None)


@dataclasses.dataclass(frozen=True)
class Group:
    """One stacked agent group's abstract state and its placement."""

    preset: str
    cfg: qwen2.Qwen2Config
    ref_cfg: qwen2.Qwen2Config
    trees: dict[str, Any]  # ROWS but activations -> ShapeDtypeStructs, leading agent axis
    shardings: dict[str, Any]  # the same keys -> NamedShardings
    lora: lora_lib.LoRAConfig | None = None  # then params are adapters over trees["base"]

    @property
    def agents(self) -> int:
        return jax.tree.leaves(self.trees["params"])[0].shape[0]

    def bytes(self, row: str, per_device: bool) -> int:
        return _bytes(self.trees[row], self.shardings[row] if per_device else None)


@dataclasses.dataclass(frozen=True)
class Plan:
    config: PlanConfig
    mesh: jax.sharding.Mesh
    groups: list[Group]
    activations: int  # per device, from the compiled step over all groups

    def per_device(self, row: str) -> int:
        if row == "activations":
            return self.activations
        return sum(g.bytes(row, per_device=True) for g in self.groups)

    def total(self, row: str) -> int:
        if row == "activations":
            return self.activations * self.mesh.size
        return sum(g.bytes(row, per_device=False) for g in self.groups)


# ----------------------------------------------------------------------------------------------
# Abstract state and the compiled train step.
# ----------------------------------------------------------------------------------------------

# The rollout KV cache [L, B, S, K, Hd] per agent: batch over data×fsdp, KV heads over tensor.
KV_RULES: sharding.Rules = ((r"(^|/)(k|v)$", P(None, sharding.BATCH_AXES, None, "tensor")),)


def _stack(tree: Any, agents: int) -> Any:
    """[...] ShapeDtypeStructs -> [A, ...]: a stacked agent group."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((agents, *x.shape), x.dtype), tree)


def _bytes(tree: Any, shardings: Any | None = None) -> int:
    """Bytes of a tree of ShapeDtypeStructs: whole, or one device's shard of each leaf."""
    leaves = jax.tree.leaves(tree)
    shapes = ([x.shape for x in leaves] if shardings is None else
              [s.shard_shape(x.shape) for x, s in zip(leaves, jax.tree.leaves(shardings))])
    return sum(math.prod(shape) * x.dtype.itemsize for x, shape in zip(leaves, shapes))


def optimizer() -> optax.GradientTransformation:
    """The train state's optimizer (AdamW after clipping): mu, nu and a counter per agent."""
    return ts.make_optimizer(ts.OptimConfig())


def kv_cache_shape(cfg: qwen2.Qwen2Config, agents: int, batch: int, length: int) -> dict:
    """One group's rollout KV cache (k and v) as [A, L, B, S, K, Hd] ShapeDtypeStructs."""
    shape = (agents, cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return {n: jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype)) for n in ("k", "v")}


def model_config(model: str, **dtypes) -> qwen2.Qwen2Config:
    """A preset name, or an HF folder whose config.json alone gives the shapes (no weights)."""
    if os.path.isdir(model):
        return hf_io.config_from_hf(model, **dtypes)
    return presets.get_preset(model, **dtypes)


def make_group(pc: PlanConfig, mesh: jax.sharding.Mesh, preset: str, agents: int) -> Group:
    """`agents` copies of `preset` (a preset name or an HF folder): params, per-agent AdamW
    state, reference, the chosen iterate's copy of the trained weights (`select`), KV cache (of
    one pass's agents with `agents_per_pass`). With LoRA,
    params, AdamW state and reference are the agents' adapters (f32) and the base is stored
    once, in the compute dtype."""
    cfg = model_config(preset, param_dtype=pc.param_dtype, dtype=pc.compute_dtype, remat=pc.remat)
    ref_cfg = cfg.replace(param_dtype=pc.ref_dtype)
    if pc.lora:
        cfg = cfg.replace(param_dtype=pc.compute_dtype)
        base = qwen2.param_shapes(cfg)
        params = reference = _stack(lora_lib.adapter_shapes(base, pc.lora), agents)
    else:
        base, params = {}, _stack(qwen2.param_shapes(cfg), agents)
        reference = _stack(qwen2.param_shapes(ref_cfg), agents)
    trees = {
        "params": params,
        "optimizer": jax.eval_shape(jax.vmap(optimizer().init), params),
        "reference": reference,
        "chosen": params if pc.select else {},
        "base": base,
        # Agents in passes decode one pass at a time: only that pass's caches are live.
        "kv_cache": kv_cache_shape(cfg, min(agents, pc.agents_per_pass or agents),
                                   pc.rollout_batch, pc.cache_len),
    }
    shardings = {row: sharding.param_shardings(
        mesh, tree, KV_RULES if row == "kv_cache" else sharding.DEFAULT_RULES,
        stacked=row != "base", on_indivisible=pc.on_indivisible) for row, tree in trees.items()}
    return Group(preset, cfg, ref_cfg, trees, shardings, pc.lora)


def abstract_state(groups: Sequence[Group]) -> ts.TrainState:
    """The train state of `groups` as sharded ShapeDtypeStructs (no weights)."""
    agent_groups = {}
    for i, g in enumerate(groups):
        tree = {row: sharding.abstract(g.trees[row], g.shardings[row])
                for row in ("params", "optimizer", "reference", "base")}
        fields = dict(params=tree["params"], opt_state=tree["optimizer"],
                      ref_params=tree["reference"], model=g.cfg, optim=ts.OptimConfig())
        agent_groups[f"{i}:{g.preset}"] = (ts.AgentGroup(**fields) if g.lora is None else
                                           ts.LoRAGroup(**fields, base=tree["base"], lora=g.lora))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return ts.TrainState(groups=agent_groups, step=scalar, skipped=scalar)


def abstract_batch(pc: PlanConfig, mesh: jax.sharding.Mesh, state: ts.TrainState
                   ) -> grpo_step.GRPOBatch:
    """A GRPO batch of `train_batch` sequences of `seq_len` tokens per agent, node groups of 4."""
    shard = sharding.batch_sharding(mesh, stacked=True)
    rollouts = {}
    for name, g in state.groups.items():
        a, b, t = g.num_agents, pc.train_batch, pc.seq_len
        arr = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=shard)
        rollouts[name] = grpo_step.Rollouts(
            tokens=arr((a, b, t), jnp.int32), mask=arr((a, b, t), bool),
            loss_mask=arr((a, b, t), bool), sampler_logp=arr((a, b, t), jnp.float32),
            rewards=arr((a, b), jnp.float32), group_ids=arr((a, b), jnp.int32))
    groups = sum(g.num_agents for g in state.groups.values()) * pc.train_batch // 4
    return grpo_step.GRPOBatch(rollouts=rollouts, group_agent=jax.ShapeDtypeStruct(
        (max(groups, 1),), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, P())))


def activation_bytes(pc: PlanConfig, mesh: jax.sharding.Mesh, groups: Sequence[Group]) -> int:
    """Per-device temporaries (activations, gradients, logits) of the compiled GRPO step:
    the real `grpo_step` (policy and reference forward, backward, AdamW, for every agent)."""
    state = abstract_state(groups)
    step = jax.jit(functools.partial(grpo_step.grpo_step, cfg=grpo_step.GRPOStepConfig(
        loss=grpo.GRPOConfig(beta=0.04), inner_steps=1, micro_batch=pc.micro_batch or None,
        agents_per_pass=pc.agents_per_pass or None)),
        donate_argnums=0)
    compiled = step.lower(state, abstract_batch(pc, mesh, state)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def make_plan(pc: PlanConfig, devices: Sequence[jax.Device] | None = None) -> Plan:
    mesh = sharding.make_mesh(pc.mesh, devices)
    for what, size in (("Train batch", pc.train_batch), ("Rollout batch", pc.rollout_batch)):
        sharding.check_batch(mesh.shape, size, what)
    groups = [make_group(pc, mesh, preset, agents) for preset, agents in pc.groups]
    return Plan(pc, mesh, groups, activation_bytes(pc, mesh, groups))


# ----------------------------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------------------------

def _device_capacity() -> int | None:
    """Memory of one local device, where the backend reports it (TPU, GPU; not CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def format_plan(plan: Plan, capacity: int | None = None, full_ft: Plan | None = None) -> str:
    """The table; `full_ft`: the same system without LoRA, whose total is printed beside."""
    pc = plan.config
    mesh = " ".join(f"{k}={v}" for k, v in plan.mesh.shape.items())
    kind = plan.mesh.devices.flat[0].device_kind
    lines = [f"Plan on {plan.mesh.size} x {kind} (mesh {mesh})"]
    for g in plan.groups:
        n = qwen2.count_params(g.cfg)
        size = f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
        lines.append(f"  group {g.preset} x {g.agents} agents, {size} params per agent")
    trained = f"LoRA adapters, rank {pc.lora_rank} (float32)" if pc.lora else \
        f"params ({pc.param_dtype})"
    labels = {
        "params": trained,
        "optimizer": f"optimizer (AdamW mu, nu; {'float32' if pc.lora else pc.param_dtype})",
        "reference": ("reference policy (adapters at SFT's end)" if pc.lora else
                      f"reference policy ({pc.ref_dtype})"),
        "chosen": ("chosen iterate's policies (grpo.select_every)" if pc.select else
                   "chosen iterate (none: grpo.select_every=0)"),
        "base": (f"frozen base, once per group ({pc.compute_dtype})" if pc.lora else
                 "frozen base (none: full fine-tuning)"),
        "kv_cache": f"KV cache (rollout {pc.rollout_batch} x {pc.cache_len}, {pc.compute_dtype}"
                    f"{f', {pc.agents_per_pass} agent(s) per pass' if pc.agents_per_pass else ''})",
        "activations": f"activations, temps (train {pc.train_batch} x {pc.seq_len}"
                       f"{f', micro {pc.micro_batch}' if pc.micro_batch else ''}"
                       f"{f', {pc.agents_per_pass} agent(s) per pass' if pc.agents_per_pass else ''})",
    }
    width = max(52, *(len(label) + 2 for label in labels.values()))
    row = lambda label, dev, tot: f"  {label:<{width}}{dev / GiB:>12.2f}{tot / GiB:>14.2f}"
    lines.append(f"  {'GiB':<{width}}{'per device':>12}{'whole system':>14}")
    lines += [row(labels[r], plan.per_device(r), plan.total(r)) for r in ROWS]
    peak = sum(plan.per_device(r) for r in ROWS)
    lines.append(row("total", peak, sum(plan.total(r) for r in ROWS)))
    if full_ft is not None:
        lines.append(row("full fine-tuning of the same agents, total",
                         sum(full_ft.per_device(r) for r in ROWS),
                         sum(full_ft.total(r) for r in ROWS)))
    if capacity:
        verdict = ("fits" if peak <= capacity else
                   f"does NOT fit (over by {(peak - capacity) / GiB:.2f} GiB)")
        lines.append(f"  device memory {capacity / GiB:.2f} GiB: {verdict}")
    lines.append(
        "  activations: compiled memory analysis of the GRPO train step (policy and reference "
        "forward,\n  backward, AdamW; one inner step) for these devices; other backends fuse "
        "differently, so plan on the target.\n  The KV cache is held during rollouts.")
    return "\n".join(lines)


def parse_groups(text: str) -> tuple[tuple[str, int], ...]:
    """'3b+3b' (a named system) or 'qwen2.5-7b:1,qwen2.5-3b:4' (preset:agents, ...)."""
    if text in SYSTEMS:
        return SYSTEMS[text]
    groups = []
    for item in text.split(","):
        preset, _, count = item.strip().partition(":")
        presets.get_preset(preset)  # a clear error for unknown names
        groups.append((preset, int(count or 1)))
    return tuple(groups)


def from_run_config(spec: str) -> dict[str, Any]:
    """`FILE.py[:ARG]`, the --config of `joyagents train`: its agent groups (an HF folder's
    config.json or a preset each), dtypes, remat and mesh, as PlanConfig fields."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("plan_config", path)
    if module_spec is None or not os.path.isfile(path):
        raise ValueError(f"--config {spec}: no such config file.")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    c = module.get_config(arg) if arg else module.get_config()
    if c.lora.rank and c.lora.groups:
        raise ValueError(f"--config {spec}: lora.groups={c.lora.groups!r} (LoRA on some groups "
                         f"only) is not modelled by plan; plan every group with LoRA "
                         f"(--lora-rank) or none (--lora-rank 0).")
    groups = tuple((g.checkpoint or g.model, len(g.agents)) for g in c.groups.values())
    for model, _ in groups:
        if not os.path.isdir(model):
            presets.get_preset(model)  # a clear error for a folder that is not there
    return {"groups": groups, "param_dtype": c.param_dtype, "compute_dtype": c.dtype,
            "remat": c.remat, "mesh": c.mesh or "fsdp=-1", "micro_batch": c.grpo.micro_batch,
            "agents_per_pass": c.agents_per_pass, "select": c.grpo.select_every > 0,
            "lora_rank": c.lora.rank,
            "lora_alpha": c.lora.alpha, "lora_targets": c.lora.targets}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = PlanConfig(groups=())
    p = argparse.ArgumentParser(
        prog="joyagents plan",
        description="Per-device memory of a multi-agent system on a mesh, without weights.")
    p.add_argument("--config", default="3b+3b",
                   help=f"a train config file (FILE.py[:ARG], as `joyagents train --config`), "
                        f"a named system ({', '.join(SYSTEMS)}) or preset:agents,... "
                        f"(e.g. qwen2.5-7b:1,qwen2.5-3b:4)")
    p.add_argument("--mesh", default=None,
                   help=f"axis sizes, e.g. data=2,fsdp=-1,tensor=2 (default: the config "
                        f"file's, else {d.mesh})")
    p.add_argument("--cpu-devices", type=int, help="simulate N CPU devices (plan a pod locally)")
    p.add_argument("--device-gib", type=float, help="device memory to check the total against")
    p.add_argument("--param-dtype", default=None, help=f"default: the config file's, else "
                                                           f"{d.param_dtype}")
    p.add_argument("--compute-dtype", default=None, help=f"default: the config file's, else "
                                                             f"{d.compute_dtype}")
    p.add_argument("--ref-dtype", default=d.ref_dtype)
    p.add_argument("--train-batch", type=int, default=d.train_batch, help="sequences per agent")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per agent in one forward/backward, as grpo.micro_batch (default: "
                        "the config file's, else 0 = the whole train batch)")
    p.add_argument("--agents-per-pass", type=int, default=None,
                   help="agents of a group in one gradient pass, as config.agents_per_pass "
                        "(default: the config file's, else 0 = all at once)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--rollout-batch", type=int, default=d.rollout_batch, help="sequences per agent")
    p.add_argument("--cache-len", type=int, default=d.cache_len)
    p.add_argument("--no-remat", dest="remat", action="store_const", const=False, default=None)
    p.add_argument("--lora-rank", type=int, default=None,
                   help="per-agent LoRA adapters of this rank over one frozen base (default: the "
                        "config file's, else 0 = full fine-tuning)")
    p.add_argument("--lora-targets", default=None, help=f"default: {d.lora_targets}")
    p.add_argument("--no-select", dest="select", action="store_const", const=False,
                   default=None, help="no copy of the chosen iterate's policies, as "
                                      "grpo.select_every=0 (default: the config file's, else one)")
    p.add_argument("--on-indivisible", choices=("error", "replicate"), default=d.on_indivisible)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:  # must precede the first JAX computation
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    else:  # on a pod, every host runs plan and the mesh spans all of them
        distributed.initialize()
    names = {f.name for f in dataclasses.fields(PlanConfig)}
    try:
        fields = (from_run_config(args.config) if args.config.partition(":")[0].endswith(".py")
                  else {"groups": parse_groups(args.config)})
        fields.update({k: v for k, v in vars(args).items() if k in names and v is not None})
        plan = make_plan(PlanConfig(**fields))
        full_ft = make_plan(PlanConfig(**{**fields, "lora_rank": 0})) if plan.config.lora \
            else None
    except ValueError as e:  # a bad file, mesh, batch, preset or dtype: say which and stop
        print(f"joyagents plan: {e}", file=sys.stderr)
        return 2
    capacity = int(args.device_gib * GiB) if args.device_gib else _device_capacity()
    if distributed.is_primary():
        print(format_plan(plan, capacity, full_ft))
    return 0


if __name__ == "__main__":
    sys.exit(main())
