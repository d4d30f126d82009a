"""Train state for several agents: params stacked per agent group, one optimizer per agent.

Agents that share an architecture form an `AgentGroup` whose params, optimizer state and frozen
reference params carry a leading agent axis [A, ...]. The optimizer is vmapped over that axis, so
every agent has its own Adam moments, schedule count and global-norm clip: agents never see each
other's gradients. Agents of different sizes (a 7B-like master, 3B-like sub-agents) are separate
groups in one `TrainState`.

Agents are numbered globally by group name (sorted, the pytree order of a dict) and then by row,
so a node group can name its owner with one integer (`agent_offsets`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from joyagents_jax import sharding
from joyagents_jax.models import lora as lora_lib
from joyagents_jax.models import qwen2

Params = qwen2.Params


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW (or momentum SGD) with a warmup + cosine (or constant) schedule and global-norm
    clipping per agent.

    Frozen, so it can live in the static part of the state's pytree. Each agent's schedule
    advances with its own optimizer count, i.e. with the updates it actually received.
    """

    learning_rate: float = 1e-5
    # "sgd": heavy-ball momentum b1; steps scale with the gradient instead of Adam's
    # per-parameter normalization, which moves weakly informed parameters as far as the rest.
    kind: Literal["adamw", "sgd"] = "adamw"
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 0
    total_steps: int = 1000  # cosine horizon including warmup
    end_lr_ratio: float = 0.0  # cosine floor as a fraction of the peak
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float | None = 1.0


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay or constant."""
    peak = cfg.learning_rate
    if cfg.schedule == "cosine":
        if cfg.total_steps <= cfg.warmup_steps:
            raise ValueError(f"cosine schedule: total_steps {cfg.total_steps} must exceed "
                             f"warmup_steps {cfg.warmup_steps} (the horizon includes warmup).")
        return optax.warmup_cosine_decay_schedule(0.0, peak, cfg.warmup_steps, cfg.total_steps,
                                                  end_value=peak * cfg.end_lr_ratio)
    if cfg.schedule == "constant":
        if not cfg.warmup_steps:
            return optax.constant_schedule(peak)
        warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
        return optax.join_schedules([warmup, optax.constant_schedule(peak)], [cfg.warmup_steps])
    raise ValueError(f"unknown schedule {cfg.schedule!r}; expected cosine or constant")


def _decays(params: Params) -> Params:
    """Weight decay on matrices (kernels, embeddings) only, not on biases or norm scales."""
    last = lambda path: getattr(path[-1], "key", None)
    return jax.tree_util.tree_map_with_path(lambda p, _: last(p) in ("kernel", "embed"), params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """The single-agent optimizer; `AgentGroup` vmaps it over the agent axis."""
    lr = learning_rate_schedule(cfg)
    if cfg.kind == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                          mask=_decays)
    elif cfg.kind == "sgd":
        opt = optax.chain(optax.add_decayed_weights(cfg.weight_decay, mask=_decays),
                          optax.sgd(lr, momentum=cfg.b1))
    else:
        raise ValueError(f"unknown optimizer {cfg.kind!r}; expected adamw or sgd")
    if cfg.clip_norm is None:
        return opt
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)


# ----------------------------------------------------------------------------------------------
# State.
# ----------------------------------------------------------------------------------------------


@flax.struct.dataclass
class AgentGroup:
    """Agents of one architecture, fully fine-tuned. Every array leaf has a leading agent axis
    [A, ...]: `params` are the agents' weights."""

    params: Params
    opt_state: optax.OptState
    ref_params: Params | None  # frozen KL reference (the SFT result); None when unused
    model: qwen2.Qwen2Config = flax.struct.field(pytree_node=False)
    optim: OptimConfig = flax.struct.field(pytree_node=False)
    # Class attributes, not fields (a `LoRAGroup` makes them fields): full fine-tuning has no
    # base, and its pytree (hence its checkpoints) stays as it was before LoRA existed.
    base = None
    lora = None

    @property
    def num_agents(self) -> int:
        return jax.tree.leaves(self.params)[0].shape[0]

    @property
    def optimizer(self) -> optax.GradientTransformation:
        return make_optimizer(self.optim)

    def view(self, tree: Params) -> Params | lora_lib.LoRAParams:
        """The policy that `tree` (params or ref_params, [A, ...] or one agent's) stands for."""
        return tree

    @property
    def policies(self) -> Params | lora_lib.LoRAParams:
        """The agents' current policies, stacked (vmap them with `lora.agent_axes`)."""
        return self.view(self.params)

    @property
    def references(self) -> Params | lora_lib.LoRAParams | None:
        """The frozen reference policies, stacked; None when unused."""
        return None if self.ref_params is None else self.view(self.ref_params)


