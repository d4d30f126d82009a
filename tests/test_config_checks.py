"""One validation pass over the whole config: every mistake named with its key and fix."""

import math

import ml_collections
import pytest

from joyagents_jax import config as config_lib
from joyagents_jax import config_checks


def _with(**overrides) -> ml_collections.ConfigDict:
    c = config_lib.get_config()
    for key, value in overrides.items():
        node, (*path, last) = c, key.split("__")
        for part in path:
            node = node[part]
        node[last] = value
    return c


def test_the_default_the_byte_default_and_real_checkpoint_configs_are_valid(tmp_path):
    assert config_checks.problems(config_lib.get_config()) == []
    (tmp_path / "config.json").write_text("{}")
    real = config_lib.real_checkpoint_config({"all": (config_lib.get_config().agents,
                                                      str(tmp_path))})
    real.tokenizer = str(tmp_path)
    assert config_checks.problems(real) == []
    real.tokenizer = "suite_bpe"
    assert config_checks.problems(real) == [
        "config.groups.all.checkpoint is set with config.tokenizer='suite_bpe': a checkpoint has "
        "its own tokenizer; set config.tokenizer to its folder."]
    assert config_checks.problems(config_lib.byte_default()) == []


@pytest.mark.parametrize("overrides, fragment", [
    ({"grpo__kl": "k9"}, "config.grpo.kl='k9': not one of k1, k2, k3"),
    ({"attention_impl": "flash"}, "config.attention_impl='flash': not one of xla, cudnn"),
    ({"grpo__min_groups": -1}, "config.grpo.min_groups=-1: must be >= 0 (0 turns dynamic sampling off)"),
    ({"grpo__max_refills": -2}, "config.grpo.max_refills=-2: must be >= 0"),
    ({"sft__extra_worlds": -1}, "config.sft.extra_worlds=-1: must be >= 0"),
    ({"lora__rank": -1}, "config.lora.rank=-1: must be >= 0 (0 = full fine-tuning)"),
    ({"lora__alpha": 0.0}, "config.lora.alpha=0.0: must be > 0"),
    ({"lora__targets": "qkv"}, "config.lora.targets='qkv': must be a regex matching the whole"),
    ({"lora__targets": "(q"}, "config.lora.targets='(q': must be a regex"),
    ({"lora__groups": "all,subs"}, "config.lora.groups='all,subs': no agent group named ['subs']"),
    ({"grpo__branch_agents": "qa,router"},
     "config.grpo.branch_agents='qa,router': no agent named ['router']"),
    ({"grpo__branch_min_change": 1.0}, "config.grpo.branch_min_change=1.0: must be >= 0 and < 1"),
    ({"grpo__branch_min_change": 0.1, "grpo__greedy_completions": True},
     "config.grpo.branch_min_change=0.1: it reads how likely a sample repeats tau0's sampled"),
    ({"grpo__unbranched_memory": "master"},
     "config.grpo.unbranched_memory='master': not one of off, eval, all"),
    ({"grpo__aggregation": "bogus"}, "config.grpo.aggregation='bogus': not one of token_mean"),
    ({"grpo__advantage": "bogus"}, "config.grpo.advantage='bogus': not one of std"),
    ({"grpo__optimizer": "adam"}, "config.grpo.optimizer='adam': not one of adamw, sgd"),
    ({"grpo__schedule": "linear"}, "config.grpo.schedule='linear': not one of constant, cosine"),
    ({"sft__learning_rate": math.nan}, "config.sft.learning_rate=nan: must be finite"),
    ({"grpo__learning_rate": -1e-5}, "config.grpo.learning_rate=-1e-05: must be > 0"),
    ({"grpo__beta": -1.0}, "config.grpo.beta=-1.0: must be >= 0"),
    ({"grpo__neg_weight": -0.5},
     "config.grpo.neg_weight=-0.5: must be >= 0 (the scale of negative advantages; 1 is GRPO)"),
    ({"grpo__eps_low": 2.0}, "config.grpo.eps_low=2.0: must be >= 0 and < 1"),
    ({"grpo__temperature": 0.0}, "config.grpo.temperature=0.0: must be > 0"),
    ({"grpo__top_p": 1.5}, "config.grpo.top_p=1.5: must be > 0 and <= 1"),
    ({"memory__capacity": 0}, "config.memory.capacity=0: must be >= 1"),
    ({"memory__tau_hint": 1.0}, "config.memory.tau_hint=1.0 > tau_reuse=0.99995"),
    ({"eval__grpo_every": -1}, "config.eval.grpo_every=-1: must be >= 0"),
    ({"checkpoint__every": -2}, "config.checkpoint.every=-2: must be >= 0"),
    ({"checkpoint__keep": 0}, "config.checkpoint.keep=0: must be >= 1"),
    ({"grpo__topk": -1}, "config.grpo.topk=-1: must be >= 0"),
    ({"grpo__seed": -2}, "config.grpo.seed=-2: must be >= -1 (-1 uses config.seed)"),
    ({"sft__demo_seed": -2}, "config.sft.demo_seed=-2: must be >= -1 (-1 uses config.seed)"),
    ({"init_seed": -3}, "config.init_seed=-3: must be >= -1 (-1 uses config.seed)"),
    ({"sft__order": "sorted"}, "config.sft.order='sorted': not one of random, epochs"),
    ({"grpo__group_size": 1}, "config.grpo.group_size=1: must be >= 2"),
    ({"grpo__mode": "beam"}, "config.grpo.mode='beam': not one of nodewise"),
    ({"grpo__micro_batch": 12}, "config.grpo.micro_batch=12: must be a power of two"),
    ({"agents_per_pass": -1}, "config.agents_per_pass=-1: must be >= 0 (0 runs every"),
    ({"sampler__decode_phases": 0}, "config.sampler.decode_phases=0: must be >= 1"),
    ({"grpo__memory_groups": "skip"}, "config.grpo.memory_groups='skip': not one of keep, drop"),
    ({"grpo__query_order": "zipf"}, "config.grpo.query_order='zipf': not one of traffic, questions"),
    ({"grpo__query_power": 1.5}, "config.grpo.query_power=1.5: must be >= 0 and <= 1"),
    ({"grpo__query_power": 0.5, "grpo__query_order": "questions"},
     "config.grpo.query_power=0.5 with grpo.query_order=questions"),
    ({"grpo__grounding_match": "letters"},
     "config.grpo.grounding_match='letters': not one of word, chars"),
    ({"grpo__memory_groups": "drop", "grpo__mode": "full_tree"},
     "full_tree rollouts do not mark memory-answered"),
    ({"grpo__gold_branches": True, "grpo__mode": "full_tree"},
     "config.grpo.gold_branches=True: a gold output joins node groups, which only node-wise"),
    ({"grpo__suffix_credit": True, "grpo__topk": 5},
     "config.grpo.suffix_credit=True: samples then carry their GRPO advantage"),
    ({"grpo__suffix_credit": True, "grpo__advantage": "loo"}, "advantage='loo'"),
    ({"grpo__self_imitation": 8, "memory__enabled": False},
     "config.grpo.self_imitation=8: it imitates the memory's best entries"),
    ({"grpo__self_imitation": -1}, "config.grpo.self_imitation=-1: must be >= 0"),
    ({"grpo__replay": -1}, "config.grpo.replay=-1: must be >= 0"),
    ({"grpo__replay": 36}, "config.grpo.replay=36: a step re-asks at most grpo.replay"),
    ({"grpo__select_every": -4}, "config.grpo.select_every=-4: must be >= 0"),
    ({"grpo__select_examples": 0}, "config.grpo.select_examples=0: must be >= 1"),
    ({"grpo__select_split": "test"},
     "config.grpo.select_split='test': not one of train, validation"),
    ({"grpo__memory_members": 0}, "config.grpo.memory_members=0: must be >= 1"),
    ({"grpo__domain_repeats": "cooperation=0"},
     "config.grpo.domain_repeats='cooperation=0': 'cooperation=0' is not 'domain=n' with a "
     "whole n >= 1; write e.g. 'cooperation=2'"),
    ({"grpo__domain_repeats": "cooperation"}, "'cooperation' is not 'domain=n'"),
    ({"grpo__domain_repeats": "math=2,math=3"}, "domain 'math' is given twice"),
    ({"grpo__domain_repeats": "chess=2"},
     "config.grpo.domain_repeats='chess=2': assistant_suite has no domain 'chess'; its domains "
     "are math, qa, efc, gfc, cooperation."),
    ({"grpo__memory_members": 3, "grpo__suffix_credit": True},
     "config.grpo.memory_members=3 with grpo.suffix_credit=True"),
    ({"grpo__greedy_completions": True, "grpo__tempered_loss": True},
     "config.grpo.greedy_completions=True with grpo.tempered_loss=True: greedy outputs"),
    ({"groups__all__model": "qwen9"}, "config.groups.all.model='qwen9': not a preset"),
    ({"groups__all__checkpoint": "/nonexistent/qwen", "tokenizer": "bytes"},
     "no config.json there"),
    ({"tokenizer": "/nonexistent/tok"}, "config.tokenizer='/nonexistent/tok': not a folder"),
    ({"pad_rows_to": 48}, "config.pad_rows_to=48: must be a power of two or 0"),
    ({"pad_rows_to": -1}, "config.pad_rows_to=-1: must be >= 0"),
    ({"groups__all__model": "tiny"}, "config.groups.all.model='tiny' has a vocabulary of 264"),
    ({"groups__all__model": "base-120m"}, "use model 'tiny-bpe'"),
    ({"suite": "huge"}, "config.suite='huge': not one of"),
    ({"eval__splits": ("test", "dev")}, "config.eval.splits=['test', 'dev']"),
    ({"mesh": "data=3,fsdp=5"}, "config.mesh='data=3,fsdp=5'"),
    ({"mesh": "rows=2"}, "Unknown mesh axes ['rows']"),
    ({"agents": ("master", "qa", "chef"), "groups__all__agents": ("master", "qa", "chef")},
     "unknown agent(s) ['chef']"),
    ({"agents": ("master", "math"), "groups__all__agents": ("master", "math")},
     "['efc', 'gfc', 'qa'] are missing"),
    ({"agents": ("master", "qa", "efc", "gfc", "math", "math"),
      "groups__all__agents": ("master", "qa", "efc", "gfc", "math", "math")},
     "lists an agent twice"),
    ({"agents": ("qa", "efc", "gfc", "math"), "groups__all__agents": ("qa", "efc", "gfc", "math")},
     "must include 'master'"),
    ({"groups__all__agents": ("master", "qa")}, "must place every agent"),
])
def test_each_mistake_is_one_line_naming_the_key(overrides, fragment):
    found = config_checks.problems(_with(**overrides))
    assert len(found) == 1, found
    assert fragment in found[0]
    with pytest.raises(config_checks.ConfigError, match="1 config problem"):
        config_checks.validate(_with(**overrides))


