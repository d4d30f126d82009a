"""The hierarchical agent system: roles, and episodes advanced one node at a time.

An `Episode` is host-side state. `pending()` names the next node (which agent, and the chat it
sees); `apply(output)` consumes that node's generated text: it parses the action, runs tools
or routes to a sub-agent, and either asks for the next node or finishes. Nothing here samples:
the rollout engine batches the pending nodes of many episodes into few sampler calls, and
replays recorded outputs to branch an episode at any node (tools are deterministic).

Every failure path ends or continues without an exception: a malformed action ends
the episode; an unknown agent or tool, or a tool error, becomes an observation; the node and
token limits end the episode with whatever reward it earned.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from joyagents_jax.agents import protocol
from joyagents_jax.agents.protocol import Answer, Call, ParseError, ToolCall
from joyagents_jax.rl import rewards


@dataclasses.dataclass(frozen=True)
class Limits:
    max_nodes: int = 8  # LLM nodes per episode (master and sub-agents together)
    max_tokens_per_node: int = 64  # the sampler's max_new_tokens
    max_observation_chars: int = protocol.MAX_OBSERVATION_CHARS

    def __post_init__(self):
        if min(self.max_nodes, self.max_tokens_per_node) < 1:
            raise ValueError(f"Limits need max_nodes >= 1 and max_tokens_per_node >= 1, got {self}.")


@dataclasses.dataclass(frozen=True)
class AgentSystem:
    """The static system: agent specs (one named `protocol.MASTER`), tools, the world, limits."""

    specs: Mapping[str, protocol.AgentSpec]
    run_tool: Callable[[str, Any], str]  # (name, args) -> observation text; never raises
    limits: Limits = Limits()

    def __post_init__(self):
        if protocol.MASTER not in self.specs:
            raise ValueError(f"The agent system needs an agent named {protocol.MASTER!r}; got "
                             f"{sorted(self.specs)}.")
        unknown = [a for a in self.specs[protocol.MASTER].tools if a not in self.specs]
        if unknown:
            raise ValueError(f"The master may call {unknown}, which are not agents of the system "
                             f"({sorted(self.specs)}).")

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(self.specs)


@dataclasses.dataclass
class Node:
    """One generation: who, from which chat, what it wrote, and what that parsed to."""

    agent: str
    query: str
    turns: tuple[protocol.Turn, ...]
    output: str
    action: protocol.Action | ParseError
    truncated: bool = False  # hit max_tokens_per_node without a stop
    from_memory: bool = False  # reused from memory: no LLM call

    @property
    def wellformed(self) -> bool:
        return not isinstance(self.action, ParseError) and not self.truncated

    def grounding(self, match: str = "word") -> float | None:
        """The share of the words this node copies (tool argument values; an answer, or the
        values of an answer that is a JSON object) that occur in its query and turns
        (`rewards.grounded_share`, by `match`). None for other nodes: a master's sub-query is a
        paraphrase, and malformed output copies nothing.
        """
        if isinstance(self.action, ToolCall):
            copied = _json_values(self.action.args)
        elif isinstance(self.action, Answer):
            value = _json_object(self.action.text)
            copied = self.action.text if value is None else _json_values(value)
        else:
            return None
        context = " ".join([self.query, *(text for turn in self.turns for text in turn)])
        return rewards.grounded_share(copied, context, match)


@dataclasses.dataclass(frozen=True)
class Request:
    """The next node of an episode: the agent and the chat it continues."""

    agent: str
    query: str
    turns: tuple[protocol.Turn, ...]


class Episode:
    """One user query worked through master and sub-agent nodes."""

    def __init__(self, system: AgentSystem, query: str):
        self.system, self.query = system, query
        self.nodes: list[Node] = []
        self.master_turns: list[protocol.Turn] = []
        self.sub: tuple[str, str, list[protocol.Turn]] | None = None  # (agent, sub-query, turns)
        self.pending_call: str | None = None  # the master output awaiting its sub-agent's answer
        self.answer: str | None = None
        self.end: str | None = None  # why it ended: answer, malformed, node_limit, ...
        self.tool_calls = 0

    @classmethod
    def replay(cls, system: AgentSystem, query: str, outputs: Sequence[tuple[str, bool]]) -> "Episode":
        """A new episode fed the recorded (output, truncated) pairs: the state before node k."""
        episode = cls(system, query)
        for output, truncated in outputs:
            episode.apply(output, truncated=truncated)
        return episode

    @property
    def done(self) -> bool:
        return self.end is not None

    def pending(self) -> Request | None:
        if self.done:
            return None
        if self.sub is not None:
            agent, sub_query, turns = self.sub
            return Request(agent, sub_query, tuple(turns))
        return Request(protocol.MASTER, self.query, tuple(self.master_turns))

    def apply(self, output: str, *, truncated: bool = False, from_memory: bool = False) -> None:
        """Consumes the pending node's output; advances, finishes, or records a failure."""
        request = self.pending()
        if request is None:
            raise ValueError("apply() on a finished episode.")
        role = self.system.specs[request.agent].role
        action = protocol.parse_action(output, role)
        self.nodes.append(Node(request.agent, request.query, request.turns, output, action,
                               truncated, from_memory))
        if truncated or isinstance(action, ParseError):
            self.end = "truncated" if truncated else "malformed"
        elif role == protocol.MASTER:
            self._master(action, output)
        else:
            self._sub(action, output)
        if not self.done and len(self.nodes) >= self.system.limits.max_nodes:
            self.end = "node_limit"

    def _master(self, action: protocol.Action, output: str) -> None:
        if isinstance(action, Answer):
            self.answer, self.end = action.text, "answer"
            return
        assert isinstance(action, Call)
        callable_agents = self.system.specs[protocol.MASTER].tools
        if action.agent not in callable_agents:
            self._observe_master(output, f"error: unknown agent {action.agent!r}; agents: "
                                         f"{', '.join(callable_agents)}")
            return
        self.pending_call = output
        self.sub = (action.agent, self.query if action.query is None else action.query, [])

    def _sub(self, action: protocol.Action, output: str) -> None:
        agent, sub_query, turns = self.sub
        if isinstance(action, Answer):
            self.sub = None
            self._observe_master(self.pending_call, action.text)
            self.pending_call = None
            return
        assert isinstance(action, ToolCall)
        allowed = self.system.specs[agent].tools
        if action.name not in allowed:
            observation = f"error: unknown tool {action.name!r}; tools: {', '.join(allowed)}"
        else:
            self.tool_calls += 1
            observation = self.system.run_tool(action.name, action.args)
        turns.append((output, self._clip(observation)))

    def _observe_master(self, output: str, observation: str) -> None:
        self.master_turns.append((output, self._clip(observation)))

    def _clip(self, text: str) -> str:
        return protocol.format_observation(text, self.system.limits.max_observation_chars)

    # -- scoring -----------------------------------------------------------------------------

    @property
    def llm_calls(self) -> int:
        return sum(not n.from_memory for n in self.nodes)

    def grounding(self, match: str = "word") -> float:
        """The mean grounded share of the nodes that copy (0 when none does)."""
        shares = [g for g in (n.grounding(match) for n in self.nodes) if g is not None]
        return sum(shares) / len(shares) if shares else 0.0

    def reward(self, gold: str, kind: str, min_llm_calls: int,
               cfg: rewards.RewardConfig = rewards.RewardConfig()) -> rewards.RewardParts:
        """R_A + R_F - R_E (+ R_G) of the finished episode."""
        score = 0.0 if self.answer is None else rewards.check_answer(self.answer, gold, kind, cfg)
        grounding = self.grounding(cfg.grounding_match) if cfg.w_grounding else 0.0
        return rewards.reward_parts(score, len(self.nodes), sum(n.wellformed for n in self.nodes),
                                    self.llm_calls, min_llm_calls, cfg, grounding)


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _json_values(value: Any) -> str:
    """The leaf values of a JSON value, space-separated (keys are schema, not copies).
    Iterative: any JSON the parser accepted, however deep, is walked without recursion."""
    leaves, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (dict, list)):
            stack.extend(reversed(list(v.values() if isinstance(v, dict) else v)))
        elif v is not None and not isinstance(v, bool):
            leaves.append(str(v))
    return " ".join(leaves)


