"""Rollout cost per training step for nodewise, trajectory and full_tree sampling (DESIGN §4,
the paper's open question 2), as the trajectory length k and the number of sub-agents N grow.

Scripted policies with fixed output lengths stand in for the models (the cost claim is about
how many nodes are sampled, not about what they say): the master calls one sub-agent, which
calls a tool k - 3 times and answers; the master then answers (k LLM nodes per episode). Query q
routes to sub-agent q mod N. Measured per step of 8 queries with G = 4: alternatives sampled,
LLM nodes generated, generated tokens, waves (batched sampler calls), agent batches (sampler
calls if every agent were its own group), and the engine's wall time.

    python benchmarks/sampling_cost.py [--out benchmarks/sampling_cost.png]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from joyagents_jax.agents import protocol, system
from joyagents_jax.rl import rollout

QUERIES, G = 8, 4
TOKENS_PER_NODE = 24  # scripted output length


class ScriptedPolicy:
    """Master: call sub-agent (query id mod N), then answer; sub-agent: `tools` echo calls, answer."""

    def __init__(self, num_subs: int, tools: int):
        self.num_subs, self.tools, self.calls, self.agent_batches = num_subs, tools, 0, 0

    def _text(self, node: rollout.NodeInput) -> str:
        turns = node.prompt.count("<|im_start|>assistant") - 1
        if node.agent == protocol.MASTER:
            q = int(node.prompt.split("query ")[1].split("<")[0])
            return "<answer>ok</answer>" if turns else f'<call agent="sub{q % self.num_subs}"/>'
        return '<tool name="echo">{"x":1}</tool>' if turns < self.tools else "<answer>ok</answer>"

    def sample(self, inputs, group_size, greedy=False):
        self.calls += 1
        self.agent_batches += len({i.agent for i in inputs})
        gen = lambda t: rollout.Generation(t, np.zeros(TOKENS_PER_NODE, np.int32),
                                           np.zeros(TOKENS_PER_NODE, np.float32), False)
        return [[gen(self._text(i)) for _ in range(group_size)] for i in inputs]


class _Chars:
    """A character tokenizer: enough for rendering prompts in the engine."""

    vocab_size, pad_id, stop_ids = 256, 0, ()

    def encode(self, text):
        return [ord(c) % 256 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def measure(mode: str, k: int, num_subs: int) -> dict[str, float]:
    subs = [f"sub{i}" for i in range(num_subs)]
    specs = {protocol.MASTER: protocol.AgentSpec(protocol.MASTER, "Route.", tuple(subs))}
    specs.update({s: protocol.AgentSpec(s, "Work.", ("echo",)) for s in subs})
    sys_ = system.AgentSystem(specs, lambda name, args: "1", system.Limits(max_nodes=32))
    policy = ScriptedPolicy(num_subs, tools=k - 3)
    tasks = [rollout.Task(f"query {q}", "ok", "text", k) for q in range(QUERIES)]
    start = time.perf_counter()
    result = rollout.Rollout(sys_, _Chars(), policy, rollout.RolloutConfig(mode, G)).run(tasks)
    c = result.counters
    assert all(len(t.episode.nodes) == k for t in result.episodes)
    return {"alternatives": c.alternatives, "llm_nodes": c.llm_nodes,
            "generated_tokens": c.generated_tokens, "waves": c.waves,
            "agent_batches": policy.agent_batches, "seconds": time.perf_counter() - start}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/sampling_cost.png")
    args = parser.parse_args()
    modes = ("nodewise", "trajectory", "full_tree")
    by_k = {m: {k: measure(m, k, 4) for k in range(3, 8)} for m in modes}
    by_n = {m: {n: measure(m, 4, n) for n in (2, 4, 8, 16)} for m in modes}
    cols = ("alternatives", "llm_nodes", "generated_tokens", "waves", "agent_batches", "seconds")
    for title, table, var in (("k (N = 4)", by_k, "k"), ("N (k = 4)", by_n, "N")):
        print(f"\nper step of {QUERIES} queries, G = {G}, varying {title}")
        print(f"| mode | {var} | " + " | ".join(cols) + " |")
        print("|---|---|" + "---|" * len(cols))
        for m in modes:
            for x, r in table[m].items():
                print(f"| {m} | {x} | " + " | ".join(
                    f"{r[c]:.3f}" if c == "seconds" else f"{r[c]:,}" for c in cols) + " |")
    _plot(by_k, args.out)
    print(f"\nplot: {args.out}")


def _plot(by_k, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for mode, rows in by_k.items():
        ks = sorted(rows)
        ax.plot(ks, [rows[k]["llm_nodes"] for k in ks], marker="o", label=mode)
    ax.set_yscale("log")
    ax.set_xlabel("LLM nodes per trajectory k")
    ax.set_ylabel(f"LLM nodes sampled per step ({QUERIES} queries, G={G})")
    ax.set_title("Rollout cost: nodewise is additive in k, full_tree multiplicative")
    ax.legend()
    FigureCanvasAgg(fig).print_png(path)


if __name__ == "__main__":
    main()
