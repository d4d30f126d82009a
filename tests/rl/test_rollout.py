"""Rollout modes with scripted policies (structure, counts, rewards) and with the real sampler."""

import collections
import types

import jax
import numpy as np
import pytest

from joyagents_jax import batching
from joyagents_jax.agents import protocol, system
from joyagents_jax.data import assistant_suite as suite
from joyagents_jax.models import qwen2
from joyagents_jax.rl import memory_hook, rollout
from joyagents_jax.sampling import Sampler, SamplingConfig
from joyagents_jax.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


class ScriptedPolicy:
    """Test double: output = script(node input, j, group size); counts calls like a sampler."""

    def __init__(self, script, repeat=lambda node_input: 1.0):
        self.script, self.calls, self.batch_sizes, self.draws = script, 0, [], []
        self.repeat = repeat  # node input -> the chance that a sample repeats the output

    def sample(self, inputs, group_size, greedy=False):
        self.calls += 1
        self.batch_sizes.append(len(inputs))
        self.draws.append((group_size, greedy))
        out = []
        for node_input in inputs:
            row = []
            for j in range(group_size):
                text = self.script(node_input, j, group_size)
                ids = np.asarray(TOK.encode(text), np.int32)
                row.append(rollout.Generation(text, ids, np.zeros(len(ids), np.float32), False,
                                              float(np.log(self.repeat(node_input)))))
            out.append(row)
        return out


@pytest.fixture(scope="module")
def examples():
    records = suite.generate_splits(suite.TINY)["train"]
    exs = [suite.decode(r) for r in records]
    by_domain = {}
    for ex in exs:
        by_domain.setdefault(ex.domain, ex)
    return by_domain


@pytest.fixture(scope="module")
def sys_():
    return system.make_system(suite.suite_world(suite.TINY))


def _task(ex):
    return rollout.Task(ex.query, ex.answer, ex.answer_kind, ex.min_llm_calls)


def gold_script(examples, wrong_every=0):
    """Replays gold outputs, keyed by rendered prompt; in draws of several samples, every
    `wrong_every`-th answer node answers wrongly, so groups get reward spread."""
    table = {}
    sys_ = system.make_system(suite.suite_world(suite.TINY))
    for ex in examples:
        ep = system.demonstration(sys_, ex.query, [n.output for n in ex.gold])
        for node in ep.nodes:
            spec = sys_.specs[node.agent]
            table[protocol.render_prompt(TOK, spec, node.query, node.turns)] = node.output
    counter = collections.Counter()

    def script(node_input, j, group_size):
        gold = table[node_input.prompt] if node_input.prompt in table else "<answer>?</answer>"
        counter[group_size] += 1
        if group_size > 1 and wrong_every and gold.startswith("<answer>") \
                and counter[group_size] % wrong_every == 0:
            return "<answer>wrong</answer>"
        return gold
    return script


def second_answer_wrong(examples):
    """gold_script, except that the second sample of each draw of several at an answer node
    answers wrongly: every node group ending in an answer gets a reward spread."""
    gold = gold_script(examples)

    def script(node_input, j, group_size):
        out = gold(node_input, j, group_size)
        wrong = group_size > 1 and j == 1 and out.startswith("<answer>")
        return "<answer>wrong</answer>" if wrong else out
    return script


def test_nodewise_groups_share_prefix_and_score_their_own_continuation(examples, sys_):
    exs = [examples["math"], examples["cooperation"]]
    g = 3
    policy = ScriptedPolicy(gold_script(exs, wrong_every=2))
    result = rollout.Rollout(sys_, TOK, policy, rollout.RolloutConfig("nodewise", g)).run(
        [_task(e) for e in exs])
    k = [len(t.episode.nodes) for t in result.episodes]
    assert k == [e.min_llm_calls for e in exs]  # tau0 follows the gold trajectory
    assert result.counters.alternatives == g * sum(k)  # sum_i G_i, not prod_i G_i
    groups = collections.defaultdict(list)
    for s in result.samples:
        groups[s.group].append(s)
    assert len(groups) == sum(k) and all(len(m) == g for m in groups.values())
    for members in groups.values():
        assert len({(m.query, m.node, m.agent, tuple(m.prompt_ids)) for m in members}) == 1
    # tau0 is member 0 and earns the full reward; a wrong alternative answer scores lower.
    rewards = np.array([[m.reward for m in groups[i]] for i in sorted(groups)])
    assert np.allclose(rewards[:, 0], 1.1)
    assert (rewards[:, 1:] < 1.0).any() and np.isclose(rewards[:, 1:], 1.1).any()


