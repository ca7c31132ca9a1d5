"""Leaks under time: thousands of short requests with aborts mixed in leave nothing behind.

Marked slow; `--soak-requests N` sets its length (the default, what CI runs, is short; the README
gives the numbers of a long run). After a warm-up, every node's RSS must stay within 10% of what it
was, and at the end no request may be held anywhere (router or node tables), every KV pool must be
empty and no process may hold more file descriptors than after the warm-up."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from tests.helpers import wait_until
from tests.stack import Stack

WARMUP = 100
EMPTY_GAUGES = (
    "pdserve:num_requests_running{",
    "pdserve:num_requests_waiting{",
    "pdserve:node_requests_held{",
    "pdserve:kv_blocks_used{",
    "pdserve:num_requests_in_flight ",
    "pdserve:router_requests_waiting ",
)


async def _wave(url: str, n: int, start: int, concurrency: int = 16) -> list[int]:
    """n short requests; every tenth is a stream that the client hangs up on after its first chunk (an abort)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(i: int) -> int:
            body = {"model": "tiny", "prompt": f"soak {i} " * (1 + i % 7), "max_tokens": 1 + i % 8}
            async with gate:
                if i % 10:
                    return (await client.post("/v1/completions", json=body)).status_code
                body.update(stream=True, max_tokens=300)
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        break
                    return r.status_code

        return await asyncio.gather(*(one(i) for i in range(start, start + n)))


def _fds(stack: Stack, name: str) -> int:
    return len(os.listdir(f"/proc/{stack.procs[name].pid}/fd"))


def _settled_fds(stack: Stack, name: str, limit: int) -> int:
    """A process's descriptors, once they drop to `limit` (the router closes client connections a moment after the
    client does) or 15 s have passed."""
    wait_until(lambda: _fds(stack, name) <= limit, 15, 0.1)
    return _fds(stack, name)


def _not_empty(stack: Stack) -> list[str]:
    """The request and KV gauges of /metrics that are not zero."""
    lines = httpx.get(stack.url + "/metrics", timeout=10).text.splitlines()
    seen = [ln for ln in lines if ln.startswith(EMPTY_GAUGES)]
    assert len(seen) >= 2 + 4 * 2, seen  # the router's two, four per node
    return [ln for ln in seen if float(ln.rsplit(" ", 1)[1]) != 0]


@pytest.mark.slow
def test_soak_leaves_no_requests_kv_descriptors_or_memory_behind(tmp_path, request):
    n = request.config.getoption("--soak-requests")
    stack = Stack(tmp_path, "tiny", mode="disagg").start()
    try:
        assert set(asyncio.run(_wave(stack.url, WARMUP, 0))) == {200}
        stack.wait_kv_free()
        names = list(stack.procs)
        rss = {p: stack.rss_bytes(p) for p in names}
        fds = {p: _settled_fds(stack, p, 10**6) for p in names}
        assert set(asyncio.run(_wave(stack.url, n, WARMUP))) == {200}
        stack.wait_kv_free()
        wait_until(lambda: not _not_empty(stack), 60, 0.2)  # node gauges come with their stats, every 0.5 s
        busy = _not_empty(stack)
        assert not busy, f"requests or KV still held after the soak: {busy}"
        grown = {p: _settled_fds(stack, p, fds[p]) - fds[p] for p in names}
        assert not any(g > 0 for g in grown.values()), f"file descriptors leaked: {grown}"
        growth = {p: stack.rss_bytes(p) / rss[p] - 1 for p in names}
        print(f"soak of {n} requests after {WARMUP}: RSS growth {growth}")
        assert all(g < 0.10 for g in growth.values()), f"memory grew: {growth}"
    finally:
        stack.close()