@flax.struct.dataclass
class TrainState:
    """Everything a train step reads and writes. Randomness is not state: the trainer derives
    every key from (seed, step), so a resumed run draws what an uninterrupted one draws."""

    groups: dict[str, AgentGroup]
    step: jax.Array  # [] int32, applied steps
    skipped: jax.Array  # [] int32, steps dropped for a non-finite loss, gradient or update


@flax.struct.dataclass
class LoRAGroup(AgentGroup):
    """Agents of one architecture as LoRA adapters (`models/lora.py`) over one frozen `base`
    stored once, without an agent axis. `params` are the adapters [A, ...]; only they get
    gradients and AdamW state, and `ref_params` are the adapters at the end of SFT."""

    base: Params | None = None  # None only in what a checkpoint holds (`RunState.without_bases`)
    lora: lora_lib.LoRAConfig | None = flax.struct.field(pytree_node=False, default=None)

    def view(self, tree: Params) -> lora_lib.LoRAParams:
        return lora_lib.LoRAParams(self.base, tree, self.lora.scale)


def stack_agents(params: Sequence[Params]) -> Params:
    """Per-agent params of one architecture -> one tree with a leading agent axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *params)


def unstack_agents(params: Params) -> list[Params]:
    """The inverse of `stack_agents`."""
    num = jax.tree.leaves(params)[0].shape[0]
    return [jax.tree.map(lambda x: x[i], params) for i in range(num)]


def _copy(tree: Any) -> Any:
    """A copy in fresh buffers, so donating one tree never invalidates the other."""
    return jax.tree.map(jnp.copy, tree)


@functools.partial(jax.jit, static_argnums=0)
def _init_opt_state(optim: OptimConfig, params: Params) -> optax.OptState:
    return jax.vmap(make_optimizer(optim).init)(params)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(model: qwen2.Qwen2Config, keys: jax.Array) -> Params:
    return jax.vmap(lambda k: qwen2.init_params(model, k))(keys)


def init_group(model: qwen2.Qwen2Config, optim: OptimConfig, params: Params, *,
               reference: bool = True, base: Params | None = None,
               lora: lora_lib.LoRAConfig | None = None) -> AgentGroup:
    """A group from stacked params [A, ...] (with `lora`: stacked adapters over `base`); the
    reference starts as a copy of them."""
    opt_state = _init_opt_state(optim, params)
    fields = dict(params=params, opt_state=opt_state, ref_params=_copy(params) if reference
                  else None, model=model, optim=optim)
    return AgentGroup(**fields) if lora is None else LoRAGroup(**fields, base=base, lora=lora)


def init_random_group(model: qwen2.Qwen2Config, optim: OptimConfig, num_agents: int,
                      key: jax.Array, *, reference: bool = True) -> AgentGroup:
    """A group of `num_agents` independently initialized random policies."""
    params = _init_params(model, jax.random.split(key, num_agents))
    return init_group(model, optim, params, reference=reference)


def create(groups: Mapping[str, AgentGroup]) -> TrainState:
    """The state before the first step. Counters are separate buffers so both can be donated."""
    return TrainState(groups=dict(groups), step=jnp.zeros((), jnp.int32),
                      skipped=jnp.zeros((), jnp.int32))


def agent_offsets(groups: Mapping[str, Any]) -> dict[str, int]:
    """Global index of each group's first agent: groups in sorted name order, then rows."""
    return offsets_of_sizes({name: g.num_agents for name, g in groups.items()})


def offsets_of_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    """`agent_offsets` from agent counts per group (before any state exists)."""
    offsets, total = {}, 0
    for name in sorted(sizes):
        offsets[name] = total
        total += sizes[name]
    return offsets


def num_agents(groups: Mapping[str, AgentGroup]) -> int:
    return sum(g.num_agents for g in groups.values())


def state_shardings(state: TrainState, mesh: Mesh, rules: sharding.Rules = sharding.DEFAULT_RULES,
                    **kwargs) -> TrainState:
    """`NamedSharding`s shaped like `state`, for the in/out shardings of a jitted step.

    Params, reference and optimizer state follow the partition rules with the agent axis in
    front (`sharding.param_shardings(stacked=True)`, kwargs go there), a LoRA base the same
    rules without it; counters are replicated.
    """
    place = lambda tree, stacked=True: sharding.param_shardings(mesh, tree, rules,
                                                                stacked=stacked, **kwargs)
    groups = {}
    for name, g in state.groups.items():
        groups[name] = g.replace(params=place(g.params), opt_state=place(g.opt_state),
                                 ref_params=place(g.ref_params))
        if g.lora is not None:
            groups[name] = groups[name].replace(base=place(g.base, False))
    replicated = NamedSharding(mesh, P())
    return state.replace(groups=groups, step=replicated, skipped=replicated)