def test_nodewise_reward_comes_from_each_alternatives_own_completion(examples, sys_):
    ex = examples["math"]

    def script(node_input, j, group_size):  # the math agent's alternative answer is wrong
        base = gold_script([ex])(node_input, j, 1)
        if node_input.agent == "math" and base.startswith("<answer>") and group_size > 1:
            return "<answer>wrong</answer>"
        return base
    result = rollout.Rollout(sys_, TOK, ScriptedPolicy(script),
                             rollout.RolloutConfig("nodewise", 3)).run([_task(ex)])
    by_node = {s.node: [] for s in result.samples}
    for s in result.samples:
        by_node[s.node].append(s.reward)
    math_answer_node = 2
    assert by_node[math_answer_node] == pytest.approx([1.1, 0.1, 0.1])  # wrong answers propagate
    assert by_node[0] == pytest.approx([1.1, 1.1, 1.1])  # routing alternatives complete correctly


def test_share_identical_completes_each_distinct_output_once(examples, sys_):
    """share_identical: alternatives equal to an earlier member of their node group take its
    reward instead of a completion of their own; distinct ones are completed as before."""
    ex = examples["math"]  # master call, math tool, math answer, master answer
    gold = gold_script([ex])
    completions = collections.Counter()

    def script(node_input, j, group_size):  # alternative math answers are wrong; completions
        out = gold(node_input, j, group_size)  # of the math answer are wrong every second time
        if node_input.agent == "math" and out.startswith("<answer>"):
            completions[group_size] += 1
            if group_size > 1 or completions[1] % 2 == 0:
                return "<answer>wrong</answer>"
        return out
    g = 3

    def run(share):
        completions.clear()
        return rollout.Rollout(sys_, TOK, ScriptedPolicy(script), rollout.RolloutConfig(
            "nodewise", g, share_identical=share)).run([_task(ex)])
    plain, shared = run(False), run(True)
    k = len(shared.episodes[0].episode.nodes)
    math_answer = 2
    by_node = collections.defaultdict(list)
    for s in shared.samples:
        by_node[s.node].append(s.reward)
    assert by_node[math_answer] == pytest.approx([1.1, 0.1, 0.1])
    assert all(by_node[i] == pytest.approx([1.1] * g) for i in range(k) if i != math_answer)
    plain_rewards = [s.reward for s in plain.samples if s.node < math_answer]
    assert min(plain_rewards) < 1.0  # completions of equal outputs drew wrong answers there
    assert shared.counters.shared == (g - 1) * k - 1  # all but the first wrong math answer
    assert plain.counters.shared == 0
    # One completion (the master's answer after the wrong math answer) instead of one per
    # alternative: sum over nodes i of (G - 1) * (k - 1 - i) nodes.
    assert shared.counters.llm_nodes == k + (g - 1) * k + 1
    assert plain.counters.llm_nodes == k + (g - 1) * k + (g - 1) * k * (k - 1) // 2
    assert [len(s.output_ids) for s in shared.samples] == \
        [len(s.output_ids) for s in plain.samples]


@pytest.mark.parametrize("greedy", [False, True])
def test_greedy_completions_decode_all_but_the_branch_nodes_greedily(examples, sys_, greedy):
    exs = [examples["math"], examples["cooperation"]]
    policy = ScriptedPolicy(gold_script(exs, wrong_every=2))
    cfg = rollout.RolloutConfig("nodewise", 3, greedy_completions=greedy)
    result = rollout.Rollout(sys_, TOK, policy, cfg).run([_task(e) for e in exs])
    assert {d for d in policy.draws if d[0] > 1} == {(3 - 1, False)}  # alternatives: sampled
    assert {d for d in policy.draws if d[0] == 1} == {(1, greedy)}  # tau0 and completions
    assert len({s.group for s in result.samples}) == sum(e.min_llm_calls for e in exs)


def test_suffix_credit_trains_each_alternatives_later_nodes_with_its_advantage(examples, sys_):
    """suffix_credit: node-group members carry their group advantage; in groups with a reward
    spread, every node a completed alternative sampled after its branch joins as a (query,
    agent)-grouped sample with that alternative's advantage, and the memory never stores it."""
    ex = examples["math"]  # master call, math tool, math answer, master answer
    gold = gold_script([ex])

    def script(node_input, j, group_size):  # alternative math answers are wrong
        out = gold(node_input, j, group_size)
        wrong = node_input.agent == "math" and out.startswith("<answer>") and group_size > 1
        return "<answer>wrong</answer>" if wrong else out

    def run(suffix):
        return rollout.Rollout(sys_, TOK, ScriptedPolicy(script), rollout.RolloutConfig(
            "nodewise", 3, suffix_credit=suffix)).run([_task(ex)])
    plain, result = run(False), run(True)
    members = [s for s in result.samples if not s.suffix]
    key = lambda s: (s.agent, tuple(s.prompt_ids), tuple(s.output_ids), s.group, s.node,
                     s.memory_reward)
    assert [key(s) for s in members] == [key(s) for s in plain.samples]
    math_answer, k = 2, 4
    adv = rollout.episode_advantages(np.array([1.1, 0.1, 0.1]))
    by_node = collections.defaultdict(list)
    for s in members:
        by_node[s.node].append(s.reward)
    assert by_node[math_answer] == pytest.approx(list(adv))
    assert all(by_node[i] == pytest.approx([0.0] * 3) for i in range(k) if i != math_answer)
    suffix = [s for s in result.samples if s.suffix]  # only the math answer's group has spread
    assert [(s.node, s.agent) for s in suffix] == [(3, "master")] * 2
    assert [s.reward for s in suffix] == pytest.approx([adv[1], adv[2]])
    assert len({s.group for s in suffix}) == 1  # (query, agent)
    assert not {s.group for s in suffix} & {s.group for s in members}
    assert all(s.prompt_ids != members[-1].prompt_ids for s in suffix)  # their own context
    assert [key(s) for s in memory_hook._generated(result)] == [key(s) for s in members]


