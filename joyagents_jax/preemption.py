"""Preemption: SIGTERM / SIGINT become a flag that every process agrees on at a step.

A preempted job (a TPU VM maintenance event, SLURM's time limit, Ctrl-C) gets SIGTERM or SIGINT;
the train loop checks `Guard.stop_agreed()` after each step, saves a checkpoint and leaves, and a
rerun resumes from it.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class Guard:
    """Turns SIGTERM/SIGINT into a flag, so the train loop can save and exit cleanly.

    Inside `with Guard() as guard:` the first signal sets `guard.requested`; the loop
    checks it after each step, saves, waits for the save and leaves. A second signal restores
    the previous handlers and re-delivers itself (a second Ctrl-C interrupts at once). The old
    handlers come back on exit. Signal handlers can only be installed from the main thread.
    """

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> Guard:
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.requested:
            self._restore()
            signal.raise_signal(signum)
            return
        self.requested, self.received = True, signal.Signals(signum)
        logging.warning("Received %s: saving a checkpoint and stopping after this step.",
                        self.received.name)

    def stop_agreed(self) -> bool:
        """`requested` on any process. A collective: call it on every process at the same step."""
        if jax.process_count() == 1:
            return self.requested
        flags = multihost_utils.process_allgather(np.asarray(self.requested))
        return bool(np.any(flags))