def test_gsm8k_has_no_validation_split_to_select_on():
    c = _with(agents=("master",), groups__all__agents=("master",), dataset="gsm8k",
              gsm8k_dir="/x", eval__splits=("test",), grpo__select_split="validation")
    assert config_checks.problems(c) == [
        "config.grpo.select_split=validation: GSM8K has no validation split (train and test "
        "only); use grpo.select_split=train, or grpo.select_every=0."]
    c.grpo.select_every = 0  # nothing is scored, so no split is needed
    assert not config_checks.problems(c)


def test_gsm8k_repeats_only_its_math_domain():
    c = _with(agents=("master",), groups__all__agents=("master",), dataset="gsm8k",
              gsm8k_dir="/x", eval__splits=("test",), grpo__domain_repeats="math=2")
    assert not config_checks.problems(c)
    c.grpo.domain_repeats = "cooperation=2"
    assert config_checks.problems(c) == [
        "config.grpo.domain_repeats='cooperation=2': gsm8k has no domain 'cooperation'; its "
        "domains are math."]


def test_branch_agents_must_list_an_agent_of_the_config():
    """Branching at the sub-agents' nodes only (the byte default's), a master-only config would
    form no node group and train nothing, which is refused; listing every agent ("") is valid."""
    c = _with(agents=("master",), groups__all__agents=("master",), dataset="gsm8k",
              grpo__branch_agents="qa,efc,gfc,math")
    found = [p for p in config_checks.problems(c) if "branch_agents" in p]
    assert found == ["config.grpo.branch_agents='qa,efc,gfc,math': lists none of config.agents "
                     "(master), so no node group forms and GRPO trains nothing; list some of "
                     "them, or leave it empty to branch at every agent's nodes."]
    c.grpo.branch_agents = ""
    assert not [p for p in config_checks.problems(c) if "branch_agents" in p]
    c.grpo.mode = "trajectory"  # no node groups anyway: the list does not apply
    c.grpo.branch_agents = "qa"
    assert not [p for p in config_checks.problems(c) if "branch_agents" in p]


