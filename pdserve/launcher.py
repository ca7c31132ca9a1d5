"""`pdserve up`: the whole local stack as child processes, each started with its role's own command.

Nodes bind free ports and report their addresses in a ready file; the router starts once every
node is ready; the URL is printed once the router answers /health. Ctrl-C or SIGTERM stops every
child, by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdserve.cli import engine_argv, router_limits_argv

READY_TIMEOUT_S = 300


def _cores(spec: str | None, index: int, pin: bool) -> str:
    if not pin:
        return ""
    if spec is not None:
        return spec
    return str(index % (os.cpu_count() or 1))


def plan(a: argparse.Namespace, tmp: Path) -> list[tuple[str, list[str], Path]]:
    """(role, argv, ready file) of every node to start."""
    devices = {a.device, a.prefill_device or a.device, a.decode_device or a.device}
    if a.kv_transport == "cuda_ipc" and any(not d.startswith("cuda") for d in devices):
        raise ValueError("--kv-transport cuda_ipc needs CUDA devices (--prefill-device / --decode-device cuda:N)")
    if a.kv_transport == "shm" and any(d != "cpu" for d in devices):
        raise ValueError("--kv-transport shm is for CPU nodes; use cuda_ipc on GPUs")
    pin = not a.no_pin and a.device == "cpu"
    base = [sys.executable, "-m", "pdserve"]
    nodes = []
    if a.mode == "colocated":
        cores = a.cpu_cores if a.cpu_cores is not None else (f"0-{(os.cpu_count() or 1) - 1}" if pin else "")
        nodes.append(("colocated", [*base, "colocated", *engine_argv(a), "--device", a.device,
                                    "--cpu-cores", cores if pin else ""], tmp / "colocated0.json"))  # fmt: skip
        return nodes
    for i in range(a.num_prefill):
        dev = a.prefill_device or a.device
        cores = _cores(a.prefill_cores, i, pin)
        argv = [*base, "prefill", *engine_argv(a), "--device", dev, "--cpu-cores", cores]
        nodes.append(("prefill", argv, tmp / f"prefill{i}.json"))
    for i in range(a.num_decode):
        dev = a.decode_device or a.device
        cores = _cores(a.decode_cores, a.num_prefill + i, pin)
        argv = [*base, "decode", *engine_argv(a), "--device", dev, "--cpu-cores", cores]
        nodes.append(("decode", argv, tmp / f"decode{i}.json"))
    return nodes


def _wait_ready(procs: list[subprocess.Popen], files: list[Path]) -> list[dict]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a node exited during start-up (pid {p.pid}, code {p.returncode})")
        if all(f.exists() for f in files):
            return [json.loads(f.read_text()) for f in files]
        time.sleep(0.1)
    raise RuntimeError("nodes did not become ready in time")


def _wait_http(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited during start-up (code {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the router did not become ready in time")


def stop_all(procs: list[subprocess.Popen], drain_s: float = 0.0) -> None:
    """SIGTERM every child, the router (started last) first: it drains its requests while the nodes still serve."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            if p is procs[-1]:
                _wait(p, drain_s + 5)
    deadline = time.monotonic() + drain_s + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait(p: subprocess.Popen, timeout: float) -> None:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def launch(a: argparse.Namespace) -> int:
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as tmp:
        try:
            nodes = plan(a, Path(tmp))
            for _, argv, ready in nodes:
                procs.append(subprocess.Popen([*argv, "--ready-file", str(ready)]))
            infos = _wait_ready(procs, [r for _, _, r in nodes])
            argv = [sys.executable, "-m", "pdserve", "router", "--model", a.model, "--host", a.host,
                    "--port", str(a.port), *router_limits_argv(a)]  # fmt: skip
            for role in ("colocated", "prefill", "decode"):
                addrs = [i["listen"] for i in infos if i["role"] == role]
                if addrs:
                    argv += [f"--{role}", *addrs]
            kv = [i["kv_listen"] for i in infos if i["role"] == "decode"]
            if kv:
                argv += ["--decode-kv", *kv]
            router = subprocess.Popen(argv)
            procs.append(router)
            url = f"http://{a.host}:{a.port}"
            _wait_http(url, router)
            print(f"pdserve is serving {a.model} ({a.mode}) at {url}/v1", flush=True)
            while all(p.poll() is None for p in procs):
                time.sleep(0.5)
            print("pdserve: a child process exited; stopping the stack", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        except RuntimeError as e:
            print(f"pdserve: {e}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stop_all(procs, a.drain_timeout_s)
