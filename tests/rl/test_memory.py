"""Adaptive memory: every update rule by hand-built case, lookup vs NumPy, compile counts,
checkpoint round trip, and reuse of a rewarded query end to end with scripted policies."""

import collections
import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from joyagents_jax import components
from joyagents_jax import config as config_lib
from joyagents_jax.agents import protocol, system
from joyagents_jax.data import assistant_suite as suite
from joyagents_jax.models import qwen2
from joyagents_jax.rl import memory, memory_hook, rollout, self_imitation
from joyagents_jax.tokenizers import ByteTokenizer
from tests.rl.test_rollout import ScriptedPolicy, gold_script

TOK = ByteTokenizer()
D = 8
CFG = memory.MemoryConfig(capacity=4, response_length=6, request_length=5, prompt_length=7,
                          decay_steps=10.0)
LOW = 0.1  # filler reward: fillers are real samples (they set mu and sigma) that never enter


def unit(*coords) -> np.ndarray:
    v = np.zeros(D, np.float32)
    v[:len(coords)] = coords
    return v / np.linalg.norm(v)


E = [unit(*([0] * i + [1])) for i in range(D)]  # orthonormal basis
NEAR_E0 = unit(1, 0.01)  # cosine 0.99995 with E[0]: a near duplicate


def batch(rows, fillers=15, length=3):
    """Candidates: rows of (key, reward[, response token]) then `fillers` low-reward samples."""
    rows = list(rows) + [(E[-1], LOW)] * fillers
    n = len(rows)
    token = [r[2] if len(r) > 2 else 10 + i for i, r in enumerate(rows)]
    return memory.Candidates(
        key=np.stack([r[0] for r in rows]),
        response=np.array([[t] * CFG.response_length for t in token], np.int32),
        length=np.full(n, length, np.int32),
        request=np.tile(np.arange(CFG.request_length, dtype=np.int32), (n, 1)),
        request_length=np.full(n, 2, np.int32),
        prompt=np.array([[t + 1] * CFG.prompt_length for t in token], np.int32),
        prompt_length=np.full(n, 4, np.int32),
        reward=np.array([r[1] for r in rows], np.float32), valid=np.ones(n, bool))


def hits(*records):
    """HitRecords of (slot, outcome reward) pairs, padded to 4 rows."""
    padded = list(records) + [(0, 0.0)] * (4 - len(records))
    return memory.HitRecords(slot=np.array([s for s, _ in padded], np.int32),
                             reward=np.array([r for _, r in padded], np.float32),
                             valid=np.arange(4) < len(records))


def step(table, cands, hit_records=None, t=1):
    """One update with the batch's own thresholds; metrics as ints."""
    th = memory.thresholds(cands.reward, cands.valid, CFG)
    table, metrics = memory.update(table, cands, hit_records or hits(), th, t, CFG)
    return table, {k: int(v) for k, v in metrics.items()}


def filled(rows):
    """A table holding rows of (key, reward, step) in slots 0, 1, ..."""
    table = memory.init_table(CFG, D)
    n = len(rows)
    return table.replace(key=table.key.at[:n].set(np.stack([r[0] for r in rows])),
                         reward=table.reward.at[:n].set([r[1] for r in rows]),
                         step=table.step.at[:n].set([r[2] for r in rows]),
                         length=table.length.at[:n].set(3), valid=table.valid.at[:n].set(True))


def snapshot(table):
    return jax.tree.map(lambda x: np.array(x, copy=True), table)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and np.array_equal(x, y)


# ----------------------------------------------------------------------------------------------
# Update rules.
# ----------------------------------------------------------------------------------------------

