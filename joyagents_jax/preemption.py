"""Preemption: SIGTERM / SIGINT / SIGHUP become a flag that every process agrees on at a step.

A preempted job (a TPU VM maintenance event, SLURM's time limit, Ctrl-C, the ssh session of the
terminal it runs in dropping) gets SIGTERM, SIGINT or SIGHUP; the train loop checks
`Guard.stop_agreed()` after each step, saves a checkpoint and leaves, and a rerun resumes from it.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class Guard:
    """Turns SIGTERM/SIGINT/SIGHUP into a flag, so the train loop can save and exit cleanly.

    Inside `with Guard() as guard:` the first signal sets `guard.requested`; the loop
    checks it after each step, saves, waits for the save and leaves. A second signal restores
    the previous handlers and re-delivers itself (a second Ctrl-C interrupts at once). The old
    handlers come back on exit. Signal handlers can only be installed from the main thread.

    SIGHUP means the terminal is gone: writes to it fail (EIO), so standard output and error,
    where they were that terminal, are redirected to `hangup_log` (appended) and the run's last
    lines land there. A hang-up can arrive twice (from the login shell and from the kernel) and
    never counts as a second signal. A SIGHUP ignored on entry (`nohup`) stays ignored.
    """

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT,
                                                           signal.SIGHUP),
                 hangup_log: str = os.devnull):
        self.signals = tuple(signals)
        self.hangup_log = hangup_log
        self.requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._terminals: list[int] = []

    def __enter__(self) -> Guard:
        self._terminals = [fd for fd in (1, 2) if os.isatty(fd)]  # no longer ttys once hung up
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals
                          if not _nohup(s)}
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if signum == signal.SIGHUP:
            self._leave_terminal()
        elif self.requested:
            self._restore()
            signal.raise_signal(signum)
            return
        if not self.requested:
            self.requested, self.received = True, signal.Signals(signum)
            logging.warning("Received %s: saving a checkpoint and stopping after this step.",
                            self.received.name)

    def _leave_terminal(self) -> None:
        """Points the file descriptors that were the terminal at `hangup_log` (once)."""
        if not self._terminals:
            return
        logging.warning("Received SIGHUP (the terminal closed): the output goes on in %s.",
                        self.hangup_log)
        try:
            log = os.open(self.hangup_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:  # e.g. a full disk: the output is lost, the run still saves and stops
            log = os.open(os.devnull, os.O_WRONLY)
        for fd in self._terminals:
            os.dup2(log, fd)
        os.close(log)
        self._terminals = []

    def stop_agreed(self) -> bool:
        """`requested` on any process. A collective: call it on every process at the same step."""
        if jax.process_count() == 1:
            return self.requested
        flags = multihost_utils.process_allgather(np.asarray(self.requested))
        return bool(np.any(flags))


def _nohup(s: signal.Signals) -> bool:
    """A SIGHUP that the process was started ignoring (`nohup CMD`): the user asked to go on."""
    return s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN
