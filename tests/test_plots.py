"""Tests for joyagents_jax.plots: PNGs from a synthetic metrics.jsonl, missing metrics skipped."""

import json

import numpy as np

from joyagents_jax import metrics, plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
AGENTS = ("master", "math", "travel")


def _synthetic_run(workdir) -> None:
    """5 SFT steps, then 15 GRPO steps with an evaluation every 5, as the train loop logs."""
    rng = np.random.default_rng(0)
    with metrics.MetricsWriter(workdir) as writer:
        for step in range(1, 6):
            writer.write(step, {"sft/loss": 3.0 / step}, phase="sft")
        for step in range(6, 21):
            row = {f"grpo/reward/{a}": rng.uniform() for a in AGENTS}
            row |= {f"grpo/updated/{a}": int(rng.uniform() < 0.5) for a in AGENTS}
            row |= {"memory/entries": 4 * step, "memory/hit_rate": step / 20,
                    "rollout/sampler_calls": 12, "rollout/generated_tokens": 900 + step,
                    "rollout/seconds": 1.5}
            if step % 5 == 0:
                for split in ("test", "test_novel"):
                    row[f"eval/{split}/accuracy"] = step / 25
                    row |= {f"eval/{split}/accuracy/{d}": rng.uniform() for d in ("math", "kb")}
            writer.write(step, row, phase="grpo")


def test_every_plot_is_a_png(tmp_path):
    _synthetic_run(tmp_path)
    paths = plots.plot_workdir(tmp_path)
    assert sorted(p.name for p in paths) == sorted(plots.PLOTS)
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_missing_metrics_skip_their_plots(tmp_path):
    (tmp_path / metrics.METRICS_FILE).write_text(
        "".join(json.dumps({"step": s, "phase": "sft", "sft/loss": 1.0 / s}) + "\n"
                for s in (1, 2, 3)) + '{"step": 4, "sft/lo')  # and a line cut by a crash
    assert [p.name for p in plots.plot_workdir(tmp_path)] == ["sft_loss.png"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / metrics.METRICS_FILE).write_text("")
    assert plots.plot_workdir(empty) == []


def test_main_writes_plots_and_rejects_a_folder_without_metrics(tmp_path, capsys):
    _synthetic_run(tmp_path)
    assert plots.main(["--workdir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("Wrote ") == len(plots.PLOTS)
    assert plots.main(["--workdir", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_smooth_is_a_trailing_moving_average():
    from joyagents_jax import plots

    np.testing.assert_allclose(plots.smooth([1, 3, 5, 7], 2), [1, 2, 4, 6])
    np.testing.assert_allclose(plots.smooth([2, 4, 9], 1), [2, 4, 9])
    np.testing.assert_allclose(plots.smooth([2, 4], 5), [2, 3])