def test_thresholds_follow_the_batch_and_cap_hi():
    r = np.array([1.1] + [LOW] * 7, np.float32)
    th = memory.thresholds(r, np.ones(8, bool), CFG)
    mu, sigma = r.mean(), r.std()
    np.testing.assert_allclose([th.mu, th.lo, th.hi], [mu, mu - 1.96 * sigma, mu + 1.96 * sigma],
                               rtol=1e-5)
    padded = memory.thresholds(np.append(r, 9.0), np.arange(9) < 8, CFG)  # padding is ignored
    np.testing.assert_allclose([padded.mu, padded.hi], [th.mu, th.hi], rtol=1e-6)
    capped = memory.thresholds(np.array([1.1, 1.1, LOW], np.float32), np.ones(3, bool), CFG)
    assert float(capped.hi) == np.float32(CFG.best_reward) and bool(capped.active)
    equal = memory.thresholds(np.full(3, 0.7, np.float32), np.ones(3, bool), CFG)
    assert not bool(equal.active)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_reward_is_left_out_of_the_thresholds(bad):
    r = np.array([1.1] + [LOW] * 7, np.float32)
    clean = memory.thresholds(r, np.ones(8, bool), CFG)
    poisoned = memory.thresholds(np.append(r, bad).astype(np.float32), np.ones(9, bool), CFG)
    for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(poisoned), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(float(poisoned.mu)) and bool(poisoned.active)


def test_jitted_thresholds_equal_the_op_by_op_ones_bit_for_bit():
    """Jitting the moments (one program per N instead of a dozen eager ops) changes no value."""
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 33, 100, 257):
        r = (rng.choice([0.0, 0.1, 0.55, 1.1], n) + rng.normal(size=n)).astype(np.float32)
        r[rng.integers(n)] = np.nan
        valid = rng.random(n) < 0.9
        jitted = memory.thresholds(r, valid, CFG)
        with jax.disable_jit():
            eager = memory.thresholds(r, valid, CFG)
        for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
            np.testing.assert_array_equal(a, b)


def test_insert_into_an_empty_slot():
    table, m = step(memory.init_table(CFG, D), batch([(E[0], 1.1)]), t=3)
    assert m == dict(entries=1, inserts=1, replacements=0, evictions=0, deletions=0)
    assert np.asarray(table.valid).tolist() == [True, False, False, False]
    np.testing.assert_array_equal(table.key[0], E[0])
    np.testing.assert_array_equal(table.response[0], [10] * 6)
    np.testing.assert_array_equal(table.prompt[0], [11] * 7)
    assert (int(table.length[0]), int(table.request_length[0]), int(table.prompt_length[0]),
            int(table.step[0])) == (3, 2, 4, 3)
    assert float(table.reward[0]) == np.float32(1.1)


def test_replace_a_near_duplicate_only_when_the_new_reward_is_at_least_the_old():
    table, _ = step(memory.init_table(CFG, D), batch([(E[0], 1.05, 1)]))
    before = snapshot(table)
    table, m = step(table, batch([(NEAR_E0, 1.0, 2)]), t=2)  # passes hi, but lower than stored
    assert m["inserts"] + m["replacements"] + m["evictions"] == 0
    assert_same(snapshot(table), before)
    table, m = step(table, batch([(NEAR_E0, 1.05, 3)]), t=3)  # equal reward: replaces
    assert m == dict(entries=1, inserts=0, replacements=1, evictions=0, deletions=0)
    np.testing.assert_array_equal(table.key[0], NEAR_E0)
    assert int(table.response[0, 0]) == 3 and int(table.step[0]) == 3


def test_evict_the_lowest_retention_score_when_full():
    cands = batch([(E[4], 1.1)])
    t, mu = 10, memory.thresholds(cands.reward, cands.valid, CFG).mu
    rows = [(E[0], 1.1, 10), (E[1], 1.1, 0), (E[2], 1.0, 10), (E[3], 1.05, 5)]
    retention = [np.exp(-(t - s) / CFG.decay_steps) + (r - float(mu)) for _, r, s in rows]
    assert int(np.argmin(retention)) == 1  # old beats low-reward: recency matters
    table, m = step(filled(rows), cands, t=t)
    assert m == dict(entries=4, inserts=0, replacements=0, evictions=1, deletions=0)
    np.testing.assert_array_equal(table.key[1], E[4])
    np.testing.assert_array_equal(np.asarray(table.key)[[0, 2, 3]], np.stack([E[0], E[2], E[3]]))