def test_every_mistake_is_reported_at_once():
    c = _with(grpo__kl="k9", sft__learning_rate=math.nan, eval__sft_every=-1, memory__capacity=0)
    message = str(pytest.raises(config_checks.ConfigError, config_checks.validate, c).value)
    assert message.startswith("4 config problem(s):")
    for key in ("grpo.kl", "sft.learning_rate", "eval.sft_every", "memory.capacity"):
        assert f"config.{key}=" in message


def test_unknown_and_missing_keys_are_named():
    c = config_lib.get_config()
    c.grpo.topkk = 3
    found = config_checks.problems(c)
    assert found == [f"config.grpo.topkk: unknown key (a typo?); the keys of config.grpo are "
                     f"{', '.join(sorted(config_lib.get_config().grpo.keys()))}."]
    c = config_lib.get_config()
    del c.memory["alpha"]
    assert config_checks.problems(c)[0].startswith("config.memory.alpha: missing")
    c = config_lib.get_config()
    c.groups.all.size = "big"
    assert "config.groups.all: has keys" in config_checks.problems(c)[0]


def test_zero_means_phase_ends_only_and_is_valid():
    assert config_checks.problems(_with(eval__sft_every=0, eval__grpo_every=0, checkpoint__every=0, grpo__topk=0)) == []


