"""`pdserve up --ray` on a Ray cluster of simulated hosts (ray.cluster_utils.Cluster) on this machine.

The head holds no CPUs, so every node lands on one of the two simulated hosts, each labelled by a custom
resource. First a controller alone places two nodes with `--placement pack`; then one deployment, with CurveZMQ
keys, serves the rest of the module; its tests run in order: spread placement, greedy output, strangers kept
out, scaling decode from 1 to 2 while serving, a decode actor killed and restarted by Ray, then scaling decode
from 2 to 1 while serving (the removed node drains). Last, a second deployment beside it (on the two CPUs the
first leaves free) with two router workers, each of which finds the nodes through Ray.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zmq
import zmq.auth

from bench.systems import node_counters_per_node
from pdserve.checkpoint import resolve_model
from pdserve.cli import build_parser
from pdserve.wire.codec import encode
from pdserve.wire.messages import PROTOCOL_VERSION, Hello, KvHello
from tests.helpers import each_worker_health, hf_greedy, mixed_workload, optional, probe_answers, wait_until
from tests.stack import free_port

ray = optional("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from pdserve.ray_cluster import start_controller  # noqa: E402
from pdserve.router.membership import RAY_NAMESPACE, controller_name  # noqa: E402

DEPLOYMENT = "t"
HOSTS = ("sim_host_a", "sim_host_b")
START_TIMEOUT_S = 240
PROBE_WAIT_MS = 2000


@pytest.fixture(scope="module")
def cluster():
    # Ray starts its workers, and so the nodes' actors, at nice 15 unless told otherwise: on a host that other work
    # keeps busy (the load runs of the tests) they then got a few percent of a core. docs/deployment.md says so.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")  # read by each raylet this process starts
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        try:
            for host in HOSTS:
                c.add_node(num_cpus=2, resources={host: 1})
            c.wait_for_nodes()
            ray.init(address=c.address, namespace=RAY_NAMESPACE, logging_level="WARNING", log_to_driver=False)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys") / "deployment"
    subprocess.run([sys.executable, "-m", "pdserve", "keys", str(folder)], check=True, capture_output=True)
    return folder


@pytest.fixture(scope="module")
def deployment(cluster, keys):
    """`pdserve up --ray` as a user runs it; stopped by PID (SIGTERM) at the end."""
    with _up_ray(cluster, DEPLOYMENT, "--kv-transport", "auto", "--zmq-keys", str(keys)) as url:
        yield url


@contextlib.contextmanager
def _up_ray(cluster, name: str, *extra: str):
    """`pdserve up --ray --name NAME` (1P1D, spread) until the block ends; stopped by PID (SIGTERM)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "--log-level",
        "WARNING",
        "up",
        "--ray",
        cluster.address,
        "--name",
        name,
        "--model",
        "tiny",
        "--port",
        str(port),
        "--placement",
        "spread",
        "--ray-bind-host",
        "127.0.0.1",
        "--num-kv-blocks",
        "256",
        *extra,
    ]
    proc = subprocess.Popen(argv, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: proc.poll() is not None or _healthy(url), START_TIMEOUT_S)
        assert proc.poll() is None, f"pdserve up --ray exited with {proc.returncode}"
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


FOUR, LONG = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], 1800  # ~1.5 s of decoding, two a node


@functools.cache
def _four_ref() -> list[list[int]]:
    return hf_greedy(resolve_model("tiny"), FOUR, [LONG] * len(FOUR))


def _wait(done, timeout: float, interval: float = 0.2) -> None:
    if not wait_until(done, timeout, interval):
        raise TimeoutError("condition not reached")


def _controller(name: str = DEPLOYMENT):
    return ray.get_actor(controller_name(name), namespace=RAY_NAMESPACE)


def _nodes(url: str, role: str) -> list[dict]:
    return [n for n in httpx.get(url + "/health", timeout=10).json()["nodes"] if n["role"] == role]