def test_delete_after_a_bad_hit():
    # Rewards 1.1 and 0.9 (mu 1.0, lo 0.80); responses longer than L are never written.
    cands = batch([(E[5], 1.1)] * 4 + [(E[5], 0.9)] * 4, fillers=0, length=CFG.response_length + 1)
    table = filled([(E[0], 1.1, 0), (E[1], 1.1, 0)])
    table, m = step(table, cands, hits((1, 0.1), (0, 1.1), (3, 0.0)))
    assert m == dict(entries=1, inserts=0, replacements=0, evictions=0, deletions=1)
    assert np.asarray(table.valid).tolist() == [True, False, False, False]


def test_nothing_written_or_deleted_when_sigma_is_zero():
    table = filled([(E[0], 1.1, 0), (E[1], 1.1, 0)])
    before = snapshot(table)
    table, m = step(table, batch([(E[2], 1.1), (E[3], 1.1)], fillers=0), hits((1, 0.0)))
    assert m == dict(entries=2, inserts=0, replacements=0, evictions=0, deletions=0)
    assert np.asarray(table.hits).tolist() == [0, 1, 0, 0]  # the reuse is still counted
    assert_same(snapshot(table).replace(hits=before.hits), before)


def test_colliding_candidates_resolve_in_row_order():
    empty = lambda: memory.init_table(CFG, D)
    # Two near duplicates in one step: the first inserts; the second replaces it iff its
    # reward is at least the first's (the later one wins ties).
    for rewards, kept in [((1.1, 1.05), 1), ((1.05, 1.1), 2), ((1.1, 1.1), 2)]:
        cands = batch([(E[0], rewards[0], 1), (NEAR_E0, rewards[1], 2)])
        table, m = step(empty(), cands)
        again, _ = step(empty(), cands)
        assert_same(snapshot(table), snapshot(again))
        assert m["entries"] == 1 and m["inserts"] == 1 and m["replacements"] == (kept == 2)
        assert int(table.response[0, 0]) == kept
    # Two evictions in one step take the two lowest retention scores, not each other's slot.
    rows = [(E[0], 1.1, 10), (E[1], 1.1, 0), (E[2], 1.0, 10), (E[3], 1.05, 5)]
    table, m = step(filled(rows), batch([(E[4], 1.1), (E[5], 1.1)]), t=10)
    assert m["evictions"] == 2
    np.testing.assert_array_equal(np.asarray(table.key)[[1, 3]], np.stack([E[4], E[5]]))


def test_capacity_is_never_exceeded_and_counts_add_up():
    rng = np.random.default_rng(0)
    table, seen, total = memory.init_table(CFG, D), [E[0]], collections.Counter()
    for t in range(1, 13):
        keys = rng.normal(size=(8, D)).astype(np.float32)
        keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
        for i in np.flatnonzero(rng.random(8) < 0.3):  # some repeat an earlier key
            keys[i] = seen[rng.integers(len(seen))]
        seen += list(keys)
        cands = batch([(k, rng.choice([1.1, 1.1, 1.05, 1.0, 0.9])) for k in keys], fillers=0)
        entries = int(table.valid.sum())
        slots = rng.integers(0, 4, size=2)
        table, m = step(table, cands, hits(*[(int(s), rng.choice([0.0, 1.1])) for s in slots]),
                        t=t)
        assert m["entries"] == int(table.valid.sum()) <= CFG.capacity
        assert m["entries"] == entries - m["deletions"] + m["inserts"]
        total.update(m)
        valid = np.asarray(table.valid)
        np.testing.assert_allclose(np.linalg.norm(np.asarray(table.key)[valid], axis=-1), 1,
                                   rtol=1e-5)
    assert min(total[k] for k in ("inserts", "replacements", "evictions", "deletions")) > 0


# ----------------------------------------------------------------------------------------------
# Lookup, hits, compilation, checkpoints, dump.
# ----------------------------------------------------------------------------------------------

def test_lookup_matches_numpy_and_handles_an_empty_table():
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(4, D)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    valid = np.array([True, False, True, True])
    table = memory.init_table(CFG, D).replace(key=jnp.asarray(keys), valid=jnp.asarray(valid))
    queries = rng.normal(size=(5, D)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=-1, keepdims=True)
    queries[0] = keys[1]  # nearest to an empty slot: must not pick it
    sim, slot = memory.lookup(table, queries)
    ref = np.where(valid, queries @ keys.T, -np.inf)
    np.testing.assert_array_equal(slot, ref.argmax(-1))
    np.testing.assert_allclose(sim, ref.max(-1), rtol=1e-6)
    assert int(slot[0]) != 1
    sim, slot = memory.lookup(memory.init_table(CFG, D), queries)
    assert np.all(np.isneginf(sim)) and np.all(np.asarray(slot) == -1)