class MathMemory:
    """Test double: answers every math-agent node from "memory" with `script`'s output."""

    def __init__(self, script, sys_):
        self.script, self.sys_ = script, sys_

    def lookup(self, requests):
        out = []
        for r in requests:
            if r.agent != "math":
                out.append(None)
                continue
            prompt = protocol.render_prompt(TOK, self.sys_.specs[r.agent], r.query, r.turns)
            text = self.script(rollout.NodeInput(r.agent, prompt, [], "sub"), 0, 1)
            ids = np.asarray(TOK.encode(text), np.int32)
            out.append(rollout.Reuse(rollout.Generation(text, ids, np.zeros(len(ids)), False), 0))
        return out


@pytest.mark.parametrize("mode", ["nodewise", "trajectory"])
def test_samples_of_episodes_with_a_memory_answer_are_marked(examples, sys_, mode):
    ex = examples["math"]
    script = gold_script([ex])
    result = rollout.Rollout(sys_, TOK, ScriptedPolicy(script), rollout.RolloutConfig(mode, 2),
                             MathMemory(script, sys_)).run([_task(ex)])
    nodes = result.episodes[0].episode.nodes
    memory_at = [i for i, n in enumerate(nodes) if n.from_memory]
    assert memory_at and all(nodes[i].agent == "math" for i in memory_at)
    assert {s.agent for s in result.samples} == {"master"}  # memory nodes are never trained
    assert all(s.uses_memory for s in result.samples)
    alone = rollout.Rollout(sys_, TOK, ScriptedPolicy(script), rollout.RolloutConfig(mode, 2)
                            ).run([_task(ex)])
    assert alone.samples and not any(s.uses_memory for s in alone.samples)


def _stored_math_run(examples, sys_, cfg: rollout.RolloutConfig) -> rollout.RolloutResult:
    """The math example rolled out beside a memory of its gold outputs, the math agent's
    samples (not its greedy tau0) answering wrongly."""
    ex = examples["math"]
    gold = gold_script([ex])

    def script(node_input, j, group_size):
        if node_input.agent == "math" and group_size > 1:
            return "<answer>wrong</answer>"
        return gold(node_input, j, group_size)
    return rollout.Rollout(sys_, TOK, ScriptedPolicy(script), cfg,
                           MathMemory(gold, sys_)).run([_task(ex)])


def test_memory_branches_group_the_stored_output_with_policy_samples(examples, sys_):
    """memory_branches: a memory-answered node forms a node group too, the memory's output
    (member 0, NaN sampler log-probs) beside G - 1 policy samples, which here answer wrongly,
    so the group has the reward spread that moves the policy toward the stored answer."""
    g = 3
    result = _stored_math_run(examples, sys_,
                              rollout.RolloutConfig("nodewise", g, memory_branches=True))
    nodes = result.episodes[0].episode.nodes
    memory_at = [i for i, n in enumerate(nodes) if n.from_memory]
    assert memory_at and result.counters.alternatives == g * len(nodes)
    for i in memory_at:
        members = [s for s in result.samples if s.node == i]
        assert len(members) == g and {s.agent for s in members} == {"math"}
        assert [s.from_memory for s in members] == [True] + [False] * (g - 1)
        assert np.isnan(members[0].sampler_logp).all()
        assert all(np.isfinite(s.sampler_logp).all() for s in members[1:])
        assert members[0].reward > max(s.reward for s in members[1:])
    assert not any(s.from_memory for s in result.samples if s.node not in memory_at)
    without = _stored_math_run(examples, sys_, rollout.RolloutConfig("nodewise", g))
    assert {s.node for s in without.samples}.isdisjoint(memory_at)


