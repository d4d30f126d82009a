"""Tests for joyagents_jax.rl.grpo_step: selection over the batch, the masked all-agents step, and
learning on a toy bandit."""

import dataclasses
import functools
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from joyagents_jax import sharding
from joyagents_jax import train_state as ts
from joyagents_jax.models import lora, qwen2
from joyagents_jax.rl import grpo
from joyagents_jax.rl import grpo_step as gs
from tests.test_sharding import ROOT

SUB = qwen2.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2)
MASTER = SUB.replace(hidden_size=48, intermediate_size=96, tie_embeddings=False)
# Adam's eps is 1e-4, not 1e-8: the key bias gradient is 0 up to rounding (a bias on every key
# shifts a query's scores equally, and softmax ignores that), and a tiny eps would blow rounding
# noise, which differs between sharded and unsharded runs, up to a full-size step.
OPTIM = ts.OptimConfig(learning_rate=1e-2, schedule="constant", weight_decay=0.01, eps=1e-4)

# A hand-built batch: agent 0 is the master (its own group), agents 1-3 are the sub-agents.
# Node groups and their population reward variances:
#   g0 master [1, 0, 1, 0] .25 | g1 sub0 [1, 1] 0 | g2 sub0 [0, 2] 1 | g3 sub1 [0, 1, 2, 3] 1.25
#   g4 sub2 [0, .5] .0625 (plus two padding samples) | g5 a padding group.
GROUP_AGENT = np.array([0, 1, 1, 2, 3, -1])
GROUP_IDS = {"master": [[0, 0, 0, 0]],
             "subs": [[1, 1, 2, 2], [3, 3, 3, 3], [4, 4, -1, -1]]}
REWARDS = {"master": [[1, 0, 1, 0]],
           "subs": [[1, 1, 0, 2], [0, 1, 2, 3], [0, 0.5, 0, 0]]}
VARIANCES = [0.25, 0.0, 1.0, 1.25, 0.0625, 0.0]
PROMPT, OUTPUT = 4, 4


def _rollouts(name: str, seed: int) -> gs.Rollouts:
    """Prompt (left padded on row 1) + OUTPUT generated tokens; padding samples are all pad."""
    ids = np.array(GROUP_IDS[name], np.int32)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, SUB.vocab_size, ids.shape + (PROMPT + OUTPUT,))
    mask = np.ones(tokens.shape, bool)
    mask[:, 1, :2] = False
    mask[ids < 0] = False
    loss_mask = np.zeros(tokens.shape, bool)
    loss_mask[..., PROMPT:] = mask[..., PROMPT:]
    return gs.Rollouts(tokens=jnp.asarray(tokens, jnp.int32), mask=jnp.asarray(mask),
                       loss_mask=jnp.asarray(loss_mask),
                       sampler_logp=jnp.zeros(tokens.shape, jnp.float32),
                       rewards=jnp.asarray(REWARDS[name], jnp.float32), group_ids=jnp.asarray(ids))


def _batch() -> gs.GRPOBatch:
    return gs.GRPOBatch({"master": _rollouts("master", 0), "subs": _rollouts("subs", 1)},
                        jnp.asarray(GROUP_AGENT, jnp.int32))


def _leaves(tree, agent: int) -> list[np.ndarray]:
    return [np.asarray(x)[agent] for x in jax.tree.leaves(tree)]


# ----------------------------------------------------------------------------------------------
# Selection and advantages over the whole batch.
# ----------------------------------------------------------------------------------------------


def test_segment_reward_variance_matches_the_table_version():
    rng = np.random.default_rng(0)
    table = rng.integers(0, 3, (6, 5)).astype(np.float32)
    table[1] = 1.0  # no spread
    valid = rng.uniform(size=table.shape) < 0.8
    valid[2] = [True, False, False, False, False]  # a singleton
    ids = np.where(valid, np.arange(6)[:, None], -1).reshape(-1)
    order = rng.permutation(ids.size)  # members anywhere in the batch
    got = grpo.segment_reward_variance(table.reshape(-1)[order], ids[order], 6)
    want = [np.var(r[v]) for r, v in zip(table, valid)]  # population variance per row
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[1] == 0.0 and got[2] == 0.0