def _complete_batch(url: str, prompts: list[list[int]], n: int) -> tuple[int, list[list[int]]]:
    """One completion request of every prompt (the router dispatches them together); each choice's tokens."""
    body = {
        "model": "tiny",
        "prompt": prompts,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=180)
    if r.status_code != 200:
        return r.status_code, []
    return 200, [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _complete(url: str, prompt: list[int], n: int) -> tuple[int, list[int]]:
    code, choices = _complete_batch(url, [prompt], n)
    return code, choices[0] if choices else []


@pytest.fixture(scope="module")
def workload():
    prompts, outs = mixed_workload(8, 512, seed=5, max_prompt=120, max_out=40)
    return prompts, outs, hf_greedy(resolve_model("tiny"), prompts, outs)


def _host_of() -> dict[str, str]:
    """Ray node id -> the simulated host's label."""
    return {n["NodeID"]: next((h for h in HOSTS if h in n["Resources"]), "head") for n in ray.nodes()}


def test_a_placement_the_cluster_cannot_hold_is_refused_in_one_line(cluster):
    """Three nodes of 2 CPUs on two hosts of 2 CPUs: said at once (what was asked, what the cluster has), exit 2."""
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--ray",
        cluster.address,
        "--name",
        "too-big",
        "--model",
        "tiny",
        "--num-prefill",
        "2",
        "--num-decode",
        "1",
        "--ray-node-cpus",
        "2",
        "--port",
        str(free_port()),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy(), timeout=START_TIMEOUT_S)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "serving" not in out.stdout, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("pdserve: error: the Ray cluster cannot place 3 nodes of 2 CPU each"), line
    assert "6 CPU in all" in line and "the cluster has 4 CPU on 3 host(s), at most 2 CPU on one" in line, line
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    ), "the placement group was left behind"


def test_pack_places_a_prefill_and_a_decode_node_on_one_host(cluster):
    """A controller of its own (the deployment below comes after it): both nodes on one simulated host."""
    a = build_parser().parse_args(
        [
            "up",
            "--ray",
            cluster.address,
            "--name",
            "packed",
            "--model",
            "tiny",
            "--placement",
            "pack",
            "--ray-bind-host",
            "127.0.0.1",
            "--num-kv-blocks",
            "64",
            "--drain-timeout-s",
            "5",
        ]
    )
    controller = start_controller(a)
    try:
        assert ray.get(controller.scale.remote(1, 1), timeout=START_TIMEOUT_S) == {"prefill": 1, "decode": 1}
        members = ray.get(controller.members.remote())
        where = {m["role"]: _host_of()[m["ray_node_id"]] for m in members}
        assert sorted(where) == ["decode", "prefill"], members
        assert len(set(where.values())) == 1 and set(where.values()) <= set(HOSTS), f"pack put them on {where}"
    finally:
        ray.get(controller.stop.remote(), timeout=60)  # drains (idle: at once), frees the placement group
        ray.kill(controller)
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    ), "the controller left a placement group behind"


def test_spread_places_prefill_and_decode_on_different_hosts(cluster, deployment):
    members = ray.get(_controller().members.remote())
    where = {m["role"]: _host_of()[m["ray_node_id"]] for m in members}
    assert sorted(where) == ["decode", "prefill"], members
    assert set(where.values()) == set(HOSTS), f"spread placement put the nodes on {where}"


def test_greedy_output_over_the_cluster_equals_transformers(deployment, workload):
    prompts, outs, ref = workload
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda i: _complete(deployment, prompts[i], outs[i]), range(len(prompts))))
    assert [code for code, _ in got] == [200] * len(prompts)
    mismatched = [i for i, (_, ids) in enumerate(got) if ids != ref[i]]
    assert not mismatched, f"requests {mismatched} differ from transformers"


