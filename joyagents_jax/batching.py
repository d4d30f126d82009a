"""Host-side batch assembly: demonstrations and rollout samples -> padded [A, B, T] arrays.

Each agent group of the train state gets arrays with its agent axis first; a row holds one
(context, output) sequence, right padded. B is rounded up to a power of two and T to a multiple
of LENGTH_STEP (or fixed at max_len), so a run compiles its train steps a bounded number of
times: on a CPU each compile of a step costs as much as many steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from joyagents_jax import sft
from joyagents_jax.rl import grpo_step, rollout
from joyagents_jax.sampling import bucket

AgentSlots = Mapping[str, tuple[str, int]]  # agent -> (group name, row in the group)
LENGTH_STEP = 64  # T is rounded up to a multiple: at most max_len / 64 shapes, little padding


class Sequences:
    """Per agent group, [A, B, T] token arrays being filled row by row."""

    def __init__(self, group_sizes: Mapping[str, int], rows: Mapping[str, int], length: int):
        self.arrays = {g: {"tokens": np.zeros((a, rows[g], length), np.int32),
                           "mask": np.zeros((a, rows[g], length), bool),
                           "loss_mask": np.zeros((a, rows[g], length), bool),
                           "logp": np.zeros((a, rows[g], length), np.float32)}
                       for g, a in group_sizes.items()}

    def put(self, group: str, agent: int, row: int, context: Sequence[int], output: Sequence[int],
            logp: Sequence[float] | None = None) -> None:
        a = self.arrays[group]
        n, m = len(context), len(output)
        a["tokens"][agent, row, :n + m] = list(context) + list(output)
        a["mask"][agent, row, :n + m] = True
        a["loss_mask"][agent, row, n:n + m] = True
        if logp is not None:
            a["logp"][agent, row, n:n + m] = logp


def _check_length(longest: int, max_len: int) -> None:
    if longest > max_len:
        raise ValueError(f"A training sequence has {longest} tokens, more than max_len "
                         f"{max_len}; raise the config's max sequence length or shorten prompts.")


def _layout(items: Sequence[tuple[str, int]], slots: AgentSlots, group_sizes: Mapping[str, int],
            max_len: int, min_rows: int = 1, fixed_len: bool = False):
    """Row of each item within its agent, rows per group (bucketed) and the bucketed length."""
    counts: dict[str, int] = {}
    rows = []
    for agent, _ in items:
        rows.append(counts.get(agent, 0))
        counts[agent] = rows[-1] + 1
    per_group = {g: bucket(max([counts.get(a, 0) for a, (gg, _) in slots.items() if gg == g]
                               + [min_rows])) for g in group_sizes}
    longest = max([n for _, n in items] + [1])
    _check_length(longest, max_len)
    length = max_len if fixed_len else min(-(-longest // LENGTH_STEP) * LENGTH_STEP, max_len)
    return rows, per_group, length


def sft_batch(demos: Sequence[tuple[str, Sequence[int], Sequence[int]]], slots: AgentSlots,
              group_sizes: Mapping[str, int], max_len: int, min_rows: int = 1,
              fixed_len: bool = False) -> dict[str, sft.SFTBatch]:
    """(agent, context ids, output ids) demonstrations -> {group: SFTBatch [A, B, T]}."""
    rows, per_group, length = _layout([(a, len(c) + len(o)) for a, c, o in demos], slots,
                                      group_sizes, max_len, min_rows, fixed_len)
    seqs = Sequences(group_sizes, per_group, length)
    for (agent, context, output), row in zip(demos, rows):
        group, index = slots[agent]
        seqs.put(group, index, row, context, output)
    return {g: sft.SFTBatch(tokens=a["tokens"], mask=a["mask"], loss_mask=a["loss_mask"])
            for g, a in seqs.arrays.items()}


def sorted_passes(demos: Sequence[tuple[str, Sequence[int], Sequence[int]]], slots: AgentSlots,
                  group_sizes: Mapping[str, int], rows: int, max_len: int
                  ) -> dict[str, list[sft.SortedPass]]:
    """(agent, context ids, output ids) demonstrations -> per group, `sft.SortedPass`es of
    `rows` rows each in order of length (the last filled with empty rows), each padded to its
    own longest row rounded up to LENGTH_STEP; row weights 1 / (A * the agent's target tokens
    in `demos`), so the passes' summed loss is the mean over agents of each one's token mean."""
    by_group: dict[str, list] = {}
    for agent, context, output in demos:
        group, index = slots[agent]
        by_group.setdefault(group, []).append((len(context) + len(output), index, context, output))
    out = {}
    for group, items in by_group.items():
        items.sort(key=lambda item: item[0])
        _check_length(items[-1][0], max_len)
        targets = np.zeros(group_sizes[group])  # the loss's targets: tokens[1:] of the outputs
        for _, index, context, output in items:
            targets[index] += max(len(output) - (len(context) == 0), 0)
        weights = 1.0 / (group_sizes[group] * np.where(targets > 0, targets, 1.0))
        out[group] = []
        for start in range(0, len(items), rows):
            chunk = items[start:start + rows]
            length = min(-(-chunk[-1][0] // LENGTH_STEP) * LENGTH_STEP, max_len)
            seqs = Sequences({group: 1}, {group: rows}, length)
            agent, weight = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
            for row, (_, index, context, output) in enumerate(chunk):
                seqs.put(group, 0, row, context, output)
                agent[row], weight[row] = index, weights[index]
            a = {k: v[0] for k, v in seqs.arrays[group].items()}
            out[group].append(sft.SortedPass(tokens=a["tokens"], mask=a["mask"],
                                             loss_mask=a["loss_mask"], agent=agent, weight=weight))
    return out


def informative(samples: Sequence[rollout.Sample]) -> list[rollout.Sample]:
    """The samples of node groups with a reward spread (>= 2 members, max > min).

    The other groups have zero advantage and are never kept by the group-wise top-K, so their
    loss weight is 0 and dropping them before the step changes no update (the step's variance
    rule, `grpo.segment_reward_variance`, is the same test) while shrinking the batch.
    """
    rewards: dict[int, list[float]] = {}
    for s in samples:
        rewards.setdefault(s.group, []).append(s.reward)
    spread = {g for g, r in rewards.items() if len(r) >= 2 and max(r) > min(r)}
    return [s for s in samples if s.group in spread]


def for_agent_selection(samples: Sequence[rollout.Sample]) -> list[rollout.Sample]:
    """`informative`'s samples and the first sample of every other node group.

    `select = agents` ranks agents by their mean group variance, so a group without a spread
    still counts (variance 0) in its agent's mean; one member keeps that count (a one-member
    group has variance 0 and zero advantage) and trains nothing, as the whole group would.
    """
    spread = {s.group for s in informative(samples)}
    seen: set[int] = set()
    out = []
    for s in samples:
        if s.group in spread or s.group not in seen:
            out.append(s)
        seen.add(s.group)
    return out


def grpo_batch(samples: Sequence[rollout.Sample], slots: AgentSlots,
               group_sizes: Mapping[str, int], offsets: Mapping[str, int], max_len: int,
               min_rows: int = 1, fixed_len: bool = False) -> grpo_step.GRPOBatch:
    """Rollout samples -> a GRPOBatch: rewards and node-group ids per row, group owners.

    B is at least `min_rows` (the mesh's data-parallel size, a power of two), so the batch
    always splits evenly. Node group ids are renumbered densely in order of appearance;
    `group_agent` has one entry per row of the batch (a group holds at least one sample), so
    its length follows B and adds no compiled shapes of its own; padding groups own no
    samples (-1).
    """
    rows, per_group, length = _layout(
        [(s.agent, len(s.prompt_ids) + len(s.output_ids)) for s in samples], slots, group_sizes,
        max_len, min_rows, fixed_len)
    seqs = Sequences(group_sizes, per_group, length)
    rewards = {g: np.zeros((a, per_group[g]), np.float32) for g, a in group_sizes.items()}
    group_ids = {g: np.full((a, per_group[g]), -1, np.int32) for g, a in group_sizes.items()}
    dense: dict[int, int] = {}
    owners: list[int] = []
    for s, row in zip(samples, rows):
        group, index = slots[s.agent]
        seqs.put(group, index, row, s.prompt_ids, s.output_ids, s.sampler_logp)
        rewards[group][index, row] = s.reward
        if s.group not in dense:
            dense[s.group] = len(owners)
            owners.append(offsets[group] + index)
        elif owners[dense[s.group]] != offsets[group] + index:
            raise ValueError(f"Node group {s.group} mixes agents; every sample of a group must "
                             f"belong to one agent.")
        group_ids[group][index, row] = dense[s.group]
    group_agent = np.full(sum(a * per_group[g] for g, a in group_sizes.items()), -1, np.int32)
    group_agent[:len(owners)] = owners
    roll = {g: grpo_step.Rollouts(tokens=a["tokens"], mask=a["mask"], loss_mask=a["loss_mask"],
                                  sampler_logp=a["logp"], rewards=rewards[g],
                                  group_ids=group_ids[g])
            for g, a in seqs.arrays.items()}
    return grpo_step.GRPOBatch(rollouts=roll, group_agent=group_agent)
