"""`pdserve up --ray`: prefill and decode nodes placed on a Ray cluster as actors, found by the router.

What runs where:
1. The launcher (`pdserve up --ray [ADDRESS]`) is a Ray driver. It connects to the cluster (or starts
   a local one), starts the deployment's controller actor, asks it for the nodes, then runs the router
   on this host as a child process, as `pdserve up` does.
2. The controller (a named actor, `<name>-controller` in namespace "pdserve") places the nodes: each
   scale-up gets a placement group with one bundle per node (one GPU, or --ray-node-cpus CPUs),
   strategy PACK or SPREAD (`--placement`). It keeps the registry: key -> the node's addresses, renewed
   by the node every HEARTBEAT_S; an entry not renewed for ENTRY_TTL_S is no longer listed.
3. A node actor starts the very node process `pdserve prefill|decode` runs, bound to its host's cluster
   IP on free ports, reads the addresses from the node's ready file and registers them. When the node
   process exits, the actor exits too, and Ray restarts it (up to --max-restarts): the new node process
   registers under the same key with its new addresses. When the actor dies, its node process gets
   SIGTERM (parent-death signal).
4. The router (`pdserve router --ray ADDRESS`) reads the registry every second (router/membership.py):
   new nodes join, gone or replaced ones leave, their requests failed as a dead node's are.
5. `pdserve scale --ray ADDRESS --prefill N --decode M` changes the counts while serving: new nodes join
   once ready; removed ones (the newest of their role) drain: their node process gets SIGTERM (pdserve/nodes/base.py:
   it takes nothing new and finishes what it holds, the router dispatching elsewhere meanwhile) and stays
   listed until it exits, then its actor and placement group go. The call returns once both are done. A
   draining node that dies is not brought back: its requests are dispatched again as a dead node's, and if Ray
   restarts its actor, the actor starts no node and ends.
6. With --zmq-keys, every node and the router use the CurveZMQ keys in that folder (an absolute path, which
   must hold the same keys on every host): a process without them gets nothing from any node socket.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.flags import engine_argv, router_command, router_options
from pdserve.launcher import _wait_http, check_stack, router_env, start_child, stop_all
from pdserve.process import die_with_parent, unwind_once
from pdserve.router.membership import RAY_NAMESPACE, controller_name
from pdserve.startup import READY_TIMEOUT_S
from pdserve.wire.params import KvTransport, Role

log = logging.getLogger("pdserve.ray")
HEARTBEAT_S = 1.0
ENTRY_TTL_S = 10.0
FIT_CHECK_S = 2.0  # a placement group pending this long is checked against the cluster's resources
DRAIN_MARGIN_S = 15.0  # beyond the nodes' --drain-timeout-s: their wait for the router's answer, and exiting
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}


# ---- a node on a Ray worker ----------------------------------------------------------------------
def _wait_ready(proc: subprocess.Popen, ready: Path) -> dict:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the node process exited during start-up (code {proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError("the node process did not become ready in time")
        time.sleep(0.1)
    return json.loads(ready.read_text())


class NodeActor:
    """One prefill or decode node process on the host Ray placed this actor on."""

    def __init__(self, key: str, role: str, spec: dict) -> None:
        """spec: the node's flags (argv), log_level, bind_host ("": the host's cluster IP), threads (0: torch's
        default), drain_timeout_s and the deployment whose controller lists it."""
        self.controller = ray.get_actor(controller_name(spec["deployment"]), namespace=RAY_NAMESPACE)
        if ray.get(self.controller.is_leaving.remote(key)):  # Ray restarted a node scaled away: stay dead
            raise RuntimeError(f"node {key} was scaled away while Ray restarted it; not starting it again")
        host = spec["bind_host"] or ray.util.get_node_ip_address()
        ready = Path(tempfile.mkdtemp(prefix="pdserve-node-")) / "ready.json"
        addrs = ["--listen", f"tcp://{host}:0"] + (["--kv-listen", f"tcp://{host}:0"] if role == Role.DECODE else [])
        env = {**os.environ, **({"OMP_NUM_THREADS": str(spec["threads"])} if spec["threads"] else {})}
        ray_node_id = ray.get_runtime_context().get_node_id()  # one Ray node per host: it names the host
        cmd = [
            sys.executable,
            "-m",
            "pdserve",
            "--log-level",
            spec["log_level"],
            role,
            *spec["argv"],
            *addrs,
            "--ready-file",
            str(ready),
            "--host-id",
            f"ray:{ray_node_id}",
        ]
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
        node = _wait_ready(self.proc, ready)
        self.entry = {
            "key": key,
            "role": role,
            "listen": node["listen"],
            "kv_listen": node.get("kv_listen", ""),
            "pid": node["pid"],
            "ray_node_id": ray_node_id,
        }
        ray.get(self.controller.renew.remote(self.entry))  # listed before the caller learns we are ready
        self.leaving = False
        threading.Thread(target=self._keep_registered, daemon=True).start()

    def info(self) -> dict:
        return self.entry

    def drain(self, timeout_s: float) -> int | None:
        """SIGTERM the node process, which finishes what it holds and takes nothing new, and wait until it exits
        (killed after `timeout_s`); its exit code. It stays registered meanwhile: the router keeps its requests."""
        self.leaving = True
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def _keep_registered(self) -> None:
        while self.proc.poll() is None:
            self.controller.renew.remote(self.entry)
            time.sleep(HEARTBEAT_S)
        if not self.leaving:
            os._exit(1)  # the node process died: end this actor too, so that Ray restarts both


RemoteNode = ray.remote(NodeActor)


# ---- the controller: placement and registry ------------------------------------------------------
class Controller:
    """Places node actors and lists the live ones. Methods run on a small thread pool (max_concurrency)."""

    def __init__(self, deployment: str, node_spec: dict, bundle: dict, placement: str, max_restarts: int) -> None:
        self.deployment, self.node_spec, self.bundle = deployment, node_spec, bundle  # node_spec: see NodeActor
        self.placement, self.max_restarts = placement, max_restarts
        self.lock = threading.Lock()
        self.entries: dict[str, tuple[dict, float]] = {}  # key -> (entry, last renewal)
        self.actors: dict[str, tuple[str, object, object]] = {}  # key -> (role, actor, placement group)
        self.leaving: dict[str, tuple[str, object, object]] = {}  # scaled away, draining: still listed
        self.serial = 0

    def renew(self, entry: dict) -> None:
        """List a node's entry, or renew it: any node of the deployment's, but a leaving one only from the process
        it had (a node gone, or one Ray restarted under a key scaled away, may say hello once more: ignored)."""
        with self.lock:
            key, listed = entry["key"], self.entries.get(entry["key"], ({}, 0.0))[0]
            if key in self.actors or (key in self.leaving and listed.get("pid") == entry["pid"]):
                self.entries[key] = (entry, time.monotonic())

    def is_leaving(self, key: str) -> bool:
        with self.lock:
            return key in self.leaving

    def members(self) -> list[dict]:
        now = time.monotonic()
        with self.lock:
            return [e for e, t in self.entries.values() if now - t < ENTRY_TTL_S]

    def counts(self) -> dict[str, int]:
        with self.lock:
            roles = [role for role, _, _ in self.actors.values()]
        return {r: roles.count(r) for r in (Role.PREFILL, Role.DECODE)}

    def scale(self, num_prefill: int, num_decode: int) -> dict[str, int]:
        """Add or remove nodes until there are this many of each role; returns once the added ones serve and
        the removed ones (the newest of their role) have drained."""
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a deployment needs at least one prefill and one decode node")
        have = self.counts()
        wants = ((Role.PREFILL, num_prefill), (Role.DECODE, num_decode))
        self._drain([self._take_newest(role) for role, want in wants for _ in range(have[role] - want)])
        adds = [Role.PREFILL] * max(0, num_prefill - have[Role.PREFILL])
        adds += [Role.DECODE] * max(0, num_decode - have[Role.DECODE])
        if adds:
            self._add(adds)
        return self.counts()

    def _add(self, roles: list[str]) -> None:
        bundles = [dict(self.bundle)] * len(roles)
        pg = placement_group(bundles, strategy=STRATEGIES[self.placement])
        if not pg.wait(FIT_CHECK_S):  # pending: say so at once if the cluster could never hold it
            hosts = cluster_hosts()
            if hosts_for(self.bundle, hosts) < len(bundles):
                state = ray.util.placement_group_table(pg).get("state", "?")
                remove_placement_group(pg)
                raise ValueError(no_room(len(bundles), self.bundle, hosts, state))
        if not pg.wait(READY_TIMEOUT_S):
            remove_placement_group(pg)
            raise RuntimeError(f"the cluster has no room for {len(roles)} nodes of {self.bundle} each")
        actors = [self._start_actor(role, pg, i) for i, role in enumerate(roles)]
        ray.get([a.info.remote() for a in actors], timeout=READY_TIMEOUT_S)

    def _start_actor(self, role: str, pg, index: int):
        with self.lock:
            key, self.serial = f"{role}-{self.serial}", self.serial + 1
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        cpus, gpus = self.bundle.get("CPU", 0), self.bundle.get("GPU", 0)
        actor = RemoteNode.options(
            num_cpus=cpus,
            num_gpus=gpus,
            max_restarts=self.max_restarts,
            scheduling_strategy=strategy,
            name=f"{self.deployment}-{key}",
            namespace=RAY_NAMESPACE,
        ).remote(key, role, {**self.node_spec, "threads": 0 if gpus else int(cpus)})
        with self.lock:
            self.actors[key] = (role, actor, pg)
        return actor

    def stop(self) -> None:
        """Drain every node and end its actor (`pdserve up --ray` stopping): the decode nodes first, then the prefill
        nodes once those have exited, since a decode node maps the KV pools of the prefill nodes on its host (the
        launcher's order, `stop_all`)."""
        with self.lock:
            roles = {key: role for key, (role, _, _) in self.actors.items()}
            self.leaving.update(self.actors)
            self.actors.clear()
        self._drain([key for key, role in roles.items() if role != Role.PREFILL])
        self._drain([key for key, role in roles.items() if role == Role.PREFILL])

    def _take_newest(self, role: str) -> str:
        """Move the newest node of `role` from the deployment's count to the leaving ones; its key."""
        with self.lock:
            key = max((k for k, (r, _, _) in self.actors.items() if r == role), key=lambda k: int(k.split("-")[1]))
            self.leaving[key] = self.actors.pop(key)
        return key

    def _drain(self, keys: list[str]) -> None:
        """Drain the nodes of `keys` together (listed until their process exits), then end their actors."""
        if not keys:
            return
        timeout = self.node_spec["drain_timeout_s"] + DRAIN_MARGIN_S
        try:
            ray.get([self.leaving[k][1].drain.remote(timeout) for k in keys], timeout=timeout + DRAIN_MARGIN_S)
        except ray.exceptions.RayError as e:  # an actor that died meanwhile, or one stuck: end it all the same
            log.warning("draining %s: %s", keys, e)
        for key in keys:
            self._end(key)

    def _end(self, key: str) -> None:
        with self.lock:
            _, actor, pg = self.leaving.pop(key)
            self.entries.pop(key, None)
            pg_in_use = any(p is pg for _, _, p in [*self.actors.values(), *self.leaving.values()])
        ray.kill(actor, no_restart=True)
        if not pg_in_use:
            remove_placement_group(pg)


RemoteController = ray.remote(Controller)


def cluster_hosts() -> list[dict[str, float]]:
    """The resources (CPU, GPU, memory...) of each live host of the cluster, in all (used or not)."""
    return [n["Resources"] for n in ray.nodes() if n["Alive"]]


def hosts_for(bundle: dict, hosts: list[dict[str, float]]) -> int:
    """How many bundles like `bundle` the hosts could hold at most, each bundle on one host."""
    return sum(int(min(host.get(k, 0) // v for k, v in bundle.items() if v)) for host in hosts)


def no_room(count: int, bundle: dict, hosts: list[dict[str, float]], state: str) -> str:
    """One line: what was asked, what the cluster has, what to change."""
    each = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    asked = ", ".join(f"{v * count:g} {k}" for k, v in bundle.items())
    has = ", ".join(f"{sum(h.get(k, 0) for h in hosts):g} {k}" for k in bundle)
    most = ", ".join(f"{max(h.get(k, 0) for h in hosts):g} {k}" for k in bundle)
    return (
        f"the Ray cluster cannot place {count} nodes of {each} each (placement group {state}): they ask for "
        f"{asked} in all, one node's share on one host; the cluster has {has} on {len(hosts)} host(s), at most "
        f"{most} on one. Start "
        f"fewer nodes (--num-prefill, --num-decode), give each fewer CPUs (--ray-node-cpus), or add hosts"
    )


# ---- the launcher --------------------------------------------------------------------------------
def node_bundle(a: argparse.Namespace) -> dict:
    """What one node holds on its host: a GPU (and a CPU to drive it), or --ray-node-cpus CPUs."""
    if a.device.startswith("cuda"):
        return {"GPU": 1, "CPU": 1}
    return {"CPU": a.ray_node_cpus}


def node_device(a: argparse.Namespace) -> str:
    """A node's device on its host: the GPU Ray gives it is its cuda:0."""
    return "cuda:0" if a.device.startswith("cuda") else "cpu"


def node_spec(a: argparse.Namespace) -> dict:
    """How every node starts (see NodeActor): the engine's flags, and the device Ray gives it (its GPU is cuda:0)."""
    return {
        "argv": [*engine_argv(a), "--device", node_device(a)],
        "log_level": a.log_level,
        "bind_host": a.ray_bind_host,
        "drain_timeout_s": a.drain_timeout_s,
        "deployment": a.name,
    }


def check_args(a: argparse.Namespace) -> None:
    if a.mode != "disagg":
        raise ValueError("--ray places prefill and decode nodes: use --mode disagg")
    if a.num_prefill < 1 or a.num_decode < 1:
        raise ValueError("--ray needs --num-prefill and --num-decode of at least 1")
    if a.prefill_device or a.decode_device:
        raise ValueError("with --ray every node gets --device (cpu, or cuda: one GPU per node)")
    if a.ray_node_cpus < 1:
        raise ValueError("--ray-node-cpus must be at least 1")
    if a.kv_transport == KvTransport.CUDA_IPC and not a.device.startswith("cuda"):
        raise ValueError("--kv-transport cuda_ipc needs --device cuda")
    if a.kv_transport == KvTransport.SHM and a.device != "cpu":
        raise ValueError("--kv-transport shm is for CPU nodes")


def connect(address: str) -> None:
    """Join the cluster at `address` ('auto', 'host:port'), or start a local one ('local')."""
    ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)


def start_controller(a: argparse.Namespace):
    ctl = RemoteController.options(
        name=controller_name(a.name), namespace=RAY_NAMESPACE, max_concurrency=16, num_cpus=0
    )
    return ctl.remote(a.name, node_spec(a), node_bundle(a), a.placement, a.max_restarts)


def router_argv(a: argparse.Namespace, gcs_address: str, instance_id: str) -> list[str]:
    options = ["--ray", gcs_address, "--ray-deployment", a.name, *router_options(a), "--instance-id", instance_id]
    return router_command(a.model, [], options, a.log_level)


def with_absolute_paths(a: argparse.Namespace) -> argparse.Namespace:
    """`a` with its --zmq-keys folder absolute: node processes start in their Ray worker's folder."""
    return argparse.Namespace(**{**vars(a), "zmq_keys": os.path.abspath(a.zmq_keys) if a.zmq_keys else ""})


def get(ref):
    """ray.get, where a user's mistake the controller found (a ValueError) is raised as itself: one line, no trace."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise ValueError(str(e.cause)) from None
        raise


def stop_nodes(controller, timeout_s: float) -> None:
    """Drain the deployment's nodes (the router stopped first) and end their actors; give up after `timeout_s`."""
    try:
        ray.get(controller.stop.remote(), timeout=timeout_s)
    except ray.exceptions.RayError as e:
        log.warning("stopping the nodes: %s", e)


def launch_on_ray(a: argparse.Namespace) -> int:
    """`pdserve up --ray`: nodes on the cluster, the router here; stops everything on Ctrl-C / SIGTERM."""
    check_args(a)
    check_stack(a, {Role.PREFILL: node_device(a), Role.DECODE: node_device(a)})  # the devices: on the nodes' hosts
    a = with_absolute_paths(a)

    stopping = unwind_once(signal.SIGTERM, signal.SIGINT)
    procs: list[subprocess.Popen] = []
    controller = None
    try:
        connect(a.ray)
        controller = start_controller(a)
        counts = get(controller.scale.remote(a.num_prefill, a.num_decode))
        instance_id = uuid.uuid4().hex
        procs.append(start_child(router_argv(a, ray.get_runtime_context().gcs_address, instance_id), router_env(a)))
        url = f"http://{a.host}:{a.port}"
        _wait_http(url, procs[0], instance_id)
        print(
            f"pdserve is serving {a.model} at {url}/v1 with {counts['prefill']} prefill and {counts['decode']} "
            f"decode nodes on the Ray cluster (deployment {a.name!r})",
            flush=True,
        )
        while procs[0].poll() is None:
            time.sleep(0.5)
        print(f"pdserve: the router exited with code {procs[0].returncode}; stopping the deployment", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve: stopping (the router first, then the nodes)", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, ray.exceptions.RayError) as e:
        print(f"pdserve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stopping.append(True)  # from here on, every signal is ignored
        stop_all(procs, a.drain_timeout_s)
        if controller is not None:
            stop_nodes(controller, 2 * (a.drain_timeout_s + 2 * DRAIN_MARGIN_S))  # two groups, one after the other
        ray.shutdown()  # the controller, owned by this driver, goes with it (and its node actors, if any are left)


def scale(a: argparse.Namespace) -> int:
    """`pdserve scale --ray ADDRESS --prefill N --decode M`."""
    connect(a.ray)
    try:
        controller = ray.get_actor(controller_name(a.name), namespace=RAY_NAMESPACE)
    except ValueError:
        raise ValueError(f"no pdserve deployment {a.name!r} on the Ray cluster at {a.ray}") from None
    have = ray.get(controller.counts.remote())
    counts = get(controller.scale.remote(a.prefill or have[Role.PREFILL], a.decode or have[Role.DECODE]))
    print(f"pdserve deployment {a.name!r}: {counts['prefill']} prefill and {counts['decode']} decode nodes")
    ray.shutdown()
    return 0
