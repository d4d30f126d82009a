"""`RunState`: everything a run resumes from, as one pytree that checkpoints whole.

The agents' train state (params, optimizer state, frozen reference), the memory tables, the
train records GRPO re-asks next (`grpo.replay`), the chosen iterate (`grpo.select_every`) and
the step. The data position is the step:
the step's fresh queries and every random draw derive from (seed, step), so restoring a
`RunState` resumes exactly. The phase is static (it decides the tree's structure: the SFT or
the GRPO optimizer, memory tables or none). Without replay the tree has no `replay` node at
all, so checkpoints written before it existed restore unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from joyagents_jax import selection
from joyagents_jax import train_state as ts
from joyagents_jax.rl.memory import MemoryTable

_ARRAY_FIELDS = ("train", "memory", "step", "replay", "selected")
_OPTIONAL = ("replay", "selected")
# `RunState.replay` / `.selected` when off: not a tree node (None cannot mark it: tree utilities
# unflatten with None in place of every leaf).
OFF = ()


@dataclasses.dataclass(frozen=True)
class RunState:
    train: ts.TrainState
    memory: dict[str, MemoryTable]  # {group: [A, ...] tables}; {} in SFT or memory off
    step: jax.Array  # [] int32: steps done, SFT and GRPO counted together
    # [R] int32: the train records the next GRPO step re-asks (`grpo.replay`), -1 padding;
    # OFF in SFT or with replay off.
    replay: jax.Array | tuple = OFF
    # the best-scored GRPO iterate so far (`selection`); OFF in SFT or with selection off.
    selected: selection.Selected | tuple = OFF
    phase: str = dataclasses.field(default="sft", metadata={"pytree_node": False})  # or "grpo"

    def replace(self, **changes) -> RunState:
        return dataclasses.replace(self, **changes)

    @classmethod
    def start(cls, train: ts.TrainState) -> RunState:
        """Step 0 of SFT."""
        return cls(train=train, memory={}, step=jnp.zeros((), jnp.int32), phase="sft")

    def without_bases(self) -> RunState:
        """What a checkpoint holds: LoRA groups keep their adapters, not the frozen base
        (`Experiment.save_bases` writes it once)."""
        groups = {g: grp if grp.lora is None else grp.replace(base=None)
                  for g, grp in self.train.groups.items()}
        return self.replace(train=self.train.replace(groups=groups))

    def next(self, train: ts.TrainState, memory_tables: dict | None = None,
             replay: jax.Array | None = None) -> RunState:
        """The state after one more step (memory tables and replay unchanged unless given)."""
        return self.replace(train=train, step=self.step + 1,
                            memory=self.memory if memory_tables is None else memory_tables,
                            replay=self.replay if replay is None else replay)

    def metadata(self) -> dict:
        """What a checkpoint of this state records beside its arrays: the step, and what its
        tree's structure depends on (the phase, the chosen-iterate node)."""
        return {"step": int(self.step), "phase": self.phase, "selection": self.selects}

    @property
    def replays(self) -> bool:
        return self.replay is not OFF

    @property
    def selects(self) -> bool:
        return self.selected is not OFF


def _flatten(run: RunState):
    """Children keyed by field name, `replay` and `selected` only when set; the phase is
    static."""
    names = [n for n in _ARRAY_FIELDS if n not in _OPTIONAL or getattr(run, n) is not OFF]
    return ([(jax.tree_util.GetAttrKey(n), getattr(run, n)) for n in names],
            (tuple(names), run.phase))


def _unflatten(aux, children) -> RunState:
    names, phase = aux
    return RunState(**dict(zip(names, children)), phase=phase)


jax.tree_util.register_pytree_with_keys(RunState, _flatten, _unflatten)
