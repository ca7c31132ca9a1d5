"""The systems a benchmark compares, each opened as a context manager that yields `run(workload, desc)`.

- `colocated` / `disagg`: `pdserve up --mode ...` as a child process on a free port, driven over HTTP;
  stopped with SIGTERM to its PID (the launcher stops its own children).
- `static` / `hf_cb`: Hugging Face static and continuous batching in this process (bench/baselines.py).
- an external OpenAI-compatible server (e.g. `vllm serve`), started by the user, driven over HTTP.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.baselines import cb_manager, run_hf_cb, run_static
from bench.http_client import HttpTarget, run_http
from bench.metrics import RequestRecord
from bench.workloads import Workload

READY_MARK = "is serving"
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 20

Runner = Callable[[Workload, str], tuple[float, list[RequestRecord]]]


class SystemFailed(RuntimeError):
    """A system could not be started or driven; the message says why, for the report."""


@dataclass(frozen=True)
class StackOptions:
    """What `pdserve up` gets: the same engine budget as the in-process baselines."""

    model: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gb: float
    kv_transport: str
    log_prefix: Path  # logs go to <log_prefix>.pdserve-<mode>.log
    extra_args: tuple[str, ...] = ()


# ---- pdserve as a child process --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_argv(opts: StackOptions, mode: str, port: int) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--model",
        opts.model,
        "--mode",
        mode,
        "--port",
        str(port),
        "--max-num-seqs",
        str(opts.max_num_seqs),
        "--max-num-batched-tokens",
        str(opts.max_num_batched_tokens),
        "--kv-cache-gb",
        str(opts.kv_cache_gb),
    ]
    if mode == "disagg":
        argv += ["--kv-transport", opts.kv_transport]
    return argv + list(opts.extra_args)


class Stack:
    """One `pdserve up` child: its output goes to a log file; `ready` is set once it says it serves."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.reader = threading.Thread(target=self._copy_output, daemon=True)
        self.reader.start()

    def _copy_output(self) -> None:
        with self.log_path.open("w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if READY_MARK in line:
                    self.ready.set()

    def tail(self) -> list[str]:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return lines[-LOG_TAIL_LINES:]

    def reason(self) -> str:
        """The most telling line of the log: its first error, else its last line."""
        tail = self.tail()
        errors = [line for line in tail if "error" in line.lower()]
        return (errors or tail or ["(no output)"])[0].strip()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None:
                raise SystemFailed(
                    f"`pdserve up` exited with code {self.proc.returncode} before serving: {self.reason()}\n"
                    f"log {self.log_path}:\n" + "\n".join(self.tail())
                )
            if time.monotonic() > deadline:
                raise SystemFailed(f"`pdserve up` did not serve within {timeout_s:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the launcher's PID; its process group is killed only if it will not stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.reader.join(timeout=5)


@contextmanager
def pdserve_stack(opts: StackOptions, mode: str, progress: bool) -> Iterator[Runner]:
    port = free_port()
    stack = Stack(stack_argv(opts, mode, port), opts.log_prefix.with_name(f"{opts.log_prefix.name}.pdserve-{mode}.log"))
    try:
        stack.wait_ready(READY_TIMEOUT_S)
        target = HttpTarget(f"http://127.0.0.1:{port}")
        yield lambda w, desc: _checked_http(target, w, desc, progress, stack)
    finally:
        stack.stop()


def _checked_http(target: HttpTarget, workload: Workload, desc: str, progress: bool, stack: Stack):
    if stack.proc.poll() is not None:
        raise SystemFailed(f"the pdserve stack exited (code {stack.proc.returncode}); log {stack.log_path}")
    return run_http(target, workload, desc, progress)


@contextmanager
def external_server(url: str, progress: bool) -> Iterator[Runner]:
    target = HttpTarget(url.rstrip("/").removesuffix("/v1"))
    yield lambda w, desc: run_http(target, w, desc, progress)


# ---- in-process baselines ----------------------------------------------------------------------


@contextmanager
def static_batching(model, max_batch: int, progress: bool) -> Iterator[Runner]:
    yield lambda w, desc: run_static(model, w, max_batch, desc, progress)


@contextmanager
def hf_continuous_batching(
    model, max_batch: int, max_batch_tokens: int, kv_cache_gb: float, progress: bool
) -> Iterator[Runner]:
    manager = cb_manager(model, max_batch, max_batch_tokens, kv_cache_gb)
    manager.start()
    try:
        yield lambda w, desc: run_hf_cb(manager, w, desc, progress)
    finally:
        manager.stop(block=True, timeout=STOP_TIMEOUT_S)
        manager.destroy()
