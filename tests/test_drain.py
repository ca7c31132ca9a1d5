"""SIGTERM drains: a router or node stops taking work, finishes (or clearly fails) what it holds, and exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from helpers import Streamer, wait_until
from stack import Stack, free_port

SHORT = {"model": "tiny", "prompt": "x", "max_tokens": 2}


def _start_streams(url: str, n: int, max_tokens: int) -> list[Streamer]:
    started = threading.Barrier(n + 1)
    streams = [Streamer(url, max_tokens, started) for _ in range(n)]
    for s in streams:
        s.start()
    started.wait(timeout=60)  # every stream has its first chunk
    return streams


def _join(streams: list[Streamer]) -> None:
    for s in streams:
        s.join(timeout=120)


def _refused(url: str) -> bool:
    """A new request is turned away: no connection, or a 503."""
    try:
        return httpx.post(url + "/v1/completions", json=SHORT, timeout=30).status_code == 503
    except httpx.TransportError:
        return True


def test_router_sigterm_finishes_streams_or_past_its_grace_fails_them_clearly(tmp_path):
    stack = Stack(tmp_path, "tiny", mode="colocated", router_args=("--drain-timeout-s", "120")).start()
    try:
        streams = _start_streams(stack.url, 4, 1800)
        router = stack.procs["router"]
        router.send_signal(signal.SIGTERM)
        alive = any(s.is_alive() for s in streams)
        assert _refused(stack.url)
        assert alive, "the streams had ended before SIGTERM: the test proves nothing"
        _join(streams)
        assert all(s.complete for s in streams), [(len(s.token_ids), s.error) for s in streams]
        assert router.wait(timeout=60) == 0
        assert stack.procs["colocated0"].poll() is None  # a router's drain leaves its nodes alone

        stack.start_router(("--drain-timeout-s", "0.2"))  # the streams need ~1.2 s more
        streams = _start_streams(stack.url, 2, 1800)
        stack.procs["router"].send_signal(signal.SIGTERM)
        _join(streams)
        assert all(not s.done and "shutting down" in s.error for s in streams), [s.error for s in streams]
        assert stack.procs["router"].wait(timeout=60) == 0
    finally:
        stack.close()


def _wait_draining(stack: Stack, role: str) -> None:
    """Until the router has heard that the node of `role` drains (its stats say so within 0.5 s)."""
    def draining() -> bool:
        nodes = httpx.get(stack.url + "/health", timeout=10).json()["nodes"]
        return any(n["draining"] for n in nodes if n["role"] == role)

    assert wait_until(draining, 30), f"the router never saw the {role} node drain"


def test_decode_node_sigterm_finishes_its_streams_or_past_its_grace_fails_them_clearly(tmp_path):
    stack = Stack(tmp_path, "tiny", mode="disagg", decode_args=("--drain-timeout-s", "120")).start()
    try:
        streams = _start_streams(stack.url, 3, 600)
        decode = stack.procs["decode0"]
        decode.send_signal(signal.SIGTERM)
        _wait_draining(stack, "decode")
        r = httpx.post(stack.url + "/v1/completions", json=SHORT, timeout=30)  # no other decode node: refused
        assert r.status_code == 503, r.text
        _join(streams)
        assert all(s.complete for s in streams), [(len(s.token_ids), s.error) for s in streams]
        assert decode.wait(timeout=60) == 0
        assert stack.procs["prefill0"].poll() is None and stack.procs["router"].poll() is None

        stack.restart_node("decode0", "decode", ("--drain-timeout-s", "0.2"))  # the streams need ~1.2 s
        stack.wait_healthy(timeout=60)
        streams = _start_streams(stack.url, 2, 1800)
        stack.procs["decode0"].send_signal(signal.SIGTERM)
        _join(streams)
        assert all(not s.done and "drain period" in s.error for s in streams), [s.error for s in streams]
        assert stack.procs["decode0"].wait(timeout=60) == 0
        stack.restart_node("decode0", "decode")
        stack.wait_healthy(timeout=60)
        stack.wait_kv_free()
    finally:
        stack.close()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def test_pdserve_up_forwards_sigterm_and_every_child_exits(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", "up", "--model", "tiny", "--mode",
            "colocated", "--port", str(port), "--no-pin"]  # fmt: skip
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert "is serving" in up.stdout.readline()
        children = _children(up.pid)
        assert len(children) == 2, children
        streams = _start_streams(f"http://127.0.0.1:{port}", 2, 600)
        up.send_signal(signal.SIGTERM)
        _join(streams)
        assert all(s.complete for s in streams), [(len(s.token_ids), s.error) for s in streams]
        assert up.wait(timeout=90) == 0
        assert not [c for c in children if Path(f"/proc/{c}").exists() and _alive(c)], "children left running"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def _alive(pid: int) -> bool:
    """Not a zombie (a child of the launcher that it has already reaped does not exist at all)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
