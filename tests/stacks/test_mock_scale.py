"""32 mock nodes (8 prefill, 24 decode) behind one router: membership, the least-loaded pick, a node killed
mid-stream, a node drained mid-stream, and aborts that free KV on every node. Nothing here is timed: the decode
nodes' modelled step (10 ms) only keeps streams running while the tests act on them."""

from __future__ import annotations

import signal

import httpx
import pytest

from pdserve.checkpoint import resolve_model
from pdserve.engine.mock import mock_tokens
from tests.helpers import Stream, start_streams, wait_until
from tests.stack import Stack

NUM_PREFILL, NUM_DECODE = 8, 24
MOCK = ("--engine", "mock", "--mock-step-s", "0.001,0,0", "--max-num-seqs", "64")
DECODE_STEP = ("--mock-step-s", "0.01,0,0")


def exact(s: Stream) -> bool:
    """The stream ended cleanly with the mock tokens of its prompt, every one."""
    return s.done and not s.error and s.token_ids == mock_tokens(s.body["prompt"], s.body["max_tokens"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    resolve_model("tiny")  # the router's tokenizer, written with torch here so that the router needs none
    s = Stack(
        tmp_path_factory.mktemp("mock32"),
        "tiny",
        mode="disagg",
        num_prefill=NUM_PREFILL,
        num_decode=NUM_DECODE,
        engine_args=MOCK,
        decode_args=DECODE_STEP,
    ).start()
    yield s
    s.close()


def _health(stack: Stack) -> dict:
    return httpx.get(stack.url + "/health", timeout=10).json()


def _in_flight(stack: Stack, role: str) -> dict[str, int]:
    return {n["addr"]: n["in_flight"] for n in _health(stack)["nodes"] if n["role"] == role and n["up"]}


def _name(stack: Stack, addr: str) -> str:
    return next(name for name, info in stack.infos.items() if info["listen"] == addr)


def _start(stack: Stack, n: int, max_tokens: int, first: int = 7) -> list[Stream]:
    """`n` streams of prompts that start with `first`, `first` + 1, ... (a prompt no node has seen has no cached
    prefix anywhere, so the router picks by load alone)."""
    prompts = [[first + i, 11, 13 + i] * (4 + i) for i in range(n)]
    return start_streams(stack.url, [{"model": "tiny", "prompt": p, "max_tokens": max_tokens} for p in prompts])


def _counter(stack: Stack, name: str) -> float:
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_32_mock_nodes_join_one_router_and_serve_exactly(stack):
    health = _health(stack)
    roles = [n["role"] for n in health["nodes"] if n["up"]]
    assert health["status"] == "ok" and (roles.count("prefill"), roles.count("decode")) == (NUM_PREFILL, NUM_DECODE)
    streams = _start(stack, 8, 30)
    for s in streams:
        s.join(60)
    assert all(exact(s) for s in streams), [(len(s.token_ids), s.error) for s in streams]


def test_the_router_gives_each_stream_the_least_loaded_decode_node_and_aborts_free_every_block(stack):
    streams = _start(stack, NUM_DECODE, 1500, first=100)  # each has its first token: all dispatched, none near its end
    try:
        assert sorted(_in_flight(stack, "decode").values()) == [1] * NUM_DECODE  # one each: none got two
    finally:
        for s in streams:
            s.hang_up()
    for s in streams:
        s.join(60)
    assert wait_until(lambda: _health(stack)["waiting"] == 0 and not any(_in_flight(stack, "decode").values()), 30)
    used = stack.wait_kv_free()
    assert len(used) == NUM_PREFILL + NUM_DECODE and not any(used.values()), used


def _stream_on_one_decode_node(stack: Stack, max_tokens: int) -> tuple[Stream, str]:
    """A stream under way (20 tokens in), alone on its decode node: that node's name in the stack."""
    (s,) = _start(stack, 1, max_tokens)
    assert wait_until(lambda: len(s.token_ids) >= 20, 30)
    (addr,) = [a for a, n in _in_flight(stack, "decode").items() if n]
    return s, _name(stack, addr)


def test_a_decode_node_killed_mid_stream_loses_no_token(stack):
    before = _counter(stack, "pdserve:requests_redispatched_total")
    s, name = _stream_on_one_decode_node(stack, 400)
    stack.kill(name)
    s.join(60)
    assert exact(s), (len(s.token_ids), s.error)
    assert _counter(stack, "pdserve:requests_redispatched_total") == before + 1
    assert wait_until(lambda: stack.infos[name]["listen"] not in _in_flight(stack, "decode"), 30)


def test_a_draining_decode_node_finishes_its_stream_and_leaves(stack):
    before = _counter(stack, "pdserve:requests_redispatched_total")
    s, name = _stream_on_one_decode_node(stack, 400)
    stack.procs[name].send_signal(signal.SIGTERM)
    s.join(60)
    assert exact(s), (len(s.token_ids), s.error)
    assert _counter(stack, "pdserve:requests_redispatched_total") == before  # it finished there
    assert stack.procs[name].wait(timeout=60) == 0
    addr = stack.infos[name]["listen"]
    assert wait_until(lambda: addr not in _in_flight(stack, "decode"), 30)
    after = _start(stack, 4, 30)  # the others take the new requests
    for t in after:
        t.join(60)
    assert all(exact(t) for t in after), [t.error for t in after]