@pytest.mark.parametrize("select, k, kept", [
    ("groups", 2, [3, 2]),
    ("groups", None, [0, 2, 3, 4]),  # K = all: every group with reward spread
    ("groups", 50, [0, 2, 3, 4]),
    ("agents", 1, [3]),  # mean group variance per agent: .25, .5, 1.25, .0625
    ("agents", 2, [2, 3]),  # agent 1's zero-variance g1 stays out
])
def test_select_spans_every_agent_group(select, k, kept):
    cfg = gs.GRPOStepConfig(topk=k, select=select)
    var, got_kept, update = jax.jit(gs.marginal_benefit, static_argnums=(1, 2))(_batch(), 4, cfg)
    np.testing.assert_allclose(var, VARIANCES, rtol=1e-6)
    np.testing.assert_array_equal(np.nonzero(got_kept)[0], sorted(kept))
    np.testing.assert_array_equal(np.nonzero(update)[0], sorted(set(GROUP_AGENT[kept])))


def test_offpolicy_groups_are_those_holding_a_nan_sampler_logprob_target():
    batch = _batch()
    subs = batch.rollouts["subs"]
    logp = subs.sampler_logp.at[0, 3, -1].set(jnp.nan)  # g2: one target token unsampled
    logp = logp.at[1, 0, 0].set(jnp.nan)  # g3: NaN on the first token only (never a target)
    logp = logp.at[2, 2].set(jnp.nan)  # a padding sample: no group
    batch = batch.replace(rollouts={**batch.rollouts, "subs": subs.replace(sampler_logp=logp)})
    got = jax.jit(gs.offpolicy_groups)(batch)
    chex.assert_shape(got, (len(GROUP_AGENT),))
    np.testing.assert_array_equal(got, [False, False, True, False, False, False])


def test_advantages_are_per_node_group():
    adv = gs.advantages(_batch(), gs.GRPOStepConfig(advantage="no_std"))
    np.testing.assert_allclose(adv["master"], [[0.5, -0.5, 0.5, -0.5]])
    np.testing.assert_allclose(adv["subs"], [[0, 0, -1, 1], [-1.5, -0.5, 0.5, 1.5],
                                             [-0.25, 0.25, 0, 0]])


@pytest.mark.parametrize("advantage", ["std", "given"])
def test_neg_weight_scales_the_negative_advantages(advantage):
    batch = _batch()  # "given" takes rewards as advantages: center them so some are negative
    batch = batch.replace(rollouts={n: r.replace(rewards=r.rewards - 1.0)
                                    for n, r in batch.rollouts.items()})
    full = gs.advantages(batch, gs.GRPOStepConfig(advantage=advantage))
    half = gs.advantages(batch, gs.GRPOStepConfig(advantage=advantage, neg_weight=0.5))
    assert any(np.any(np.asarray(a) < 0) for a in full.values())
    for name in full:
        want = np.where(full[name] < 0, 0.5 * np.asarray(full[name]), full[name])
        np.testing.assert_allclose(half[name], want)


# ----------------------------------------------------------------------------------------------
# The step.
# ----------------------------------------------------------------------------------------------

STEP_CFG = gs.GRPOStepConfig(topk=2, inner_steps=2)


