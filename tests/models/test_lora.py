"""LoRA adapters: a zero b equals the base bitwise, every adapter gets a gradient, merging is
exact, and vmap maps the adapters alone."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from joyagents_jax.models import lora, qwen2

CFG = qwen2.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2)


def _inputs():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 9)), jnp.int32)
    mask = jnp.asarray(np.arange(9)[None] >= np.array([[0], [3], [6]]))
    return tokens, mask


def _trained_adapters(base, cfg, key):
    """Adapters with non-zero b, as after some training."""
    adapters = lora.init_adapters(base, cfg, key)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: 0.05 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
        if p[-1].key == "b" else x, adapters)


def test_config_checks():
    assert lora.LoRAConfig(rank=4, alpha=8.0).scale == 2.0
    assert lora.LoRAConfig(rank=4, targets="q|v").projections == ("q", "v")
    with pytest.raises(ValueError, match="rank"):
        lora.LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="matches none"):
        lora.LoRAConfig(rank=4, targets="qkv")


def test_adapter_shapes_follow_each_kernel():
    base = qwen2.param_shapes(CFG)
    shapes = lora.adapter_shapes(base, lora.LoRAConfig(rank=3))
    attn, mlp = shapes["layers"]["attn"], shapes["layers"]["mlp"]
    assert attn["q"]["a"].shape == (2, 32, 3) and attn["q"]["b"].shape == (2, 3, 4, 8)
    assert attn["k"]["b"].shape == (2, 3, 2, 8)
    assert attn["o"]["a"].shape == (2, 4, 8, 3) and attn["o"]["b"].shape == (2, 3, 32)
    assert mlp["down"]["a"].shape == (2, 48, 3) and mlp["down"]["b"].shape == (2, 3, 32)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))


def test_zero_b_gives_the_base_logits_bitwise():
    base = qwen2.init_params(CFG, jax.random.key(0))
    adapters = lora.init_adapters(base, lora.LoRAConfig(rank=4), jax.random.key(1))
    assert all(np.any(np.asarray(ab["a"]) != 0) and not np.any(np.asarray(ab["b"]))
               for sec in adapters["layers"].values() for ab in sec.values())
    tokens, mask = _inputs()
    ours = qwen2.forward(CFG, lora.LoRAParams(base, adapters, 4.0), tokens, mask=mask).logits
    ref = qwen2.forward(CFG, base, tokens, mask=mask).logits
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("targets", ["q|k|v|o|gate|up|down", "q|v"])
def test_unmerged_equals_merged(targets):
    cfg = lora.LoRAConfig(rank=4, alpha=8.0, targets=targets)
    base = qwen2.init_params(CFG, jax.random.key(0))
    adapters = _trained_adapters(base, cfg, jax.random.key(1))
    tokens, mask = _inputs()
    unmerged = qwen2.forward(CFG, lora.LoRAParams(base, adapters, cfg.scale), tokens, mask=mask)
    merged = qwen2.forward(CFG, lora.merge(base, adapters, cfg.scale), tokens, mask=mask)
    plain = qwen2.forward(CFG, base, tokens, mask=mask)
    chex.assert_trees_all_close(unmerged.logits, merged.logits, atol=1e-5)
    assert np.abs(np.asarray(unmerged.logits - plain.logits)).max() > 1e-3  # adapters matter


def test_every_adapter_gets_a_gradient():
    cfg = lora.LoRAConfig(rank=2)
    base = qwen2.init_params(CFG, jax.random.key(0))
    adapters = _trained_adapters(base, cfg, jax.random.key(1))
    tokens, mask = _inputs()

    def loss(params):
        return jnp.mean(qwen2.forward(CFG, params, tokens, mask=mask).logits ** 2)

    adapter_grads = jax.grad(lambda a: loss(lora.LoRAParams(base, a, cfg.scale)))(adapters)
    chex.assert_trees_all_equal_shapes(adapter_grads, adapters)
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(adapter_grads))


def test_stacked_agents_vmap_over_adapters_only():
    cfg = lora.LoRAConfig(rank=2)
    base = qwen2.init_params(CFG, jax.random.key(0))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                           *[_trained_adapters(base, cfg, jax.random.key(i)) for i in range(3)])
    params = lora.LoRAParams(base, stacked, cfg.scale)
    assert lora.num_agents(params) == 3
    tokens, mask = _inputs()
    run = lambda p: qwen2.forward(CFG, p, tokens, mask=mask).logits
    logits = jax.vmap(run, in_axes=(lora.agent_axes(params),))(params)
    chex.assert_shape(logits, (3, 3, 9, CFG.vocab_size))
    for i in range(3):
        chex.assert_trees_all_close(logits[i], run(lora.pick(params, i)), atol=1e-6)