def test_strangers_without_the_deployments_keys_get_nothing_from_its_nodes(deployment, keys):
    members = ray.get(_controller().members.remote())
    addrs = [m["listen"] for m in members] + [m["kv_listen"] for m in members if m["kv_listen"]]
    hello = [encode(Hello(PROTOCOL_VERSION, "router"))]
    kv_hello = [encode(KvHello(PROTOCOL_VERSION, {}, "zmq"))]
    server_public, _ = zmq.auth.load_certificate(keys / "server.key")
    stranger = (*zmq.curve_keypair(), server_public)
    for curve in (None, stranger):
        assert probe_answers(addrs, curve, [hello, kv_hello], PROBE_WAIT_MS) == [], "a stranger got an answer"
    # the probe itself works: with the deployment's client key, the decode node answers a KvHello
    client_public, client_secret = zmq.auth.load_certificate(keys / "client.key_secret")
    [kv_addr] = [m["kv_listen"] for m in members if m["kv_listen"]]
    assert probe_answers([kv_addr], (client_public, client_secret, server_public), [kv_hello], 30_000) == [kv_addr]


def test_scaling_decode_up_while_serving_loses_nothing(cluster, deployment, workload):
    prompts, outs, _ = workload
    long_out = [n + 600 for n in outs]  # running when the scale-up is asked for
    ref_long = hf_greedy(resolve_model("tiny"), prompts, long_out)
    with ThreadPoolExecutor(2 * len(prompts)) as pool:  # the late requests run beside the long ones
        futures = [pool.submit(_complete, deployment, p, n) for p, n in zip(prompts, long_out, strict=True)]
        _wait(lambda: sum(n["in_flight"] for n in _nodes(deployment, "decode")) > 0, 60, 0.01)
        scale = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve",
                "--log-level",
                "WARNING",
                "scale",
                "--ray",
                cluster.address,
                "--name",
                DEPLOYMENT,
                "--decode",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
        assert scale.returncode == 0, scale.stderr
        assert "1 prefill and 2 decode nodes" in scale.stdout
        _wait(lambda: sum(n["up"] for n in _nodes(deployment, "decode")) == 2, 60)
        # one batch request: the router dispatches its prompts together, so the new node gets some of them whatever
        # the long ones' progress (sent one by one after those ended, on a fast host, every prompt went to the node
        # whose prefix cache holds it, and the new node received no KV)
        late = pool.submit(_complete_batch, deployment, prompts, max(outs))
        got = [f.result() for f in futures]
        code, got_late = late.result()
    assert [ids for _, ids in got] == ref_long, "a request running across the scale-up lost or changed tokens"
    assert code == 200 and got_late == [r[: max(outs)] for r in ref_long]  # greedy: a prefix of the longer answer
    received = lambda: _node_counter(deployment, "kv_received", "decode")  # noqa: E731
    _wait(lambda: len(received()) == 2 and all(received().values()), 10)  # stats arrive every 0.5 s
    # --kv-transport auto: a decode node on the prefill node's (simulated) host maps its pool, the other gets zmq
    members = ray.get(_controller().members.remote())
    [prefill] = [m["ray_node_id"] for m in members if m["role"] == "prefill"]
    same_host = sum(m["ray_node_id"] == prefill for m in members if m["role"] == "decode")

    def pairings():
        return {t: sum(_node_counter(deployment, f"kv_pairings_{t}", "prefill").values()) for t in ("shm", "zmq")}

    _wait(lambda: sum(pairings().values()) == 2, 10)
    assert pairings() == {"shm": same_host, "zmq": 2 - same_host}, (pairings(), members)
    # each node's busy time (whole loop iterations with work) holds its step time, both from one stats message
    _wait(lambda: all(_node_counters(deployment, "decode")["step_time_s"].values()), 10)
    counters = _node_counters(deployment, "decode")
    assert all(counters["busy_time_s"][n] >= t for n, t in counters["step_time_s"].items()), counters


def _node_counter(url: str, name: str, role: str) -> dict[str, float]:
    """A node counter per node of `role`, from /metrics."""
    return _node_counters(url, role).get(name, {})


