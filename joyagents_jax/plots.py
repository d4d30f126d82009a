"""PNG plots of a run from its `metrics.jsonl`: `joyagents plot --workdir DIR`.

Metric keys are flat and `/`-separated (`metrics.MetricsWriter`); the train loop logs exactly
these, and each plot is written only when at least one of its keys is present:

    sft_loss.png         sft/loss                        SFT cross-entropy
    reward.png           grpo/reward/<agent>             mean reward of the agent's samples (raw, moving average)
    selected_agents.png  grpo/updated/<agent>            1 if the agent was updated (top-K), else 0
    accuracy.png         eval/<split>/accuracy           held-out accuracy over all domains
                         eval/<split>/accuracy/<domain>  held-out accuracy of one domain
    memory.png           memory/entries                  entries in the memory table
                         memory/hit_rate                 share of lookups that reused an entry
    rollout_cost.png     rollout/sampler_calls           sampler calls in the step's rollout
                         rollout/generated_tokens        tokens generated in the rollout
                         rollout/seconds                 wall seconds of the rollout

`<agent>` is an agent name (e.g. `master`, `math`), `<split>` a held-out split (`test`,
`test_novel`), `<domain>` a task domain. A step logged twice (a resume without truncation)
plots its last value. Figures are drawn on matplotlib's Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from joyagents_jax.metrics import METRICS_FILE, read_metrics

Rows = list[dict[str, Any]]
PLOTS_DIR = "plots"


def _series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, sorted by step; the last row of a step wins."""
    points = {row["step"]: row[key] for row in rows if row.get(key) is not None}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def _children(rows: Rows, prefix: str) -> list[str]:
    """Sorted names `x` of the keys `prefix/x` (one level below `prefix`)."""
    pattern = re.compile(re.escape(prefix) + r"/([^/]+)")
    return sorted({m[1] for row in rows for key in row if (m := pattern.fullmatch(key))})


def _figure(panels: int, width: float = 7.0) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(width, 2.8 * panels), layout="constrained")
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    return fig, list(axes)


