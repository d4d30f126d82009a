"""Tests for joyagents_jax.metrics: JSONL + TensorBoard logs, resume truncation, progress."""

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from joyagents_jax import metrics


def _tb_events(workdir) -> list[event_pb2.Event]:
    """Every event of every TensorBoard file in `workdir/tb`, in file order (TFRecord framing:
    length u64, its crc u32, the Event proto, its crc u32)."""
    events = []
    for path in sorted((workdir / metrics.TB_DIR).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
            pos += 12 + length + 4
    return events


def _tb_scalars(workdir) -> list[tuple[str, int, float]]:
    return [(v.tag, e.step, v.simple_value) for e in _tb_events(workdir) for v in e.summary.value]


def test_flatten_nests_and_splits_per_agent_values():
    tree = {"agents": {"math": {"loss": 1}}, "grpo": {"reward": jnp.array([0.5, 0.25])},
            "lr": np.float32(0.125)}
    assert metrics.flatten(tree, agents=["master", "math"]) == {
        "agents/math/loss": 1.0, "grpo/reward/master": 0.5, "grpo/reward/math": 0.25,
        "lr": 0.125}
    with pytest.raises(ValueError, match="grpo/reward.*shape \\(2,\\)"):
        metrics.flatten(tree)


def test_writer_writes_jsonl_and_tensorboard(tmp_path):
    with metrics.MetricsWriter(tmp_path) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"sft": {"loss": jnp.float32(1.0 / step)}, "tokens": step * 10},
                         phase="sft")
    rows = metrics.read_metrics(tmp_path)
    assert [(r["step"], r["phase"], r["sft/loss"], r["tokens"]) for r in rows] == [
        (1, "sft", 1.0, 10.0), (2, "sft", 0.5, 20.0), (3, "sft", pytest.approx(1 / 3), 30.0)]
    assert all(isinstance(r["time"], float) for r in rows)
    scalars = _tb_scalars(tmp_path)
    assert [s for s in scalars if s[0] == "sft/loss"] == [
        ("sft/loss", 1, 1.0), ("sft/loss", 2, 0.5), ("sft/loss", 3, pytest.approx(1 / 3))]
    assert ("tokens", 3, 30.0) in scalars


def test_truncated_last_line_is_tolerated_and_repaired(tmp_path):
    path = tmp_path / metrics.METRICS_FILE
    path.write_text(json.dumps({"step": 1, "x": 1.0}) + "\n" + '{"step": 2, "x"')
    assert metrics.read_metrics(tmp_path) == [{"step": 1, "x": 1.0}]
    with metrics.MetricsWriter(tmp_path) as writer:  # appends start on a clean line
        writer.write(2, {"x": 2.0})
    assert [(r["step"], r["x"]) for r in metrics.read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0)]


def test_truncate_after_drops_steps_past_the_checkpoint(tmp_path):
    with metrics.MetricsWriter(tmp_path) as writer:
        for step in range(1, 6):
            writer.write(step, {"x": step})
    with metrics.MetricsWriter(tmp_path) as writer:  # resumed from a checkpoint at step 3
        writer.truncate_after(3)
        for step in (4, 5):
            writer.write(step, {"x": step * 10})
    rows = metrics.read_metrics(tmp_path)
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]
    purges = [e.step for e in _tb_events(tmp_path) if e.HasField("session_log")]
    assert purges == [4]  # TensorBoard hides the first run's points from step 4 on
    assert _tb_scalars(tmp_path)[-2:] == [("x", 4, 40.0), ("x", 5, 50.0)]


def test_disabled_writer_writes_nothing(tmp_path):
    with metrics.MetricsWriter(tmp_path / "run", enabled=False) as writer:
        writer.write(1, {"x": 1.0})
        writer.truncate_after(0)
        writer.flush()
    assert not (tmp_path / "run").exists()


def test_progress_shows_a_compact_postfix(capsys):
    values = {"phase": "grpo", "step": 12, "reward": 0.53125, "acc": 1.0, "tok/s": 12345.6}
    assert metrics.format_postfix(values) == "phase=grpo step=12 reward=0.531 acc=1 tok/s=12.3k"
    with metrics.Progress(total=4, desc="train", initial=2) as bar:
        bar.update(2, **values)
    err = capsys.readouterr().err
    assert "4/4" in err and "reward=0.531" in err
    with metrics.Progress(total=4, enabled=False) as bar:
        bar.update(1, reward=0.5)
    assert capsys.readouterr().err == ""
