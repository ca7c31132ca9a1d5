"""Node sockets against strangers: CurveZMQ keeps them out; garbage on any port leaves every node serving."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.auth

from bench.systems import node_counters
from pdserve.config import KEY_FILES
from pdserve.wire.codec import encode
from pdserve.wire.messages import PROTOCOL_VERSION, Abort, Generate, Hello, KvHello
from pdserve.wire.params import SamplingParams
from tests.helpers import probe_answers, wait_until
from tests.stack import Stack

PROBE_WAIT_MS = 2000  # how long a stranger listens for an answer (a negative result needs some wait)
COMPLETION = {"model": "tiny", "prompt": "still serving", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("keys") / "stack"
    subprocess.run([sys.executable, "-m", "pdserve", "keys", str(folder)], check=True, capture_output=True)
    return folder


def _node_ports(stack: Stack) -> dict[str, str]:
    ports = {f"{n}.listen": i["listen"] for n, i in stack.infos.items()}
    ports.update({f"{n}.kv_listen": i["kv_listen"] for n, i in stack.infos.items() if "kv_listen" in i})
    return ports


def _node_counter(stack: Stack, name: str, role: str) -> int:
    return int(node_counters(httpx.get(stack.url + "/metrics", timeout=10).text).get(role, {}).get(name, 0))


def _probes(addrs: list[str], curve: tuple[bytes, bytes, bytes] | None, messages: list[list[bytes]]) -> list[str]:
    return probe_answers(addrs, curve, messages, PROBE_WAIT_MS)


def _keyed_stack(tmp_path: Path, keys: Path) -> Stack:
    flag = ("--zmq-keys", str(keys))
    return Stack(tmp_path, "tiny", mode="disagg", engine_args=flag, router_args=flag).start()


def test_pdserve_keys_writes_private_key_files(keys):
    assert all((keys / f).exists() for f in KEY_FILES)
    for secret in ("server.key_secret", "client.key_secret"):
        assert (keys / secret).stat().st_mode & 0o077 == 0, f"{secret} is readable by others"
    assert subprocess.run([sys.executable, "-m", "pdserve", "keys", str(keys)], capture_output=True).returncode == 2


def test_strangers_without_the_key_get_nothing_through(tmp_path, keys):
    stack = _keyed_stack(tmp_path, keys)
    try:
        assert httpx.post(stack.url + "/v1/completions", json=COMPLETION, timeout=60).status_code == 200
        server_public, _ = zmq.auth.load_certificate(keys / "server.key")
        client_public, client_secret = zmq.auth.load_certificate(keys / "client.key_secret")
        stranger_public, stranger_secret = zmq.curve_keypair()
        wrong_server, _ = zmq.curve_keypair()
        hello = [encode(Hello(PROTOCOL_VERSION, "router"))]
        generate = [encode(Generate("stranger-1", [1, 2, 3], SamplingParams(), "tcp://127.0.0.1:1"))]
        kv_hello = [encode(KvHello(PROTOCOL_VERSION, {}, "zmq"))]
        messages = [hello, generate, kv_hello]
        addrs = list(_node_ports(stack).values())
        # counters come with the nodes' periodic stats: wait for the first request's
        assert wait_until(lambda: _node_counter(stack, "requests", "prefill") >= 1, 60), "no request was counted"
        requests_before = _node_counter(stack, "requests", "prefill")
        for curve in (
            None,
            (stranger_public, stranger_secret, server_public),
            (client_public, client_secret, wrong_server),
        ):
            assert _probes(addrs, curve, messages) == [], "a stranger got an answer"
        # the probe itself works: with the stack's own client key, the decode node answers a KvHello
        kv_addr = stack.infos["decode0"]["kv_listen"]
        assert _probes([kv_addr], (client_public, client_secret, server_public), [kv_hello]) == [kv_addr]
        r = httpx.post(stack.url + "/v1/completions", json=COMPLETION, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # counters come with the nodes' periodic stats: wait until one counts our request (and, sent earlier,
        # any stranger's Generate that ran)
        assert wait_until(lambda: _node_counter(stack, "requests", "prefill") >= requests_before + 1, 60)
        assert _node_counter(stack, "requests", "prefill") == requests_before + 1, "a stranger's Generate ran"
    finally:
        stack.close()


def _real_layout() -> dict:
    from pdserve.checkpoint import resolve_model
    from pdserve.runner.model import kv_layout, load_model

    return kv_layout(load_model(resolve_model("tiny"), "float32", "cpu"), 16, "float32").to_dict()


def _garbage(layout: dict) -> list[list[bytes]]:
    truncated = encode(Generate("g-1", list(range(50)), SamplingParams(), "tcp://127.0.0.1:1"))[:-7]
    hostile_pairing = KvHello(PROTOCOL_VERSION, layout, "shm", {"name": "../../etc/passwd"})
    return [
        [pickle.dumps({"t": "Hello", "protocol_version": PROTOCOL_VERSION})],
        [os.urandom(512)],
        [truncated],
        [encode(Abort("x"))] + [b"x"] * 4999,
        [encode(hostile_pairing)],  # a well-formed pairing whose pool handle is nonsense
        [b""],
    ]


def test_garbage_on_every_node_port_leaves_every_node_serving(tmp_path):
    stack = Stack(tmp_path, "tiny", mode="disagg", transport="shm").start()
    try:
        _probes(list(_node_ports(stack).values()), None, _garbage(_real_layout()))
        for name, proc in stack.procs.items():
            assert proc.poll() is None, f"{name} died"
        for _ in range(3):
            r = httpx.post(stack.url + "/v1/completions", json=COMPLETION, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert httpx.get(stack.url + "/health", timeout=10).json()["status"] == "ok"
    finally:
        stack.close()
