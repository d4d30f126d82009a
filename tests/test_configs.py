"""The experiment configs: each builds and validates, bad args are named, and the GSM8K
single-vs-multi config trains end to end on generated files."""

import importlib.util
import json
import os

import pytest

from joyagents_jax import config_checks
from joyagents_jax import train

CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "experiments", "configs")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIGS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config


@pytest.mark.parametrize("arg, field, value", [
    ("mode=trajectory", "grpo.mode", "trajectory"), ("topk=2", "grpo.topk", 2),
    ("memory=off", "memory.enabled", False), ("sft_only=true", "grpo.steps", 0),
    ("seed=3", "seed", 3), ("preset=bytes", "tokenizer", "bytes"),
    ("topk=2,preset=bytes", "grpo.topk", 2),
    ("preset=bytes", "grpo.branch_agents", "qa,efc,gfc,math")])
def test_assistant_tiny_args(arg, field, value):
    c = _load("assistant_tiny")(arg)
    config_checks.validate(c)
    node = c
    for part in field.split("."):
        node = node[part]
    assert node == value


def test_bad_args_are_named():
    with pytest.raises(ValueError, match="unknown arg 'colour'"):
        _load("assistant_tiny")("colour=red")
    with pytest.raises(ValueError, match="preset='bpe'; use default or bytes"):
        _load("assistant_tiny")("preset=bpe")
    with pytest.raises(ValueError, match="needs the checkpoint folder"):
        _load("qwen2p5_3b")("")
    with pytest.raises(ValueError, match="starts with single or multi"):
        _load("gsm8k_single_vs_multi")("both")


@pytest.mark.parametrize("mode, agents", [("single", ("master",)), ("multi", ("master", "math"))])
def test_gsm8k_configs_validate(mode, agents, tmp_path):
    c = _load("gsm8k_single_vs_multi")(mode)
    assert tuple(c.agents) == agents and c.dataset == "gsm8k"
    with pytest.raises(ValueError, match="config.gsm8k_dir is empty"):
        config_checks.validate(c)
    c.gsm8k_dir = str(tmp_path)
    config_checks.validate(c)
    c.agents = ("master", "qa")
    with pytest.raises(ValueError, match="master alone or with the math sub-agent"):
        config_checks.validate(c)


@pytest.mark.slow
def test_gsm8k_multi_agent_trains_end_to_end(tmp_path):
    manual = tmp_path / "gsm8k"
    manual.mkdir()
    rows = [{"question": f"Ann has {a} pens and buys {b}. How many?",
             "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
            for a in range(2, 6) for b in range(1, 4)]
    for name, part in (("train.jsonl", rows), ("test.jsonl", rows[:3])):
        (manual / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    c = _load("gsm8k_single_vs_multi")("multi")
    c.gsm8k_dir = str(manual)
    c.sft.update(steps=2, batch_per_agent=2)
    c.grpo.update(steps=1, queries=2, replay=1, group_size=2)
    c.limits.update(max_tokens_per_node=16)
    c.eval.update(examples=2)
    c.sampler.update(min_prompt_bucket=16, min_batch_bucket=1)
    c.pad_to_max_len = False

    result = train.train(c, str(tmp_path / "run"))

    assert 0.0 <= result["eval/test/accuracy"] <= 1.0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["phase"] for r in rows] == ["sft", "sft", "grpo"]
    assert {"sft/loss/master", "sft/loss/math", "grpo/reward/math"} <= set().union(*rows)