def agent_batch_shardings(batch: Any, mesh: Mesh) -> Any:
    """Shardings for a pytree whose leaves are all per-agent batches [A, B, ...]: agents on the
    `agent` mesh axis, samples over the data-parallel axes (`sharding.batch_spec`)."""
    spec = NamedSharding(mesh, sharding.batch_spec(stacked=True))
    return jax.tree.map(lambda _: spec, batch)


def over_agents(fn, per_pass: int | None, params: qwen2.Params | lora_lib.LoRAParams, *rows):
    """fn(params of agent a, *rows[a]) for every agent a: params stacked [A, ...] (a LoRA base
    shared), rows [A, ...] (None allowed). One vmapped pass of all agents (per_pass None), or
    passes of `per_pass` agents one after another (`lax.map`; vmapped within a pass of several,
    where a `lax.cond` computes both branches)."""
    if per_pass is None:
        axes = (lora_lib.agent_axes(params),) + (0,) * len(rows)
        return jax.vmap(fn, in_axes=axes)(params, *rows)
    batch = per_pass if per_pass > 1 else None  # one: unbatched, so a `lax.cond` in fn skips
    if isinstance(params, lora_lib.LoRAParams):
        one = lambda a: fn(params.replace(adapters=a[0]), *a[1:])
        return jax.lax.map(one, (params.adapters, *rows), batch_size=batch)
    return jax.lax.map(lambda a: fn(*a), (params, *rows), batch_size=batch)


# ----------------------------------------------------------------------------------------------
# Updates.
# ----------------------------------------------------------------------------------------------


def where_agents(update: jax.Array, new: Any, old: Any) -> Any:
    """Per agent, the new tree where update[a] else the old one, bit for bit. update: [A]."""
    def pick(n, o):
        return jnp.where(update.reshape(update.shape + (1,) * (n.ndim - 1)), n, o)

    return jax.tree.map(pick, new, old)


def global_norms(grads: Params) -> jax.Array:
    """The global gradient norm of each agent. Leaves [A, ...] -> [A]."""
    return jax.vmap(optax.tree.norm)(grads)


def apply_gradients(group: AgentGroup, grads: Params, update: jax.Array) -> AgentGroup:
    """One optimizer step for the agents with update[a]; the others keep params and state.

    Masking selects the old leaves (`jnp.where`) instead of zeroing gradients: a zero gradient
    would still move Adam's moments, count and weight decay.
    """
    tx = group.optimizer
    updates, opt_state = jax.vmap(tx.update)(grads, group.opt_state, group.params)
    params = optax.apply_updates(group.params, updates)
    return group.replace(params=where_agents(update, params, group.params),
                         opt_state=where_agents(update, opt_state, group.opt_state))


def all_finite(tree: Any) -> jax.Array:
    """[] bool: every float leaf of `tree` is finite (integer leaves, e.g. counts, pass)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def commit(state: TrainState, groups: Mapping[str, AgentGroup], ok: jax.Array) -> TrainState:
    """The state after a step: the new groups if `ok` (a [] bool) and their params and
    optimizer states are finite, else the old state with `skipped` + 1. Params and optimizer
    states are selected, so a skip is bitwise a no-op and nothing non-finite is ever kept
    (a finite loss and gradient can still give a non-finite update, e.g. an overflowing step)."""
    ok &= all_finite([(g.params, g.opt_state) for g in groups.values()])
    pick = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    kept = {name: old.replace(params=pick(groups[name].params, old.params),
                              opt_state=pick(groups[name].opt_state, old.opt_state))
            for name, old in state.groups.items()}
    ok = ok.astype(jnp.int32)
    return state.replace(groups=kept, step=state.step + ok, skipped=state.skipped + 1 - ok)


def jit_step(step_fn, *, in_shardings=None, out_shardings=None):
    """`jax.jit` of a `(state, batch) -> (state, metrics)` step with the state donated.

    Shardings are optional pytrees of `jax.sharding.Sharding` for (state, batch) and
    (state, metrics); without them, jit follows the inputs' placement.
    """
    kwargs = {"donate_argnums": 0}
    if in_shardings is not None:
        kwargs["in_shardings"] = in_shardings
    if out_shardings is not None:
        kwargs["out_shardings"] = out_shardings
    return jax.jit(step_fn, **kwargs)