def test_memory_members_count_the_stored_output_that_many_times(examples, sys_):
    """memory_members=k: at a memory-answered node the stored output is k identical rows of its
    node group (the same output, reward and NaN log-probs), the policy's G - 1 samples one row
    each; nodes the policy answered keep G members, and k=1 is the default's group."""
    g, k = 3, 4
    runs = {n: _stored_math_run(examples, sys_, rollout.RolloutConfig(
        "nodewise", g, memory_branches=True, memory_members=n)) for n in (1, k)}
    nodes = runs[k].episodes[0].episode.nodes
    memory_at = {i for i, n in enumerate(nodes) if n.from_memory}
    assert memory_at
    for i, n in enumerate(nodes):
        members = [s for s in runs[k].samples if s.node == i]
        stored = [s for s in members if s.from_memory]
        assert len(stored) == (k if i in memory_at else 0)
        assert len(members) == len(stored) + g - (i in memory_at)
        assert len({(s.group, s.reward, bytes(s.output_ids)) for s in stored}) <= 1
        policy = lambda r: [(s.group, s.reward, bytes(s.output_ids)) for s in r.samples
                            if s.node == i and not s.from_memory]
        assert policy(runs[k]) == policy(runs[1])
    with pytest.raises(ValueError, match="memory_members > 1 needs memory_branches"):
        rollout.RolloutConfig("nodewise", g, memory_members=2)
    with pytest.raises(ValueError, match="memory_members must be >= 1"):
        rollout.RolloutConfig("nodewise", g, memory_branches=True, memory_members=0)


def test_gold_branches_add_the_gold_output_where_the_rollout_leaves_gold(examples, sys_):
    """gold_branches: where tau0 follows gold up to a node and departs there, the gold output
    joins that node group as member G + 1 (NaN sampler log-probs, an LLM call of its episode,
    completed by the policy); nodes after the departure (another context) and nodes where
    tau0 is gold get none; a task without gold gets none."""
    ex = examples["math"]  # master call, math tool, math answer, master answer
    gold = gold_script([ex])
    outputs = [n.output for n in ex.gold]

    def script(node_input, j, group_size):  # the math agent always answers wrongly
        if node_input.agent == "math" and gold(node_input, j, group_size).startswith("<answer>"):
            return "<answer>wrong</answer>"
        return gold(node_input, j, group_size)
    g = 3
    task = _task(ex)._replace(gold=tuple(outputs))
    cfg = rollout.RolloutConfig("nodewise", g, gold_branches=True)
    result = rollout.Rollout(sys_, TOK, ScriptedPolicy(script), cfg).run([task])
    nodes = result.episodes[0].episode.nodes
    departs = next(i for i, n in enumerate(nodes) if n.output != outputs[i])
    assert nodes[departs].agent == "math" and departs < len(nodes) - 1
    by_node = collections.defaultdict(list)
    for s in result.samples:
        by_node[s.node].append(s)
    for i, members in by_node.items():
        assert len({s.group for s in members}) == 1
        if i != departs:
            assert len(members) == g and not any(s.from_gold for s in members)
            continue
        assert len(members) == g + 1 and [s.from_gold for s in members] == [False] * g + [True]
        guided = members[-1]
        assert TOK.decode(guided.output_ids.tolist()) == outputs[i]
        assert np.isnan(guided.sampler_logp).all()
        assert all(np.isfinite(s.sampler_logp).all() for s in members[:-1])
        assert guided.reward > max(s.reward for s in members[:-1])  # the right answer
    assert result.counters.alternatives == g * len(nodes)
    plain = rollout.Rollout(sys_, TOK, ScriptedPolicy(script), cfg).run([_task(ex)])
    assert not any(s.from_gold for s in plain.samples)
    assert list(collections.Counter(s.group for s in plain.samples).values()) == \
        [g] * len(plain.episodes[0].episode.nodes)


@pytest.mark.parametrize("credit", [False, True])
def test_subagent_credit_scores_the_sub_agent_by_its_own_answer(examples, sys_, credit):
    """The master repairs the efc agent's wrong alternative: the episode's reward cannot tell
    it from the right one, the sub-agent's own answer can (node group and memory reward); the
    master's node groups are scored as before."""
    ex = examples["efc"]  # master call, efc answer, master answer
    outputs = [n.output for n in ex.gold]
    gold = gold_script([ex])

    def script(node_input, j, group_size):
        if node_input.agent == "efc" and group_size > 1 and j == 1:
            return "<answer>wrong</answer>"
        out = gold(node_input, j, group_size)
        return outputs[-1] if node_input.agent == protocol.MASTER and out == "<answer>?</answer>" \
            else out
    g = 3
    task = _task(ex)._replace(gold=tuple(outputs))
    cfg = rollout.RolloutConfig("nodewise", g, subagent_credit=credit)
    result = rollout.Rollout(sys_, TOK, ScriptedPolicy(script), cfg).run([task])
    best = cfg.rewards.best_memory_reward
    by_node = collections.defaultdict(list)
    for s in result.samples:
        by_node[s.node].append((TOK.decode(s.output_ids.tolist()), s.reward, s.memory_reward))
    assert [(o, r) for o, r, _ in by_node[1]] == [
        (outputs[1], pytest.approx(best)), (outputs[1], pytest.approx(best)),
        ("<answer>wrong</answer>", pytest.approx(best - 1.0 if credit else best))]
    assert by_node[1][-1][2] == pytest.approx(best - 1.0 if credit else best)
    assert all(r == pytest.approx(best) for i in (0, 2) for _, r, _ in by_node[i])
    no_gold = rollout.Rollout(sys_, TOK, ScriptedPolicy(script), cfg).run([_task(ex)])
    assert all(s.reward == pytest.approx(best) for s in no_gold.samples)


