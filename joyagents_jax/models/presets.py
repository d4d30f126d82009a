"""Model presets: the released Qwen2.5 shapes and tiny configs for tests and the CPU default.

Shapes are the ones in the official Qwen2.5 `config.json` files (hidden, intermediate, layers,
heads, kv heads, vocab, tied embeddings, rope theta, rms eps). A checkpoint's own `config.json` always
wins when loading (`hf_io.config_from_hf`); presets serve random-weight runs, `plan` and tests.
"""

from __future__ import annotations

from joyagents_jax.models.qwen2 import Qwen2Config
from joyagents_jax.tokenizers import SUITE_BPE_VOCAB

_QWEN_VOCAB_SMALL = 151936  # 0.5B-3B (tied embeddings)
_QWEN_VOCAB_LARGE = 152064  # 7B and larger (separate lm_head)


def _qwen25(hidden, inter, layers, heads, kv, vocab, tie):
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_embeddings=tie, max_position_embeddings=32768)


# The embedded CPU default: byte vocabulary (see tokenizers.ByteTokenizer), ~0.1M params. Two
# heads of 32 (one kv head): the T x T attention work scales with the head count, and on a
# 2-core CPU this trains ~1.4x faster than four heads of 16 at equal parameters.
_TINY = Qwen2Config(vocab_size=264, hidden_size=64, intermediate_size=192, num_layers=2,
                    num_heads=2, num_kv_heads=1, rope_theta=1e4, max_position_embeddings=1024,
                    scan_layers=False)

PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, _QWEN_VOCAB_SMALL, True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, _QWEN_VOCAB_SMALL, True),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, _QWEN_VOCAB_SMALL, True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, _QWEN_VOCAB_LARGE, False),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, _QWEN_VOCAB_LARGE, False),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, _QWEN_VOCAB_LARGE, False),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, _QWEN_VOCAB_LARGE, False),
    "tiny": _TINY,
    # "tiny" with room for a suite BPE's ids (config.tokenizer="suite_bpe"): the default's agents.
    "tiny-bpe": _TINY.replace(vocab_size=SUITE_BPE_VOCAB),
    # "tiny-bpe" with 4 layers (0.26M parameters against 0.16M). The default's GRPO phase with
    # it took ~1.6x the time and ended 2.2 points higher alone on 3 seeds (seed noise), while
    # both baselines gained more: benchmarks/RESULTS.md, "Four layers instead of two".
    "deep-bpe": _TINY.replace(vocab_size=SUITE_BPE_VOCAB, num_layers=4),
    # ~30M parameters: the sampler benchmark's mid size (byte vocabulary). Unrolled layers: on
    # CPU the scanned backward copies every layer's saved activations out of the stacked
    # buffers, and the train step runs ~10% slower (benchmarks/RESULTS.md, "GRPO train step").
    "small-30m": Qwen2Config(vocab_size=264, hidden_size=512, intermediate_size=1536,
                             num_layers=9, num_heads=8, num_kv_heads=2, rope_theta=1e4,
                             max_position_embeddings=4096, scan_layers=False),
    # ~120M parameters: the benchmarks' large CPU size (byte vocabulary, Qwen2.5's 6:1 GQA).
    "base-120m": Qwen2Config(vocab_size=264, hidden_size=768, intermediate_size=3072,
                             num_layers=14, num_heads=12, num_kv_heads=2, rope_theta=1e4,
                             max_position_embeddings=4096, scan_layers=False),
}


def get_preset(name: str, **overrides) -> Qwen2Config:
    """A preset by name, with optional field overrides (e.g. dtype='bfloat16')."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    return PRESETS[name].replace(**overrides)
