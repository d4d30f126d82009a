"""Self-imitation: after each GRPO step, a supervised step on the memory's best entries.

The memory keeps the node outputs of the rollouts' best-scoring episodes. With
`grpo.self_imitation` = n > 0, every agent also takes one token-mean NLL step (the SFT loss,
through the GRPO optimizer) on up to n of its entries that scored the best attainable
R_A + R_F, each its stored hint-free prompt -> stored response, drawn without replacement. The
policies so learn to answer by themselves what the memory answers verbatim. The draw reads only
the run state's tables and a generator seeded by (seed, step), so a resumed run draws what an
uninterrupted one does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from joyagents_jax.rl.memory import MemoryTable

Demo = tuple[str, list[int], list[int]]  # (agent, prompt ids, output ids), as SFT batches them


def eligible(table: MemoryTable, min_reward: float, max_len: int) -> np.ndarray:
    """One agent's host table -> the slots [n] a step may imitate: valid, reward at least
    `min_reward` (f32 as stored), prompt kept whole, prompt and response within max_len."""
    p = table.prompt.shape[-1]
    ok = (table.valid & (table.reward >= np.float32(min_reward))
          & (table.prompt_length <= p) & (table.prompt_length + table.length <= max_len))
    return np.flatnonzero(ok)


def draw(tables: Mapping[str, MemoryTable], agents: Sequence[str], rows: int, min_reward: float,
         max_len: int, rng: np.random.Generator) -> list[Demo]:
    """{agent: host table} -> up to `rows` demonstrations per agent (in `agents` order), drawn
    without replacement from its `eligible` slots."""
    demos = []
    for agent in agents:
        table = tables[agent]
        slots = eligible(table, min_reward, max_len)
        for slot in rng.choice(slots, min(rows, len(slots)), replace=False):
            demos.append((agent, table.prompt[slot, :table.prompt_length[slot]].tolist(),
                          table.response[slot, :table.length[slot]].tolist()))
    return demos
