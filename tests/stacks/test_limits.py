"""Bounded input: oversized bodies and headers are refused without stalling anyone else's stream."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.helpers import Stream, start_streams, tiny_greedy, wait_until
from tests.stack import Stack

HUGE = 64 * 2**20
STREAM_TOKENS = 1800
HANG_S = 30.0  # a guard against a hang, not a latency target (a loaded host may starve the router for seconds)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("limits"), "tiny", mode="colocated")
    yield s.start()
    s.close()


def _chunks_while_streams_run(streams: list[Stream], total: int, seen: list[bool], size: int = 2**20):
    """A body of `total` bytes in chunks of `size`; after the first, wait for a token on some stream (it goes to
    `seen`): the router reads the body and serves the streams at once, or that never comes."""
    yield b"x" * size
    tokens = sum(len(s.times) for s in streams)
    seen.append(wait_until(lambda: sum(len(s.times) for s in streams) > tokens, HANG_S, 0.01))
    for _ in range(total // size - 1):
        yield b"x" * size


def test_huge_bodies_get_413_while_streams_run(stack):
    streams = start_streams(stack.url, [tiny_greedy(STREAM_TOKENS)] * 16)  # every stream is receiving tokens
    rss_before = stack.rss_bytes("router")
    r = httpx.post(
        stack.url + "/v1/completions", content=b"x" * HUGE, timeout=HANG_S, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "max-request-bytes" in r.json()["error"]["message"], r.text
    # no Content-Length: the body is counted as it streams in, while the streams go on
    seen: list[bool] = []
    r = httpx.post(
        stack.url + "/v1/completions", content=_chunks_while_streams_run(streams, HUGE, seen), timeout=HANG_S
    )
    assert r.status_code == 413, r.text
    assert seen == [True], "no stream got a token while the router read a refused body"
    assert stack.rss_bytes("router") - rss_before < 48 * 2**20, "the router buffered a refused body"
    for s in streams:  # they went on through both bodies: no need to wait for their end on a slow host
        s.hang_up()
    for s in streams:
        s.join(timeout=HANG_S)
    assert not any(s.is_alive() or s.error or s.status != 200 for s in streams), [s.error for s in streams]
    assert max(s.max_gap() for s in streams) < HANG_S


def test_a_body_just_under_the_limit_is_parsed(stack):
    # padded with "user", a field accepted and ignored (an unknown one would be refused)
    body = json.dumps({"model": "tiny", "max_tokens": 2, "prompt": "a" * 1000, "user": "y" * (3 * 2**20)}).encode()
    r = httpx.post(
        stack.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 200, r.text


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(stack):
    r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 3_000_000}, timeout=30)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 3_000_000}]}
    r = httpx.post(stack.url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text


def test_oversized_headers_are_refused_and_the_router_serves_on(stack):
    port = int(stack.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"y" * 64 * 1024 + b"\r\n\r\n")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 4"), reply[:100]
    r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