def test_update_counts_the_steps_reuses_and_a_write_resets_them():
    table = filled([(E[0], 1.0, 0), (E[1], 1.0, 0), (E[2], 1.0, 0)])
    high = hits((0, 1.0), (2, 1.0), (0, 1.0))  # good outcomes: nothing is deleted
    table, m = step(table, batch([]), high)  # fillers only: sigma = 0, nothing enters
    assert np.asarray(table.hits).tolist() == [2, 0, 1, 0] and m["deletions"] == 0
    table, _ = step(table, batch([(E[0], 2.0)]), hits((1, 1.0)))  # E[0] rewritten
    assert np.asarray(table.hits).tolist() == [0, 1, 1, 0]


def test_update_and_lookup_compile_once_for_fixed_shapes():
    cfg = dataclasses.replace(CFG, capacity=3)  # shapes no other test uses
    table = memory.init_table(cfg, D)
    lookups, updates = memory.lookup._cache_size(), memory.update._cache_size()
    for t, reward in enumerate([1.1, 1.05, 1.0]):
        cands = batch([(E[t], reward)])
        th = memory.thresholds(cands.reward, cands.valid, cfg)
        table, _ = memory.update(table, cands, hits((t % 3, 0.0)), th, t, cfg)
        memory.lookup(table, np.stack(E[:3]) * (t + 1))
    assert memory.update._cache_size() - updates == 1  # one compile each for these shapes
    assert memory.lookup._cache_size() - lookups == 1


def test_orbax_round_trip_is_bit_exact(tmp_path):
    table, _ = step(memory.init_table(CFG, D), batch([(E[0], 1.1), (E[1], 1.05)]), t=7)
    table, _ = step(table, batch([]), hits((1, 1.1), (1, 1.1)), t=8)
    state = {"all": jax.tree.map(lambda *x: jnp.stack(x), table, memory.init_table(CFG, D))}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "memory", state)
        ckpt.wait_until_finished()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        restored = ckpt.restore(tmp_path / "memory", abstract)
    assert isinstance(restored["all"], memory.MemoryTable)
    assert_same(snapshot(restored), snapshot(state))


def test_dump_writes_decoded_entries(tmp_path):
    table = memory.init_table(CFG, D)
    req, resp = TOK.encode("hi?"), TOK.encode("<a>ok")
    table = table.replace(
        request=table.request.at[2, :3].set(req), request_length=table.request_length.at[2].set(3),
        response=table.response.at[2, :5].set(resp), length=table.length.at[2].set(5),
        reward=table.reward.at[2].set(1.1), step=table.step.at[2].set(4),
        hits=table.hits.at[2].set(2), valid=table.valid.at[2].set(True))
    n = memory.dump({"math": table, "qa": memory.init_table(CFG, D)}, TOK, tmp_path / "m.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert n == 1 and lines == [dict(agent="math", slot=2, reward=pytest.approx(1.1), step=4,
                                     hits=2, request="hi?", response="<a>ok")]


def test_tables_follow_the_run_config():
    model = qwen2.Qwen2Config(vocab_size=TOK.vocab_size, hidden_size=8, intermediate_size=16,
                              num_layers=1, num_heads=2, num_kv_heads=1)
    ref = jax.tree.map(lambda x: jnp.zeros((2, *x.shape), x.dtype), qwen2.param_shapes(model))
    config = config_lib.get_config()
    config.memory.update(capacity=5, response_len=7, request_len=3, z=1.5)
    config.max_len = 20
    cfg = components.build(config).memory
    assert (cfg.capacity, cfg.response_length, cfg.z, cfg.prompt_length) == (5, 7, 1.5, 19)
    tables = memory_hook.init_tables(cfg, {"g": memory_hook.GroupModel(model, ref)})
    assert tables["g"].key.shape == (2, 5, 8) and tables["g"].request.shape == (2, 5, 3)
    assert tables["g"].prompt.shape == (2, 5, 19)


