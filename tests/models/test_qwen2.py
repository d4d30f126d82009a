"""Our Qwen2 forward vs transformers' PyTorch Qwen2ForCausalLM, and KV-cache consistency."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from joyagents_jax.models import hf_io, qwen2


def _left_padded(rng, vocab, lengths, t):
    tokens = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), bool)
    for i, n in enumerate(lengths):
        tokens[i, t - n:] = rng.integers(0, vocab, n)
        mask[i, t - n:] = True
    return tokens, mask


def _torch_logits(model, tokens, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.numpy()


def test_logits_match_transformers_left_padded(hf_model):
    folder, model, kw = hf_model
    params, cfg = hf_io.load_params(folder)
    cfg = cfg.replace(scan_layers=kw["layers"] != 3)  # both layer loops meet the reference
    tokens, mask = _left_padded(np.random.default_rng(0), kw["vocab"], [11, 7, 1, 4], 11)
    ours = np.asarray(qwen2.forward(cfg, params, jnp.asarray(tokens), mask=jnp.asarray(mask)).logits)
    ref = _torch_logits(model, tokens, mask)
    assert ours.shape == ref.shape == (4, 11, kw["vocab"])
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=0)
    # Each padded row equals the same row run alone, unpadded.
    for i in range(tokens.shape[0]):
        alone = tokens[i:i + 1, mask[i]]
        single = np.asarray(qwen2.forward(cfg, params, jnp.asarray(alone)).logits)[0]
        np.testing.assert_allclose(ours[i][mask[i]], single, atol=1e-5, rtol=0)


def test_hidden_states_match_transformers(hf_model):
    folder, model, kw = hf_model
    params, cfg = hf_io.load_params(folder)
    tokens = np.random.default_rng(1).integers(0, kw["vocab"], (2, 9)).astype(np.int32)
    ours = np.asarray(qwen2.forward(cfg, params, jnp.asarray(tokens)).hidden)
    with torch.no_grad():
        ref = model.model(input_ids=torch.tensor(tokens, dtype=torch.long)).last_hidden_state.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("remat, scan", [(False, True), (True, True), (False, False)])
def test_prefill_then_decode_equals_full_forward(remat, scan):
    cfg = qwen2.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, remat=remat, scan_layers=scan)
    params = qwen2.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params)
    tokens, mask = _left_padded(np.random.default_rng(2), 50, [9, 5, 2], 9)
    full = qwen2.forward(cfg, params, jnp.asarray(tokens), mask=jnp.asarray(mask)).logits

    prefill = 4  # first 4 slots in one call, the rest one token at a time
    cache = qwen2.init_cache(cfg, batch=3, length=12)
    positions = qwen2.positions_from_mask(jnp.asarray(mask))
    step = jax.jit(lambda p, tok, pos, m, c: qwen2.forward(cfg, p, tok, pos, m, c), donate_argnums=4)
    out = step(params, tokens[:, :prefill], positions[:, :prefill], mask[:, :prefill], cache)
    pieces, cache = [out.logits], out.cache
    for t in range(prefill, 9):
        out = step(params, tokens[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1], cache)
        pieces.append(out.logits)
        cache = out.cache
    assert int(cache.index) == 9
    incremental = jnp.concatenate(pieces, axis=1)
    np.testing.assert_allclose(np.asarray(incremental)[mask], np.asarray(full)[mask], atol=1e-5, rtol=0)


def test_unstacked_layers_give_the_same_hidden_states():
    cfg = qwen2.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=3,
                            num_heads=4, num_kv_heads=2)
    params = qwen2.init_params(cfg, jax.random.key(0))
    unstacked = qwen2.unstack_layers(cfg, params)
    assert isinstance(unstacked["layers"], tuple) and len(unstacked["layers"]) == 3
    np.testing.assert_array_equal(unstacked["layers"][2]["mlp"]["up"]["kernel"],
                                  params["layers"]["mlp"]["up"]["kernel"][2])
    tokens, mask = _left_padded(np.random.default_rng(0), 50, [6, 3], 6)
    positions = qwen2.positions_from_mask(jnp.asarray(mask))
    stacked = qwen2.run_layers(cfg, params, tokens, positions, mask)
    unrolled = qwen2.run_layers(cfg.replace(scan_layers=False), unstacked, tokens, positions, mask)
    np.testing.assert_allclose(unrolled[0], stacked[0], atol=1e-5, rtol=0)
    for a, b in zip(qwen2.per_layer(stacked[1], cfg), unrolled[1]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan", [True, False])
def test_cache_layout_and_append(scan):
    """Stacked buffers for scanned layers, one per layer for unrolled ones; `append` writes new
    slots at the index, in either form."""
    cfg = qwen2.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=3,
                            num_heads=4, num_kv_heads=2, scan_layers=scan)
    cache = qwen2.init_cache(cfg, batch=2, length=5)
    if scan:
        chex.assert_shape([cache.k, cache.v], [(3, 2, 2, 8, 5), (3, 2, 2, 5, 8)])
    else:
        assert isinstance(cache.k, tuple) and len(cache.k) == len(cache.v) == 3
        chex.assert_shape([*cache.k, *cache.v], [(2, 2, 8, 5)] * 3 + [(2, 2, 5, 8)] * 3)
    assert cache.length == 5
    new = lambda x, axis: jax.random.normal(jax.random.key(x.size), x.shape[:axis] + (2,)
                                            + x.shape[axis + 1:])
    k = jax.tree.map(lambda x: new(x, x.ndim - 1), cache.k)
    v = jax.tree.map(lambda x: new(x, x.ndim - 2), cache.v)
    out = qwen2.append(cache.replace(index=jnp.asarray(1, jnp.int32)), k, v,
                       jnp.array([[True, False], [True, True]]))
    assert int(out.index) == 3
    np.testing.assert_array_equal(out.mask, [[0, 1, 0, 0, 0], [0, 1, 1, 0, 0]])
    for c, x in zip(jax.tree.leaves(out.v), jax.tree.leaves(v)):
        np.testing.assert_array_equal(np.asarray(c)[..., 1:3, :], x)
        assert not np.asarray(c)[..., [0, 3, 4], :].any()
    for c, x in zip(jax.tree.leaves(out.k), jax.tree.leaves(k)):
        np.testing.assert_array_equal(np.asarray(c)[..., 1:3], x)


@pytest.mark.parametrize("scan", [True, False])
def test_writing_into_the_cache_equals_reading_it_then_appending(scan):
    """`hidden_states` writes the new tokens into the cache inside each layer and attends to
    it; the same as reading the cache (beside another read-only one) and appending after."""
    cfg = qwen2.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, scan_layers=scan)
    params = qwen2.init_params(cfg, jax.random.key(0), std=0.3)
    fill = lambda c, key: c.replace(
        k=jax.tree.map(lambda x: jax.random.normal(key, x.shape), c.k),
        v=jax.tree.map(lambda x: jax.random.normal(key, x.shape), c.v))
    cache = fill(qwen2.init_cache(cfg, batch=2, length=7), jax.random.key(1)).replace(
        mask=jnp.array([[0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]], bool),
        index=jnp.asarray(3, jnp.int32))
    other = fill(qwen2.init_cache(cfg, batch=2, length=4), jax.random.key(2)).replace(
        mask=jnp.array([[1, 1, 0, 1], [0, 1, 1, 1]], bool))
    tokens, mask = jnp.array([[4, 9, 1], [7, 2, 30]]), jnp.array([[1, 0, 1], [1, 1, 1]], bool)
    positions = jnp.array([[5, 5, 6], [6, 7, 8]])
    hidden, written = qwen2.hidden_states(cfg, params, tokens, positions, mask, cache, (other,))
    ref_hidden, k, v = qwen2.run_layers(cfg, params, tokens, positions, mask, (cache, other))
    appended = qwen2.append(cache, k, v, mask)
    np.testing.assert_allclose(hidden, ref_hidden, atol=1e-5, rtol=0)
    assert int(written.index) == 6
    np.testing.assert_array_equal(written.mask, appended.mask)
    for a, b in zip(jax.tree.leaves((written.k, written.v)), jax.tree.leaves((appended.k, appended.v))):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan", [True, False])
def test_grow_adds_empty_slots_after_the_last(scan):
    cfg = qwen2.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, scan_layers=scan)
    cache = qwen2.init_cache(cfg, batch=2, length=3)
    cache = cache.replace(k=jax.tree.map(lambda x: x + 1, cache.k),
                          v=jax.tree.map(lambda x: x + 2, cache.v),
                          mask=jnp.array([[1, 0, 1], [1, 1, 1]], bool),
                          index=jnp.asarray(3, jnp.int32))
    assert qwen2.grow(cache, 3) is cache
    grown = qwen2.grow(cache, 5)
    assert grown.length == 5 and int(grown.index) == 3
    np.testing.assert_array_equal(grown.mask, [[1, 0, 1, 0, 0], [1, 1, 1, 0, 0]])
    for x in jax.tree.leaves(grown.v):
        chex.assert_shape(x, x.shape[:-2] + (5, 8))
        assert (np.asarray(x)[..., :3, :] == 2).all() and not np.asarray(x)[..., 3:, :].any()
    for x in jax.tree.leaves(grown.k):
        chex.assert_shape(x, x.shape[:-1] + (5,))
        assert (np.asarray(x)[..., :3] == 1).all() and not np.asarray(x)[..., 3:].any()


def test_shared_segment_attention_equals_repeated_rows():
    """A segment of B / G rows read by G query rows each equals that segment repeated G times."""
    ks = jax.random.split(jax.random.key(0), 6)
    b, g, t, n, kh, hd, s = 2, 3, 2, 4, 2, 8, 5
    q = jax.random.normal(ks[0], (b * g, t, n, hd))
    pk, pv = jax.random.normal(ks[1], (b, kh, hd, s)), jax.random.normal(ks[2], (b, kh, s, hd))
    pmask = jnp.array([[0, 1, 1, 1, 1], [0, 0, 0, 1, 1]], bool)
    own_k, own_v = jax.random.normal(ks[3], (b * g, kh, hd, 2)), jax.random.normal(ks[4], (b * g, kh, 2, hd))
    own = (own_k, own_v, jnp.ones((b * g, t, 2), bool).at[::2, :, 1].set(False))
    shared = qwen2.attention(q, [own, (pk, pv, pmask[:, None, :])])
    rep = lambda x: jnp.repeat(x, g, axis=0)
    repeated = qwen2.attention(q, [own, (rep(pk), rep(pv), rep(pmask)[:, None, :])])
    chex.assert_shape(shared, (b * g, t, n, hd))
    np.testing.assert_allclose(shared, repeated, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("t", [1, 3])
def test_segment_attention_equals_attention_over_the_joined_cache(t, dtype, atol):
    """Segments in the cache layout give XLA attention over their keys and values joined; one
    query row (a decode step, multiply-and-sum products) and several (einsum products) alike."""
    ks = jax.random.split(jax.random.key(1), 5)
    b, n, kh, hd, sizes = 3, 4, 2, 8, (4, 6)
    q = jax.random.normal(ks[0], (b, t, n, hd)).astype(dtype)
    k = [jax.random.normal(jax.random.fold_in(ks[1], i), (b, kh, hd, s)).astype(dtype)
         for i, s in enumerate(sizes)]
    v = [jax.random.normal(jax.random.fold_in(ks[2], i), (b, kh, s, hd)).astype(dtype)
         for i, s in enumerate(sizes)]
    allowed = [jax.random.bernoulli(jax.random.fold_in(ks[3], i), 0.7, (b, t, s)).at[:, :, 0].set(True)
               for i, s in enumerate(sizes)]
    out = qwen2.attention(q, list(zip(k, v, allowed)))
    joined = lambda xs, axis: jnp.concatenate(xs, axis=axis)
    ref = jax.nn.dot_product_attention(
        q.astype(jnp.float32), joined(k, -1).transpose(0, 3, 1, 2).astype(jnp.float32),
        joined(v, 2).transpose(0, 2, 1, 3).astype(jnp.float32), mask=joined(allowed, -1)[:, None])
    chex.assert_shape(out, (b, t, n, hd))
    chex.assert_type(out, dtype)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("t", [6, 7])
def test_cudnn_attention_form_equals_plain_attention(t):
    """The cuDNN form (mask over every head, odd T padded by one self-attending token) gives
    plain attention's output; run with XLA so the CPU checks it."""
    ks = jax.random.split(jax.random.key(0), 3)
    b, n, kh, hd = 2, 4, 2, 8
    q = jax.random.normal(ks[0], (b, t, n, hd))
    k, v = (jax.random.normal(key, (b, t, kh, hd)) for key in ks[1:])
    mask = jnp.arange(t)[None] >= jnp.array([[0], [2]])  # row 1 left-padded by 2
    allowed = mask[:, None, :] & jnp.tril(jnp.ones((t, t), bool))[None]
    allowed = allowed | jnp.eye(t, dtype=bool)[None]  # padded queries attend to themselves
    plain = jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None])
    out = qwen2.cudnn_attention(q, k, v, allowed, implementation="xla")
    chex.assert_shape(out, (b, t, n, hd))
    np.testing.assert_allclose(out, plain, atol=1e-6, rtol=0)


def test_cudnn_training_traces_with_vmapped_agents(monkeypatch):
    """The GRPO step's shape: agents vmapped, odd T (next-token logits drop the last token),
    gradients. Tracing runs JAX's cuDNN batching rule and shape checks, which raised on the
    mask's head axis of 1 and on the odd length (seen on an H200); the CPU has no cuDNN, so
    its version and compute-capability probes are stubbed and only shapes are computed."""
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda *a, **k: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda *a, **k: True)
    cfg = qwen2.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, param_dtype="bfloat16",
                            dtype="bfloat16", attention_impl="cudnn")
    keys = jax.random.split(jax.random.key(0), 3)
    params = jax.vmap(lambda key: qwen2.init_params(cfg, key))(keys)
    tokens, mask = jnp.zeros((3, 4, 15), jnp.int32), jnp.ones((3, 4, 15), bool)
    loss = lambda p: jax.vmap(lambda p, x, m: qwen2.forward(cfg, p, x, mask=m).logits)(
        p, tokens, mask).sum()
    grads = jax.eval_shape(jax.grad(loss), params)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, jax.eval_shape(lambda: params))


@pytest.mark.parametrize("k, m", [(4, 12), (12, 4), (8, 8)])
def test_matmul_gradients_equal_autodiff(k, m):
    """The custom VJP's gradients (weight gradient by whichever operand is narrower) equal
    autodiff's of x @ w, and the cotangents keep the primals' dtypes under promotion."""
    ks = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(ks[0], (6, k)), jax.random.normal(ks[1], (k, m))
    c = jax.random.normal(ks[2], (6, m))
    ours = jax.grad(lambda x, w: jnp.sum(qwen2.matmul(x, w) * c), argnums=(0, 1))(x, w)
    plain = jax.grad(lambda x, w: jnp.sum((x @ w) * c), argnums=(0, 1))(x, w)
    chex.assert_trees_all_equal_shapes_and_dtypes(ours, (x, w))
    chex.assert_trees_all_close(ours, plain, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(qwen2.matmul(x, w), x @ w)
    mixed = jax.grad(lambda x, w: jnp.sum(qwen2.matmul(x, w)), argnums=(0, 1))(
        x.astype(jnp.bfloat16), w)
    assert (mixed[0].dtype, mixed[1].dtype) == (jnp.bfloat16, jnp.float32)


@pytest.mark.parametrize("scan", [True, False])
def test_remat_gives_the_gradients_of_the_plain_model(scan):
    """Rematerialized layers (the Qwen configs' setting) recompute the projections' custom VJP
    inputs and give the plain model's parameter gradients."""
    cfg = qwen2.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=96, num_layers=2,
                            num_heads=4, num_kv_heads=2, scan_layers=scan)
    params = qwen2.init_params(cfg, jax.random.key(0), std=0.1)
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 64)
    loss = lambda c: jax.grad(lambda p: jnp.sum(qwen2.forward(c, p, tokens).logits ** 2))(params)
    plain, remat = loss(cfg), loss(cfg.replace(remat=True))
    chex.assert_trees_all_equal_shapes(plain, params)
    chex.assert_trees_all_close(remat, plain, rtol=1e-5, atol=1e-5)


def test_bf16_compute_close_to_f32():
    cfg = qwen2.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2)
    params = qwen2.init_params(cfg, jax.random.key(0), std=0.1)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    f32 = qwen2.forward(cfg, params, tokens).logits
    bf16 = qwen2.forward(cfg.replace(dtype="bfloat16"), params, tokens).logits
    assert bf16.dtype == jnp.float32  # logits stay f32 whatever the compute dtype
    np.testing.assert_allclose(np.asarray(bf16), np.asarray(f32), atol=0.05)


@pytest.mark.parametrize("bad, match", [
    (dict(hidden_size=30, num_heads=4), "not divisible by num_heads"),
    (dict(num_heads=4, num_kv_heads=3), "not divisible by num_kv_heads"),
    (dict(dtype="float64"), "must be float32, bfloat16"),
    (dict(num_layers=0), "num_layers must be >= 1"),
    (dict(attention_impl="flash"), "attention_impl must be 'xla' or 'cudnn'"),
])
def test_config_errors(bad, match):
    base = dict(vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                num_kv_heads=2)
    with pytest.raises(ValueError, match=match):
        qwen2.Qwen2Config(**{**base, **bad})
