"""Presets carry the released Qwen2.5 shapes: parameter counts match the published sizes."""

import pytest

from joyagents_jax.models import presets, qwen2


# Exact counts of the released checkpoints (sum of their safetensors tensors; the model cards
# round them to 0.49B, 1.54B, 3.09B and 7.61B).
@pytest.mark.parametrize("name, count", [
    ("qwen2.5-0.5b", 494_032_768),
    ("qwen2.5-1.5b", 1_543_714_304),
    ("qwen2.5-3b", 3_085_938_688),
    ("qwen2.5-7b", 7_615_616_512),
])
def test_parameter_counts_match_published(name, count):
    assert qwen2.count_params(presets.get_preset(name)) == count


def test_72b_rounds_to_published():
    assert round(qwen2.count_params(presets.get_preset("qwen2.5-72b")) / 1e9, 1) == 72.7


def test_overrides_and_unknown():
    cfg = presets.get_preset("tiny", dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and cfg.hidden_size == presets.PRESETS["tiny"].hidden_size
    with pytest.raises(ValueError, match="Unknown model preset 'qwen9'.*choose one of"):
        presets.get_preset("qwen9")


def test_benchmark_sizes():
    assert 25e6 < qwen2.count_params(presets.get_preset("small-30m")) < 40e6
    assert 110e6 < qwen2.count_params(presets.get_preset("base-120m")) < 130e6


def test_suite_bpe_presets():
    """deep-bpe is tiny-bpe with 4 layers instead of 2: 0.26M parameters against 0.16M."""
    tiny, deep = presets.get_preset("tiny-bpe"), presets.get_preset("deep-bpe")
    assert deep == tiny.replace(num_layers=4)
    assert (qwen2.count_params(tiny), qwen2.count_params(deep)) == (164_416, 263_232)
