"""`RunState`: everything a run resumes from, as one pytree that checkpoints whole.

The agents' train state (params, optimizer state, frozen reference), the memory tables, the
train records GRPO re-asks next (`grpo.replay`) and the step. The data position is the step:
the step's fresh queries and every random draw derive from (seed, step), so restoring a
`RunState` resumes exactly. The phase is static (it decides the
tree's structure: the SFT or the GRPO optimizer, memory tables or none).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from joyagents_jax import train_state as ts
from joyagents_jax.rl.memory import MemoryTable


@flax.struct.dataclass
class RunState:
    train: ts.TrainState
    memory: dict[str, MemoryTable]  # {group: [A, ...] tables}; {} in SFT or memory off
    step: jax.Array  # [] int32: steps done, SFT and GRPO counted together
    # [R] int32: the train records the next GRPO step re-asks (`grpo.replay`), -1 padding;
    # None in SFT or with replay off.
    replay: jax.Array | None = None
    phase: str = flax.struct.field(pytree_node=False, default="sft")  # "sft" | "grpo"

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
