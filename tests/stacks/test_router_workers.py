"""Two router workers (--router-workers 2) over mock nodes behave as one router does: a decode node killed under
streams of both workers (each dispatches its own again), a draining decode node (it waits for both workers' streams),
the API key and the request limits (every worker applies them). One stack of mock nodes serves the module; nothing
here is timed: the decode nodes' modelled step only keeps streams running while the tests act on them."""

from __future__ import annotations

import json
import signal
import socket

import httpx
import pytest

from pdserve.checkpoint import resolve_model
from tests.helpers import Stream, each_worker_health, wait_until
from tests.stack import Stack
from tests.stacks.test_mock_scale import MOCK, exact

KEY = "test-key"
DECODE_STEP = ("--mock-step-s", "0.01,0,0")
STREAMS = 8  # each on a new connection, so on both workers


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    resolve_model("tiny")  # the router's tokenizer, written with torch here so that the router needs none
    s = Stack(
        tmp_path_factory.mktemp("workers"),
        "tiny",
        mode="disagg",
        num_prefill=1,
        num_decode=3,
        engine_args=MOCK,
        decode_args=DECODE_STEP,
        router_args=("--router-workers", "2", "--max-request-bytes", "4096"),
        api_key=KEY,
    ).start()
    yield s
    s.close()


def _workers(stack: Stack) -> dict[int, dict]:
    return each_worker_health(stack.url, 60)


def _on_node(workers: dict[int, dict], addr: str) -> dict[int, int]:
    """Requests each worker has on the node at `addr`."""
    return {w: next(n["in_flight"] for n in h["nodes"] if n["addr"] == addr) for w, h in workers.items()}


def _start(stack: Stack, first: int, max_tokens: int) -> list[Stream]:
    """Streams (each on a new connection) until each worker has two: each worker puts its two on two decode nodes
    (the least loaded by its own count), so with three decode nodes one has streams of both."""
    streams: list[Stream] = []
    while len(streams) < 4 * STREAMS and not all(h["in_flight"] >= 2 for h in _workers(stack).values()):
        batch = [
            Stream(
                stack.url,
                {"model": "tiny", "prompt": [first + len(streams) + i, 11, 13 + i] * 4, "max_tokens": max_tokens},
                stack.headers,
            )
            for i in range(STREAMS)
        ]
        for s in batch:
            s.start()
        for s in batch:
            assert s.first.wait(60) and not s.error, s.error
        streams += batch
    return streams


def _busiest_decode_node(stack: Stack) -> tuple[str, dict[int, int]]:
    """The decode node with streams of both workers on it, the most of them: its name, and each worker's count."""
    workers = _workers(stack)
    counts = {
        info["listen"]: _on_node(workers, info["listen"])
        for name, info in stack.infos.items()
        if name.startswith("decode")
    }
    addr = max((a for a, c in counts.items() if all(c.values())), key=lambda a: sum(counts[a].values()))
    return next(n for n, info in stack.infos.items() if info["listen"] == addr), counts[addr]


def _counter(stack: Stack, name: str) -> float:
    text = httpx.get(stack.url + "/metrics", headers=stack.headers, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _response(f) -> tuple[int, bytes]:
    """One HTTP/1.1 response read from the connection's file `f`: status and body (by its Content-Length)."""
    status = int(f.readline().split()[1])
    headers = dict(line.decode().lower().split(":", 1) for line in iter(f.readline, b"\r\n"))
    return status, f.read(int(headers.get("content-length", "0")))


def _refusals(url: str) -> tuple[int, list[int]]:
    """Over one connection, so from one worker: its number (/health), then the status of a request without the key,
    of one with a bad field, and of one whose body is too long (said by its Content-Length: refused unread)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": -1}).encode()
    heads = [b"", f"Authorization: Bearer {KEY}\r\n".encode()]
    with socket.create_connection((host, int(port)), timeout=60) as sock, sock.makefile("rb") as f:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        worker = json.loads(_response(f)[1])["worker"]
        statuses = []
        for auth, length in ((heads[0], len(body)), (heads[1], len(body)), (heads[1], 100_000)):
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + auth
                + f"Content-Length: {length}\r\n\r\n".encode()
                + (body if length == len(body) else b"")
            )
            statuses.append(_response(f)[0])
    return worker, statuses


def test_every_worker_asks_for_the_api_key_and_applies_the_limits(stack):
    seen: dict[int, list[int]] = {}

    def both() -> bool:
        worker, statuses = _refusals(stack.url)
        seen[worker] = statuses
        return len(seen) == 2

    assert wait_until(both, 60, interval=0.01), f"only workers {sorted(seen)} were asked"
    assert seen == {0: [401, 400, 413], 1: [401, 400, 413]}


def test_a_decode_node_killed_under_both_workers_streams_loses_no_token(stack):
    before = _counter(stack, "pdserve:requests_redispatched_total")
    streams = _start(stack, 7, 600)
    name, counts = _busiest_decode_node(stack)
    stack.kill(name)
    for s in streams:
        s.join(60)
    assert all(exact(s) for s in streams), [(len(s.token_ids), s.error) for s in streams]
    moved = sum(counts.values())  # every stream on the node, each dispatched again by its own worker
    assert wait_until(lambda: _counter(stack, "pdserve:requests_redispatched_total") == before + moved, 30)
    addr = stack.infos[name]["listen"]
    assert wait_until(lambda: not any(_on_node(_workers(stack), addr).values()), 30)


def test_a_draining_decode_node_finishes_both_workers_streams_and_leaves(stack):
    before = _counter(stack, "pdserve:requests_redispatched_total")
    streams = _start(stack, 60, 400)
    name, _ = _busiest_decode_node(stack)
    stack.procs[name].send_signal(signal.SIGTERM)
    for s in streams:
        s.join(60)
    assert all(exact(s) for s in streams), [(len(s.token_ids), s.error) for s in streams]
    assert _counter(stack, "pdserve:requests_redispatched_total") == before, "they finished where they were"
    assert stack.procs[name].wait(timeout=60) == 0, "the node left once both workers' streams had ended"
    after = _start(stack, 90, 20)  # the node left: both workers send new requests to the others
    for s in after:
        s.join(60)
    assert all(exact(s) for s in after), [s.error for s in after]