def test_branch_agents_leave_unlisted_agents_without_node_groups(examples, sys_):
    """branch_agents: only the listed agents' nodes of tau0 get node groups; the others (the
    master, gfc) keep tau0's outputs, sample no alternatives and train nothing; the listed
    agents' groups are those branching at every agent forms (same members, rewards, order)."""
    exs = [examples["math"], examples["cooperation"], examples["qa"]]
    script = second_answer_wrong(exs)
    listed = ("qa", "math")
    g = 3
    tasks = [_task(e) for e in exs]
    every = rollout.Rollout(sys_, TOK, ScriptedPolicy(script),
                            rollout.RolloutConfig("nodewise", g)).run(tasks)
    subs = rollout.Rollout(sys_, TOK, ScriptedPolicy(script),
                           rollout.RolloutConfig("nodewise", g, branch_agents=listed)).run(tasks)
    key = lambda s: (s.query, s.node, s.agent, tuple(s.prompt_ids), tuple(s.output_ids),
                     s.reward)
    assert {s.agent for s in every.samples} == {protocol.MASTER, "gfc", *listed}
    assert [key(s) for s in subs.samples] == [key(s) for s in every.samples
                                              if s.agent in listed]
    assert {s.agent for s in subs.samples} == set(listed)
    branched = sum(n.agent in listed for t in subs.episodes for n in t.episode.nodes)
    assert len({s.group for s in subs.samples}) == branched
    assert subs.counters.alternatives == g * branched < every.counters.alternatives
    assert any(s.reward < 1.0 for s in subs.samples)  # the groups keep their reward spread



def test_unbranched_memory_gives_unlisted_agents_memory_candidates(examples, sys_):
    """unbranched_memory: tau0's LLM nodes of the agents outside branch_agents become one-member
    node groups (tau0's reward) that reach the memory's candidates and train nothing; the
    listed agents' node groups are unchanged."""
    exs = [examples["math"], examples["cooperation"], examples["qa"]]
    script = second_answer_wrong(exs)
    g, tasks, listed = 3, [_task(e) for e in exs], ("qa", "math")
    run = lambda on: rollout.Rollout(sys_, TOK, ScriptedPolicy(script), rollout.RolloutConfig(
        "nodewise", g, branch_agents=listed, unbranched_memory=on)).run(tasks)
    off, on = run(False), run(True)
    key = lambda s: (s.query, s.node, s.agent, tuple(s.prompt_ids), tuple(s.output_ids),
                     s.reward)
    extra = [s for s in on.samples if s.agent not in listed]
    assert [key(s) for s in on.samples if s.agent in listed] == [key(s) for s in off.samples]
    assert [(s.query, s.node) for s in extra] == [
        (q, i) for q, t in enumerate(on.episodes) for i, n in enumerate(t.episode.nodes)
        if n.agent not in listed]
    assert {s.agent for s in extra} == {protocol.MASTER, "gfc"}
    assert len({s.group for s in extra}) == len(extra)
    assert {s.group for s in extra}.isdisjoint(s.group for s in on.samples if s.agent in listed)
    assert all(s.reward == pytest.approx(float(on.rewards[s.query].total)) for s in extra)
    assert on.counters.alternatives == off.counters.alternatives
    assert [key(s) for s in batching.informative(on.samples)] == \
        [key(s) for s in batching.informative(off.samples)]
    assert [key(s) for s in memory_hook._generated(on)] == [key(s) for s in on.samples]

