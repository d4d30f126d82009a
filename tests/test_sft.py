"""Tests for joyagents_jax.sft: the teacher-forced loss and the all-agents SFT step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from joyagents_jax import batching, sft
from joyagents_jax import train_state as ts
from joyagents_jax.models import lora, qwen2
from tests.rl.test_grpo_step import _random_params

SUB = qwen2.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2)
MASTER = SUB.replace(hidden_size=48, intermediate_size=96, tie_embeddings=False)
OPTIM = ts.OptimConfig(learning_rate=1e-2, schedule="constant", warmup_steps=5)
PROMPT, OUTPUT, SEQS = 4, 5, 4


def _demos(num_agents: int, seed: int, silent: tuple[int, ...] = ()) -> sft.SFTBatch:
    """SEQS fixed demonstrations per agent: a 4-token prompt that starts with a unique
    (agent, sequence) id, then OUTPUT uniformly random target tokens, then one pad token.

    Agents in `silent` have no target tokens (an all-zero loss mask)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, SUB.vocab_size, (num_agents, SEQS, PROMPT + OUTPUT + 1))
    tokens[:, :, 0] = np.arange(num_agents * SEQS).reshape(num_agents, SEQS)
    tokens[:, :, -1] = 0
    mask = np.ones(tokens.shape, bool)
    mask[:, :, -1] = False  # right padding: never a target, never attended by targets
    loss_mask = np.zeros(tokens.shape, bool)
    loss_mask[:, :, PROMPT:PROMPT + OUTPUT] = True
    loss_mask[list(silent)] = False
    return sft.SFTBatch(jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), jnp.asarray(loss_mask))


