"""Every component's config, built from one run config in one place.

The run config (`config.py`, `experiments/configs/*.py`) is the only thing a user edits; this
module turns its sections into the frozen dataclasses the components take (optimizers, the GRPO
step, the rollout and its rewards, the sampler, the episode limits, the memory), so no field is
translated twice and every field reaches its component (tests/test_components.py checks that
each key changes what is built, or is one of the loop's own `LOOP_KEYS`).
"""

from __future__ import annotations

from typing import NamedTuple

import ml_collections

from joyagents_jax import train_state as ts
from joyagents_jax.agents import demonstrator, system
from joyagents_jax.models import lora
from joyagents_jax.rl import grpo, grpo_step, memory, rollout
from joyagents_jax.rl import rewards as rw
from joyagents_jax.sampling import SamplingConfig

# Read by the train loop itself (how many steps, which batch), not by a component.
LOOP_KEYS = ("sft.steps", "sft.shared_steps", "sft.batch_per_agent", "sft.extra_worlds",
             "sft.sorted_passes", "sft.demo_seed", "sft.order",
             "grpo.steps", "grpo.queries", "grpo.memory_groups", "grpo.min_groups",
             "grpo.max_refills", "grpo.query_order", "grpo.query_power", "grpo.domain_repeats",
             "grpo.self_imitation", "grpo.replay",
             "grpo.seed", "grpo.select_every", "grpo.select_examples",
             "grpo.select_split", "memory.enabled",
             "memory.in_rollouts")


class Components(NamedTuple):
    sft_optim: ts.OptimConfig
    grpo_optim: ts.OptimConfig
    grpo_step: grpo_step.GRPOStepConfig
    rollout: rollout.RolloutConfig
    sampling: SamplingConfig  # rollouts; evaluation is the same, greedy
    limits: system.Limits
    memory: memory.MemoryConfig
    demonstrator: demonstrator.DemoErrors  # SFT demonstrations' detours
    lora: dict[str, lora.LoRAConfig | None]  # per agent group; None: full fine-tuning


def memory_branches(c: ml_collections.ConfigDict) -> bool:
    """grpo.memory_branches where it applies: node-wise rollouts that read the memory (the
    default's switch is on; trajectory GRPO or a run without the memory simply has no such
    nodes)."""
    return bool(c.grpo.memory_branches and c.grpo.mode == "nodewise" and c.memory.enabled
                and c.memory.in_rollouts)


def suffix_credit(c: ml_collections.ConfigDict) -> bool:
    """grpo.suffix_credit where it applies: node-wise rollouts (trajectory GRPO already trains
    every node with its episode's advantage)."""
    return bool(c.grpo.suffix_credit and c.grpo.mode == "nodewise")


def branch_agents(c: ml_collections.ConfigDict) -> tuple[str, ...]:
    """grpo.branch_agents as a tuple where it applies: node-wise rollouts (trajectory GRPO and
    full trees have no node groups to leave out); empty means every agent."""
    listed = tuple(a for a in c.grpo.branch_agents.split(",") if a)
    return listed if c.grpo.mode == "nodewise" else ()


