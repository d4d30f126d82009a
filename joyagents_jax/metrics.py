"""Training metrics: a JSONL log, TensorBoard scalars and a progress bar.

`workdir/metrics.jsonl` holds one line per `write`: `{"step", "phase", "time", <key>: value}`
with flat `a/b/c` keys. It is the record `plots` reads; TensorBoard event files in `workdir/tb/`
are written next to it with tensorboardX (no TensorFlow needed). After a restart from a
checkpoint at step S, `truncate_after(S)` drops the lines (and TensorBoard points) past S, so a
resumed run's log equals an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tqdm

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


def flatten(tree: Mapping[str, Any], *, agents: Sequence[str] | None = None,
            prefix: str = "") -> dict[str, float]:
    """Nested metrics -> flat `a/b/c` keys with float values.

    `{'agents': {'math': {'loss': 1}}}` -> `{'agents/math/loss': 1.0}`. With `agents`, an array
    of one value per agent becomes one key per agent (`reward` [A] -> `reward/<agent>`).
    """
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, agents=agents, prefix=name))
            continue
        value = np.asarray(value)
        if value.size == 1:
            flat[name] = float(value.reshape(()))
        elif agents is not None and value.shape == (len(agents),):
            flat.update({f"{name}/{agent}": float(v) for agent, v in zip(agents, value)})
        else:
            raise ValueError(f"metric {name!r} has shape {value.shape}; log scalars, or pass "
                             f"agents (len {len(agents or ())}) for one value per agent.")
    return flat


def read_metrics(workdir: str | Path) -> list[dict[str, Any]]:
    """All rows of `workdir/metrics.jsonl`; a line cut short by a crash is skipped."""
    path = Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logging.warning("%s:%d is not valid JSON (cut short by a crash?); skipped.", path,
                            number)
    return rows


class MetricsWriter:
    """Appends scalars to `workdir/metrics.jsonl` and TensorBoard; a no-op when not `enabled`.

    Pass `enabled=jax.process_index() == 0` so only one process of a multi-host job writes.
    Each line is flushed as it is written: after a crash the log reaches the last step.
    """

    def __init__(self, workdir: str | Path, *, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(workdir) / METRICS_FILE
        self._tb_dir = Path(workdir) / TB_DIR
        self._file = self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_last_line(self.path)
            self._file = self.path.open("a", encoding="utf-8")
            self._tb = self._open_tb()

    def _open_tb(self, purge_step: int | None = None):
        from tensorboardX import SummaryWriter  # imported late: it pulls in protobuf

        # Event files are named by the second; the suffix keeps a restart within the same
        # second from overwriting the previous file (and sorts after it).
        return SummaryWriter(str(self._tb_dir), purge_step=purge_step, flush_secs=30,
                             filename_suffix=f".{time.time_ns()}")

    def write(self, step: int, scalars: Mapping[str, Any], phase: str | None = None) -> None:
        """Logs `scalars` (flat or nested; see `flatten`) at `step`."""
        if not self.enabled:
            return
        flat = flatten(scalars)
        row = {"step": int(step), "phase": phase, "time": time.time(), **flat}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for key, value in flat.items():
            self._tb.add_scalar(key, value, int(step))

    def truncate_after(self, step: int) -> None:
        """Forgets everything logged after `step` (call on resume from a checkpoint at `step`).

        Rewrites the JSONL without later rows and restarts TensorBoard with `purge_step`, which
        tells TensorBoard to hide the earlier run's points past `step`.
        """
        if not self.enabled:
            return
        self._file.close()
        kept = [row for row in read_metrics(self.path.parent) if row["step"] <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb.close()
        self._tb = self._open_tb(purge_step=step + 1)

    def flush(self) -> None:
        if self.enabled:
            self._file.flush()
            self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()
            self.enabled = False

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _drop_partial_last_line(path: Path) -> None:
    """Cuts a last line without its newline (a crash mid-write), so appends start clean."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


# ----------------------------------------------------------------------------------------------
# Progress bar.
# ----------------------------------------------------------------------------------------------


def format_postfix(values: Mapping[str, Any]) -> str:
    """`phase=grpo step=12 reward=0.531 tok/s=12.3k`: 3 significant digits, k/M for large."""
    def fmt(value: Any) -> str:
        if isinstance(value, str):
            return value
        value = float(np.asarray(value))
        if value.is_integer() and abs(value) < 1000:
            return str(int(value))
        if abs(value) >= 1000:
            return tqdm.tqdm.format_sizeof(value, divisor=1000)
        return f"{value:.3g}"

    return " ".join(f"{key}={fmt(value)}" for key, value in values.items())


class Progress:
    """A tqdm bar over steps whose postfix shows phase, step, reward, accuracy, tokens/s...

    Shown on any stream (also when not a TTY, e.g. a pod's log); `enabled=False` hides it
    (tests, non-primary processes). `initial` is the step a resumed run starts from.
    """

    def __init__(self, total: int, desc: str = "", *, initial: int = 0, enabled: bool = True):
        self._bar = tqdm.tqdm(total=total, desc=desc, initial=initial, disable=not enabled,
                              dynamic_ncols=True, smoothing=0.1)

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advances by `n` steps and shows `postfix` (e.g. `reward=0.5, **{'tok/s': 1e4}`)."""
        if postfix:
            self._bar.set_postfix_str(format_postfix(postfix), refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
