"""Sampler: HF greedy parity, sampling distribution, log-probs, shared prefill, buckets, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from joyagents_jax import sampling
from joyagents_jax.models import hf_io, qwen2
from joyagents_jax.sampling import Sampler, SamplingConfig
from tests.models.conftest import TINY_CONFIGS, build_hf_qwen2


def _tiny(vocab=48, seed=0, std=0.3, **kw):
    cfg = qwen2.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, max_position_embeddings=256, **kw)
    return cfg, qwen2.init_params(cfg, jax.random.key(seed), std=std)


PROMPTS = [[5, 9, 2, 11, 3, 7, 1], [4, 4, 8], [30], [12, 1, 40, 2, 9]]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_matches_transformers_generate(name, tmp_path):
    kw = TINY_CONFIGS[name]
    model = build_hf_qwen2(tmp_path / name, **kw)
    params, cfg = hf_io.load_params(str(tmp_path / name))
    n, pad = 12, 0
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, kw["vocab"], k).tolist() for k in (7, 3, 1, 5)]
    ours = Sampler(cfg, pad_id=pad, decode_block=5).generate(  # blocks of 5, 5, 2 steps
        params, prompts, key=jax.random.key(0), scfg=SamplingConfig(n, greedy=True))

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=pad, eos_token_id=None)
    np.testing.assert_array_equal(ours.tokens[:, 0], ref[:, width:].numpy())


def test_logprobs_equal_a_separate_forward():
    cfg, params = _tiny()
    n, g = 10, 3
    out = Sampler(cfg, pad_id=0, decode_block=4).generate(  # blocks of 4, 4, 2 steps
        params, PROMPTS, key=jax.random.key(1), group_size=g, scfg=SamplingConfig(n),
        stop_ids=[3, 17])
    assert out.tokens.shape == (4, g, n) and out.lengths.shape == (4, g)
    for b, prompt in enumerate(PROMPTS):
        for s in range(g):
            k = int(out.lengths[b, s])
            seq = jnp.asarray([prompt + out.tokens[b, s, :k].tolist()])
            logp = jax.nn.log_softmax(qwen2.forward(cfg, params, seq).logits[0], axis=-1)
            ref = logp[len(prompt) - 1:-1][jnp.arange(k), seq[0, len(prompt):]]
            np.testing.assert_allclose(out.logp_policy[b, s, :k], ref, atol=1e-5)
            # temperature 1 without filtering: sampling and policy log-probs agree
            np.testing.assert_allclose(out.logp_sample[b, s, :k], ref, atol=1e-5)
            assert np.all(out.logp_policy[b, s, k:] == 0)


def test_stop_tokens_end_rows_and_pad_after():
    cfg, params = _tiny()
    sampler = Sampler(cfg, pad_id=0)
    scfg = SamplingConfig(12, greedy=True)
    free = sampler.generate(params, PROMPTS, key=jax.random.key(0), scfg=scfg)
    stop = int(free.tokens[0, 0, 4])  # the 5th greedy token of prompt 0
    first = int(np.argmax(free.tokens[0, 0] == stop))
    per_row = [[stop], [], [], []]  # only prompt 0 stops on it
    out = sampler.generate(params, PROMPTS, key=jax.random.key(0), scfg=scfg, stop_ids=per_row)
    assert out.lengths[0, 0] == first + 1 and out.stopped[0, 0]
    np.testing.assert_array_equal(out.tokens[0, 0, :first + 1], free.tokens[0, 0, :first + 1])
    assert np.all(out.tokens[0, 0, first + 1:] == 0)
    np.testing.assert_array_equal(out.tokens[1:], free.tokens[1:])
    assert not out.stopped[1:].any() and np.all(out.lengths[1:] == 12)


class TwoWayCharTokenizer:
    """Test double: ids 2c and 2c+1 both decode to the c-th letter; encode uses the even id.

    Generated text can therefore spell a stop string with ids its encoding does not use, which
    only the host-side check can see; the even-id case is caught inside the decode loop.
    """

    vocab_size = 48

    def encode(self, text):
        return [2 * (ord(c) - 65) for c in text]

    def decode(self, ids):
        return "".join(chr(65 + int(i) // 2) for i in ids)


@pytest.mark.parametrize("seed", range(4))
def test_stop_strings_end_rows_at_first_occurrence(seed):
    tok = TwoWayCharTokenizer()
    cfg, params = _tiny(vocab=48, std=0.5)
    sampler = Sampler(cfg, pad_id=0, tokenizer=tok)
    prompts, key, scfg = [[1, 2, 3], [7]], jax.random.key(seed), SamplingConfig(16)
    free = sampler.generate(params, prompts, key=key, scfg=scfg, group_size=3)
    stop = tok.decode(free.tokens[0, 0, 5:7])
    out = sampler.generate(params, prompts, key=key, scfg=scfg, group_size=3, stop_strings=[stop])
    for b, g in np.ndindex(2, 3):
        text = tok.decode(free.tokens[b, g])
        expected = text.find(stop) + len(stop) if stop in text else 16
        assert out.lengths[b, g] == expected and out.stopped[b, g] == (stop in text)
        np.testing.assert_array_equal(out.tokens[b, g, :expected], free.tokens[b, g, :expected])
        assert np.all(out.tokens[b, g, expected:] == 0) and np.all(out.logp_policy[b, g, expected:] == 0)


def test_sampling_frequencies_match_softmax():
    """First-token frequencies over many draws vs softmax(logits / T).

    With n draws, a frequency's standard error is sqrt(p (1 - p) / n); 5 standard errors (plus a
    1e-3 floor for near-zero p) bound a false failure per token at < 1e-6, and the seed is fixed.
    """
    cfg, params = _tiny(vocab=16, std=0.5)
    prompt, temp, n = [3, 1, 4, 1, 5], 0.7, 16384
    out = Sampler(cfg, pad_id=0).generate(params, [prompt], key=jax.random.key(7), group_size=n,
                                          scfg=SamplingConfig(1, temperature=temp))
    logits = qwen2.forward(cfg, params, jnp.asarray([prompt])).logits[0, -1]
    p = np.asarray(jax.nn.softmax(logits / temp))
    freq = np.bincount(out.tokens[0, :, 0], minlength=16) / n
    np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / n) + 1e-3)


@pytest.mark.parametrize("block, phases", [(1, 1), (3, 1), (16, 1), (3, 2), (3, 4), (1, 11),
                                           (3, 9)])
def test_decode_blocks_and_phases_change_no_sample(block, phases):
    """Blocks decide when the generated cache is appended to, phases how many slots of it a
    step reads (more phases than blocks: one block each): same key, same samples."""
    cfg, params = _tiny()
    run = lambda b, p: Sampler(cfg, pad_id=0, decode_block=b, decode_phases=p).generate(
        params, PROMPTS, key=jax.random.key(2), group_size=3, scfg=SamplingConfig(11))
    ref, out = run(11, 1), run(block, phases)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logp_policy, ref.logp_policy, atol=1e-5)


def test_draw_inverts_the_cdf_and_never_picks_a_zero_mass_token():
    probs = np.array([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0],   # zero mass first, between and last
                      [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],     # only the last token
                      [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])    # only the first
    n = 8192
    logp = jnp.log(jnp.asarray(np.repeat(probs, n, axis=0), jnp.float32))
    tokens = np.asarray(sampling.draw(jax.random.key(3), logp)).reshape(3, n)
    chex.assert_shape(tokens, (3, n))
    for row, p in zip(tokens, probs):
        freq = np.bincount(row, minlength=6) / n
        assert (freq[p == 0] == 0).all()
        np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / n) + 1e-3)


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.6), (5, 0.8)])
def test_top_k_top_p_never_leave_their_set(top_k, top_p):
    cfg, params = _tiny(vocab=32, std=0.5)
    prompt = [3, 1, 4, 1, 5]
    out = Sampler(cfg, pad_id=0).generate(params, [prompt], key=jax.random.key(2), group_size=4096,
                                          scfg=SamplingConfig(1, top_k=top_k, top_p=top_p))
    logits = np.asarray(qwen2.forward(cfg, params, jnp.asarray([prompt])).logits[0, -1])
    order = np.argsort(-logits)
    allowed = set(order[:top_k].tolist()) if top_k else set(range(32))
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    if top_k:
        probs = np.where(np.isin(np.arange(32), order[:top_k]), probs, 0) / probs[order[:top_k]].sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    allowed &= set(order[mass_before < top_p].tolist())
    drawn = set(out.tokens[0, :, 0].tolist())
    assert drawn <= allowed and len(drawn) == len(allowed)  # never outside, and the set is reached


def test_filter_logits_keeps_top_p_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    kept = sampling.filter_logits(logits, SamplingConfig(1, top_p=0.75)) > -1e30
    np.testing.assert_array_equal(np.asarray(kept), [[True, True, False, False]])
    kept = sampling.filter_logits(logits, SamplingConfig(1, top_p=0.85)) > -1e30
    np.testing.assert_array_equal(np.asarray(kept), [[True, True, True, False]])


def test_group_shares_one_prefill_and_buckets_do_not_recompile():
    cfg, params = _tiny()
    sampler = Sampler(cfg, pad_id=0)
    scfg = SamplingConfig(4)
    sampler.generate(params, PROMPTS, key=jax.random.key(0), scfg=scfg, group_size=8)
    assert sampler.compiles == 1
    assert sampler.prefill_shapes == [(4, 16)]  # prefill on B prompts, not B * G rows
    other = [[1, 2, 3], [9] * 12, [7, 7], [2]]  # same buckets (4 prompts, length <= 16)
    sampler.generate(params, other, key=jax.random.key(1), scfg=scfg, group_size=8)
    sampler.generate(params, other[:3], key=jax.random.key(1), scfg=scfg, group_size=8)
    assert sampler.compiles == 1
    sampler.generate(params, [[1] * 20], key=jax.random.key(1), scfg=scfg, group_size=8)
    assert sampler.compiles == 2 and sampler.prefill_shapes[-1] == (1, 32)


def test_deterministic_for_a_key():
    cfg, params = _tiny()
    sampler = Sampler(cfg, pad_id=0)
    a = sampler.generate(params, PROMPTS, key=jax.random.key(5), scfg=SamplingConfig(6), group_size=2)
    b = sampler.generate(params, PROMPTS, key=jax.random.key(5), scfg=SamplingConfig(6), group_size=2)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens[:, 0], a.tokens[:, 1])  # samples of a group differ


def test_stacked_agents_pick_and_vmap():
    cfg, p0 = _tiny(seed=0)
    _, p1 = _tiny(seed=1)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), p0, p1)
    sampler = Sampler(cfg, pad_id=0)
    scfg = SamplingConfig(6, greedy=True)
    per_agent = [PROMPTS[:2], PROMPTS[2:]]
    both = sampler.generate_per_agent(stacked, per_agent, key=jax.random.key(0), scfg=scfg)
    for a, params in enumerate([p0, p1]):
        alone = sampler.generate(params, per_agent[a], key=jax.random.key(0), scfg=scfg)
        picked = sampler.generate(stacked, per_agent[a], key=jax.random.key(0), scfg=scfg, agent=a)
        np.testing.assert_array_equal(both[a].tokens, alone.tokens)
        np.testing.assert_array_equal(picked.tokens, alone.tokens)


def test_agents_in_passes_sample_as_one_vmapped_pass():
    """Three stacked agents decoded in passes of two (then one) draw the same tokens with the
    same log-probs as one vmapped pass, from the same key."""
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *(_tiny(seed=s)[1] for s in range(3)))
    cfg = _tiny()[0]
    per_agent = [PROMPTS[:2], PROMPTS[2:], PROMPTS[1:3]]
    run = lambda sampler: sampler.generate_per_agent(
        stacked, per_agent, key=jax.random.key(3), scfg=SamplingConfig(6), group_size=2)
    one, passes = run(Sampler(cfg, pad_id=0)), run(Sampler(cfg, pad_id=0, agents_per_pass=2))
    for a, b in zip(one, passes, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.lengths, a.lengths)
        np.testing.assert_allclose(b.logp_policy, a.logp_policy, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b.logp_sample, a.logp_sample, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[1, 2], []]), "Prompt 1 is empty"),
    (dict(prompts=[]), "No prompts given"),
    (dict(prompts=[[1] * 250]), "exceeds the cache length 256"),
    (dict(group_size=0), "group_size must be >= 1"),
    (dict(stop_ids=[3, 999]), r"Unknown stop token id\(s\) \[999\]"),
    (dict(prompts=[[1, 48]]), r"outside \[0, 48\)"),
    (dict(stop_strings=["</answer>"]), "stop_strings need a tokenizer"),
])
def test_bad_input_errors(kwargs, match):
    cfg, params = _tiny()
    args = dict(prompts=[[1, 2, 3]], group_size=2, stop_ids=(), stop_strings=())
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Sampler(cfg, pad_id=0).generate(params, args.pop("prompts"), key=jax.random.key(0),
                                        scfg=SamplingConfig(8), **args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(decode_phases=0), "decode_phases must be an integer >= 1, got 0"),
    (dict(decode_block=2.5), "decode_block must be an integer >= 1, got 2.5"),
])
def test_bad_decode_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampler(_tiny()[0], pad_id=0, **kwargs)


def test_sampling_config_errors():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingConfig(4, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SamplingConfig(0)


def test_ids_beyond_the_tokenizer_are_never_drawn():
    class Small(TwoWayCharTokenizer):
        vocab_size = 10

    cfg, params = _tiny(vocab=48, std=0.5)
    out = Sampler(cfg, pad_id=0, tokenizer=Small()).generate(
        params, [[1, 2, 3]], key=jax.random.key(0), scfg=SamplingConfig(8), group_size=256)
    assert out.tokens.max() < 10
    with pytest.raises(ValueError, match="does not belong to this model"):
        Sampler(qwen2.Qwen2Config(8, 32, 64, 1, 4, 2), pad_id=0, tokenizer=Small())
