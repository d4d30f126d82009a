"""Tests for joyagents_jax.preemption: signals become a flag; a second one goes through."""

import os
import signal
import sys
import time

import pytest

from joyagents_jax import preemption


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_preemption_guard_turns_sigterm_into_a_flag():
    before = signal.getsignal(signal.SIGTERM)
    with preemption.Guard() as guard:
        assert not guard.requested and not guard.stop_agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: guard.requested)
        assert guard.requested and guard.received == signal.SIGTERM and guard.stop_agreed()
    assert signal.getsignal(signal.SIGTERM) is before


def test_preemption_guard_second_interrupt_goes_through():
    # Python's own SIGINT handler as the previous one: a process started in the background by
    # a non-interactive shell (as CI may be) inherits SIGINT ignored instead.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _second_interrupt_raises()
    finally:
        signal.signal(signal.SIGINT, outer)


def _second_interrupt_raises():
    with pytest.raises(KeyboardInterrupt), preemption.Guard([signal.SIGINT]) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        _wait_for(lambda: guard.requested)
        assert guard.requested
        os.kill(os.getpid(), signal.SIGINT)  # the previous handler raises KeyboardInterrupt
        _wait_for(lambda: False, timeout=2.0)


def test_a_hang_up_is_one_request_however_often_it_comes_and_never_a_second_signal():
    with preemption.Guard() as guard:
        os.kill(os.getpid(), signal.SIGHUP)
        _wait_for(lambda: guard.requested)
        os.kill(os.getpid(), signal.SIGHUP)  # the kernel's after the login shell's
        _wait_for(lambda: False, timeout=0.2)
        assert guard.requested and guard.received == signal.SIGHUP
    with preemption.Guard() as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: guard.requested)
        os.kill(os.getpid(), signal.SIGHUP)  # the terminal closes while the run saves
        _wait_for(lambda: False, timeout=0.2)
        assert guard.received == signal.SIGTERM


def test_a_hang_up_ignored_on_entry_stays_ignored():
    outer = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` starts a command
    try:
        with preemption.Guard() as guard:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            _wait_for(lambda: False, timeout=0.2)
            assert not guard.requested
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, outer)


# Enters the Guard with stdout and stderr on a terminal, waits for the request, then writes as a
# run's last lines do: to the terminal that is gone.
_CHILD = """
import sys, time
from joyagents_jax import preemption
with preemption.Guard(hangup_log=sys.argv[1]) as guard:
    print("ready", flush=True)
    while not guard.requested:
        time.sleep(0.01)
    for _ in range(3):
        print("saved and leaving", flush=True)
        print("progress", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("folder", ["here", "missing"])
def test_a_closed_terminal_stops_the_run_and_its_output_goes_on_in_the_log(
        tmp_path, folder, spawn_on_a_terminal):
    """As over a dropped ssh connection: the process leads a session whose terminal's master
    closes; it gets SIGHUP and its writes to the terminal would fail (EIO). A log that cannot
    be opened loses the output, not the run."""
    log = tmp_path / folder / "train.hangup.log"
    (tmp_path / "here").mkdir()
    pid, master = spawn_on_a_terminal([sys.executable, "-c", _CHILD, str(log)], dict(os.environ))
    seen = b""
    while b"ready" not in seen:
        try:
            seen += os.read(master, 1024)
        except OSError:  # the child ended before it was ready
            pytest.fail(seen.decode(errors="replace"))
    os.close(master)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if folder == "here":
        text = log.read_text()
        assert "Received SIGHUP (the terminal closed)" not in text  # said to the terminal
        assert "Received SIGHUP: saving a checkpoint" in text
        assert text.count("saved and leaving") == 3 and text.count("progress") == 3
    else:
        assert not log.exists()