def rollout_memory_agents(c: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The agents whose memory entries GRPO's rollouts may reuse (empty: every agent). Under
    grpo.unbranched_memory="eval" only the branched agents': the others' entries answer at
    evaluation and leave the training rollouts as they were without them."""
    return branch_agents(c) if c.grpo.unbranched_memory == "eval" else ()


def build(c: ml_collections.ConfigDict) -> Components:
    s, g = c.sft, c.grpo
    rewards = rw.RewardConfig(w_format=g.w_format, w_efficiency=g.w_efficiency,
                              w_grounding=g.w_grounding, grounding_match=g.grounding_match)
    loss = grpo.GRPOConfig(eps_low=g.eps_low, eps_high=g.eps_high, beta=g.beta, kl=g.kl,
                           aggregation=g.aggregation, max_len=c.limits.max_tokens_per_node,
                           temperature=g.temperature if g.tempered_loss else 1.0)
    return Components(
        sft_optim=ts.OptimConfig(
            learning_rate=s.learning_rate, schedule="cosine" if s.steps > s.warmup_steps
            else "constant", warmup_steps=s.warmup_steps,
            total_steps=max(s.steps, s.warmup_steps + 1), weight_decay=s.weight_decay,
            clip_norm=s.clip_norm),
        grpo_optim=ts.OptimConfig(learning_rate=g.learning_rate, kind=g.optimizer,
                                  schedule=g.schedule, warmup_steps=g.warmup_steps,
                                  total_steps=g.warmup_steps + max(g.steps * g.inner_steps, 1),
                                  clip_norm=g.clip_norm),
        grpo_step=grpo_step.GRPOStepConfig(
            loss=loss, inner_steps=g.inner_steps, topk=g.topk or None, select=g.select,
            advantage="given" if g.mode == "trajectory" or suffix_credit(c) else g.advantage,
            neg_weight=g.neg_weight,
            micro_batch=g.micro_batch or None, agents_per_pass=c.agents_per_pass or None),
        rollout=rollout.RolloutConfig(g.mode, g.group_size, rewards,
                                      memory_branches=memory_branches(c),
                                      memory_members=g.memory_members
                                      if memory_branches(c) else 1,
                                      gold_branches=g.gold_branches,
                                      share_identical=bool(g.share_identical
                                                           and g.mode == "nodewise"),
                                      suffix_credit=suffix_credit(c),
                                      greedy_completions=bool(g.greedy_completions
                                                              and g.mode == "nodewise"),
                                      subagent_credit=bool(g.subagent_credit
                                                           and g.mode == "nodewise"),
                                      branch_agents=branch_agents(c),
                                      branch_min_change=g.branch_min_change
                                      if g.mode == "nodewise" else 0.0,
                                      unbranched_memory=g.unbranched_memory != "off"
                                      and g.mode == "nodewise"),
        sampling=SamplingConfig(c.limits.max_tokens_per_node, temperature=g.temperature,
                                top_k=g.top_k, top_p=g.top_p),
        limits=system.Limits(**c.limits),
        memory=_memory(c.memory, rewards.best_memory_reward, c.max_len),
        demonstrator=demonstrator.DemoErrors(wrong_route=s.demo_wrong_route,
                                             wrong_tool=s.demo_wrong_tool,
                                             redundant_call=s.demo_redundant_call),
        lora=_lora(c))


def _lora(c: ml_collections.ConfigDict) -> dict[str, lora.LoRAConfig | None]:
    """Each group's adapters: the `lora` section for the listed groups (all when empty)."""
    listed = [g for g in c.lora.groups.split(",") if g]
    on = lambda g: c.lora.rank > 0 and (not listed or g in listed)
    return {g: lora.LoRAConfig(c.lora.rank, c.lora.alpha, c.lora.targets) if on(g) else None
            for g in c.groups}


def _memory(m: ml_collections.ConfigDict, best_reward: float, max_len: int
            ) -> memory.MemoryConfig:
    """Every `memory` key but `enabled` (which decides whether there is a memory at all);
    prompts are kept up to max_len - 1 tokens (a longer one leaves no room for a response)."""
    return memory.MemoryConfig(
        capacity=m.capacity, response_length=m.response_len, request_length=m.request_len,
        prompt_length=max_len - 1,
        tau_reuse=m.tau_reuse, tau_hint=m.tau_hint, reuse_min_reward=m.reuse_min_reward,
        tau_dup=m.tau_dup, z=m.z, best_reward=best_reward, alpha=m.alpha, beta=m.beta,
        decay_steps=m.decay_steps, reuse=m.reuse, hints=m.hints, embed_batch=m.embed_batch)
