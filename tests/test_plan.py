"""`joyagents plan`: exact byte counts on a tiny system (in process, 1 device, no compile), the
activations of agents in passes (tiny, compiled) and the compiled 3B+3B plan on 8 simulated
devices (a subprocess: `--cpu-devices 8` must precede JAX's start)."""

import dataclasses
import math

import jax
import pytest

from joyagents_jax import plan, sharding
from joyagents_jax.models import presets, qwen2
from tests.test_sharding import run_python

TINY = plan.PlanConfig(groups=(("tiny", 3), ("tiny", 1)), train_batch=2, seq_len=16,
                       rollout_batch=2, cache_len=32)


@pytest.fixture(scope="module")
def tiny_plan() -> plan.Plan:
    """Two groups, built without compiling (the 3B test below compiles a real step)."""
    mesh = sharding.make_mesh()
    groups = [plan.make_group(TINY, mesh, "tiny", 3), plan.make_group(TINY, mesh, "tiny", 1)]
    return plan.Plan(TINY, mesh, groups, activations=12345)


@pytest.mark.parametrize("dtype, size", [("float32", 4), ("bfloat16", 2)])
def test_param_bytes_are_param_count_times_dtype_size(dtype, size):
    mesh = sharding.make_mesh()
    group = plan.make_group(dataclasses.replace(TINY, param_dtype=dtype), mesh, "tiny", 3)
    count = qwen2.count_params(presets.get_preset("tiny"))
    assert group.bytes("params", per_device=False) == 3 * count * size
    assert group.bytes("params", per_device=True) == 3 * count * size  # one device holds all
    # AdamW: mu and nu like the params, plus two int32 counters per agent (Adam's and the
    # learning-rate schedule's).
    assert group.bytes("optimizer", per_device=False) == 2 * 3 * count * size + 3 * 2 * 4
    assert group.bytes("reference", per_device=False) == 3 * count * 2  # bfloat16
    assert group.bytes("chosen", per_device=False) == 3 * count * size  # the params' copy
    unchosen = plan.make_group(dataclasses.replace(TINY, select=False), mesh, "tiny", 3)
    assert unchosen.bytes("chosen", per_device=False) == 0


def test_plan_sums_its_groups(tiny_plan):
    cfg = presets.get_preset("tiny")
    count = qwen2.count_params(cfg)
    assert tiny_plan.total("params") == tiny_plan.per_device("params") == 4 * count * 4
    kv = 2 * 4 * cfg.num_layers * 2 * 32 * cfg.num_kv_heads * cfg.head_dim * 2  # k, v in bf16
    assert tiny_plan.total("kv_cache") == kv
    assert tiny_plan.per_device("activations") == tiny_plan.total("activations") == 12345


def test_format_plan_lists_every_row(tiny_plan):
    text = plan.format_plan(tiny_plan, capacity=1 << 30)
    for label in ("params (float32)", "optimizer (AdamW", "reference policy (bfloat16)",
                  "chosen iterate's policies (grpo.select_every)",
                  "KV cache (rollout 2 x 32", "activations, temps (train 2 x 16)", "total"):
        assert label in text
    assert "device memory 1.00 GiB: fits" in text


def test_agents_in_passes_plan_less_activation_and_kv_cache_memory():
    pc = plan.PlanConfig(groups=(("tiny", 4),), train_batch=4, seq_len=64, rollout_batch=2,
                         cache_len=32)
    one_pass = plan.make_plan(pc)
    passes = plan.make_plan(dataclasses.replace(pc, agents_per_pass=1))
    assert 0 < passes.total("activations") < one_pass.total("activations")
    assert passes.total("kv_cache") * 4 == one_pass.total("kv_cache")  # one agent's live at once
    text = plan.format_plan(passes, capacity=1 << 30)
    assert "activations, temps (train 4 x 64, 1 agent(s) per pass)" in text
    assert "KV cache (rollout 2 x 32, bfloat16, 1 agent(s) per pass)" in text


def test_parse_groups():
    assert plan.parse_groups("3b+3b") == (("qwen2.5-3b", 5),)
    assert plan.parse_groups("qwen2.5-7b:1,qwen2.5-3b:4") == (("qwen2.5-7b", 1), ("qwen2.5-3b", 4))
    with pytest.raises(ValueError, match="Unknown model preset 'qwen9'"):
        plan.parse_groups("qwen9:2")


def test_mesh_larger_than_devices():
    with pytest.raises(sharding.ShardingError, match="needs 2 devices, but only 1"):
        plan.make_plan(plan.PlanConfig(groups=(("tiny", 1),), mesh="data=2"))


PLAN_3B = """
import contextlib, sys
from joyagents_jax import plan
plan.main(["--cpu-devices", "8", "--config", "3b+3b", "--mesh", "fsdp=8"])
with contextlib.redirect_stderr(sys.stdout):
    print("EXIT", plan.main(["--config", "3b+3b", "--mesh", "fsdp=2,tensor=4"]))
    print("EXIT", plan.main(["--config", "3b+3b", "--train-batch", "4"]))
"""


