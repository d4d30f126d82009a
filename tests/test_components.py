"""Every key of the run config reaches the component that uses it (or the loop itself)."""

import dataclasses

import pytest

from joyagents_jax import components, config_checks
from joyagents_jax import config as config_lib

# A valid value different from the default, for every key a component reads.
CHANGED = {
    "limits.max_nodes": 5, "limits.max_tokens_per_node": 40, "limits.max_observation_chars": 50,
    "sft.learning_rate": 1e-3, "sft.warmup_steps": 3, "sft.weight_decay": 0.01,
    "sft.clip_norm": 0.5, "sft.demo_wrong_route": 0.2, "sft.demo_wrong_tool": 0.3,
    "sft.demo_redundant_call": 0.4,
    "grpo.group_size": 6, "grpo.mode": "trajectory", "grpo.topk": 2, "grpo.select": "agents",
    "grpo.micro_batch": 4, "grpo.inner_steps": 3, "grpo.beta": 0.01, "grpo.eps_low": 0.1,
    "grpo.eps_high": 0.3, "grpo.kl": "k1", "grpo.aggregation": "token_mean",
    "grpo.advantage": "loo", "grpo.optimizer": "sgd", "grpo.learning_rate": 1e-6,
    "grpo.schedule": "cosine", "grpo.warmup_steps": 4,
    "grpo.clip_norm": 0.7, "grpo.temperature": 0.9, "grpo.tempered_loss": True, "grpo.top_p": 0.9, "grpo.top_k": 20,
    "grpo.w_format": 0.2, "grpo.w_efficiency": 0.1, "grpo.w_grounding": 0.3,
    "grpo.grounding_match": "chars", "grpo.memory_branches": False, "grpo.neg_weight": 0.5,
    "grpo.gold_branches": True, "grpo.share_identical": False,
    "grpo.suffix_credit": True, "grpo.greedy_completions": True, "grpo.subagent_credit": True,
    "grpo.branch_agents": "qa,math", "grpo.branch_min_change": 0.05,
    "grpo.unbranched_memory": "off", "grpo.memory_members": 2,
    "memory.capacity": 7, "memory.response_len": 5, "memory.request_len": 6,
    "memory.tau_reuse": 0.99999, "memory.tau_hint": 0.999, "memory.hints": True, "memory.reuse": False,
    "memory.reuse_min_reward": 0.5, "memory.tau_dup": 0.93, "memory.z": 1.5,
    "memory.decay_steps": 9.0, "memory.alpha": 0.3, "memory.beta": 0.7, "memory.embed_batch": 3,
}
SECTIONS = ("limits", "sft", "grpo", "memory")


def _set(c, key, value):
    section, name = key.split(".")
    c[section][name] = value


def test_every_key_is_read_by_a_component_or_the_loop():
    c = config_lib.get_config()
    keys = {f"{s}.{k}" for s in SECTIONS for k in c[s]}
    assert keys == set(CHANGED) | set(components.LOOP_KEYS)


@pytest.mark.parametrize("key", sorted(CHANGED))
def test_a_changed_key_changes_what_is_built(key):
    c = config_lib.get_config()
    default = components.build(c)
    _set(c, key, CHANGED[key])
    changed = components.build(c)
    differ = [f for f in components.Components._fields
              if getattr(default, f) != getattr(changed, f)]
    assert differ, f"config.{key} reaches no component"


def test_values_arrive_unchanged_where_names_match():
    c = config_lib.get_config()
    for key, value in CHANGED.items():
        # mode and suffix_credit switch advantage to "given"; branch_min_change is refused
        # beside greedy_completions
        if key not in ("grpo.mode", "grpo.suffix_credit", "grpo.branch_min_change"):
            _set(c, key, value)
    parts = components.build(c)
    assert dataclasses.asdict(parts.limits) == dict(c.limits)
    assert (parts.memory.capacity, parts.memory.response_length, parts.memory.alpha,
            parts.memory.reuse, parts.memory.embed_batch) == (7, 5, 0.3, False, 3)
    assert (parts.grpo_step.topk, parts.grpo_step.select, parts.grpo_step.advantage,
            parts.grpo_step.micro_batch, parts.grpo_step.loss.kl) == (2, "agents", "loo", 4, "k1")
    assert (parts.sampling.temperature, parts.sampling.top_k, parts.sampling.max_new_tokens) == \
        (0.9, 20, 40)
    assert (parts.sft_optim.weight_decay, parts.grpo_optim.learning_rate) == (0.01, 1e-6)
    # the cosine horizon counts optimizer updates: warmup + steps x inner steps
    assert (parts.grpo_optim.schedule, parts.grpo_optim.total_steps) == \
        ("cosine", 4 + c.grpo.steps * 3)
    assert parts.rollout.rewards.w_format == 0.2 and parts.rollout.group_size == 6
    assert parts.rollout.rewards.w_grounding == 0.3
    assert parts.rollout.rewards.grounding_match == "chars"


