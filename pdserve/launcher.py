"""`pdserve up`: the whole local stack as child processes, each started with its role's own command.

1. Start-up checks (pdserve/startup.py): the HTTP port is free, each device exists, the checkpoint is one
   pdserve can serve. A mistake ends it here, in one line, before any process starts.
2. A built-in checkpoint is written (once) before anything starts. The nodes and the router start together:
   each node's addresses are chosen here (free ports, `node_ports`), so the router connects to them at once and
   greets each node the moment it serves. Each node's ready file and the router's /health mark the stages, logged
   with their times; the URL is printed once /health answers with this launch's instance id (so another server on
   the port cannot pass for ours): the router answers only once every node is loaded, warmed up and joined.
3. Ctrl-C or SIGTERM: "stopping", then the router is stopped first (it drains its requests while the
   nodes still serve), then the nodes, each by PID. The children run in their own session, so a Ctrl-C
   in the terminal reaches the launcher alone and the order holds. A child that exits by itself while
   serving is a failure: it is named, the stack stopped, the exit code 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path

from pdserve.checkpoint import resolve_model
from pdserve.config import DEVICE, EngineConfig, NodeConfig, RouterConfig
from pdserve.flags import engine_argv, from_args, router_command, router_options
from pdserve.process import die_with_parent, unwind_once
from pdserve.startup import READY_TIMEOUT_S, check_checkpoint, check_device, check_port_free
from pdserve.wire.params import KvTransport, Role

log = logging.getLogger("pdserve.up")


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
        if not DEVICE.fullmatch(dev):
            raise ValueError(f"the {role} nodes' device must be 'cpu' or 'cuda:N', not {dev!r}")
    if a.mode == "colocated":
        return  # one process: no KV moves between nodes
    off_gpu = [f"{role} on {dev}" for role, dev in devices.items() if not dev.startswith("cuda")]
    if a.kv_transport == KvTransport.CUDA_IPC and off_gpu:
        raise ValueError(
            f"--kv-transport cuda_ipc needs every node on a GPU, not {', '.join(off_gpu)}: give "
            "--prefill-device and --decode-device (or --device) as cuda:N"
        )
    on_gpu = [f"{role} on {dev}" for role, dev in devices.items() if dev != "cpu"]
    if a.kv_transport == KvTransport.SHM and on_gpu:
        raise ValueError(f"--kv-transport shm is for CPU nodes, not {', '.join(on_gpu)}; use cuda_ipc on GPUs")


def plan(a: argparse.Namespace, tmp: Path) -> list[tuple[str, list[str], Path]]:
    """(role, argv, ready file) of every node to start, each with the addresses it will listen on (`--listen`, and a
    decode node's `--kv-listen`). Nodes on the CPU are pinned to cores."""
    devices = role_devices(a)
    check_devices(a, devices)
    pin = {role: not a.no_pin and dev == "cpu" for role, dev in devices.items()}
    base = [sys.executable, "-m", "pdserve", "--log-level", a.log_level]
    if a.mode == "colocated":
        all_cores = f"0-{(os.cpu_count() or 1) - 1}"
        cores = (a.cpu_cores if a.cpu_cores is not None else all_cores) if pin[Role.COLOCATED] else ""
        kinds = [(Role.COLOCATED, 0, cores)]
    else:
        kinds = [(Role.PREFILL, i, _cores(a.prefill_cores, i, pin[Role.PREFILL])) for i in range(a.num_prefill)]
        kinds += [
            (Role.DECODE, i, _cores(a.decode_cores, a.num_prefill + i, pin[Role.DECODE])) for i in range(a.num_decode)
        ]
    ports = iter(node_ports(len(kinds) + sum(role == Role.DECODE for role, _, _ in kinds)))
    nodes = []
    for role, i, cores in kinds:
        argv = [*base, role, *engine_argv(a), "--device", devices[role], "--cpu-cores", cores]
        argv += ["--listen", f"tcp://127.0.0.1:{next(ports)}"]
        argv += ["--kv-listen", f"tcp://127.0.0.1:{next(ports)}"] if role == Role.DECODE else []
        nodes.append((role, argv, tmp / f"{role}{i}.json"))
    return nodes


def node_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports of 127.0.0.1 for the nodes to listen on, drawn below the range the kernel hands
    out for outgoing connections and port 0 (so that none of those takes one before its node binds it)."""
    low = _ephemeral_low()
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(max(1024, low // 3), low)
        if port not in ports and _bindable(port):
            ports.append(port)
    return ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def planned_infos(nodes: list[tuple[str, list[str], Path]]) -> list[dict]:
    """What each node's ready file will say of its addresses, from its command line: the router's node list."""
    infos = []
    for role, argv, _ in nodes:
        info = {"role": role, "listen": argv[argv.index("--listen") + 1]}
        if "--kv-listen" in argv:
            info["kv_listen"] = argv[argv.index("--kv-listen") + 1]
        infos.append(info)
    return infos


def wait_stack(url: str, procs: list[subprocess.Popen], files: list[Path], instance_id: str, started: float) -> None:
    """Until the router started last in `procs` answers /health with `instance_id` (it does once every node has
    answered it): each node's ready file, as it appears, logged with its time since `started`; a child that exits
    meanwhile ends the wait (RuntimeError)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen: set[Path] = set()
    while time.monotonic() < deadline:
        _check_alive(procs)
        for f in [f for f in files if f not in seen and f.exists()]:
            seen.add(f)
            role = json.loads(f.read_text())["role"]
            log.info("the %s node is ready, %.1f s after launch", role, time.monotonic() - started)
        if _health_instance(url) == instance_id:
            return
        time.sleep(0.05)
    raise RuntimeError("the stack did not become ready in time")


def _check_alive(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is not None:
            what = "the router" if p is procs[-1] else "a node"
            raise RuntimeError(f"{what} exited during start-up (pid {p.pid}, code {p.returncode})")


def _wait_http(url: str, proc: subprocess.Popen, instance_id: str) -> None:
    """Until the router started as `proc` answers /health: a server answering with another instance id is not it."""
    wait_stack(url, [proc], [], instance_id, time.monotonic())


def _health_instance(url: str) -> str | None:
    """The instance id that the server at `url` reports on /health (None: no answer, or not a pdserve router)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return json.loads(r.read()).get("instance")
    except (OSError, ValueError, AttributeError):
        return None


def start_child(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child in a session of its own: a terminal's Ctrl-C reaches only the launcher, which stops them in order;
    and, on Linux, one that gets SIGTERM if the launcher dies without stopping it (SIGKILL)."""
    return subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent)


def router_argv(a: argparse.Namespace, infos: list[dict], instance_id: str) -> list[str]:
    """The router of the stack: started with its nodes, it waits for them as long as the launcher does."""
    options = [*router_options(a), "--instance-id", instance_id, "--connect-timeout-s", str(READY_TIMEOUT_S)]
    return router_command(a.model, infos, options, a.log_level)


def preflight(a: argparse.Namespace) -> None:
    """Every start-up check of the stack `a` describes (ValueError: one line that says what to change)."""
    devices = role_devices(a)
    check_devices(a, devices)
    check_stack(a, devices)
    for device in set(devices.values()):
        check_device(device, a.engine)


def check_stack(a: argparse.Namespace, devices: dict[str, str]) -> None:
    """The checks that hold wherever the nodes run (this host, or a Ray cluster's): the configs, the router's port
    and the checkpoint (the router reads its tokenizer here)."""
    check_configs(a, devices)
    check_port_free(a.host, a.port)
    check_checkpoint(a.model, tokenizer=not a.skip_tokenizer)


def check_configs(a: argparse.Namespace, devices: dict[str, str]) -> None:
    """The configs the nodes and the router will build from the flags `up` passes on: refused here, once, rather
    than by each child."""
    for role, device in devices.items():
        from_args(NodeConfig, a, role=role, engine=from_args(EngineConfig, a, device=device, cpu_cores=()))
    from_args(RouterConfig, a, colocated=("tcp://127.0.0.1:0",))  # its nodes' addresses are not known yet


def stop_all(procs: list[subprocess.Popen], drain_s: float = 0.0, owners: Sequence[subprocess.Popen] = ()) -> None:
    """SIGTERM every child, the router (started last) first: it drains its requests while the nodes still serve.
    `owners` (the prefill nodes, whose KV pools decode nodes may map) are stopped once the others have exited: a
    pool's owner that exits while another process still maps it leaves that mapping dangling (over cuda_ipc torch
    warns that the producer exited before the tensors it shared were released). Each of the two groups is given
    `drain_s` + 10 s before it is killed."""
    rest = [p for p in procs if p not in owners]
    for group in (rest, [p for p in procs if p in owners]):
        for p in reversed(group):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                if p is procs[-1]:
                    _wait(p, drain_s + 5)
        deadline = time.monotonic() + drain_s + 10
        for p in group:
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
    preflight(a)
    procs: list[subprocess.Popen] = []
    roles: dict[int, str] = {}  # pid -> what it runs, for messages
    owners: list[subprocess.Popen] = []  # the prefill nodes: their KV pools' owners stop last

    # the first SIGTERM or SIGINT (even where the shell that started us ignores it: a background job) stops the stack
    stopping = unwind_once(signal.SIGTERM, signal.SIGINT)
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as tmp:
        try:
            started = time.monotonic()
            resolve_model(a.model)  # a built-in is written once, here, not by every child at once
            nodes = plan(a, Path(tmp))
            for role, argv, ready in nodes:
                procs.append(start_child([*argv, "--ready-file", str(ready)]))
                roles[procs[-1].pid] = f"the {role} node"
                if role == Role.PREFILL:
                    owners.append(procs[-1])
            instance_id = uuid.uuid4().hex
            procs.append(start_child(router_argv(a, planned_infos(nodes), instance_id), env=router_env(a)))
            roles[procs[-1].pid] = "the router"
            log.info("started %d node(s) and the router beside them", len(nodes))
            url = f"http://{a.host}:{a.port}"
            wait_stack(url, procs, [r for _, _, r in nodes], instance_id, started)
            log.info(
                "ready %.1f s after launch: every node loaded and warmed up, the router joined them",
                time.monotonic() - started,
            )
            print(f"pdserve is serving {a.model} ({a.mode}) at {url}/v1", flush=True)
            while all(p.poll() is None for p in procs):
                time.sleep(0.5)
            gone = next(p for p in procs if p.poll() is not None)
            print(
                f"pdserve: {roles[gone.pid]} (pid {gone.pid}) exited with code {gone.returncode}; stopping the stack",
                file=sys.stderr,
                flush=True,
            )
            return 1
        except KeyboardInterrupt:
            print("pdserve: stopping (the router first, then the nodes)", file=sys.stderr, flush=True)
            return 0
        except RuntimeError as e:
            print(f"pdserve: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            stopping.append(True)  # from here on, every signal is ignored
            stop_all(procs, a.drain_timeout_s, owners)