def test_batch_must_split_over_the_mesh(monkeypatch):
    monkeypatch.setattr("jax.device_count", lambda: 8)
    found = config_checks.problems(_with(mesh="data=2,fsdp=4", sft__batch_per_agent=4))
    assert found == ["config.sft.batch_per_agent=4: not divisible by the mesh's data x fsdp "
                     "size 8; use a multiple of 8."]


def test_a_multi_process_job_needs_a_mesh(monkeypatch):
    monkeypatch.setattr("jax.process_count", lambda: 2)
    monkeypatch.setattr("jax.device_count", lambda: 4)
    assert config_checks.problems(_with(mesh="")) == [
        "config.mesh='': keeps every array on one device, process 0's, which the other 1 "
        "process(es) of this job cannot reach; give the job a mesh over its 4 devices, e.g. "
        "--config.mesh=fsdp=-1 (or data=2,fsdp=-1)."]
    assert config_checks.problems(_with(mesh="fsdp=-1")) == []


def test_agents_in_passes_are_refused_when_the_mesh_splits_the_agents(monkeypatch):
    monkeypatch.setattr("jax.device_count", lambda: 8)
    found = config_checks.problems(_with(mesh="agent=2,fsdp=4", agents_per_pass=1))
    assert found == ["config.agents_per_pass=1: runs a group's agents one pass after another, "
                     "but config.mesh='agent=2,fsdp=4' splits them over 2 devices on its agent "
                     "axis to run side by side; set agents_per_pass=0 or drop the agent axis "
                     "from the mesh."]
    assert config_checks.problems(_with(mesh="agent=2,fsdp=4", agents_per_pass=0)) == []


def test_extra_worlds_are_refused_outside_the_assistant_suite():
    found = config_checks.problems(_with(sft__extra_worlds=2, dataset="gsm8k", gsm8k_dir="/x"))
    assert any("config.sft.extra_worlds=2: other worlds exist only for the assistant suite"
               in p for p in found), found


def test_override_sets_dotted_keys_in_place():
    c = config_lib.get_config()
    out = config_lib.override(c, {"grpo.topk": 2, "groups.all.model": "small-30m", "seed": 3})
    assert out is c and (c.grpo.topk, c.groups.all.model, c.seed) == (2, "small-30m", 3)


def test_domain_repeats_reads_domain_n_parts():
    assert config_lib.domain_repeats("") == {}
    assert config_lib.domain_repeats(" cooperation=2, math=3 ,") == {"cooperation": 2, "math": 3}
    for bad in ("cooperation", "=2", "math=1.5", "math=-1", "math=0", "qa=2,qa=2"):
        with pytest.raises(ValueError):
            config_lib.domain_repeats(bad)


def test_byte_default_is_the_default_of_sessions_57_to_63():
    """The old default stays reachable: bytes, the byte model, 900 SFT steps, node groups at the
    sub-agents' nodes only; building it leaves the embedded default as it is."""
    c = config_lib.byte_default()
    assert (c.tokenizer, c.groups.all.model, c.max_len, c.sampler.min_prompt_bucket,
            c.sft.steps, c.sft.shared_steps, c.grpo.branch_agents) == (
        "bytes", "tiny", 512, 256, 900, 900, "qa,efc,gfc,math")
    d = config_lib.get_config()
    assert (d.tokenizer, d.groups.all.model, d.max_len, d.sft.steps, d.grpo.branch_agents) == (
        "suite_bpe", "tiny-bpe", 256, 600, "")