@pytest.fixture(scope="module")
def plan_3b() -> str:
    return run_python(PLAN_3B, devices=None)


def test_3b_plus_3b_table_on_8_devices(plan_3b):
    lines = plan_3b.splitlines()
    assert lines[0] == "Plan on 8 x cpu (mesh agent=1 data=1 fsdp=8 tensor=1)"
    assert "group qwen2.5-3b x 5 agents, 3.086B params per agent" in lines[1]
    rows = {line[:54].strip(): [float(v) for v in line[54:].split()]
            for line in lines[3:11]}
    count = qwen2.count_params(presets.get_preset("qwen2.5-3b"))
    per_device, whole = rows["params (float32)"]
    assert whole == pytest.approx(5 * count * 4 / 2**30, abs=0.005)
    # Everything but the [L, D] norm scales is split 8 ways.
    assert per_device == pytest.approx(whole / 8, rel=0.01)
    assert rows["optimizer (AdamW mu, nu; float32)"][0] == pytest.approx(2 * per_device, rel=0.01)
    assert rows["activations, temps (train 8 x 1024)"][0] > 0
    assert rows["frozen base (none: full fine-tuning)"] == [0.0, 0.0]
    assert rows["chosen iterate's policies (grpo.select_every)"] == [per_device, whole]
    assert math.isclose(rows["total"][0], sum(r[0] for k, r in rows.items() if k != "total"),
                        abs_tol=0.03)


def test_plan_reports_errors_instead_of_crashing(plan_3b):
    errors = [line for line in plan_3b.splitlines() if line.startswith("joyagents plan:")]
    assert errors[0].startswith(
        "joyagents plan: Cannot shard layers/attn/k/bias [5, 36, 2, 128]: dimension 2 (size 2) "
        "is not divisible by mesh axis tensor of size 4.")
    assert errors[1] == ("joyagents plan: Train batch 4 is not divisible by the data-parallel "
                         "size 8 (mesh axes data=1 × fsdp=8); use a multiple of 8.")
    assert [line for line in plan_3b.splitlines() if line.startswith("EXIT")] == ["EXIT 2"] * 2


def test_a_train_config_file_is_planned_from_its_folders_config_json(tmp_path, capsys):
    import transformers

    transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True).save_pretrained(tmp_path)  # no weights
    spec = f"experiments/configs/qwen2p5_3b.py:{tmp_path}"
    fields = plan.from_run_config(spec)
    assert fields == {"groups": ((str(tmp_path), 5),), "param_dtype": "bfloat16",
                      "compute_dtype": "bfloat16", "remat": True, "mesh": "fsdp=-1",
                      "micro_batch": 16, "agents_per_pass": 0, "select": True, "lora_rank": 0,
                      "lora_alpha": 16.0,
                      "lora_targets": "q|k|v|o|gate|up|down"}
    group = plan.make_group(plan.PlanConfig(**fields), sharding.make_mesh(), str(tmp_path), 5)
    assert (group.cfg.hidden_size, group.cfg.num_layers, group.cfg.vocab_size) == (32, 2, 300)
    assert plan.main(["--config", spec, "--train-batch", "2", "--seq-len", "16",
                      "--rollout-batch", "2", "--cache-len", "32"]) == 0
    assert f"group {tmp_path} x 5 agents" in capsys.readouterr().out
    assert plan.main(["--config", "experiments/configs/qwen2p5_3b.py:/no/such/folder"]) == 2
    assert "Unknown model preset '/no/such/folder'" in capsys.readouterr().err


def test_lora_plans_adapters_per_agent_and_the_base_once():
    from joyagents_jax.models import lora

    pc = dataclasses.replace(TINY, lora_rank=4, compute_dtype="bfloat16")
    group = plan.make_group(pc, sharding.make_mesh(), "tiny", 3)
    cfg = presets.get_preset("tiny")
    adapters = sum(math.prod(x.shape) for x in jax.tree.leaves(
        lora.adapter_shapes(qwen2.param_shapes(cfg), pc.lora)))
    assert adapters < qwen2.count_params(cfg) / 5
    assert group.bytes("params", per_device=False) == 3 * adapters * 4  # f32, per agent
    assert group.bytes("reference", per_device=False) == 3 * adapters * 4
    assert group.bytes("chosen", per_device=False) == 3 * adapters * 4
    assert group.bytes("optimizer", per_device=False) == 2 * 3 * adapters * 4 + 3 * 2 * 4
    assert group.bytes("base", per_device=False) == qwen2.count_params(cfg) * 2  # once, bf16
    full = plan.make_group(TINY, sharding.make_mesh(), "tiny", 3)
    assert full.bytes("base", per_device=False) == 0
    lora_plan = plan.Plan(pc, sharding.make_mesh(), [group], activations=0)
    text = plan.format_plan(lora_plan, full_ft=plan.Plan(TINY, sharding.make_mesh(), [full], 0))
    assert "LoRA adapters, rank 4 (float32)" in text and "frozen base, once per group" in text
    assert "full fine-tuning of the same agents, total" in text
