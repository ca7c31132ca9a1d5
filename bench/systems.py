"""The systems a benchmark compares, each opened as a context manager that yields `run(workload, desc)`.

- `colocated` / `disagg`: `pdserve up --mode ...` as a child process on a free port, driven over HTTP;
  stopped with SIGTERM to its PID (the launcher stops its own children). Its runner also reads the
  router's CPU time (utime + stime of the `pdserve router` child, from /proc) around each run, and
  the router's /metrics (every node's counters).
- `static` / `hf_cb`: Hugging Face static and continuous batching in this process (bench/baselines.py).
- an external OpenAI-compatible server (e.g. `vllm serve`), started by the user, driven over HTTP.
"""

from __future__ import annotations

import dataclasses
import os
import random
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
from pdserve.flags import engine_flags

READY_MARK = "is serving"
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 20

Runner = Callable[[Workload, str], tuple[float, list[RequestRecord]]]


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
METRICS_TIMEOUT_S = 10.0
METRICS_SETTLE_S = 0.6  # nodes send their counters to the router every 0.5 s
METRICS_TRIES = 10


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
    max_concurrency: int | None = None  # the load generator's requests in flight at most
    deadline: float | None = None  # time.monotonic() by which every run ends (unfinished requests fail)


# ---- pdserve as a child process --------------------------------------------------------------------


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range where there is room: a client's source port always
    comes from that range, so a client that reconnects to a port of ours while its server restarts can never
    connect to itself there (TCP simultaneous open) and hold the port the server is about to bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.Random().sample(range(10000, low), min(64, low - 10000)) if low > 11000 else []
    for port in [*candidates, 0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free loopback port")


def stack_argv(opts: StackOptions, mode: str, port: int) -> list[str]:
    engine = engine_flags(
        model=opts.model,
        max_num_seqs=opts.max_num_seqs,
        kv_cache_gb=opts.kv_cache_gb,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        kv_transport=opts.kv_transport if mode == "disagg" else None,
    )
    return [sys.executable, "-m", "pdserve", "up", "--mode", mode, "--port", str(port), *engine, *opts.extra_args]


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


def time_left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (a time.monotonic() value), never negative; None: no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# ---- the router's CPU time, from /proc (Linux) ----------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state is [0], ppid [1], utime [11])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (None when it is gone or there is no /proc)."""
    fields = _proc_stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def child_pids(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _proc_stat(int(entry.name))
        if fields is not None and int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def router_pid(launcher_pid: int) -> int | None:
    """The `pdserve router` child of a `pdserve up` process."""
    for pid in child_pids(launcher_pid):
        argv = _argv(pid)
        if "pdserve" in argv and "router" in argv:
            return pid
    return None


# ---- pdserve stack runner --------------------------------------------------------------------------


class StackRunner:
    """Drives a started stack over HTTP. After each run, `router_cpu_s` holds the CPU seconds its router
    spent during it (None where it cannot be read); `metrics()` is the router's /metrics text."""

    def __init__(
        self, stack: Stack | SharedStack, target: HttpTarget, progress: bool, deadline: float | None = None
    ) -> None:
        self.stack, self.target, self.progress, self.deadline = stack, target, progress, deadline
        self.router_pid = router_pid(stack.pid if isinstance(stack, SharedStack) else stack.proc.pid)
        self.router_cpu_s: float | None = None

    def _router_cpu(self) -> float | None:
        return None if self.router_pid is None else cpu_seconds(self.router_pid)

    def __call__(self, workload: Workload, desc: str) -> tuple[float, list[RequestRecord]]:
        if isinstance(self.stack, SharedStack):
            if not Path(f"/proc/{self.stack.pid}").exists():
                raise SystemFailed(f"the shared pdserve stack at {self.stack.url} (PID {self.stack.pid}) is gone")
        elif self.stack.proc.poll() is not None:
            raise SystemFailed(
                f"the pdserve stack exited (code {self.stack.proc.returncode}); log {self.stack.log_path}"
            )
        target = dataclasses.replace(self.target, run_timeout_s=time_left(self.deadline))
        before = self._router_cpu()
        result = run_http(target, workload, desc, self.progress)
        after = self._router_cpu()
        self.router_cpu_s = None if before is None or after is None else after - before
        return result

    def metrics(self) -> str:
        import httpx  # the bench extra, as in http_client

        return httpx.get(f"{self.target.base_url}/metrics", timeout=METRICS_TIMEOUT_S).text


def _node_counter_lines(metrics_text: str) -> Iterator[tuple[str, str, str, float]]:
    """(role, node, counter, value) of each `pdserve:node_<counter>_total{role=...,node=...} value` line of the
    router's /metrics."""
    for line in metrics_text.splitlines():
        if not line.startswith("pdserve:node_") or "{" not in line or 'role="' not in line:
            continue
        name, rest = line.split("{", 1)
        role = rest.split('role="', 1)[1].split('"', 1)[0]
        node = rest.split('node="', 1)[1].split('"', 1)[0] if 'node="' in rest else ""
        yield role, node, name.removeprefix("pdserve:node_").removesuffix("_total"), float(line.rsplit(" ", 1)[1])


def node_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """The node counters of the router's /metrics, summed per role: {role: {counter: value}}."""
    roles: dict[str, dict[str, float]] = {}
    for role, _, key, value in _node_counter_lines(metrics_text):
        counters = roles.setdefault(role, {})
        counters[key] = counters.get(key, 0.0) + value
    return roles


def node_counters_per_node(metrics_text: str, role: str) -> dict[str, dict[str, float]]:
    """The node counters of the router's /metrics for the nodes of `role`, one by one: {counter: {node: value}}."""
    out: dict[str, dict[str, float]] = {}
    for r, node, key, value in _node_counter_lines(metrics_text):
        if r == role:
            out.setdefault(key, {})[node] = value
    return out


def counters_diff(after: dict, before: dict) -> dict[str, dict[str, float]]:
    return {
        role: {k: v - before.get(role, {}).get(k, 0.0) for k, v in counts.items()} for role, counts in after.items()
    }


def settled_counters(run: StackRunner) -> dict[str, dict[str, float]]:
    """The nodes' counters once two reads a stats period apart agree (they reach the router every 0.5 s)."""
    last = node_counters(run.metrics())
    for _ in range(METRICS_TRIES):
        time.sleep(METRICS_SETTLE_S)
        now = node_counters(run.metrics())
        if now == last:
            break
        last = now
    return last


@contextmanager
def pdserve_stack(opts: StackOptions, mode: str, progress: bool) -> Iterator[StackRunner]:
    port = free_port()
    stack = Stack(stack_argv(opts, mode, port), opts.log_prefix.with_name(f"{opts.log_prefix.name}.pdserve-{mode}.log"))
    try:
        stack.wait_ready(READY_TIMEOUT_S)
        target = HttpTarget(f"http://127.0.0.1:{port}", max_concurrency=opts.max_concurrency)
        yield StackRunner(stack, target, progress, opts.deadline)
    finally:
        stack.stop()


@dataclass(frozen=True)
class SharedStack:
    """A `pdserve up` that another process started and stops (the GPU kit's): where it serves, its PID (the router's
    CPU is read below it), the Triton cache folder it compiles into."""

    system: str  # colocated | disagg
    url: str
    pid: int
    triton_cache: Path


@contextmanager
def shared_stack(shared: SharedStack, opts: StackOptions, progress: bool) -> Iterator[StackRunner]:
    """Drives a stack another process runs, as `pdserve_stack` drives its own; leaves it running."""
    target = HttpTarget(shared.url.rstrip("/"), max_concurrency=opts.max_concurrency)
    yield StackRunner(shared, target, progress, opts.deadline)


@contextmanager
def external_server(url: str, progress: bool) -> Iterator[Runner]:
    target = HttpTarget(url.rstrip("/").removesuffix("/v1"))
    yield lambda w, desc: run_http(target, w, desc, progress)


# ---- in-process baselines ----------------------------------------------------------------------


@contextmanager
def static_batching(model, max_batch: int, progress: bool, deadline: float | None = None) -> Iterator[Runner]:
    yield lambda w, desc: run_static(model, w, max_batch, desc, progress, time_left(deadline))


@dataclass(frozen=True)
class CbOptions:
    """HF continuous batching: the engine budget of pdserve, and the load generator's limits."""

    max_batch: int
    max_batch_tokens: int
    kv_cache_gb: float
    max_concurrency: int | None = None
    deadline: float | None = None  # time.monotonic() by which every run ends (unfinished requests fail)
    cuda_graphs: bool = False


@contextmanager
def hf_continuous_batching(model, opts: CbOptions, progress: bool) -> Iterator[Runner]:
    manager = cb_manager(model, opts.max_batch, opts.max_batch_tokens, opts.kv_cache_gb, opts.cuda_graphs)
    manager.start()
    try:
        yield lambda w, desc: run_hf_cb(manager, w, desc, progress, opts.max_concurrency, time_left(opts.deadline))
    finally:
        manager.stop(block=True, timeout=STOP_TIMEOUT_S)
        manager.destroy()