def _node_counters(url: str, role: str) -> dict[str, dict[str, float]]:
    """Every node counter, per node of `role`, from one scrape of /metrics."""
    return node_counters_per_node(httpx.get(url + "/metrics", timeout=10).text, role)


def test_a_killed_decode_actors_requests_move_on_and_it_rejoins(deployment):
    """Killing a decode actor: the requests in flight on it are dispatched again to the surviving decode node
    (the router's node-loss handling) and every one completes with transformers' greedy tokens, as if nothing had
    happened; Ray's restart brings the node back."""
    ray.get(_controller().scale.remote(1, 2))  # no-op after the scaling test
    _wait(lambda: sum(n["up"] for n in _nodes(deployment, "decode")) == 2, 120)
    want = _four_ref()[0]  # FOUR[0]'s LONG greedy tokens
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_complete, deployment, FOUR[0], LONG) for _ in range(4)]
        _wait(lambda: sum(n["in_flight"] for n in _nodes(deployment, "decode")) == len(futures), 60, 0.02)
        in_flight = {n["addr"]: n["in_flight"] for n in _nodes(deployment, "decode")}
        victim = max(
            (m for m in ray.get(_controller().members.remote()) if m["role"] == "decode"),
            key=lambda m: in_flight[m["listen"]],
        )
        ray.kill(ray.get_actor(f"{DEPLOYMENT}-{victim['key']}", namespace=RAY_NAMESPACE), no_restart=False)
        results = [f.result(timeout=180) for f in futures]  # a thread's exception is raised here
    assert in_flight[victim["listen"]] > 0, "the victim held no request: the test proves nothing"
    assert [code for code, _ in results] == [200] * len(futures), (results, in_flight)
    # on a mismatch: each result's length and first token unlike transformers' (None: equal), and where each ran
    firsts = [next((i for i, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b), None) for _, ids in results]
    assert all(ids == want for _, ids in results), ([len(ids) for _, ids in results], firsts, in_flight, victim)
    # Ray restarts the actor; its new node registers and the router takes it in, in place of the dead one
    _wait(lambda: _rejoined(deployment, victim["listen"]), START_TIMEOUT_S)
    code, ids = _complete(deployment, [1, 2, 3], 4)
    assert code == 200 and len(ids) == 4


def _rejoined(url: str, dead_addr: str) -> bool:
    nodes = _nodes(url, "decode")
    return len(nodes) == 2 and all(n["up"] for n in nodes) and dead_addr not in {n["addr"] for n in nodes}


