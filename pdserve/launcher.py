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

from pdserve.flags import engine_argv, router_command, router_options
from pdserve.wire.protocol import KvTransport, Role

READY_TIMEOUT_S = 300


def _cores(spec: str | None, index: int, pin: bool) -> str:
    if not pin:
        return ""
    if spec is not None:
        return spec
    return str(index % (os.cpu_count() or 1))


def role_devices(a: argparse.Namespace) -> dict[str, str]:
    """The device each kind of node gets: prefill and decode nodes their own flag, else --device."""
    if a.mode == "colocated":
        return {Role.COLOCATED: a.device}
    return {Role.PREFILL: a.prefill_device or a.device, Role.DECODE: a.decode_device or a.device}


def check_devices(a: argparse.Namespace, devices: dict[str, str]) -> None:
    """Refuse a KV transport that cannot run between the devices the nodes actually get."""
    for role, dev in devices.items():
        if not (dev == "cpu" or dev.startswith("cuda")):
            raise ValueError(f"the {role} nodes' device must be 'cpu' or 'cuda:N', not {dev!r}")
    if a.mode == "colocated":
        return  # one process: no KV moves between nodes
    off_gpu = [f"{role} on {dev}" for role, dev in devices.items() if not dev.startswith("cuda")]
    if a.kv_transport == KvTransport.CUDA_IPC and off_gpu:
        raise ValueError(f"--kv-transport cuda_ipc needs every node on a GPU, not {', '.join(off_gpu)}: give "
                         "--prefill-device and --decode-device (or --device) as cuda:N")  # fmt: skip
    on_gpu = [f"{role} on {dev}" for role, dev in devices.items() if dev != "cpu"]
    if a.kv_transport == KvTransport.SHM and on_gpu:
        raise ValueError(f"--kv-transport shm is for CPU nodes, not {', '.join(on_gpu)}; use cuda_ipc on GPUs")


def plan(a: argparse.Namespace, tmp: Path) -> list[tuple[str, list[str], Path]]:
    """(role, argv, ready file) of every node to start. Nodes on the CPU are pinned to cores."""
    devices = role_devices(a)
    check_devices(a, devices)
    pin = {role: not a.no_pin and dev == "cpu" for role, dev in devices.items()}
    base = [sys.executable, "-m", "pdserve"]
    nodes = []
    if a.mode == "colocated":
        all_cores = f"0-{(os.cpu_count() or 1) - 1}"
        cores = (a.cpu_cores if a.cpu_cores is not None else all_cores) if pin[Role.COLOCATED] else ""
        nodes.append((Role.COLOCATED, [*base, Role.COLOCATED, *engine_argv(a), "--device", devices[Role.COLOCATED],
                                       "--cpu-cores", cores], tmp / "colocated0.json"))  # fmt: skip
        return nodes
    for i in range(a.num_prefill):
        cores = _cores(a.prefill_cores, i, pin[Role.PREFILL])
        argv = [*base, Role.PREFILL, *engine_argv(a), "--device", devices[Role.PREFILL], "--cpu-cores", cores]
        nodes.append((Role.PREFILL, argv, tmp / f"prefill{i}.json"))
    for i in range(a.num_decode):
        cores = _cores(a.decode_cores, a.num_prefill + i, pin[Role.DECODE])
        argv = [*base, Role.DECODE, *engine_argv(a), "--device", devices[Role.DECODE], "--cpu-cores", cores]
        nodes.append((Role.DECODE, argv, tmp / f"decode{i}.json"))
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


def router_env(a: argparse.Namespace) -> dict[str, str]:
    """The API key travels in the router's environment, not its argv (which `ps` shows everyone)."""
    env = os.environ.copy()
    if a.api_key:
        env["PDSERVE_API_KEY"] = a.api_key
    return env


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
            router = subprocess.Popen(router_command(a.model, infos, router_options(a)), env=router_env(a))
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