@pytest.mark.parametrize("key,value", [("grpo.mode", "trajectory"), ("grpo.mode", "full_tree"),
                                       ("memory.enabled", False), ("memory.in_rollouts", False)])
def test_memory_branches_only_where_rollouts_read_the_memory(key, value):
    """The default's memory_branches is a no-op, not an error, where no rollout node is
    memory-answered: `--config.grpo.mode=trajectory` alone is a valid ablation."""
    c = config_lib.get_config()
    assert components.build(c).rollout.memory_branches
    _set(c, key, value)
    assert not components.build(c).rollout.memory_branches
    assert config_checks.problems(c) == []


@pytest.mark.parametrize("mode", ["trajectory", "full_tree"])
@pytest.mark.parametrize("switch", ["share_identical", "greedy_completions", "subagent_credit"])
def test_node_group_switches_only_in_nodewise_rollouts(mode, switch):
    """share_identical (on by default), greedy_completions and subagent_credit are no-ops, not
    errors, where rollouts form no node groups: `--config.grpo.mode=trajectory` alone is a
    valid ablation."""
    c = config_lib.get_config()
    c.grpo[switch] = True
    assert getattr(components.build(c).rollout, switch)
    c.grpo.mode = mode
    assert not getattr(components.build(c).rollout, switch)
    assert config_checks.problems(c) == []


@pytest.mark.parametrize("mode", ["trajectory", "full_tree"])
@pytest.mark.parametrize("key,value,built,off", [
    ("branch_agents", "qa,efc,gfc,math", ("qa", "efc", "gfc", "math"), ()),
    ("branch_min_change", 0.05, 0.05, 0.0), ("unbranched_memory", "all", True, False)])
def test_branch_choices_only_in_nodewise_rollouts(mode, key, value, built, off):
    """grpo.branch_agents, branch_min_change and unbranched_memory are no-ops outside node-wise
    rollouts, like the switches above."""
    c = config_lib.get_config()
    c.grpo[key] = value
    assert getattr(components.build(c).rollout, key) == built
    c.grpo.mode = mode
    assert getattr(components.build(c).rollout, key) == off
    assert config_checks.problems(c) == []


@pytest.mark.parametrize("mode", ["trajectory", "full_tree"])
def test_suffix_credit_only_in_nodewise_rollouts(mode):
    """suffix_credit is a no-op, not an error, outside node-wise rollouts (trajectory GRPO
    trains every node anyway); with it node-wise steps take advantages as given."""
    c = config_lib.get_config()
    c.grpo.suffix_credit = True
    parts = components.build(c)
    assert parts.rollout.suffix_credit and parts.grpo_step.advantage == "given"
    c.grpo.mode = mode
    assert not components.build(c).rollout.suffix_credit
    assert config_checks.problems(c) == []


@pytest.mark.parametrize("value,expected", [(1, 1), (3, 3), (0, None)])
def test_agents_per_pass_reaches_the_grpo_step(value, expected):
    c = config_lib.get_config()
    c.agents_per_pass = value
    assert components.build(c).grpo_step.agents_per_pass == expected


@pytest.mark.parametrize("choice,agents", [("off", ()), ("all", ()),
                                           ("eval", ("qa", "efc", "gfc", "math"))])
def test_rollouts_read_the_unbranched_agents_memory_unless_eval(choice, agents):
    """grpo.unbranched_memory="eval": GRPO's rollouts read only the branched agents' entries;
    "all" (and "off", which writes none for the others) read every agent's."""
    c = config_lib.get_config()
    c.grpo.update(unbranched_memory=choice, branch_agents="qa,efc,gfc,math")
    assert components.rollout_memory_agents(c) == agents
    c.grpo.branch_agents = ""
    assert components.rollout_memory_agents(c) == ()