def _random_params(cfg: qwen2.Qwen2Config, num_agents: int, seed: int) -> qwen2.Params:
    """Stacked random params made in NumPy: no init to compile, in the test or the subprocess."""
    rng = np.random.default_rng(seed)

    def leaf(path, spec):
        shape = (num_agents, *spec.shape)
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return jnp.ones(shape)
        return jnp.asarray(0.02 * rng.standard_normal(shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(leaf, qwen2.param_shapes(cfg))


def _fresh_state() -> ts.TrainState:
    return ts.create({"subs": ts.init_group(SUB, OPTIM, _random_params(SUB, 3, 0)),
                      "master": ts.init_group(MASTER, OPTIM, _random_params(MASTER, 1, 1))})


@pytest.fixture
def state():
    """A fresh state per test: the step donates it."""
    return _fresh_state()


@pytest.fixture(scope="module")
def step():
    return gs.make_grpo_step(STEP_CFG)


def test_step_updates_exactly_the_selected_agents(state, step):
    before = jax.tree.map(np.asarray, state.groups)

    state, metrics = step(state, _batch())

    # K = 2 keeps g3 (agent 2 = subs row 1) and g2 (agent 1 = subs row 0).
    assert (int(metrics["kept_groups"]), int(metrics["updated_agents"])) == (2, 2)
    assert int(metrics["mixed_groups"]) == 4 and not bool(metrics["skipped"])
    assert (int(state.step), int(state.skipped)) == (1, 0)
    subs, master = metrics["agents"]["subs"], metrics["agents"]["master"]
    np.testing.assert_array_equal(subs["updated"], [True, True, False])
    np.testing.assert_array_equal(master["updated"], [False])
    np.testing.assert_array_equal(subs["kept_groups"], [1, 1, 0])
    np.testing.assert_allclose(subs["mean_reward"], [1.0, 1.5, 0.25])
    # Sampler log-probs are 0 here and the fresh policies are near uniform: |0 - logp| ~ ln 32.
    np.testing.assert_allclose(subs["logprob_gap"], np.log(32), rtol=0.02)
    np.testing.assert_allclose(master["logprob_gap"], np.log(32), rtol=0.02)
    for agent_metrics in (subs, master):
        assert all(np.all(np.isfinite(v)) for v in agent_metrics.values())
    assert np.all(subs["grad_norm"][:2] > 0) and subs["grad_norm"][2] == 0
    assert np.all(subs["kl"][:2] > 0)  # the second inner step moved away from the reference

    after = jax.tree.map(np.asarray, state.groups)
    for name, row in [("master", 0), ("subs", 2)]:  # unselected: bit for bit
        for old, new in zip(_leaves((before[name].params, before[name].opt_state), row),
                            _leaves((after[name].params, after[name].opt_state), row)):
            assert old.tobytes() == new.tobytes()
    # Selected: every parameter moved, except maybe the key bias (its gradient is 0 up to
    # rounding, see OPTIM).
    for row in (0, 1):
        for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(before["subs"].params),
                                    jax.tree.leaves(after["subs"].params)):
            name = jax.tree_util.keystr(path)
            if name != "['layers']['attn']['k']['bias']":
                assert not np.array_equal(old[row], new[row]), name


def test_memory_outputs_nan_sampler_logprobs_train_alike_and_leave_the_gap(step):
    """A memory-supplied output (memory_branches) has NaN sampler log-probs: the step's update
    is bit for bit the one with finite ones (the loss never reads them), and the log-prob gap
    averages the sampled tokens only."""
    plain, memory = _batch(), _batch()
    subs = memory.rollouts["subs"]
    nan_row = subs.sampler_logp.at[1, 0].set(jnp.nan)  # agent 2's first sample: from memory
    memory = memory.replace(rollouts={**memory.rollouts, "subs": subs.replace(sampler_logp=nan_row)})
    new_plain, m_plain = step(_fresh_state(), plain)
    new_memory, m_memory = step(_fresh_state(), memory)
    assert not bool(m_memory["skipped"])
    for a, b in zip(jax.tree.leaves(new_plain.groups), jax.tree.leaves(new_memory.groups)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    gap = np.asarray(m_memory["agents"]["subs"]["logprob_gap"])
    assert np.all(np.isfinite(gap))
    np.testing.assert_allclose(gap, np.log(32), rtol=0.02)
    # Its group g3 has a reward spread and is kept (K = 2): counted as an off-policy group.
    for metrics, want in ((m_plain, 0), (m_memory, 1)):
        counts = (int(metrics["offpolicy_mixed_groups"]), int(metrics["offpolicy_kept_groups"]))
        assert counts == (want, want)


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_micro_batches_accumulate_to_the_full_batch_step(aggregation):
    loss = grpo.GRPOConfig(aggregation=aggregation)
    full_cfg = gs.GRPOStepConfig(loss=loss, topk=3, inner_steps=2)
    micro_cfg = gs.GRPOStepConfig(loss=loss, topk=3, inner_steps=2, micro_batch=2)
    full, full_m = gs.make_grpo_step(full_cfg)(_fresh_state(), _batch())
    micro, micro_m = gs.make_grpo_step(micro_cfg)(_fresh_state(), _batch())
    _assert_same_step(micro, micro_m, full, full_m)
    assert int(micro_m["kept_groups"]) == int(full_m["kept_groups"]) == 3


def _assert_same_step(got, got_m, want, want_m):
    """Two steps' params, optimizer states and per-agent metrics agree up to rounding."""
    for a, b in zip(jax.tree.leaves(want.groups), jax.tree.leaves(got.groups), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    for name in ("subs", "master"):
        for key, value in want_m["agents"][name].items():
            np.testing.assert_allclose(got_m["agents"][name][key], value, rtol=1e-5,
                                       atol=1e-6, err_msg=f"{name} {key}")


@pytest.mark.parametrize("per_pass,as_lora", [(1, False), (2, True)])
def test_agents_in_passes_give_the_one_pass_step(step, per_pass, as_lora):
    """The same params, optimizer states and metrics, up to rounding, with the agents of a group
    run in passes (2: a pass of two sub-agents, then the third alone; the master alone)."""
    fresh = _lora_state if as_lora else _fresh_state
    one, one_m = step(fresh(), _batch())
    passes, passes_m = gs.make_grpo_step(dataclasses.replace(STEP_CFG, agents_per_pass=per_pass))(
        fresh(), _batch())
    assert int(passes.skipped) == int(one.skipped) == 0
    _assert_same_step(passes, passes_m, one, one_m)


def test_agents_per_pass_below_one_is_refused():
    with pytest.raises(ValueError, match="agents_per_pass must be >= 1"):
        gs.GRPOStepConfig(agents_per_pass=0)


def test_a_micro_batch_that_does_not_divide_the_rows_is_refused(state):
    cfg = gs.GRPOStepConfig(micro_batch=3)
    with pytest.raises(ValueError, match="micro_batch 3 does not divide"):
        jax.eval_shape(functools.partial(gs.grpo_step, cfg=cfg), state, _batch())


def test_non_finite_loss_skips_the_whole_step(state, step):
    params = state.groups["subs"].params
    poisoned = params["embed"].at[0].set(jnp.inf)  # a selected agent diverged
    state = state.replace(groups=dict(state.groups, subs=state.groups["subs"].replace(
        params={**params, "embed": poisoned})))
    before = jax.tree.map(np.asarray, state.groups)

    state, metrics = step(state, _batch())

    assert bool(metrics["skipped"])
    assert (int(state.step), int(state.skipped)) == (0, 1)
    after = jax.tree.map(np.asarray, state.groups)
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert old.tobytes() == new.tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_reward_in_a_group_that_is_not_kept_changes_nothing(step, bad):
    """g1 (sub0, rewards [1, 1]) has no spread; one bad reward there must not skip the step."""
    clean, clean_m = step(_fresh_state(), _batch())
    batch = _batch()
    subs = batch.rollouts["subs"]
    poisoned = subs.replace(rewards=subs.rewards.at[0, 0].set(bad))
    batch = gs.GRPOBatch({**batch.rollouts, "subs": poisoned}, batch.group_agent)

    state, metrics = step(_fresh_state(), batch)

    assert not bool(metrics["skipped"]) and int(metrics["updated_agents"]) == 2
    for a, b in zip(jax.tree.leaves(clean.groups), jax.tree.leaves(state.groups), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    np.testing.assert_array_equal(metrics["agents"]["subs"]["loss"],
                                  clean_m["agents"]["subs"]["loss"])


def test_a_non_finite_update_is_never_committed(step):
    """Finite loss and gradients, but a learning rate that overflows float32: skipped."""
    huge = ts.OptimConfig(learning_rate=1e39, schedule="constant")
    state = ts.create({"subs": ts.init_group(SUB, huge, _random_params(SUB, 3, 0)),
                       "master": ts.init_group(MASTER, huge, _random_params(MASTER, 1, 1))})
    before = jax.tree.map(np.asarray, state.groups)

    state, metrics = gs.make_grpo_step(gs.GRPOStepConfig(topk=2, inner_steps=1))(state, _batch())

    assert bool(metrics["skipped"]) and (int(state.step), int(state.skipped)) == (0, 1)
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(state.groups), strict=True):
        assert old.tobytes() == np.asarray(new).tobytes()


def test_bad_batches_fail_with_a_clear_message(state):
    trace = lambda state, batch: jax.eval_shape(  # traces the step, compiles nothing
        functools.partial(gs.grpo_step, cfg=STEP_CFG), state, batch)
    batch = _batch()
    with pytest.raises(ValueError, match="every agent group needs a Rollouts entry"):
        trace(state, batch.replace(rollouts={"subs": batch.rollouts["subs"]}))
    three = jax.tree.map(lambda x: jnp.concatenate([x] * 3), batch.rollouts["master"])
    with pytest.raises(ValueError, match="'master' have agent axis 3, the group has 1 agents"):
        trace(state, batch.replace(rollouts={**batch.rollouts, "master": three}))
    unfrozen = state.groups["master"].replace(ref_params=None)
    with pytest.raises(ValueError, match="beta > 0 needs reference params"):
        trace(state.replace(groups={**state.groups, "master": unfrozen}), batch)


# ----------------------------------------------------------------------------------------------
# Learning: a bandit where each agent must emit its own target token after its prompts.
# ----------------------------------------------------------------------------------------------

BANDIT_AGENTS, PROMPTS, GROUP_SIZE, TARGETS = 3, 4, 8, np.array([5, 11, 17])


@functools.partial(jax.jit, static_argnums=0)
def _sample(model, params, prompts, key, temperature=1.0):
    """One token per prompt from the current policies at `temperature`. prompts [A, B, P] ->
    tokens [A, B, P+1] and the sampler's log-prob of each token (aligned, 0 on the prompt)."""
    def one(p, prompt, k):
        logits = qwen2.forward(model, p, prompt).logits[:, -1] / temperature
        tok = jax.random.categorical(k, logits)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)
        return tok, logp[:, 0]

    tok, logp = jax.vmap(one)(params, prompts, jax.random.split(key, prompts.shape[0]))
    tokens = jnp.concatenate([prompts, tok[..., None]], -1)
    logps = jnp.concatenate([jnp.zeros(prompts.shape), logp[..., None]], -1)
    return tokens, logps


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_raises_the_reward_on_a_bandit(temperature):
    """Reward 1 when an agent's generated token is its target (chance ~1/32 at the start).

    K = 6 of the 12 node groups, so this also trains through the marginal-benefit mask. The
    sampler and the trainer run the same params and, with a tempered loss, the same
    temperature, so their log-prob gap (~0) shows that logp_old is taken before the first
    update and that the loss scores the distribution the tokens were drawn from.
    """
    cfg = gs.GRPOStepConfig(topk=BANDIT_AGENTS * PROMPTS // 2, inner_steps=2,
                            loss=grpo.GRPOConfig(beta=0.0, temperature=temperature))
    state = ts.create({"subs": ts.init_group(SUB, OPTIM, _random_params(SUB, BANDIT_AGENTS, 3))})
    step = gs.make_grpo_step(cfg)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, SUB.vocab_size, (BANDIT_AGENTS, PROMPTS, 3))
    prompts = jnp.asarray(np.repeat(prompts, GROUP_SIZE, axis=1), jnp.int32)  # [A, B, 3]
    group_ids = np.arange(BANDIT_AGENTS * PROMPTS).repeat(GROUP_SIZE).reshape(BANDIT_AGENTS, -1)
    group_agent = jnp.arange(BANDIT_AGENTS).repeat(PROMPTS)
    loss_mask = jnp.zeros(prompts.shape[:2] + (4,), bool).at[..., -1].set(True)

    rewards, gaps, sample_key = [], [], jax.random.key(42)
    for _ in range(20):
        sample_key, key = jax.random.split(sample_key)
        tokens, logp = _sample(SUB, state.groups["subs"].params, prompts, key, temperature)
        reward = (tokens[..., -1] == TARGETS[:, None]).astype(jnp.float32)
        batch = gs.GRPOBatch({"subs": gs.Rollouts(
            tokens=tokens, mask=jnp.ones(tokens.shape, bool), loss_mask=loss_mask,
            sampler_logp=logp, rewards=reward, group_ids=jnp.asarray(group_ids, jnp.int32))},
            group_agent)
        state, metrics = step(state, batch)
        rewards.append(np.asarray(metrics["agents"]["subs"]["mean_reward"]))
        gaps.append(np.asarray(metrics["agents"]["subs"]["logprob_gap"]))
    rewards = np.array(rewards)  # [steps, agents]

    assert rewards[:3].mean() < 0.1
    assert np.all(rewards[-3:].mean(0) > 0.8)
    assert np.max(gaps) < 1e-4
    assert int(state.skipped) == 0


# ----------------------------------------------------------------------------------------------
# Sharded on 8 fake CPU devices (a subprocess: the device count is fixed when JAX starts).
# ----------------------------------------------------------------------------------------------


MESH = "data=2,fsdp=2,tensor=2"


def sharded_step(out: str) -> None:
    """Runs in the 8-device subprocess: one sharded step from `_fresh_state`, saved to `out`."""
    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = sharding.make_mesh(MESH)
    state, batch = _fresh_state(), _batch()
    state_sh = ts.state_shardings(state, mesh)
    step = gs.make_grpo_step(STEP_CFG, in_shardings=(state_sh, gs.batch_shardings(batch, mesh)),
                             out_shardings=(state_sh, None))
    state, metrics = step(jax.device_put(state, state_sh), batch)
    q = state.groups["subs"].params["layers"]["attn"]["q"]["kernel"]
    np.savez(out, **_flat_step(state, metrics), q_spec=str(q.sharding.spec),
             q_shard=q.addressable_shards[0].data.shape)


def _flat_step(state: ts.TrainState, metrics: dict) -> dict[str, np.ndarray]:
    tree = {"params": {n: g.params for n, g in state.groups.items()},
            "opt_state": {n: g.opt_state for n, g in state.groups.items()}, "metrics": metrics}
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


def test_sharded_step_matches_unsharded(step, tmp_path):
    out = str(tmp_path / "sharded.npz")
    # Backend optimization level 0 halves the compile; it changes code generation, not how
    # the program is partitioned, which is what this test checks.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS":
           "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
    code = f"from tests.rl.test_grpo_step import sharded_step; sharded_step({out!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = dict(np.load(out))

    want = _flat_step(*step(_fresh_state(), _batch()))
    assert str(got.pop("q_spec")) == str(P("agent", None, "fsdp", "tensor"))
    assert got.pop("q_shard").tolist() == [3, 1, 16, 2, 8]  # [A, L, D / fsdp, N / tensor, Hd]
    assert sorted(got) == sorted(want)
    # An update moves params by about lr = 1e-2 (1e-1 of their scale): a sharding bug shows up
    # orders of magnitude above this rounding-level bound.
    for name, w in want.items():
        scale = max(float(np.max(np.abs(w))), 1e-30)
        assert np.max(np.abs(got[name].astype(np.float64) - w)) / scale < 1e-4, name


def _lora_state() -> ts.TrainState:
    """The sub-agents as LoRA adapters over one shared base; the master in full."""
    cfg = lora.LoRAConfig(rank=2, alpha=4.0)
    base = jax.tree.map(lambda x: x[0], _random_params(SUB, 1, 0))
    adapters = ts.stack_agents([lora.init_adapters(base, cfg, jax.random.key(i))
                                for i in range(3)])
    return ts.create({"subs": ts.init_group(SUB, OPTIM, adapters, base=base, lora=cfg),
                      "master": ts.init_group(MASTER, OPTIM, _random_params(MASTER, 1, 1))})


def test_lora_step_trains_only_the_selected_agents_adapters(step):
    state = _lora_state()
    before = jax.tree.map(np.asarray, state.groups["subs"])
    state, metrics = step(state, _batch())
    after = jax.tree.map(np.asarray, state.groups["subs"])
    subs = metrics["agents"]["subs"]
    np.testing.assert_array_equal(subs["updated"], [True, True, False])
    chex.assert_trees_all_equal(before.base, after.base)  # frozen, bit for bit
    chex.assert_trees_all_equal(before.ref_params, after.ref_params)
    chex.assert_trees_all_equal_structs(after.opt_state[1][0].mu, after.params)  # adapters only
    for old, new in zip(_leaves((before.params, before.opt_state), 2),
                        _leaves((after.params, after.opt_state), 2)):
        assert old.tobytes() == new.tobytes()  # not selected
    for row in (0, 1):  # zero-initialized b moved, so the policies left the base
        assert all(np.any(new[row] != 0) for (path, new) in jax.tree_util.tree_leaves_with_path(
            after.params) if path[-1].key == "b")
    assert np.all(subs["kl"][:2] > 0)  # KL against the adapters at the start (here: the base)
    # Zero b: the first forward is the base's, whose near-uniform log-probs give the gap ln 32.
    np.testing.assert_allclose(subs["logprob_gap"], np.log(32), rtol=0.02)


def test_padding_micro_batches_and_agents_without_samples_are_skipped_exactly():
    """Agents one per pass, micro-batches of 2 rows: sub-agent 2 has no samples (only padding
    rows) and every agent's rows end in padding. The step skips those micro-batches in a
    `lax.cond` (a `case` in the lowered step; vmapped agents compute both branches: none) and
    equals the vmapped full-batch step."""
    rollouts = _rollouts("subs", 1)
    empty = np.asarray(rollouts.group_ids).copy()
    empty[2] = -1
    rollouts = rollouts.replace(group_ids=jnp.asarray(empty), mask=rollouts.mask.at[2].set(False),
                                loss_mask=rollouts.loss_mask.at[2].set(False))
    batch = gs.GRPOBatch({"master": _rollouts("master", 0), "subs": rollouts},
                         jnp.asarray([0, 1, 1, 2, -1, -1], jnp.int32))
    skipping = dataclasses.replace(STEP_CFG, agents_per_pass=1, micro_batch=2)
    step, vmapped = gs.make_grpo_step(skipping), gs.make_grpo_step(STEP_CFG)
    assert "stablehlo.case" in step.lower(_fresh_state(), batch).as_text()
    assert "stablehlo.case" not in vmapped.lower(_fresh_state(), batch).as_text()
    got, got_m = step(_fresh_state(), batch)
    want, want_m = vmapped(_fresh_state(), batch)
    _assert_same_step(got, got_m, want, want_m)
    start = _fresh_state()
    for before, after in zip(_leaves(start.groups["subs"].params, 2),
                             _leaves(got.groups["subs"].params, 2)):
        np.testing.assert_array_equal(after, before)