def test_branch_min_change_settles_the_nodes_a_sample_would_repeat(examples, sys_):
    """branch_min_change: tau0's nodes whose output a sample repeats with chance > 1 - m get
    no alternatives; each is one one-member node group (tau0's reward) that trains nothing
    but reaches the memory's candidates. The uncertain nodes' groups are those branching at
    every node forms."""
    exs = [examples["math"], examples["qa"], examples["cooperation"]]
    script = second_answer_wrong(exs)
    repeat = lambda node_input: 0.5 if node_input.agent == "qa" else 0.99
    g, tasks = 3, [_task(e) for e in exs]
    run = lambda m, memory=None: rollout.Rollout(
        sys_, TOK, ScriptedPolicy(script, repeat),
        rollout.RolloutConfig("nodewise", g, memory_branches=memory is not None,
                              branch_min_change=m), memory).run(tasks)
    every, some = run(0.0), run(0.05)
    key = lambda s: (s.query, s.node, s.agent, tuple(s.prompt_ids), tuple(s.output_ids),
                     s.reward)
    by_group = collections.Counter(s.group for s in some.samples)
    settled = [s for s in some.samples if by_group[s.group] == 1]
    assert [key(s) for s in some.samples if by_group[s.group] > 1] == \
        [key(s) for s in every.samples if s.agent == "qa"]
    tau0 = [(q, i) for q, t in enumerate(some.episodes) for i, n in enumerate(t.episode.nodes)
            if n.agent != "qa"]
    assert [(s.query, s.node) for s in settled] == tau0
    assert all(s.reward == pytest.approx(float(some.rewards[s.query].total)) for s in settled)
    assert some.counters.alternatives == len(some.samples) - len(settled) \
        < every.counters.alternatives
    assert batching.informative(some.samples) == batching.informative(
        [s for s in some.samples if s.agent == "qa"])
    assert [key(s) for s in memory_hook._generated(some)] == [key(s) for s in some.samples]
    credit = rollout.Rollout(sys_, TOK, ScriptedPolicy(script, repeat), rollout.RolloutConfig(
        "nodewise", g, branch_min_change=0.05, suffix_credit=True)).run(tasks)
    alone = [s for s in credit.samples if not s.suffix and s.agent != "qa"]
    assert len(alone) == len(settled) and all(s.reward == 0.0 for s in alone)  # advantages
    assert [s.memory_reward for s in alone] == [s.memory_reward for s in settled]


@pytest.mark.parametrize("repeat, probe, branches", [(0.99, "gold", False), (0.5, "gold", True),
                                                    (0.99, "wrong", True)])
def test_branch_min_change_probes_the_memorys_nodes(examples, sys_, repeat, probe, branches):
    """A memory-answered node is settled (no node group, no candidate) when a first policy
    sample, the probe, equals the stored output and repeats with chance > 1 - m; otherwise
    the probe is one of its G - 1 alternatives and G - 2 more are drawn."""
    ex = examples["math"]
    gold = gold_script([ex])

    def script(node_input, j, group_size):  # math's only one-sample calls are the probes
        wrong = node_input.agent == "math" and group_size == 1 and probe == "wrong"
        return "<answer>wrong</answer>" if wrong else gold(node_input, j, group_size)
    g = 4
    policy = ScriptedPolicy(script, lambda n: repeat if n.agent == "math" else 0.5)
    result = rollout.Rollout(sys_, TOK, policy, rollout.RolloutConfig(
        "nodewise", g, memory_branches=True, branch_min_change=0.05),
        MathMemory(gold, sys_)).run([_task(ex)])
    stored = [i for i, n in enumerate(result.episodes[0].episode.nodes) if n.from_memory]
    math = [s for s in result.samples if s.agent == "math"]
    assert stored and all(s.node in stored for s in math)
    assert len(math) == (g * len(stored) if branches else 0)
    if branches:
        assert [s.from_memory for s in math[:g]] == [True] + [False] * (g - 1)
        assert (g - 2, False) in policy.draws  # the probe's node: G - 2 more
    assert {s.agent for s in result.samples} == {"master"} | ({"math"} if branches else set())


def test_branch_min_change_refuses_bad_settings():
    g = 3
    with pytest.raises(ValueError, match="branch_min_change needs sampled tau0"):
        rollout.RolloutConfig("nodewise", g, branch_min_change=0.05, greedy_completions=True)
    with pytest.raises(ValueError, match="branch_min_change is a probability"):
        rollout.RolloutConfig("nodewise", g, branch_min_change=1.0)
    with pytest.raises(ValueError, match="branch_min_change needs mode nodewise"):
        rollout.RolloutConfig("trajectory", g, branch_min_change=0.05)


def test_full_tree_counts_the_product(examples, sys_):
    ex = examples["qa"]  # 4 LLM nodes
    g = 2
    policy = ScriptedPolicy(gold_script([ex]))
    result = rollout.Rollout(sys_, TOK, policy, rollout.RolloutConfig("full_tree", g)).run([_task(ex)])
    k = ex.min_llm_calls
    assert result.counters.alternatives == sum(g ** (i + 1) for i in range(k))
    assert len(result.samples) == result.counters.alternatives
    leaves = g ** k
    assert result.counters.llm_nodes == sum(g ** (i + 1) for i in range(k)) and leaves == 16
    nodewise = rollout.Rollout(sys_, TOK, ScriptedPolicy(gold_script([ex])),
                               rollout.RolloutConfig("nodewise", g)).run([_task(ex)])
    assert nodewise.counters.alternatives == g * k < leaves


