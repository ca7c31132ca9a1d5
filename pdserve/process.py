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