# ----------------------------------------------------------------------------------------------
# End to end: a rewarded query is answered from memory the second time.
# ----------------------------------------------------------------------------------------------

def test_repeated_rewarded_query_is_answered_from_memory(monkeypatch):
    world = suite.suite_world(suite.TINY)
    sys_ = system.make_system(world)
    exs = {}
    for record in suite.generate_splits(suite.TINY)["train"]:
        ex = suite.decode(record)
        exs.setdefault(ex.domain, ex)
    good, bad = exs["math"], exs["qa"]
    script = gold_script([good])  # the qa query gets "<answer>?</answer>": a low reward
    task = lambda ex: rollout.Task(ex.query, ex.answer, ex.answer_kind, ex.min_llm_calls)

    model = qwen2.Qwen2Config(vocab_size=TOK.vocab_size, hidden_size=16, intermediate_size=32,
                              num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=1024)
    keys = jax.random.split(jax.random.key(0), len(sys_.agents))
    ref = jax.tree.map(lambda *x: jnp.stack(x), *[qwen2.init_params(model, k) for k in keys])
    cfg = memory.MemoryConfig(capacity=8, response_length=64, request_length=32,
                              tau_reuse=0.9999, tau_hint=0.9999, embed_batch=8)
    slots = {a: ("all", i) for i, a in enumerate(sys_.agents)}
    ctx = memory_hook.Context(sys_, TOK, slots, cfg)
    models = {"all": memory_hook.GroupModel(model, ref)}
    tables = memory_hook.init_tables(cfg, models)
    run = lambda exs_, tables, episodes=False: getattr(rollout.Rollout(
        sys_, TOK, ScriptedPolicy(script), rollout.RolloutConfig("nodewise", 2),
        memory_hook.MemoryView(ctx, tables, models)), "episodes" if episodes else "run")(
        [task(e) for e in exs_])
    leaves = lambda tables: [np.asarray(x).tobytes() for x in jax.tree.leaves(tables)]

    first = run([good, bad], tables)
    k = good.min_llm_calls
    assert first.episodes[0].episode.llm_calls == k and first.counters.memory_hits == 0
    assert float(first.rewards[0].total) > float(first.rewards[1].total)
    tables, m = memory_hook.update(ctx, tables, models, first, step=1)
    assert m["entries"] == k and m["inserts"] == k and m["llm_calls_saved"] == 0
    # Each entry keeps its node's whole hint-free prompt beside the output: what
    # self-imitation replays, here every node of the rewarded episode.
    trace = first.episodes[0]
    demos = self_imitation.draw(memory.agent_tables(jax.device_get(tables), slots), sys_.agents,
                                k, float(first.rewards[0].memory_reward), 10_000,
                                np.random.default_rng(0))
    assert sorted((a, p, TOK.decode(o)) for a, p, o in demos) == sorted(
        (n.agent, list(i.prompt_ids), n.output) for i, n in zip(trace.inputs, trace.episode.nodes))

    before = leaves(tables)
    second = run([good], tables)
    episode = second.episodes[0].episode
    assert second.counters.memory_hits >= 1 and episode.llm_calls <= k - 1
    assert [n.output for n in episode.nodes] == [n.output for n in first.episodes[0].episode.nodes]
    assert float(second.rewards[0].total) == float(first.rewards[0].total)
    assert float(second.rewards[0].memory_reward) == float(first.rewards[0].memory_reward)
    third = run([good], tables, episodes=True)  # evaluation reads the same entries
    assert third.counters.memory_hits >= 1
    # A view of some agents reads only their entries (grpo.unbranched_memory="eval"'s rollouts).
    reused = lambda result: {n.agent for n in result.episodes[0].episode.nodes if n.from_memory}
    subs = tuple(a for a in sys_.agents if a != protocol.MASTER)
    limited = rollout.Rollout(sys_, TOK, ScriptedPolicy(script), rollout.RolloutConfig(
        "nodewise", 2), memory_hook.MemoryView(ctx, tables, models, subs)).episodes([task(good)])
    assert protocol.MASTER in reused(third) and reused(limited) == reused(third) - {
        protocol.MASTER} != set()
    assert leaves(tables) == before  # lookups never write: only the update changes the tables
    tables, m = memory_hook.update(ctx, tables, models, second, step=2)
    assert m["llm_calls_saved"] == second.counters.memory_hits and m["hit_rate"] > 0
    assert m["hit_rate"] == second.counters.memory_hits / second.counters.memory_lookups
    assert int(sum(t.hits.sum() for t in tables.values())) == second.counters.memory_hits

    # A match that may not be reused verbatim (stored reward below the bar) becomes a hint.
    searched, search = [], memory_hook._search
    monkeypatch.setattr(memory_hook, "_search", lambda *a: searched.append(len(a[-1])) or search(*a))
    hinting = memory_hook.MemoryView(ctx._replace(cfg=dataclasses.replace(cfg, reuse_min_reward=2.0)),
                                     tables, models)
    request = system.Episode(sys_, good.query).pending()
    (hint,) = hinting.lookup([request])
    assert hint == protocol.Hint(good.query[:32], first.episodes[0].episode.nodes[0].output)
    # A view searches a prompt once: repeats, in one wave or a later one, reuse that answer.
    assert hinting.lookup([request, request]) == [hint, hint] and searched == [1]

    # memory_branches: the stored outputs join node groups as members, but are not stored
    # again (candidates and thresholds are the generated samples only).
    branched = rollout.Rollout(
        sys_, TOK, ScriptedPolicy(script), rollout.RolloutConfig("nodewise", 2, memory_branches=True),
        memory_hook.MemoryView(ctx, tables, models)).run([task(good)])
    reused = [s for s in branched.samples if s.from_memory]
    assert len(reused) == sum(n.from_memory for n in branched.episodes[0].episode.nodes) >= 1
    members = memory_hook._members(ctx, branched)
    assert sum(map(len, members.values())) == len(branched.samples) - len(reused)
    assert not any(s.from_memory for found in members.values() for _, s in found)
    # gold_branches: a gold output in a node group is not stored either.
    gold = [n.output for n in good.gold]
    guided = rollout.Rollout(
        sys_, TOK, ScriptedPolicy(lambda i, j, n: "<answer>wrong</answer>"),
        rollout.RolloutConfig("nodewise", 2, gold_branches=True)).run(
        [task(good)._replace(gold=tuple(gold))])
    assert any(s.from_gold for s in guided.samples)
    members = memory_hook._members(ctx, guided)
    assert sum(map(len, members.values())) == sum(not s.from_gold for s in guided.samples)
    assert memory_hook._generated(guided) == [s for s in guided.samples if not s.from_gold]