def test_trajectory_nodes_carry_their_episodes_advantage(examples, sys_):
    exs = [examples["math"], examples["gfc"]]
    g = 4
    result = rollout.Rollout(sys_, TOK, ScriptedPolicy(gold_script(exs, wrong_every=2)),
                             rollout.RolloutConfig("trajectory", g)).run([_task(e) for e in exs])
    assert len(result.episodes) == g * len(exs)
    for q in range(len(exs)):
        totals = np.array([float(r.total) for r in result.rewards[q * g:(q + 1) * g]])
        adv = (totals - totals.mean()) / (totals.std() + 1e-6)
        for s in (s for s in result.samples if s.query == q):
            episode = next(e for e in range(g) if any(
                s.output_ids is gen.tokens for gen in result.episodes[q * g + e].gens))
            assert s.reward == pytest.approx(adv[episode])
    assert len({(s.query, s.agent) for s in result.samples}) == len({s.group for s in result.samples})


def test_sampler_calls_bounded_by_waves_not_queries(examples, sys_):
    exs = list(examples.values()) * 4  # 20 queries of every domain
    policy = ScriptedPolicy(gold_script(exs))
    rollout.Rollout(sys_, TOK, policy, rollout.RolloutConfig("nodewise", 2)).run(
        [_task(e) for e in exs])
    max_nodes = max(e.min_llm_calls for e in exs)
    total_nodes = sum(e.min_llm_calls for e in exs)
    # tau0 waves + one alternatives wave + continuation waves, each at most max_nodes
    assert policy.calls <= 2 * max_nodes + 1 < total_nodes
    assert max(policy.batch_sizes) == total_nodes  # the alternatives wave: every node at once


def test_config_errors():
    with pytest.raises(ValueError, match="rollout.mode must be"):
        rollout.RolloutConfig("beam")
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        rollout.RolloutConfig("nodewise", 1)
    with pytest.raises(ValueError, match="memory_branches needs mode nodewise"):
        rollout.RolloutConfig("trajectory", 2, memory_branches=True)
    with pytest.raises(ValueError, match="gold_branches needs mode nodewise"):
        rollout.RolloutConfig("full_tree", 2, gold_branches=True)
    with pytest.raises(ValueError, match="share_identical needs mode nodewise"):
        rollout.RolloutConfig("trajectory", 2, share_identical=True)
    with pytest.raises(ValueError, match="greedy_completions needs mode nodewise"):
        rollout.RolloutConfig("trajectory", 2, greedy_completions=True)
    with pytest.raises(ValueError, match="subagent_credit needs mode nodewise"):
        rollout.RolloutConfig("trajectory", 2, subagent_credit=True)
    with pytest.raises(ValueError, match="branch_agents needs mode nodewise"):
        rollout.RolloutConfig("full_tree", 2, branch_agents=("qa",))
    with pytest.raises(ValueError, match="unbranched_memory needs mode nodewise"):
        rollout.RolloutConfig("trajectory", 2, unbranched_memory=True)


TINY_POLICY = qwen2.Qwen2Config(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64,
                                num_layers=1, num_heads=2, num_kv_heads=1,
                                max_position_embeddings=1024)


def _sampler_policy(agents, scfg: SamplingConfig) -> rollout.SamplerPolicy:
    """Random tiny policies for `agents`, stacked in one group."""
    keys = jax.random.split(jax.random.key(0), len(agents))
    params = jax.tree.map(lambda *x: np.stack(x),
                          *[qwen2.init_params(TINY_POLICY, k) for k in keys])
    policy = rollout.SamplerPolicy({"all": Sampler(TINY_POLICY, pad_id=TOK.pad_id, tokenizer=TOK)},
                                   {a: ("all", i) for i, a in enumerate(agents)}, scfg, TOK,
                                   jax.random.key(1))
    policy.params = {"all": params}
    return policy


@pytest.mark.parametrize("mode", ["nodewise", "trajectory", "full_tree"])
def test_real_sampler_with_random_tiny_policies(mode, examples, sys_):
    agents = sys_.agents
    policy = _sampler_policy(agents, SamplingConfig(8))
    limits = system.Limits(max_nodes=2, max_tokens_per_node=8)
    small = system.make_system(suite.suite_world(suite.TINY), limits=limits)
    exs = [examples["math"], examples["qa"]]
    result = rollout.Rollout(small, TOK, policy, rollout.RolloutConfig(mode, 2)).run(
        [_task(e) for e in exs])
    assert result.samples and all(t.episode.done for t in result.episodes)
    assert result.counters.sampler_calls == policy.calls >= 1
    for s in result.samples:
        assert 1 <= len(s.output_ids) <= 8 and len(s.sampler_logp) == len(s.output_ids)
        assert np.all(s.sampler_logp <= 0) and s.agent in agents


