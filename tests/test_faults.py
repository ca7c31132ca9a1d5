"""Aborts, a refused pairing, and a dead decode node."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from helpers import Streamer, wait_until
from stack import Stack


def _stream_some(url: str, n_chunks: int, max_tokens: int = 1500, n: int = 1) -> int:
    """Start a long streamed completion (of `n` choices), read `n_chunks` chunks, then hang up."""
    body = {"model": "tiny", "prompt": list(range(1, 200)), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "n": n}  # fmt: skip
    seen = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= n_chunks:
                    break
    return seen


@pytest.mark.parametrize("mode,transport,n", [("colocated", "zmq", 3), ("disagg", "zmq", 1), ("disagg", "shm", 2)])
def test_client_disconnect_frees_kv_everywhere(tmp_path, mode, transport, n):
    with_stack = Stack(tmp_path, "tiny", mode=mode, transport=transport).start()
    try:
        threads = [threading.Thread(target=_stream_some, args=(with_stack.url, 3, 1500, n)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        with_stack.wait_kv_free()
        # the nodes still serve
        r = httpx.post(with_stack.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 3},
                       timeout=30)  # fmt: skip
        assert r.status_code == 200
    finally:
        with_stack.close()


def test_mismatched_pairing_is_refused(tmp_path):
    stack = Stack(tmp_path, "tiny", mode="disagg", decode_args=("--block-size", "32")).start()
    try:
        r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       timeout=30)  # fmt: skip
        assert r.status_code >= 500
        msg = r.json()["error"]["message"]
        assert "refused to pair" in msg and "block_size" in msg
        stack.wait_kv_free()
    finally:
        stack.close()


def test_dead_decode_node_fails_fast_and_recovers(tmp_path):
    stack = Stack(tmp_path, "tiny", mode="disagg").start()
    results: list[tuple[int, float]] = []

    def long_request():
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
        try:
            r = httpx.post(stack.url + "/v1/completions", json=body, timeout=60)
            results.append((r.status_code, time.monotonic()))
        except httpx.HTTPError:
            results.append((-1, time.monotonic()))

    try:
        threads = [threading.Thread(target=long_request) for _ in range(3)]
        beside = Streamer(stack.url, 2000)  # its tokens say when the decode node generates (stats lag 0.5 s)
        for t in [*threads, beside]:
            t.start()
        assert wait_until(lambda: len(beside.times) >= 2 and _decode_nodes(stack)[0]["in_flight"] == 4, 30, 0.01)
        killed_at = time.monotonic()
        stack.kill("decode0")
        for t in [*threads, beside]:
            t.join(timeout=30)
        assert beside.error and not beside.done, "the stream beside them ended before the kill"
        assert len(results) == 3
        assert all(code == 503 for code, _ in results), results
        assert max(at for _, at in results) - killed_at < 5.0, "in-flight requests must fail within 5 s"
        h = httpx.get(stack.url + "/health", timeout=10)
        assert h.status_code == 503 and not _decode_nodes(stack)[0]["up"]
        # the router still answers, with a clear error, while no decode node is up
        r = httpx.post(
            stack.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
        stack.restart_node("decode0", "decode")
        stack.wait_healthy(timeout=30)
        four = {"model": "tiny", "prompt": "x", "max_tokens": 4, "ignore_eos": True}  # sampled: EOS may come early
        r = httpx.post(stack.url + "/v1/completions", json=four, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        stack.close()


def _decode_nodes(stack: Stack) -> list[dict]:
    return [n for n in httpx.get(stack.url + "/health", timeout=10).json()["nodes"] if n["role"] == "decode"]


def test_offers_wait_for_a_full_decode_node_beyond_the_lease(tmp_path):
    """A decode pool that holds one request at a time, a 2 s lease (eight KvWaiting notices long, so that a
    loaded host's scheduling delays do not end it), and 64 requests that each decode for a while: the later
    ones wait on the decode node longer than the lease, and must still complete."""
    lease_s = 2.0
    stack = Stack(tmp_path, "tiny", mode="disagg", engine_args=("--kv-lease-s", str(lease_s)),
                  decode_args=("--num-kv-blocks", "8")).start()  # fmt: skip
    try:
        body = {"model": "tiny", "prompt": list(range(1, 21)), "max_tokens": 108, "ignore_eos": True}  # 128: the pool

        async def all_requests():
            async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(64)))

        t0 = time.monotonic()
        responses = asyncio.run(all_requests())
        assert [r.status_code for r in responses] == [200] * 64, [r.text for r in responses if r.status_code != 200]
        assert all(r.json()["usage"]["completion_tokens"] == 108 for r in responses)
        assert time.monotonic() - t0 > 1.5 * lease_s, "the queue never outlived the lease: the test proves nothing"
        stack.wait_kv_free()
    finally:
        stack.close()
