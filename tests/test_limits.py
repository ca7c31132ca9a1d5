"""Bounded input: oversized bodies and headers are refused without stalling anyone else's stream."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from helpers import Streamer
from stack import Stack

HUGE = 64 * 2**20
STREAM_TOKENS = 1800  # ~2-3 s of decoding for 16 streams on tiny: they must outlast both huge bodies
HANG_S = 5.0  # a hang detector, not a latency target: a stalled loop shows as a gap of many seconds


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("limits"), "tiny", mode="colocated")
    yield s.start()
    s.close()


def _chunks(total: int, size: int = 2**20):
    for _ in range(total // size):
        yield b"x" * size


def test_huge_bodies_get_413_while_streams_run(stack):
    started = threading.Barrier(17)
    streams = [Streamer(stack.url, STREAM_TOKENS, started) for _ in range(16)]
    for s in streams:
        s.start()
    started.wait(timeout=60)  # every stream is receiving tokens
    rss_before = stack.rss_bytes("router")
    t0 = time.monotonic()
    r = httpx.post(stack.url + "/v1/completions", content=b"x" * HUGE, timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and "max-request-bytes" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < HANG_S
    # no Content-Length: the body is counted as it streams in
    r = httpx.post(stack.url + "/v1/completions", content=_chunks(HUGE), timeout=30)
    assert r.status_code == 413, r.text
    assert stack.rss_bytes("router") - rss_before < 48 * 2**20, "the router buffered a refused body"
    alive = [s.is_alive() for s in streams]
    for s in streams:
        s.join(timeout=120)
    assert any(alive), "every stream had ended before the huge bodies: the test proves nothing"
    assert all(s.complete for s in streams), [(len(s.token_ids), s.error) for s in streams]
    assert max(s.max_gap() for s in streams) < HANG_S


def test_a_body_just_under_the_limit_is_parsed(stack):
    # padded with "user", a field accepted and ignored (an unknown one would be refused)
    body = json.dumps({"model": "tiny", "max_tokens": 2, "prompt": "a" * 1000, "user": "y" * (3 * 2**20)}).encode()
    r = httpx.post(stack.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)  # fmt: skip
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
