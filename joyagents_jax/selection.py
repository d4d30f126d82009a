"""Choosing the GRPO iterate a run reports and exports (`grpo.select_every`).

Every `select_every` GRPO steps and after the last, the policies answer a fixed seeded slice
of records (`grpo.select_split`: train, or the held-out validation split) greedily without the
memory; the run keeps a copy of the best step's policies (the latest on ties), and its final
evaluation and export use them. The slice never comes from `test`, and choosing changes
nothing the run trains. Why: where a run stops decides the questions its policies still
contest (benchmarks/RESULTS.md, "Choosing the GRPO iterate on the training traffic").
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from joyagents_jax import train_state as ts

SLICE_SEED = 20_261_206  # one draw for every run, so runs are chosen on the same queries


@flax.struct.dataclass
class Selected:
    """The chosen iterate: each group's policies (LoRA: the adapters), its run step (-1: none
    scored yet) and its accuracy on the slice."""
    params: dict[str, ts.Params]
    step: jax.Array  # [] int32
    accuracy: jax.Array  # [] float32


def slice_rows(num_records: int, examples: int) -> list[int]:
    """The records of the selection split the policies are scored on: one seeded draw of
    `examples` of them (all when there are fewer), sorted."""
    return sorted(np.random.default_rng(SLICE_SEED).choice(
        num_records, min(examples, num_records), replace=False).tolist())


def due(grpo_step: int, every: int, last: bool) -> bool:
    """True after GRPO step `grpo_step` (counted from 1) when it is scored: every `every` steps
    and after the last one; never when every is 0."""
    return bool(every) and (grpo_step % every == 0 or last)


def _copy(params: ts.Params) -> ts.Params:
    """Fresh buffers in the same shardings: the GRPO step donates the ones it is given."""
    return jax.tree.map(jnp.copy, params)


def start(train: ts.TrainState) -> Selected:
    """Nothing chosen yet; the policies' copy only fixes the tree's shapes."""
    return Selected({g: _copy(grp.params) for g, grp in train.groups.items()},
                    jnp.asarray(-1, jnp.int32), jnp.asarray(-1.0, jnp.float32))


def keep(selected: Selected, train: ts.TrainState, step: int, accuracy: float) -> Selected:
    """`selected`, or `train`'s policies at `step` when they score at least as well."""
    if np.float32(accuracy) < float(selected.accuracy):
        return selected
    return Selected({g: _copy(grp.params) for g, grp in train.groups.items()},
                    jnp.asarray(step, jnp.int32), jnp.asarray(accuracy, jnp.float32))


def apply(train: ts.TrainState, selected: Selected) -> ts.TrainState:
    """`train` with the chosen policies in place of its own (unchanged when none is chosen)."""
    if int(selected.step) < 0:
        return train
    groups = {g: grp.replace(params=selected.params[g]) for g, grp in train.groups.items()}
    return train.replace(groups=groups)