def _panels(rows: Rows, path: Path, title: str, panels: Sequence[tuple[str, str]]) -> bool:
    """One line plot per present (key, y label) pair, stacked; False if none is present."""
    present = [(key, label) for key, label in panels if _series(rows, key)[0]]
    if not present:
        return False
    fig, axes = _figure(len(present))
    for ax, (key, label) in zip(axes, present):
        ax.plot(*_series(rows, key), marker=".")
        ax.set(ylabel=label, xlabel="step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return True


def plot_sft_loss(rows: Rows, path: Path) -> bool:
    return _panels(rows, path, "SFT warm start", [("sft/loss", "loss")])


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over up to `window` points (the first points average fewer)."""
    sums = np.cumsum(np.asarray(values, float))
    lagged = np.concatenate([np.zeros(min(window, len(sums))), sums[:-window]])[:len(sums)]
    counts = np.minimum(np.arange(1, len(sums) + 1), window)
    return list((sums - lagged) / counts)


def plot_reward(rows: Rows, path: Path) -> bool:
    """Per agent: the raw per-step mean reward (faint) and its moving average (bold)."""
    agents = _children(rows, "grpo/reward")
    if not agents:
        return False
    fig, (ax,) = _figure(1)
    for agent in agents:
        steps, values = _series(rows, f"grpo/reward/{agent}")
        window = max(1, len(steps) // 10)
        line, = ax.plot(steps, smooth(values, window), linewidth=2,
                        label=f"{agent} ({window}-step mean)")
        ax.plot(steps, values, color=line.get_color(), alpha=0.25, linewidth=1)
    ax.set(xlabel="step", ylabel="mean reward",
           title="GRPO reward per agent (faint: each step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return True


def plot_accuracy(rows: Rows, path: Path) -> bool:
    """One panel per held-out split: a line per domain and the overall accuracy in black."""
    splits = sorted({m[1] for row in rows for key in row
                     if (m := re.fullmatch(r"eval/([^/]+)/accuracy(/[^/]+)?", key))})
    if not splits:
        return False
    fig, axes = _figure(len(splits))
    for ax, split in zip(axes, splits):
        prefix = f"eval/{split}/accuracy"
        for domain in _children(rows, prefix):
            ax.plot(*_series(rows, f"{prefix}/{domain}"), marker=".", label=domain)
        steps, overall = _series(rows, prefix)
        if steps:
            ax.plot(steps, overall, "k-", linewidth=2.5, marker="o", label="all")
        steps, alone = _series(rows, f"eval_no_memory/{split}/accuracy")
        if steps:
            ax.plot(steps, alone, "k", linestyle="none", marker="x", markersize=9,
                    label="all, policies without memory")
        ax.set(xlabel="step", ylabel="accuracy", title=f"held-out accuracy: {split}",
               ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", ncol=2)
    fig.savefig(path, dpi=100)
    return True


def plot_selected_agents(rows: Rows, path: Path) -> bool:
    """Heatmap agent x step: dark where the agent was updated (top-K), blank where not logged."""
    agents = _children(rows, "grpo/updated")
    if not agents:
        return False
    steps = sorted({row["step"] for row in rows for agent in agents
                    if row.get(f"grpo/updated/{agent}") is not None})
    column = {step: i for i, step in enumerate(steps)}
    grid = np.full((len(agents), len(steps)), np.nan)
    for i, agent in enumerate(agents):
        for step, value in zip(*_series(rows, f"grpo/updated/{agent}")):
            grid[i, column[step]] = value
    fig = Figure(figsize=(min(16.0, 4.0 + 0.08 * len(steps)), 1.2 + 0.45 * len(agents)),
                 layout="constrained")
    ax = fig.subplots()
    ax.imshow(grid, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    ticks = range(0, len(steps), max(1, math.ceil(len(steps) / 12)))
    ax.set_xticks(list(ticks), [str(steps[i]) for i in ticks])
    ax.set_yticks(range(len(agents)), agents)
    ax.set(xlabel="step", title="agents updated per step (top-K by reward variance)")
    cmap = ax.images[0].cmap
    ax.legend(handles=[Patch(color=cmap(1.0), label="updated"),
                       Patch(facecolor=cmap(0.0), edgecolor="0.6", label="not updated"),
                       Patch(facecolor="white", edgecolor="0.6", label="not logged")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.savefig(path, dpi=100)
    return True


def plot_memory(rows: Rows, path: Path) -> bool:
    return _panels(rows, path, "adaptive memory",
                   [("memory/entries", "entries"), ("memory/hit_rate", "hit rate")])


def plot_rollout_cost(rows: Rows, path: Path) -> bool:
    return _panels(rows, path, "rollout cost per step",
                   [("rollout/sampler_calls", "sampler calls"),
                    ("rollout/generated_tokens", "generated tokens"),
                    ("rollout/seconds", "seconds")])


PLOTS: dict[str, Callable[[Rows, Path], bool]] = {
    "sft_loss.png": plot_sft_loss,
    "reward.png": plot_reward,
    "accuracy.png": plot_accuracy,
    "selected_agents.png": plot_selected_agents,
    "memory.png": plot_memory,
    "rollout_cost.png": plot_rollout_cost,
}


def plot_workdir(workdir: str | Path) -> list[Path]:
    """Writes every plot whose metrics are in `workdir/metrics.jsonl` to `workdir/plots/`."""
    rows = read_metrics(workdir)
    out = Path(workdir) / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in PLOTS.items():
        if plot(rows, out / name):
            written.append(out / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="joyagents plot",
        description="Write PNG plots (reward per agent, accuracy per domain, selected agents, "
                    "memory, rollout cost, SFT loss) from a run's metrics.jsonl to DIR/plots/.")
    parser.add_argument("--workdir", required=True, help="the run's folder (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    if not (Path(args.workdir) / METRICS_FILE).exists():
        print(f"joyagents plot: no {METRICS_FILE} in {args.workdir}; is it a run's --workdir?",
              file=sys.stderr)
        return 2
    for path in plot_workdir(args.workdir):
        print(f"Wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
