"""Random tiny HF Qwen2 checkpoints (PyTorch reference), built locally: no hub access."""

import pytest

# (tied, kv heads 1 and > 1, rope theta 1e6 and 1e4, eps) — the parity matrix of the model tests.
TINY_CONFIGS = {
    "tied_kv1": dict(vocab=97, hidden=32, inter=64, layers=2, heads=4, kv=1, theta=1e6, tie=True),
    "untied_kv2": dict(vocab=101, hidden=48, inter=96, layers=3, heads=6, kv=2, theta=1e4, tie=False),
    "untied_mha": dict(vocab=64, hidden=32, inter=80, layers=2, heads=2, kv=2, theta=1e6, tie=False,
                       eps=1e-5),
}


def build_hf_qwen2(folder, *, vocab, hidden, inter, layers, heads, kv, theta, tie, eps=1e-6,
                   seed=0, max_shard_size=None):
    """Saves a random Qwen2ForCausalLM (eager attention, f32) with non-zero biases and norms."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": theta}, tie_word_embeddings=tie,
        max_position_embeddings=256, attn_implementation="eager")
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kw)
    return model


@pytest.fixture(params=sorted(TINY_CONFIGS))
def hf_model(request, tmp_path):
    """(folder, torch model, config kwargs) for each tiny config."""
    kw = TINY_CONFIGS[request.param]
    folder = tmp_path / request.param
    return str(folder), build_hf_qwen2(folder, **kw), kw
