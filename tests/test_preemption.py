"""Tests for joyagents_jax.preemption: signals become a flag; a second one goes through."""

import os
import signal
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
