"""pdserve.process: the once-only signal handler that the launcher, `up --ray`, the GPU benchmark and the kit share."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve.process import unwind_once


def settle() -> None:
    """Time for a pending signal's Python handler to run in this (the main) thread; bounded, never a hang."""
    for _ in range(50):
        time.sleep(0.001)


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_the_first_signal_unwinds_and_the_ones_after_it_are_ignored(restore_handlers) -> None:
    got = unwind_once(signal.SIGUSR1, signal.SIGUSR2)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGUSR2)
        settle()
    assert got == [signal.SIGUSR2]
    os.kill(os.getpid(), signal.SIGUSR1)  # a second, of either kind: ignored while the stop runs
    os.kill(os.getpid(), signal.SIGUSR2)
    settle()
    assert got == [signal.SIGUSR2]


def test_with_exit_code_it_exits_with_128_plus_the_signal(restore_handlers) -> None:
    unwind_once(signal.SIGUSR1, exit_code=True)
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGUSR1)
        settle()
    assert e.value.code == 128 + signal.SIGUSR1


def test_a_flag_set_before_any_signal_ignores_them_all(restore_handlers) -> None:
    """The launcher appends to the flag once it has begun its stop: the signals of `timeout` then change nothing."""
    got = unwind_once(signal.SIGUSR1)
    got.append(True)
    os.kill(os.getpid(), signal.SIGUSR1)
    settle()
    assert got == [True]