def _reference_ce(model, params, data: sft.SFTBatch, agent: int) -> float:
    """Cross-entropy from a plain forward over the full sequence, in NumPy."""
    p = jax.tree.map(lambda x: x[agent], params)
    tokens, mask, loss_mask = (np.asarray(x[agent]) for x in (data.tokens, data.mask,
                                                               data.loss_mask))
    logits = np.asarray(qwen2.forward(model, p, jnp.asarray(tokens), mask=jnp.asarray(mask)).logits,
                        np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    terms = [-logp[b, t - 1, tokens[b, t]] for b, t in zip(*np.nonzero(loss_mask))]
    return float(np.mean(terms))


@pytest.fixture
def state():
    """A fresh state per test: the step donates it."""
    groups = {"subs": ts.init_group(SUB, OPTIM, _random_params(SUB, 3, 0)),
              "master": ts.init_group(MASTER, OPTIM, _random_params(MASTER, 1, 1))}
    return ts.create(groups)


@pytest.fixture(scope="module")
def step():
    return sft.make_sft_step()


def test_sft_memorizes_each_agents_demonstrations(state, step):
    batch = {"subs": _demos(3, seed=0, silent=(2,)), "master": _demos(1, seed=1)}
    host = lambda tree: jax.tree.map(np.asarray, tree)
    start = host(state.groups)
    state, metrics = step(state, batch)
    first = host(metrics["agents"])
    for _ in range(49):
        state, metrics = step(state, batch)
    last = host(metrics["agents"])

    # The first step's loss is the teacher-forced CE of the initial params.
    for name, agent in [("subs", 0), ("subs", 1), ("master", 0)]:
        want = _reference_ce(state.groups[name].model, start[name].params, batch[name], agent)
        np.testing.assert_allclose(first[name]["loss"][agent], want, rtol=1e-5)
    np.testing.assert_array_equal(first["subs"]["tokens"], [SEQS * OUTPUT] * 2 + [0])

    # Bound: with init std 0.02 the logits start near 0, so the loss starts near ln(32) = 3.47.
    # Targets are uniformly random, so a model that ignores the prefix cannot go much below the
    # targets' empirical unigram entropy (about 2.6 nats for 20 draws from 32 tokens); each
    # prompt starts with a unique id, so the targets are a function of the prefix and the floor is
    # 0. A 100x drop (< 0.035 nats/token, p(target) > 0.96 on average) therefore needs every
    # agent to memorize its own demonstrations; 50 AdamW steps at 1e-2 reach ~0.005.
    for name, agent in [("subs", 0), ("subs", 1), ("master", 0)]:
        assert first[name]["loss"][agent] > 3.0
        assert last[name]["loss"][agent] < first[name]["loss"][agent] / 100
        assert last[name]["accuracy"][agent] == 1.0
    assert int(state.step) == 50 and int(state.skipped) == 0

    # The agent without target tokens was never updated: params and Adam state bit for bit.
    now = host(state.groups["subs"])
    for old, new in zip(jax.tree.leaves((start["subs"].params, start["subs"].opt_state)),
                        jax.tree.leaves((now.params, now.opt_state)), strict=True):
        assert old[2].tobytes() == new[2].tobytes()


def test_sft_skips_a_non_finite_step(state, step):
    poisoned = state.groups["master"].params["embed"].at[0, 3].set(jnp.nan)
    groups = dict(state.groups, master=state.groups["master"].replace(
        params={**state.groups["master"].params, "embed": poisoned}))
    state = state.replace(groups=groups)
    before = jax.tree.map(np.asarray, state.groups)
    batch = {"subs": _demos(3, seed=0), "master": _demos(1, seed=1)}
    # The master reads token 3, whose embedding is now NaN.
    batch["master"] = batch["master"].replace(tokens=batch["master"].tokens.at[0, 0, 1].set(3))

    state, metrics = step(state, batch)

    assert bool(metrics["skipped"]) and int(state.skipped) == 1 and int(state.step) == 0
    after = jax.tree.map(np.asarray, state.groups)
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert old.tobytes() == new.tobytes()


def test_lora_sft_learns_through_the_adapters_alone(step):
    """Rank-4 adapters over one frozen random base memorize each agent's demonstrations."""
    cfg = lora.LoRAConfig(rank=4, alpha=8.0)
    base = jax.tree.map(lambda x: x[0], _random_params(SUB, 1, 0))
    adapters = ts.stack_agents([lora.init_adapters(base, cfg, jax.random.key(i))
                                for i in range(3)])
    state = ts.create({"subs": ts.init_group(SUB, OPTIM, adapters, base=base, lora=cfg)})
    base = jax.tree.map(np.asarray, base)  # the step donates the state's buffers
    batch = {"subs": _demos(3, seed=0)}
    state, first = step(state, batch)
    for _ in range(59):
        state, metrics = step(state, batch)
    group = state.groups["subs"]
    chex.assert_trees_all_equal(group.base, base)
    chex.assert_trees_all_equal_structs(group.opt_state[1][0].mu, adapters)
    np.testing.assert_allclose(first["agents"]["subs"]["loss"], [
        _reference_ce(SUB, ts.stack_agents([base] * 3), batch["subs"], a) for a in range(3)],
        rtol=1e-5)  # zero b: the first loss is the base's
    assert np.all(np.asarray(metrics["agents"]["subs"]["loss"]) <
                  0.9 * np.asarray(first["agents"]["subs"]["loss"]))


@pytest.mark.parametrize("shared", [False, True])
def test_agents_in_passes_give_the_one_pass_step(state, step, shared):
    """Passes of two agents (two sub-agents, then the third, silent one alone; the master alone)
    take the same steps as one vmapped pass, up to rounding, shared or not. Rounding differs
    with the batch's shape, and Adam turns it into parameter moves of up to ~1e-5 where a
    gradient is near zero (measured on an AVX2-only AMD EPYC); a pass that skipped or mixed up an
    agent would move its parameters by whole updates (lr 2e-3 to 6e-3 over these steps)."""
    batch = {"subs": _demos(3, seed=0, silent=(2,)), "master": _demos(1, seed=1)}
    one = sft.make_sft_step(shared=True) if shared else step
    passes = sft.make_sft_step(shared=shared, agents_per_pass=2)
    fresh = ts.create(jax.tree.map(jnp.copy, state.groups))
    for _ in range(3):
        state, one_m = one(state, batch)
        fresh, passes_m = passes(fresh, batch)
    chex.assert_trees_all_close(fresh.groups, state.groups, rtol=1e-5, atol=1e-4)
    chex.assert_trees_all_close(passes_m, one_m, rtol=1e-5, atol=1e-6)


def _varied_demos(seed: int) -> list[tuple[str, list[int], list[int]]]:
    """Demonstrations of 3 sub-agents and the master, 2 to 4 per agent, 3 to 130 tokens long."""
    rng = np.random.default_rng(seed)
    demos = []
    for agent, count in (("s0", 4), ("s1", 2), ("s2", 3), ("m", 3)):
        for _ in range(count):
            n, m = int(rng.integers(1, 120)), int(rng.integers(1, 10))
            demos.append((agent, rng.integers(1, SUB.vocab_size, n).tolist(),
                          rng.integers(1, SUB.vocab_size, m).tolist()))
    return demos


def test_sorted_passes_take_the_shared_step():
    """The shared phase over length-sorted passes of 2 rows (each padded to its own length,
    rows of different agents mixed) takes the padded shared step's steps up to rounding, and
    reports its per-agent loss, accuracy, target tokens and grad norms."""
    slots = {"s0": ("subs", 0), "s1": ("subs", 1), "s2": ("subs", 2), "m": ("master", 0)}
    sizes = {"subs": 3, "master": 1}
    equal = lambda model, n, seed: jax.tree.map(
        lambda x: jnp.broadcast_to(x[:1], x.shape), _random_params(model, n, seed))
    make = lambda: ts.create({"subs": ts.init_group(SUB, OPTIM, equal(SUB, 3, 0)),
                              "master": ts.init_group(MASTER, OPTIM, equal(MASTER, 1, 1))})
    padded, sorted_ = make(), make()
    shared, by_length = sft.make_sft_step(shared=True), sft.make_sorted_sft_step()
    for seed in range(3):
        demos = _varied_demos(seed)
        padded, padded_m = shared(padded, batching.sft_batch(demos, slots, sizes, max_len=192))
        passes = batching.sorted_passes(demos, slots, sizes, rows=2, max_len=192)
        assert len({b.tokens.shape[1] for b in passes["subs"]}) > 1  # passes of own lengths
        sorted_, sorted_m = by_length(sorted_, passes)
        chex.assert_trees_all_close(sorted_m, padded_m, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(sorted_.groups, padded.groups, rtol=1e-5, atol=1e-4)
    assert int(sorted_.step) == 3 and int(sorted_.skipped) == 0
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), sorted_.groups["subs"].params,
                         make().groups["subs"].params)
    assert max(jax.tree.leaves(moved)) > 1e-3  # the steps trained