def test_key_chunks_always_have_embed_batch_rows():
    """Any number of prompts embeds in chunks of embed_batch rows: one compiled shape per
    prompt-length bucket, and each row's key as when it is embedded alone."""
    model = qwen2.Qwen2Config(vocab_size=TOK.vocab_size, hidden_size=16, intermediate_size=32,
                              num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=64)
    ref = jax.tree.map(lambda x: x[None], qwen2.init_params(model, jax.random.key(0)))
    cfg = memory.MemoryConfig(capacity=4, response_length=8, request_length=8, embed_batch=4)
    ctx = memory_hook.Context(None, TOK, {}, cfg)
    group = memory_hook.GroupModel(model, ref)
    rows = [list(range(1, 1 + n)) for n in (3, 9, 5, 12, 10, 2)]
    memory_hook._embed_agent.clear_cache()
    keys = {n: memory_hook._embed(ctx, group, 0, rows[:n]) for n in (1, 2, 6)}
    assert memory_hook._embed_agent._cache_size() == 2  # [4, 4] and [4, 16]
    chex.assert_shape(keys[6], (6, 16))
    for n, k in keys.items():
        np.testing.assert_allclose(k, keys[6][:n], atol=1e-6)
    alone = np.concatenate([memory_hook._embed(ctx, group, 0, [r]) for r in rows])
    np.testing.assert_allclose(keys[6], alone, atol=1e-6)
