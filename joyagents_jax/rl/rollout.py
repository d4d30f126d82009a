"""Rollouts: node-wise Monte Carlo sampling and its baselines, batched in waves.

`nodewise` (JoyAgents-R1): sample an initial trajectory tau0 per query; for every LLM node i of
tau0, draw G - 1 more outputs of node i's agent from tau0's prefix c_i (tau0's own output is the
G-th member); complete each alternative once with the current policies and score it (with
`share_identical`, an alternative equal to an earlier member takes its score uncompleted). Node
i's G outputs with their episodes' rewards form one GRPO group: sum_i G_i samples, not prod_i G_i
(with `suffix_credit`, each alternative's later nodes join training with its advantage).
`trajectory` (vanilla GRPO): G whole episodes per query; each node carries its episode's
advantage as its `reward` (train it with advantages taken as given), grouped per (query, agent).
`full_tree`: every node of every branch expands into G children (prod_i G_i leaves; for the
cost benchmark); a child's reward is the mean over the leaves below it.

All pending nodes of all episodes advance together in waves: one `Policy.sample` call per wave,
which the sampler policy turns into one sampler call per agent group. Tools run on the host
between waves. Counters record sampler calls, generated tokens, tool calls and wall time per
phase, so the cost of each mode is measured, not asserted.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol

import numpy as np

from joyagents_jax.agents import protocol
from joyagents_jax.agents.system import AgentSystem, Episode, Request, demonstration
from joyagents_jax.rl import rewards as rw
from joyagents_jax.rl import sub_credit

Mode = Literal["nodewise", "trajectory", "full_tree"]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    mode: Mode = "nodewise"
    group_size: int = 4  # G_i of every node (nodewise, full_tree); episodes per query (trajectory)
    rewards: rw.RewardConfig = rw.RewardConfig()
    # nodewise: also branch at the nodes of tau0 the memory answered; the stored output is one
    # member of the node group (`Sample.from_memory`), the policy draws the other G - 1.
    memory_branches: bool = False
    # nodewise with memory_branches: the stored output counts as this many members of its node
    # group (its reward that many times in the group's mean and std, its row that many times
    # in the loss), so where the policy's samples contest a stored answer the pull toward it
    # matches theirs. 1: one member like each sample.
    memory_members: int = 1
    # nodewise: where tau0 left its task's gold trajectory at a node (the context is gold's, the
    # output is not), the gold output joins the node group as member G + 1 (`Sample.from_gold`),
    # completed by the policy like the others: off-policy guidance (LUFFY) toward answers the
    # policy's own samples miss. Needs `Task.gold`; tasks without it get no such member.
    gold_branches: bool = False
    # nodewise: an alternative whose output equals an earlier member's of its node group (text
    # and truncation) is not completed again but takes that member's reward. Equal outputs get
    # equal credit at node i either way (their completions only add noise that the group's
    # advantages cancel); at the default's temperature 0.3 most alternatives repeat tau0, and
    # the default's GRPO steps sampled about a third fewer tokens.
    share_identical: bool = False
    # nodewise: in node groups with a reward spread, the nodes each completed alternative
    # sampled after its branch (its suffix) are trained too, with the alternative's advantage in
    # its node group (trajectory credit, grouped per (query, agent), `Sample.suffix`), so a step
    # learns from more of the tokens it sampled.
    # Every sample's `reward` is then its advantage (train with advantages taken as given).
    suffix_credit: bool = False
    # nodewise: tau0 and every alternative's nodes after its branch are decoded greedily, as
    # evaluation runs the policies; only the G - 1 alternatives at the branch node are sampled.
    # A node group then compares the greedy output with sampled ones, each scored by the greedy
    # policy's continuation, so its rewards carry no noise from later nodes' sampling.
    greedy_completions: bool = False
    # nodewise: R_A of a sub-agent's node is its call's own answer checked against the gold
    # trajectory's (`sub_credit`), so a node group tells a sub-agent's right answer from a wrong
    # one the master repaired. Needs `Task.gold`; calls without a gold counterpart keep the
    # episode's R_A.
    subagent_credit: bool = False
    # nodewise: the agents whose nodes get node groups; an agent not listed keeps tau0's output
    # at its nodes, samples no alternatives there and trains nothing (empty: every agent, the
    # paper's node-wise sampling).
    branch_agents: tuple[str, ...] = ()
    # nodewise: branch only at the nodes of tau0 where one more sample would differ from
    # tau0's output with at least this chance (1 - exp(`Generation.repeat_logp`)); at the
    # others the G - 1 alternatives would mostly repeat it, so their tokens buy no reward
    # spread. A memory-answered node (memory_branches) is settled when a first policy sample
    # equals the stored output and is that likely. A settled sampled node still joins the
    # memory's candidates, as a one-member node group that trains nothing. 0: every node.
    branch_min_change: float = 0.0
    # nodewise: tau0's LLM outputs at the nodes of agents outside `branch_agents` join the
    # memory's candidates, as one-member node groups that train nothing, so the memory can
    # answer those agents' repeated nodes too (False: they write no memory entries).
    unbranched_memory: bool = False

    def __post_init__(self):
        for name in ("memory_branches", "gold_branches", "share_identical", "suffix_credit",
                     "greedy_completions", "subagent_credit", "branch_agents",
                     "branch_min_change", "unbranched_memory"):
            if getattr(self, name) and self.mode != "nodewise":
                raise ValueError(f"rollout.{name} needs mode nodewise, got {self.mode!r}.")
        if self.memory_members < 1:
            raise ValueError(f"rollout.memory_members must be >= 1, got {self.memory_members}.")
        if self.memory_members > 1 and (not self.memory_branches or self.suffix_credit):
            raise ValueError("rollout.memory_members > 1 needs memory_branches and not "
                             "suffix_credit (whose rewards are already advantages).")
        if not 0.0 <= self.branch_min_change < 1.0:
            raise ValueError(f"rollout.branch_min_change is a probability in [0, 1), got "
                             f"{self.branch_min_change}.")
        if self.branch_min_change and self.greedy_completions:
            raise ValueError("rollout.branch_min_change needs sampled tau0 outputs; "
                             "greedy_completions decodes tau0 greedily (set one of them off).")
        if self.mode not in ("nodewise", "trajectory", "full_tree"):
            raise ValueError(f"rollout.mode must be nodewise, trajectory or full_tree, got "
                             f"{self.mode!r}.")
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 (GRPO compares samples within a "
                             f"group), got {self.group_size}.")


class Generation(NamedTuple):
    """One sampled node output."""

    text: str
    tokens: np.ndarray  # [n] int32, the output tokens (through the stop)
    logp: np.ndarray  # [n] f32, the sampler's log-probs (SamplerPolicy.tempered says which)
    truncated: bool  # ran out of tokens before a stop
    # The output's log-prob under the sampling distribution: the log of the chance that one
    # more sample of its node repeats it token for token (NaN: not sampled, e.g. the memory's).
    repeat_logp: float = float("nan")


class NodeInput(NamedTuple):
    agent: str
    prompt: str  # rendered chat, ending where the output starts
    prompt_ids: list[int]
    role: str


class Policy(Protocol):
    """Draws `group_size` outputs for each node input (all in as few sampler calls as it can);
    `greedy`: the argmax outputs instead (group_size 1)."""

    calls: int

    def sample(self, inputs: Sequence[NodeInput], group_size: int,
               greedy: bool = False) -> list[list[Generation]]: ...


class Reuse(NamedTuple):
    """A memory hit: the stored response replaces generation (no LLM call)."""

    generation: Generation
    slot: int  # the memory slot it came from (a bad outcome deletes it)


class Memory(Protocol):
    """The memory hook, asked once per wave: per pending node, `Reuse`, a `Hint`, or None."""

    def lookup(self, requests: Sequence[Request]) -> list[Reuse | protocol.Hint | None]: ...


class NoMemory:
    def lookup(self, requests):
        return [None] * len(requests)


@dataclasses.dataclass
class Trace:
    """An episode plus the token-level record of each of its nodes."""

    episode: Episode
    inputs: list[NodeInput] = dataclasses.field(default_factory=list)
    gens: list[Generation] = dataclasses.field(default_factory=list)
    memory_slots: dict[int, int] = dataclasses.field(default_factory=dict)  # node -> slot reused

    def branch(self, system: AgentSystem, upto: int) -> "Trace":
        """A copy holding only the first `upto` nodes (the prefix c_upto), replayed."""
        outputs = [(n.output, n.truncated) for n in self.episode.nodes[:upto]]
        return Trace(Episode.replay(system, self.episode.query, outputs), self.inputs[:upto],
                     self.gens[:upto], {k: v for k, v in self.memory_slots.items() if k < upto})


class Sample(NamedTuple):
    """One training sample: an agent's node output in its context, with its group's data."""

    agent: str
    prompt_ids: list[int]
    output_ids: np.ndarray
    sampler_logp: np.ndarray
    reward: float  # the reward GRPO normalizes within the group
    memory_reward: float  # R_A + R_F, for the memory update
    group: int  # node group id, unique within the rollout
    query: int  # index of the query in the batch
    node: int  # node index in its episode
    # The memory took part: an episode of its node group (trajectory: its episode) holds a
    # memory-answered node, before the branch point (the context) or after it (the reward).
    uses_memory: bool = False
    # The output is the memory's, not sampled (memory_branches): an off-policy member whose
    # sampler_logp is NaN; the memory does not store it again.
    from_memory: bool = False
    # The output is the task's gold one (gold_branches): off-policy like `from_memory`, but an
    # LLM call of its episode; the memory does not store it.
    from_gold: bool = False
    # A node an alternative sampled after its branch point (suffix_credit); its reward is that
    # alternative's advantage. Not a member of a node group: the memory does not store it.
    suffix: bool = False


@dataclasses.dataclass
class Counters:
    sampler_calls: int = 0
    waves: int = 0
    generated_tokens: int = 0
    llm_nodes: int = 0
    memory_lookups: int = 0  # nodes the memory was asked about
    memory_hits: int = 0
    memory_hints: int = 0
    tool_calls: int = 0
    alternatives: int = 0  # sampled alternatives that form groups (sum G_i or prod G_i)
    shared: int = 0  # alternatives that took an equal member's reward (share_identical)
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))


class RolloutResult(NamedTuple):
    samples: list[Sample]
    episodes: list[Trace]  # tau0 (nodewise, full_tree root paths) or all episodes (trajectory)
    rewards: list[rw.RewardParts]  # per returned episode
    counters: Counters


def merge(results: Sequence[RolloutResult]) -> RolloutResult:
    """Several rollouts of one step as one: node group and query ids renumbered so they stay
    unique, episodes and rewards concatenated, counters summed (dynamic sampling's refills)."""
    samples, episodes, rewards, counters = [], [], [], Counters()
    groups = queries = 0
    for r in results:
        samples += [s._replace(group=s.group + groups, query=s.query + queries) for s in r.samples]
        groups += max((s.group + 1 for s in r.samples), default=0)
        queries += max((s.query + 1 for s in r.samples), default=0)
        episodes += r.episodes
        rewards += r.rewards
        for f in dataclasses.fields(Counters):
            if f.name != "seconds":
                setattr(counters, f.name, getattr(counters, f.name) + getattr(r.counters, f.name))
        for k, v in r.counters.seconds.items():
            counters.seconds[k] += v
    return RolloutResult(samples, episodes, rewards, counters)


class Task(NamedTuple):
    """What a rollout needs of an example: the query and how to score its answer."""

    query: str
    answer: str
    answer_kind: str
    min_llm_calls: int
    gold: tuple[str, ...] = ()  # the gold trajectory's node outputs, in order (gold_branches)


# ----------------------------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------------------------

class Rollout:
    """Runs a batch of tasks in one of the three modes with a policy and a memory hook."""

    def __init__(self, system: AgentSystem, tokenizer, policy: Policy, cfg: RolloutConfig,
                 memory: Memory | None = None):
        self.system, self.tokenizer, self.policy, self.cfg = system, tokenizer, policy, cfg
        self.memory = memory or NoMemory()

    def run(self, tasks: Sequence[Task]) -> RolloutResult:
        """Training rollouts of `tasks` in the configured mode."""
        run = {"nodewise": self._nodewise, "trajectory": self._trajectory,
               "full_tree": self._full_tree}[self.cfg.mode]
        return self._timed(run, tasks)

    def episodes(self, tasks: Sequence[Task]) -> RolloutResult:
        """One episode per task and no training samples (evaluation)."""
        def run(tasks, counters):
            traces = [Trace(Episode(self.system, t.query)) for t in tasks]
            self._complete(traces, counters)
            return [], traces
        return self._timed(run, tasks)

    def _timed(self, run, tasks: Sequence[Task]) -> RolloutResult:
        counters = Counters()
        calls0 = self.policy.calls
        samples, traces = run(tasks, counters)
        counters.sampler_calls = self.policy.calls - calls0
        counters.tool_calls = sum(t.episode.tool_calls for t in traces)
        scores = [self._reward(t, tasks[q]) for q, t in self._owners(traces, tasks)]
        return RolloutResult(samples, traces, scores, counters)

    def _owners(self, traces, tasks):
        per_query = len(traces) // len(tasks)
        return [(i // per_query, t) for i, t in enumerate(traces)]

    def _reward(self, trace: Trace, task: Task) -> rw.RewardParts:
        return trace.episode.reward(task.answer, task.answer_kind, task.min_llm_calls,
                                    self.cfg.rewards)

    # -- waves -----------------------------------------------------------------------------

    def _input(self, request: Request, hint: protocol.Hint | None = None) -> NodeInput:
        spec = self.system.specs[request.agent]
        prompt = protocol.render_prompt(self.tokenizer, spec, request.query, request.turns, hint)
        return NodeInput(request.agent, prompt, self.tokenizer.encode(prompt), spec.role)

    def _record(self, trace: Trace, node_input: NodeInput, gen: Generation,
                from_memory: bool = False) -> None:
        trace.inputs.append(node_input)
        trace.gens.append(gen)
        trace.episode.apply(gen.text, truncated=gen.truncated, from_memory=from_memory)

    def _complete(self, traces: Sequence[Trace], counters: Counters,
                  greedy: bool = False) -> None:
        """Advances every unfinished trace to its end, one wave of pending nodes at a time."""
        start = time.perf_counter()
        while True:
            pending = [(t, t.episode.pending()) for t in traces if not t.episode.done]
            if not pending:
                break
            todo = []
            lookup_start = time.perf_counter()
            found = self.memory.lookup([request for _, request in pending])
            counters.seconds["memory_lookup"] += time.perf_counter() - lookup_start
            counters.memory_lookups += len(pending)
            for (trace, request), hit in zip(pending, found):
                if isinstance(hit, Reuse):
                    counters.memory_hits += 1
                    trace.memory_slots[len(trace.gens)] = hit.slot
                    self._record(trace, self._input(request), hit.generation, from_memory=True)
                    continue
                counters.memory_hints += hit is not None
                todo.append((trace, self._input(request, hit)))
            if todo:
                gens = self._sample([i for _, i in todo], 1, counters, greedy)
                for (trace, node_input), (gen,) in zip(todo, gens):
                    self._record(trace, node_input, gen)
        counters.seconds["complete"] += time.perf_counter() - start

    def _sample(self, inputs: Sequence[NodeInput], group_size: int, counters: Counters,
                greedy: bool = False) -> list[list[Generation]]:
        start = time.perf_counter()
        gens = self.policy.sample(inputs, group_size, greedy=greedy)
        counters.waves += 1
        counters.llm_nodes += len(inputs) * group_size
        counters.generated_tokens += sum(len(g.tokens) for row in gens for g in row)
        counters.seconds["sample"] += time.perf_counter() - start
        return gens

    # -- modes -----------------------------------------------------------------------------

    def _nodewise(self, tasks, counters):
        greedy = self.cfg.greedy_completions
        tau0 = [Trace(Episode(self.system, t.query)) for t in tasks]
        self._complete(tau0, counters, greedy)
        points = [(q, i) for q, t in enumerate(tau0) for i, n in enumerate(t.episode.nodes)
                  if (self.cfg.memory_branches or not n.from_memory)
                  and (not self.cfg.branch_agents or n.agent in self.cfg.branch_agents)]
        points, settled, alternatives = self._alternatives(tau0, points, counters)
        if self.cfg.unbranched_memory and self.cfg.branch_agents:
            settled += [(q, i) for q, t in enumerate(tau0) for i, n in enumerate(t.episode.nodes)
                        if n.agent not in self.cfg.branch_agents and not n.from_memory]
        g = self.cfg.group_size
        groups, to_complete = [], []
        for (q, i), gens in zip(points, alternatives):
            members, scored_by = [tau0[q]], [0]  # scored_by: the member whose reward it takes
            for gen in gens:
                child = tau0[q].branch(self.system, i)
                self._record(child, tau0[q].inputs[i], gen)
                same = [m for m in range(len(members)) if self.cfg.share_identical
                        and _output(members[m], i) == _output(child, i)]
                scored_by.append(scored_by[same[0]] if same else len(members))
                members.append(child)
            if self.cfg.gold_branches and _leaves_gold(tau0[q], tasks[q].gold, i):
                child = tau0[q].branch(self.system, i)
                self._record(child, tau0[q].inputs[i], self._gold(tasks[q].gold[i]))
                scored_by.append(len(members))
                members.append(child)
            to_complete += [t for m, t in enumerate(members[1:], 1) if scored_by[m] == m]
            groups.append((q, i, members, scored_by))
        counters.alternatives = len(points) * g
        counters.shared = sum(s != m for *_, scored_by in groups for m, s in enumerate(scored_by))
        self._complete(to_complete, counters, greedy)

        samples, suffixes = [], {}  # suffixes: (query, agent) -> its suffix group id
        gold = {}  # query -> its gold trajectory's nodes (subagent_credit)
        for group, (q, i, members, scored_by) in enumerate(groups):
            parts = {s: self._reward(members[s], tasks[q]) for s in set(scored_by)}
            if self.cfg.subagent_credit and members[0].episode.nodes[i].agent != protocol.MASTER:
                if q not in gold:
                    gold[q] = demonstration(self.system, tasks[q].query, tasks[q].gold).nodes
                parts = {s: sub_credit.credited(p, sub_credit.node_scores(
                    members[s].episode.nodes, gold[q], self.cfg.rewards).get(i))
                    for s, p in parts.items()}
            uses_memory = any(n.from_memory for m in set(scored_by)
                              for n in members[m].episode.nodes)
            adv = (episode_advantages(np.array([float(parts[s].total) for s in scored_by]))
                   if self.cfg.suffix_credit else None)
            for m, trace in enumerate(members):
                s = self._sample_of(trace, i, parts[scored_by[m]], group, q)._replace(
                    uses_memory=uses_memory, from_gold=m == g)
                samples.append(s if adv is None else s._replace(reward=float(adv[m])))
                if s.from_memory:
                    samples += [s] * (self.cfg.memory_members - 1)
            if adv is not None and np.ptp(adv) > 0:  # else every advantage is 0
                samples += self._suffix(members, scored_by, i, q, adv, len(groups), suffixes)
        first = len(groups) + len(suffixes)
        for group, (q, i) in enumerate(settled, first):  # memory candidates, train nothing
            s = self._sample_of(tau0[q], i, self._reward(tau0[q], tasks[q]), group, q)
            samples.append(s._replace(  # suffix_credit's rewards are advantages: 0
                uses_memory=any(n.from_memory for n in tau0[q].episode.nodes),
                reward=0.0 if self.cfg.suffix_credit else s.reward))
        return samples, tau0

    def _alternatives(self, tau0: Sequence[Trace], points: list[tuple[int, int]],
                      counters: Counters) -> tuple[list, list, list[list[Generation]]]:
        """Branch points -> (the points to branch at, the settled sampled ones, each branched
        point's G - 1 alternatives).

        With branch_min_change = m > 0 a node is settled where a sample is known to repeat its
        output with chance > 1 - m: a sampled output by its own probability, a memory answer
        when a first policy sample (the probe) equals it and is that likely; a probe that
        does not settle its node is one of the node's alternatives.
        """
        g, m = self.cfg.group_size, self.cfg.branch_min_change
        if not m:
            return points, [], self._sample([tau0[q].inputs[i] for q, i in points], g - 1,
                                            counters)
        sure = lambda gen: np.exp(gen.repeat_logp) > 1.0 - m  # NaN (not sampled): False
        stored = [p for p in points if tau0[p[0]].episode.nodes[p[1]].from_memory]
        probes = dict(zip(stored, [row[0] for row in self._draw(tau0, stored, 1, counters)]))
        settled = [(q, i) for q, i in points if sure(tau0[q].gens[i]) or (q, i) in probes
                   and sure(probes[q, i]) and probes[q, i].text == tau0[q].gens[i].text]
        points = [p for p in points if p not in settled]
        sampled = [p for p in points if p not in probes]
        more = [p for p in points if p in probes]
        drawn = dict(zip(sampled, self._draw(tau0, sampled, g - 1, counters)))
        drawn.update(zip(more, [[probes[p], *row] for p, row in zip(
            more, self._draw(tau0, more, g - 2, counters))]))
        return points, [p for p in settled if p not in probes], [drawn[p] for p in points]

    def _draw(self, tau0: Sequence[Trace], points: list[tuple[int, int]], n: int,
              counters: Counters) -> list[list[Generation]]:
        """n samples at each point's node input (no sampler call for none)."""
        if not points or n < 1:
            return [[] for _ in points]
        return self._sample([tau0[q].inputs[i] for q, i in points], n, counters)

    def _suffix(self, members, scored_by, i, q, adv, first_id, ids) -> list[Sample]:
        """The LLM nodes after node i of each alternative completed for its node group, each
        with that alternative's advantage; tau0's own (member 0) are members of their own node
        groups, and shared alternatives were not completed."""
        out = []
        for m, trace in enumerate(members[1:], 1):
            if scored_by[m] != m:
                continue
            for j in range(i + 1, len(trace.episode.nodes)):
                node = trace.episode.nodes[j]
                if node.from_memory:
                    continue
                group = ids.setdefault((q, node.agent), first_id + len(ids))
                out.append(self._sample_of(trace, j, None, group, q)._replace(
                    reward=float(adv[m]), suffix=True,
                    uses_memory=any(n.from_memory for n in trace.episode.nodes)))
        return out

    def _gold(self, output: str) -> Generation:
        """A gold node output as a generation: its tokens, NaN sampler log-probs (not sampled)."""
        ids = np.asarray(self.tokenizer.encode(output), np.int32)
        return Generation(output, ids, np.full(len(ids), np.nan, np.float32), False)

    def _trajectory(self, tasks, counters):
        g = self.cfg.group_size
        traces = [Trace(Episode(self.system, t.query)) for t in tasks for _ in range(g)]
        self._complete(traces, counters)
        counters.alternatives = len(traces)
        samples, groups = [], {}
        for q in range(len(tasks)):
            members = traces[q * g:(q + 1) * g]
            parts = [self._reward(t, tasks[q]) for t in members]
            adv = episode_advantages(np.array([float(p.total) for p in parts]))
            for trace, a, p in zip(members, adv, parts):
                uses_memory = any(n.from_memory for n in trace.episode.nodes)
                for i, node in enumerate(trace.episode.nodes):
                    if node.from_memory:
                        continue
                    group = groups.setdefault((q, node.agent), len(groups))
                    samples.append(self._sample_of(trace, i, p, group, q)._replace(
                        reward=float(a), uses_memory=uses_memory))
        return samples, traces

    def _full_tree(self, tasks, counters):
        g = self.cfg.group_size
        roots = [Trace(Episode(self.system, t.query)) for t in tasks]
        children: dict[int, list[Trace]] = {}  # id(parent) -> its G children
        groups: list[None] = []  # one entry per expanded node: its group id is its index
        frontier = list(roots)
        while frontier:
            frontier = [t for t in frontier if not t.episode.done]
            if not frontier:
                break
            inputs = [self._input(t.episode.pending()) for t in frontier]
            gens = self._sample(inputs, g, counters)
            next_frontier = []
            for parent, node_input, row in zip(frontier, inputs, gens):
                kids = []
                for gen in row:
                    kid = parent.branch(self.system, len(parent.episode.nodes))
                    self._record(kid, node_input, gen)
                    kids.append(kid)
                children[id(parent)] = kids
                next_frontier += kids
            counters.alternatives += len(frontier) * g
            frontier = next_frontier

        samples, paths = [], []
        for q, root in enumerate(roots):
            value: dict[int, float] = {}

            def leaf_mean(t: Trace) -> float:  # mean reward of the leaves below t
                kids = children.get(id(t))
                value[id(t)] = (float(self._reward(t, tasks[q]).total) if kids is None
                                else float(np.mean([leaf_mean(c) for c in kids])))
                return value[id(t)]

            leaf_mean(root)
            stack = [root]
            while stack:
                kids = children.get(id(stack.pop()), [])
                group = len(groups) if kids else None
                groups.extend([None] * bool(kids))
                for kid in kids:
                    s = self._sample_of(kid, len(kid.episode.nodes) - 1, None, group, q)
                    samples.append(s._replace(reward=value[id(kid)], memory_reward=value[id(kid)]))
                stack += kids
            paths.append(_first_leaf(root, children))
        return samples, paths

    def _sample_of(self, trace: Trace, node: int, parts: rw.RewardParts | None, group: int,
                   query: int) -> Sample:
        node_input, gen = trace.inputs[node], trace.gens[node]
        from_memory = trace.episode.nodes[node].from_memory
        return Sample(agent=node_input.agent, prompt_ids=node_input.prompt_ids,
                      output_ids=gen.tokens, from_memory=from_memory,
                      sampler_logp=np.full(len(gen.tokens), np.nan, np.float32) if from_memory
                      else gen.logp,  # NaN for a gold output too (`_gold`)
                      reward=0.0 if parts is None else float(parts.total),
                      memory_reward=0.0 if parts is None else float(parts.memory_reward),
                      group=group, query=query, node=node)


def _output(trace: Trace, node: int) -> tuple[str, bool]:
    """Node `node`'s output as the episode replays it: (text, truncated)."""
    n = trace.episode.nodes[node]
    return n.output, n.truncated


def _leaves_gold(trace: Trace, gold: Sequence[str], node: int) -> bool:
    """Whether `trace` follows the gold outputs up to `node` and departs from them there."""
    outputs = [n.output for n in trace.episode.nodes[:node + 1]]
    return node < len(gold) and outputs[:node] == list(gold[:node]) and outputs[node] != gold[node]


def _first_leaf(root: Trace, children: dict[int, list[Trace]]) -> Trace:
    while id(root) in children:
        root = children[id(root)][0]
    return root


def episode_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """(r - mean) / (std + eps) over one query's episodes (vanilla GRPO, trajectory mode)."""
    return (rewards - rewards.mean()) / (rewards.std() + eps)


# ----------------------------------------------------------------------------------------------
# The policy backed by the real sampler.
# ----------------------------------------------------------------------------------------------

def _vmap_is_cheaper(sampler, prompts_per_slot: dict[int, int], num_agents: int) -> bool:
    """One vmapped call pads every stacked agent to the largest bucket; separate calls pad each
    agent's prompts to its own bucket. Vmap when that costs no more rows (fewer dispatches)."""
    from joyagents_jax.sampling import bucket

    rows = lambda n: bucket(n, sampler.min_batch_bucket)
    vmapped = num_agents * rows(max(prompts_per_slot.values()))
    return len(prompts_per_slot) > 1 and vmapped <= sum(map(rows, prompts_per_slot.values()))


class SamplerPolicy:
    """Samples node outputs with `Sampler`s: per agent group and wave, one vmapped call for all
    its agents, or one call per agent when vmapping would pad more rows (`_vmap_is_cheaper`).

    agent_slots: agent -> (group name, index in that group's stacked params). Set `params`
    ({group: stacked params}) and `key` before sampling; each call splits the key.
    `tempered`: generations carry their tokens' log-probs under the sampling distribution
    (the policy a tempered GRPO loss scores) rather than the raw policy's.
    """

    def __init__(self, samplers, agent_slots, scfg, tokenizer, key, tempered: bool = False):
        self.samplers, self.agent_slots, self.scfg = samplers, agent_slots, scfg
        self.tokenizer, self.key, self.params = tokenizer, key, None
        self.tempered = tempered
        self.calls = 0

    def sample(self, inputs: Sequence[NodeInput], group_size: int,
               greedy: bool = False) -> list[list[Generation]]:
        import jax

        from joyagents_jax.models import lora

        out: list[list[Generation] | None] = [None] * len(inputs)
        by_group: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for i, node_input in enumerate(inputs):
            group, slot = self.agent_slots[node_input.agent]
            by_group[group][slot].append(i)
        for group, slots in by_group.items():
            self.key, key = jax.random.split(self.key)
            sampler, params = self.samplers[group], self.params[group]
            stops = lambda idx: [protocol.stop_strings(inputs[i].role) for i in idx]
            prompts = lambda idx: [inputs[i].prompt_ids for i in idx]
            scfg = dataclasses.replace(self.scfg, greedy=True) if greedy else self.scfg
            kw = dict(scfg=scfg, group_size=group_size, stop_ids=self.tokenizer.stop_ids)
            num = lora.num_agents(params)
            if _vmap_is_cheaper(sampler, {s: len(idx) for s, idx in slots.items()}, num):
                fill = lambda s, f, dummy: f(slots[s]) if s in slots else dummy
                per_agent = sampler.generate_per_agent(
                    params, [fill(s, prompts, [[self.tokenizer.pad_id]]) for s in range(num)],
                    stop_strings=[fill(s, stops, [()]) for s in range(num)], key=key, **kw)
                results = {s: per_agent[s] for s in slots}
                self.calls += 1
            else:
                results = {}
                for slot, idx in slots.items():
                    key, slot_key = jax.random.split(key)
                    results[slot] = sampler.generate(params, prompts(idx), agent=slot,
                                                     stop_strings=stops(idx), key=slot_key, **kw)
                    self.calls += 1
            for slot, idx in slots.items():
                for row, i in enumerate(idx):
                    out[i] = [self._generation(results[slot], row, g) for g in range(group_size)]
        return out

    def _generation(self, samples, row: int, g: int) -> Generation:
        n = int(samples.lengths[row, g])
        tokens = samples.tokens[row, g, :n]
        logp = samples.logp_sample if self.tempered else samples.logp_policy
        return Generation(self.tokenizer.decode(tokens), tokens, logp[row, g, :n],
                          truncated=not bool(samples.stopped[row, g]),
                          repeat_logp=float(np.sum(samples.logp_sample[row, g, :n])))
