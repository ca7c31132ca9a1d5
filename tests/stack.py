"""A local pdserve stack for tests: node and router processes on 127.0.0.1 and free ports, stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.systems import free_port
from pdserve.flags import router_command

START_TIMEOUT_S = 600  # a hang guard: nodes starting side by side on a loaded host can take minutes to be ready
# a node starved of CPU on a loaded host is not a dead node: tests see a node die by its disconnect (SIGKILL closes
# its sockets), and only a test that measures the silence timeout sets a short one (router_args come after this)
NODE_TIMEOUT_S = 60
# router flags for a test that sends a prompt again and means it to go through a prefill node and a KV transfer:
# otherwise the decode node that caches it prefills it itself (conditional disaggregation)
NO_LOCAL_PREFILL = ("--local-prefill-max-tokens", "0")
ROUTER_WORKERS = 1  # router processes of every stack: pytest's --router-workers (conftest.py)
STATS_INTERVAL_S = 0.1  # nodes report to the router five times as often as by default: waits on reports are short
REPORTS = "pdserve:stats_reports_total"  # Stats received from each node: a reading after it grew is fresh


class Stack:
    def __init__(
        self,
        tmp: Path,
        model: str,
        mode: str = "colocated",
        transport: str = "zmq",
        num_prefill: int = 1,
        num_decode: int = 1,
        engine_args: tuple[str, ...] = (),
        decode_args: tuple[str, ...] = (),
        router_args: tuple[str, ...] = (),
        api_key: str = "",
        router_log: bool = False,
        node_logs: bool = False,
    ) -> None:
        self.tmp, self.model, self.mode, self.transport = tmp, model, mode, transport
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.engine_args, self.decode_args = list(engine_args), list(decode_args)
        self.router_args, self.api_key = list(router_args), api_key
        self._given: set[str] = set()  # the node addresses handed out
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.infos: dict[str, dict] = {}
        self.url = ""
        self.router_log = tmp / "router.log" if router_log else None  # the router's output, else inherited
        self.node_logs = node_logs  # each node's output in tmp/NAME.log, else inherited

    # ---- processes --------------------------------------------------------------------------------
    def start_node(self, name: str, role: str, extra: list[str] = ()) -> dict:
        self.spawn_node(name, role, extra)
        return self.wait_ready(name)

    def spawn_node(self, name: str, role: str, extra: list[str] = ()) -> None:
        ready = self.tmp / f"{name}.json"
        ready.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "pdserve",
            "--log-level",
            "WARNING",
            role,
            "--model",
            self.model,
            "--kv-transport",
            self.transport,
            "--ready-file",
            str(ready),
            "--stats-interval-s",
            str(STATS_INTERVAL_S),
            *self.engine_args,
            *extra,
        ]
        self.procs[name] = _spawn(argv, os.environ.copy(), self.tmp / f"{name}.log" if self.node_logs else None)

    def wait_ready(self, name: str) -> dict:
        ready, proc = self.tmp / f"{name}.json", self.procs[name]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (exit code {proc.returncode})")
            time.sleep(0.05)
        self.infos[name] = json.loads(ready.read_text())
        return self.infos[name]

    def start(self, router: bool = True) -> Stack:
        """Start the nodes and, unless told not to (a test then starts its own with `with_router`), the router."""
        try:
            return self._start(router)
        except BaseException:
            self.close()
            raise

    def _start(self, router: bool) -> Stack:
        """Start every node, then wait for them all (a node's start is mostly one core's imports: on a host of
        several cores they start side by side), then the router."""
        # explicit ports, below the ephemeral range (free_port): a node restarted on its address finds it free
        if self.mode == "colocated":
            self.spawn_node("colocated0", "colocated", ["--listen", self._address()])
        else:
            for i in range(self.num_prefill):
                self.spawn_node(f"prefill{i}", "prefill", ["--listen", self._address()])
            for i in range(self.num_decode):
                argv = ["--listen", self._address(), "--kv-listen", self._address(), *self.decode_args]
                self.spawn_node(f"decode{i}", "decode", argv)
        for name in list(self.procs):
            self.wait_ready(name)
        return self.start_router() if router else self

    def _address(self) -> str:
        """A free port's address, none given twice by this stack: nodes started in parallel bind theirs later."""
        addr = _address()
        while addr in self._given:
            addr = _address()
        self._given.add(addr)
        return addr

    def start_router(self, extra: tuple[str, ...] = ()) -> Stack:
        """(Re)start the router on a new port, over the running nodes."""
        port = free_port()
        options = [
            "--port",
            str(port),
            "--node-timeout-s",
            str(NODE_TIMEOUT_S),
            "--router-workers",
            str(ROUTER_WORKERS),
            *self.router_args,
            *extra,
        ]
        argv = router_command(self.model, self.infos.values(), options, log_level="WARNING")
        env = {**os.environ, "PDSERVE_API_KEY": self.api_key}
        self.procs["router"] = _spawn(argv, env, self.router_log)
        self.url = f"http://127.0.0.1:{port}"
        self.wait_healthy()
        return self

    def with_router(self, extra: tuple[str, ...] = (), api_key: str = "") -> Stack:
        """A router of its own over this stack's nodes (several routers may share nodes), started with more options or
        an API key: a test of router flags needs no nodes of its own. Its close() stops only that router."""
        other = Stack(
            self.tmp, self.model, self.mode, self.transport, router_args=(*self.router_args, *extra), api_key=api_key
        )
        other.infos = dict(self.infos)
        try:
            return other.start_router()
        except BaseException:
            other.close()
            raise

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs["router"].poll() is not None:
                raise RuntimeError("the router exited")
            try:
                r = httpx.get(self.url + "/health", timeout=1)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the stack did not become healthy")

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def restart_node(self, name: str, role: str, extra: tuple[str, ...] = ()) -> None:
        self.restart_nodes([(name, role, extra)])

    def restart_nodes(self, nodes: list[tuple[str, str, tuple[str, ...]]]) -> None:
        """Start again, on their addresses, the (stopped) nodes given as (name, role, more flags): side by side."""
        for name, role, extra in nodes:
            info = self.infos[name]
            argv = ["--listen", info["listen"]]
            if role == "decode":
                argv += ["--kv-listen", info["kv_listen"], *self.decode_args]
            self.spawn_node(name, role, [*argv, *extra])
        for name, _, _ in nodes:
            self.wait_ready(name)

    def close(self) -> None:
        """Stop the nodes, then the router. A node drains on SIGTERM and waits for its router's answer (what it still
        routes there): a live router answers at once, one that stopped told it so as it went, and one that was killed
        never answers: the node waits pdserve.nodes.base.ROUTER_ANSWER_S for it. So the nodes go first while their
        router still runs, or, where none runs (a stack of nodes alone, or its router killed), they stop at once
        (SIGINT): a test has checked what they hold already."""
        router = self.procs.get("router")
        nodes = [proc for name, proc in self.procs.items() if name != "router"]
        _stop(nodes, signal.SIGTERM if router is not None and router.poll() is None else signal.SIGINT)
        _stop([router] if router is not None else [], signal.SIGTERM)

    # ---- observations ------------------------------------------------------------------------------
    def rss_bytes(self, name: str) -> int:
        """Resident memory of one of the stack's processes."""
        for line in Path(f"/proc/{self.procs[name].pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for {name}")

    def kv_used(self) -> dict[str, int]:
        """kv_blocks_used per node, from /metrics."""
        return self.node_series("pdserve:kv_blocks_used")[0]

    def node_series(self, *names: str) -> list[dict[str, int]]:
        """Per-node series of one /metrics reading (node gauges, `pdserve:stats_reports_total`): {node: value} each."""
        lines = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text.splitlines()
        return [
            {
                line.split('node="')[1].split('"')[0]: int(float(line.rsplit(" ", 1)[1]))
                for line in lines
                if line.startswith(name + "{")
            }
            for name in names
        ]

    def wait_kv_free(self, timeout: float = 60.0, dead: tuple[str, ...] = ()) -> dict[str, int]:
        """Wait until every node but the `dead` addresses (killed: their last report stays) reports zero KV blocks
        in use, in a report sent after this call began (its second from then: the first may have been on its way
        already). Returns {node: 0}; raises with the last reading if that does not happen within `timeout`."""
        (since,) = self.node_series(REPORTS)
        used, reports = {}, {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            used, reports = (_without(d, dead) for d in self.node_series("pdserve:kv_blocks_used", REPORTS))
            fresh = bool(reports) and all(n >= since.get(node, 0) + 2 for node, n in reports.items())
            if fresh and used.keys() == reports.keys() and not any(used.values()):
                return used
            time.sleep(0.1)
        raise AssertionError(
            f"the nodes' KV pools were not seen empty within {timeout} s: last kv_blocks_used "
            f"{used}, stats reports {reports} (at the start {since})"
        )


class Stacks:
    """The stacks a module's tests share: each started the first time a test asks for its settings (Stack's
    keyword arguments), all stopped by close(). A test that changes a stack's nodes puts them back as they were."""

    def __init__(self, tmp_path_factory, router: bool = True) -> None:
        self.tmp_path_factory, self.router = tmp_path_factory, router
        self.started: dict[str, Stack] = {}

    def get(self, model: str = "tiny", **settings) -> Stack:
        key = repr((model, sorted(settings.items())))
        if key not in self.started:
            tmp = self.tmp_path_factory.mktemp("stack")
            self.started[key] = Stack(tmp, model, **settings).start(router=self.router)
        return self.started[key]

    def close(self) -> None:
        """Every stack stopped, side by side (each waits for its nodes to drain and exit, then its router)."""
        with ThreadPoolExecutor(max(1, len(self.started))) as pool:
            list(pool.map(Stack.close, self.started.values()))


def _spawn(argv: list[str], env: dict[str, str], log: Path | None) -> subprocess.Popen:
    """A child process, its output appended to `log` where given, else inherited. Only tests under tests/stacks/
    start stacks, so that `pytest -m "not stack"` starts none."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    if current and not current.startswith("tests/stacks/"):
        raise RuntimeError(f"{current.split(' ')[0]} starts a stack: it belongs under tests/stacks/")
    if log is None:
        return subprocess.Popen(argv, env=env)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _without(series: dict[str, int], nodes: tuple[str, ...]) -> dict[str, int]:
    return {node: v for node, v in series.items() if node not in nodes}


def _address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"