@pytest.mark.parametrize("counts, vmapped", [({0: 2, 1: 2}, True), ({0: 3, 1: 1}, False),
                                             ({0: 5}, False), ({0: 9, 1: 1, 2: 1}, False)])
def test_policy_vmaps_agents_only_when_padding_is_free(counts, vmapped):
    sampler = types.SimpleNamespace(min_batch_bucket=1)
    assert rollout._vmap_is_cheaper(sampler, counts, num_agents=len(counts)) == vmapped


def test_separate_and_vmapped_agent_calls_sample_alike(examples, sys_, monkeypatch):
    """Greedy outputs do not depend on whether agents share one vmapped sampler call."""
    inputs = [rollout.NodeInput(agent, p, TOK.encode(p), "sub")
              for agent, p in [("qa", "Where is it?"), ("math", "1+2"), ("qa", "Red?"),
                               ("math", "2*3 is")]]
    outputs = []
    for vmap in (True, False):
        monkeypatch.setattr(rollout, "_vmap_is_cheaper", lambda *a, v=vmap: v)
        policy = _sampler_policy(sys_.agents, SamplingConfig(6, greedy=True))
        outputs.append([[g.text for g in row] for row in policy.sample(inputs, 2)])
        assert policy.calls == (1 if vmap else 2)
    assert outputs[0] == outputs[1]


def test_generations_carry_the_chance_that_a_sample_repeats_them(examples, sys_):
    """repeat_logp sums the output's log-probs under the sampling distribution (what a tempered
    policy's `logp` holds), whichever log-probs the generation carries for the loss."""
    inputs = [rollout.NodeInput(agent, p, TOK.encode(p), "sub")
              for agent, p in [("qa", "Where is it?"), ("math", "1+2")]]
    sums = {}
    for tempered in (True, False):
        policy = _sampler_policy(sys_.agents, SamplingConfig(6, temperature=0.5))
        policy.tempered = tempered
        gens = [g for row in policy.sample(inputs, 3) for g in row]
        assert all(g.repeat_logp <= 0.0 for g in gens)
        sums[tempered] = [(g.repeat_logp, float(np.sum(g.logp))) for g in gens]
    assert [r for r, _ in sums[True]] == [r for r, _ in sums[False]]  # same key, same draws
    np.testing.assert_allclose(*zip(*sums[True]), rtol=1e-5)
    assert not np.allclose(*zip(*sums[False]), rtol=1e-3)  # the raw policy's differ


def test_greedy_draws_are_the_argmax_whatever_the_sampling_config(examples, sys_):
    inputs = [rollout.NodeInput(agent, p, TOK.encode(p), "sub")
              for agent, p in [("qa", "Where is it?"), ("math", "1+2")]]
    argmax = _sampler_policy(sys_.agents, SamplingConfig(6, greedy=True)).sample(inputs, 1)
    sampling = _sampler_policy(sys_.agents, SamplingConfig(6, temperature=5.0))
    for _ in range(2):
        greedy = sampling.sample(inputs, 1, greedy=True)
        assert [[g.text for g in row] for row in greedy] == \
            [[g.text for g in row] for row in argmax]
        for got, want in zip(greedy, argmax):
            np.testing.assert_allclose(got[0].logp, want[0].logp, rtol=1e-6)


def test_merge_renumbers_groups_and_sums_counters(examples, sys_):
    exs = list(examples.values())
    cfg = rollout.RolloutConfig(mode="nodewise", group_size=2)
    run = lambda tasks: rollout.Rollout(sys_, TOK, ScriptedPolicy(gold_script(exs, 2)), cfg).run(tasks)
    first, second = run([_task(exs[0])]), run([_task(e) for e in exs[1:3]])
    merged = rollout.merge([first, second])

    assert len(merged.samples) == len(first.samples) + len(second.samples)
    assert merged.episodes == first.episodes + second.episodes
    assert merged.rewards == first.rewards + second.rewards
    groups = lambda samples: [s.group for s in samples]
    n = len(first.samples)
    assert groups(merged.samples[:n]) == groups(first.samples)
    shift = max(groups(first.samples)) + 1
    assert groups(merged.samples[n:]) == [g + shift for g in groups(second.samples)]
    for f in ("sampler_calls", "waves", "generated_tokens", "llm_nodes", "alternatives"):
        assert getattr(merged.counters, f) == getattr(first.counters, f) + getattr(second.counters, f)
