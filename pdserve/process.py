"""What a child process of pdserve does so as not to outlive the process that started it (standard library only:
the launcher, Ray's actors and the router's workers all use it)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """In a child (a Popen's preexec_fn, or a spawned process's first step), on Linux: SIGTERM it when the process
    that started it dies, a SIGKILL included, so that it drains and exits rather than serve on alone; also when that
    process died already, before this call. Elsewhere nothing."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the line above: the child was handed to init
        os.kill(os.getpid(), signal.SIGTERM)


def unwind_once(*signums: int, exit_code: bool = False) -> list:
    """The first of these signals unwinds the main thread: it raises KeyboardInterrupt, or with exit_code
    SystemExit(128 + the signal's number), so that the code stopping what was started runs. Every signal after it is
    ignored, so that it cannot cut that stop short (`timeout` sends its signal to the process and then to its process
    group; a second Ctrl-C). Returns the flag: append to it, and every signal from then on is ignored."""
    got: list = []

    def handler(signum: int, _frame) -> None:
        if not got:
            got.append(signum)
            raise SystemExit(128 + signum) if exit_code else KeyboardInterrupt

    for signum in signums:
        signal.signal(signum, handler)
    return got