# ----------------------------------------------------------------------------------------------
# The default system of the assistant suite.
# ----------------------------------------------------------------------------------------------

# Short role prompts: with the byte tokenizer every character is a token of compute.
ROLE_PROMPTS = {
    protocol.MASTER: "Route to an agent, or answer.",
    "qa": "Product questions.",
    "efc": "Orders, returns, coupons.",
    "gfc": "Weather, units.",
    "math": "Arithmetic.",
}


def make_system(world, agents: Sequence[str] = ("qa", "efc", "gfc", "math"),
                limits: Limits = Limits(), role_prompts: Mapping[str, str] | None = None
                ) -> AgentSystem:
    """The master plus the named sub-agents, their tools bound to `world`."""
    from joyagents_jax.agents import tools

    prompts = {**ROLE_PROMPTS, **(role_prompts or {})}
    unknown = [a for a in agents if a not in tools.AGENT_TOOLS]
    if unknown:
        raise ValueError(f"Unknown sub-agent(s) {unknown}; the suite's sub-agents are "
                         f"{sorted(tools.AGENT_TOOLS)}.")
    specs = {protocol.MASTER: protocol.AgentSpec(protocol.MASTER, prompts[protocol.MASTER],
                                                 tuple(agents))}
    for a in agents:
        specs[a] = protocol.AgentSpec(a, prompts[a], tools.AGENT_TOOLS[a])
    return AgentSystem(specs, lambda name, args: tools.run_tool(name, args, world), limits)


def demonstration(system: AgentSystem, query: str, outputs: Sequence[str]) -> Episode:
    """The episode that replays a gold trajectory's outputs: its nodes are SFT examples."""
    return Episode.replay(system, query, [(o, False) for o in outputs])
