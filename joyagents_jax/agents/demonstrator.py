"""An imperfect demonstrator: gold trajectories with the detours real demonstration data has.

Real demonstrations are not minimal: the router sometimes asks the wrong expert first, an agent
tries the wrong tool or repeats a call. SFT then imitates those detours, and the reward
R = R_A + R_F - R_E exposes them (each extra LLM call costs w_efficiency; a detour that ends
the episode early costs the answer), which gives GRPO something to remove. Three detours, each
with its own rate per place it can occur:

- `wrong_route`: before a master call, the master first calls another sub-agent with the same
  request, which declines (`DECLINE`); +2 LLM calls.
- `wrong_tool`: a sub-agent with several tools first calls another of its tools with the same
  arguments (the observation is the tool's error); +1.
- `redundant_call`: a sub-agent repeats its tool call; +1.

Every detoured trajectory still ends with the gold answer; one that would exceed the episode's
node limit is replaced by the clean trajectory. All rates 0 gives the gold trajectory.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence

from joyagents_jax.agents import protocol
from joyagents_jax.agents.system import AgentSystem

DECLINE = "<answer>This is not my task.</answer>"
_CALL = re.compile(r'<call agent="(\w+)"')
_TOOL = re.compile(r'<tool name="(\w+)"')


@dataclasses.dataclass(frozen=True)
class DemoErrors:
    """Rates of the detours, each in [0, 1]."""

    wrong_route: float = 0.0
    wrong_tool: float = 0.0
    redundant_call: float = 0.0

    def __post_init__(self):
        bad = {k: v for k, v in dataclasses.asdict(self).items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"DemoErrors rates must lie in [0, 1], got {bad}.")

    @property
    def clean(self) -> bool:
        return not (self.wrong_route or self.wrong_tool or self.redundant_call)


def outputs(system: AgentSystem, gold: Sequence[tuple[str, str]], errors: DemoErrors,
            rng: random.Random) -> list[str]:
    """The node outputs of one demonstration: gold [(agent, output)] with detours drawn by `rng`.

    The draws depend only on `rng` and the gold trajectory, so a seeded `rng` per example
    gives the same demonstrations in every run.
    """
    out = []
    for agent, output in gold:
        if agent == protocol.MASTER and (call := _CALL.match(output)):
            others = [a for a in system.specs[protocol.MASTER].tools if a != call.group(1)]
            if others and rng.random() < errors.wrong_route:
                wrong = rng.choice(others)
                out += [output.replace(f'agent="{call.group(1)}"', f'agent="{wrong}"', 1), DECLINE]
        elif tool := _TOOL.match(output):
            others = [t for t in system.specs[agent].tools if t != tool.group(1)]
            if others and rng.random() < errors.wrong_tool:
                out.append(output.replace(f'name="{tool.group(1)}"', f'name="{rng.choice(others)}"',
                                          1))
            if rng.random() < errors.redundant_call:
                out.append(output)
        out.append(output)
    return out if len(out) <= system.limits.max_nodes else [o for _, o in gold]