def test_scaling_decode_down_while_serving_drains_the_removed_node(cluster, deployment):
    """2 -> 1 decode nodes with requests running on both: the removed one finishes its own (no request fails
    or is dispatched again), then leaves; the one that stays serves on."""
    prompts, n = FOUR, LONG
    ref = _four_ref()
    redispatched = _router_counter(deployment, "pdserve:requests_redispatched_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_complete, deployment, p, n) for p in prompts]
        _wait(lambda: [n["in_flight"] for n in _nodes(deployment, "decode")] == [2, 2], 60, 0.02)
        newest = _newest_decode()
        seen, stop = [], threading.Event()  # the router's view of the removed node while it leaves
        watcher = threading.Thread(target=_watch, args=(deployment, newest["listen"], seen, stop))
        watcher.start()
        try:
            counts = ray.get(_controller().scale.remote(1, 1), timeout=START_TIMEOUT_S)
        finally:
            stop.set()
            watcher.join()
        assert counts == {"prefill": 1, "decode": 1}
        got = [f.result() for f in futures]
    assert any(n["draining"] and n["in_flight"] for n in seen), f"never seen draining with requests: {seen}"
    assert [ids for _, ids in got] == ref, "a request on the drained node lost or changed tokens"
    assert _router_counter(deployment, "pdserve:requests_redispatched_total") == redispatched
    assert newest["key"] not in {m["key"] for m in ray.get(_controller().members.remote())}
    _wait(lambda: [n["addr"] != newest["listen"] and n["up"] for n in _nodes(deployment, "decode")] == [True], 30)
    assert _complete(deployment, prompts[0], 4)[0] == 200


def test_a_draining_decode_node_that_dies_is_not_brought_back(cluster, deployment):
    """2 -> 1 decode nodes, and the removed node's actor is killed while it drains with requests (Ray may restart
    it): its requests are dispatched again and complete exactly, the scale call still ends with one decode node,
    and the removed node is not listed again."""
    prompts, n = FOUR, LONG
    ref = _four_ref()
    ray.get(_controller().scale.remote(1, 2), timeout=START_TIMEOUT_S)
    _wait(lambda: sum(n["up"] for n in _nodes(deployment, "decode")) == 2, START_TIMEOUT_S)
    redispatched = _router_counter(deployment, "pdserve:requests_redispatched_total")
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        futures = [pool.submit(_complete, deployment, p, n) for p in prompts]
        _wait(lambda: [n["in_flight"] for n in _nodes(deployment, "decode")] == [2, 2], 60, 0.02)
        newest = _newest_decode()
        scaled = pool.submit(lambda: ray.get(_controller().scale.remote(1, 1), timeout=START_TIMEOUT_S))
        seen: list[dict] = []  # the router's view of the removed node once it drains

        def draining() -> bool:
            seen[:] = [n for n in _nodes(deployment, "decode") if n["addr"] == newest["listen"] and n["draining"]]
            return bool(seen)

        _wait(draining, 30, 0.02)
        ray.kill(ray.get_actor(f"{DEPLOYMENT}-{newest['key']}", namespace=RAY_NAMESPACE), no_restart=False)
        assert seen[0]["in_flight"] > 0, "the node had drained before it was killed: the test proves nothing"
        assert scaled.result() == {"prefill": 1, "decode": 1}
        got = [f.result() for f in futures]
    assert [ids for _, ids in got] == ref, "a request of the node that died while draining was lost or changed"
    assert _router_counter(deployment, "pdserve:requests_redispatched_total") > redispatched
    members = [m for m in ray.get(_controller().members.remote()) if m["role"] == "decode"]
    assert newest["key"] not in {m["key"] for m in members} and len(members) == 1, members
    _wait(lambda: [n["addr"] != newest["listen"] and n["up"] for n in _nodes(deployment, "decode")] == [True], 30)
    assert _complete(deployment, prompts[0], 4)[0] == 200


def test_the_registry_keeps_a_node_scaled_away_from_coming_back():
    """The controller's registry in-process: a leaving node keeps its entry while its own process renews it, but a
    new process under its key (Ray restarted the actor) is not listed, and a restarted actor learns it is leaving."""
    from pdserve.ray_cluster import Controller

    ctl = Controller("registry", {}, {"CPU": 1}, "pack", 1)
    ctl.actors["decode-0"] = ctl.actors["decode-1"] = ("decode", None, None)
    entry = {"key": "decode-1", "role": "decode", "listen": "tcp://h:1", "kv_listen": "tcp://h:2", "pid": 10}
    ctl.renew({**entry, "key": "decode-0", "pid": 9})
    ctl.renew(entry)
    ctl.leaving["decode-1"] = ctl.actors.pop("decode-1")  # what scaling down does first
    ctl.renew(entry)  # the draining node, still renewing
    assert ctl.is_leaving("decode-1") and not ctl.is_leaving("decode-0")
    assert ctl.members() == [{**entry, "key": "decode-0", "pid": 9}, entry]
    ctl.renew({**entry, "listen": "tcp://h:3", "pid": 11})  # its process died and Ray restarted the actor
    assert ctl.members() == [{**entry, "key": "decode-0", "pid": 9}, entry]  # until it lapses, the old entry


def test_stopping_a_deployment_drains_the_decode_nodes_before_the_prefill_nodes(monkeypatch):
    """The controller in-process, its actors fakes that log their drain: the prefill nodes (the KV pools' owners)
    get SIGTERM only once every decode node has drained, and every actor is ended and its placement group removed."""
    from pdserve import ray_cluster
    from pdserve.ray_cluster import Controller

    log = []

    class Actor:
        def __init__(self, key):
            self.key = key
            self.drain = type("Remote", (), {"remote": lambda _, timeout: log.append(("drain", key)) or key})()

    monkeypatch.setattr(ray_cluster.ray, "get", lambda refs, timeout=None: [log.append(("drained", r)) for r in refs])
    monkeypatch.setattr(ray_cluster.ray, "kill", lambda actor, no_restart: log.append(("kill", actor.key)))
    monkeypatch.setattr(ray_cluster, "remove_placement_group", lambda pg: log.append(("remove", pg)))
    ctl = Controller("order", {"drain_timeout_s": 1.0}, {"CPU": 1}, "pack", 1)
    for key in ("prefill-0", "decode-1", "prefill-2", "decode-3"):
        ctl.actors[key] = (key.split("-")[0], Actor(key), "pg")
    ctl.stop()
    drained = [key for what, key in log if what == "drained"]
    assert sorted(drained[:2]) == ["decode-1", "decode-3"] and sorted(drained[2:]) == ["prefill-0", "prefill-2"]
    first_prefill = log.index(("drain", "prefill-0"))
    assert all(log.index(("kill", k)) < first_prefill for k in ("decode-1", "decode-3"))
    assert log[-1] == ("remove", "pg") and log.count(("remove", "pg")) == 1  # removed once its last node is gone
    assert not ctl.actors and not ctl.leaving


def test_two_router_workers_follow_the_ray_registry(cluster, deployment):
    """`pdserve up --ray --router-workers 2`, a second deployment beside the first: each worker reads the registry
    itself, so both list the nodes; both serve transformers' greedy tokens; the decode actor killed under requests
    of both workers: with no other decode node, each worker fails its own requests (none hangs), and once Ray has
    restarted the actor both workers take its new node in and serve again."""
    name = "t2"
    want = _four_ref()
    with _up_ray(cluster, name, "--router-workers", "2") as url:
        up = lambda h, role: [n["addr"] for n in h["nodes"] if n["role"] == role and n["up"]]  # noqa: E731
        _wait(lambda: all(up(h, "prefill") and up(h, "decode") for h in each_worker_health(url, 60).values()), 60)
        [decode] = [m for m in ray.get(_controller(name).members.remote()) if m["role"] == "decode"]
        assert {tuple(up(h, "decode")) for h in each_worker_health(url, 60).values()} == {(decode["listen"],)}
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_complete, url, FOUR[i % 4], LONG) for i in range(16)]  # 16 connections
            _wait(lambda: all(h["in_flight"] > 0 for h in each_worker_health(url, 60).values()), 60, 0.02)
            ray.kill(ray.get_actor(f"{name}-{decode['key']}", namespace=RAY_NAMESPACE), no_restart=False)
            results = [f.result(timeout=180) for f in futures]
        failed = [code for code, _ in results if code != 200]
        assert failed and set(failed) == {503}, [code for code, _ in results]  # the node died under them
        _wait(
            lambda: all(
                up(h, "decode") and decode["listen"] not in up(h, "decode")
                for h in each_worker_health(url, 60).values()
            ),
            START_TIMEOUT_S,
        )
        with ThreadPoolExecutor(8) as pool:
            again = list(pool.map(lambda i: _complete(url, FOUR[i % 4], LONG), range(8)))
        assert again == [(200, want[i % 4]) for i in range(8)]


def _newest_decode() -> dict:
    """The registry entry of the decode node scaling down removes (the newest: the highest serial in its key)."""
    members = [m for m in ray.get(_controller().members.remote()) if m["role"] == "decode"]
    return max(members, key=lambda m: int(m["key"].split("-")[1]))


def _watch(url: str, addr: str, seen: list[dict], stop: threading.Event) -> None:
    while not stop.wait(0.1):
        seen += [n for n in _nodes(url, "decode") if n["addr"] == addr]


def _router_counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"the router has no metric {name}")
