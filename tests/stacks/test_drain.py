"""SIGTERM drains: a router or node stops taking work, finishes (or clearly fails) what it holds, and exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import zmq

from pdserve.config import RouterConfig
from pdserve.router.core import RouterCore, StartupError
from pdserve.wire import transport
from pdserve.wire.messages import Hello, Pending
from tests.helpers import Stream, start_streams, tiny_greedy, wait_until
from tests.stack import Stack, free_port

SHORT = {"model": "tiny", "prompt": "x", "max_tokens": 2}
HANG_S = 600  # drain periods and waits that only guard against a hang: a loaded host may decode a few tokens a second
GONE_S = 30  # for a message already sent to arrive over loopback: only a guard, so that a missing one fails soon
MOCK = ("--engine", "mock", "--mock-step-s", "0.001,0,0")  # nodes without a model: a test of the protocol alone
STREAM = 100  # tokens a stream decodes: SIGSTOP, not length, keeps a stream running where a test needs it to


def _join(streams: list[Stream]) -> None:
    for s in streams:
        s.join(timeout=HANG_S)


def _refused(url: str) -> bool:
    """A new request is turned away: no connection, or a 503."""
    try:
        return httpx.post(url + "/v1/completions", json=SHORT, timeout=30).status_code == 503
    except httpx.TransportError:
        return True


def test_router_sigterm_finishes_streams_or_past_its_grace_fails_them_clearly(tmp_path):
    """The node is stopped (SIGSTOP) around the router's SIGTERM, so that the streams are surely still running when
    it comes, and, with a short grace, still running when the grace ends, however fast the host."""
    stack = Stack(tmp_path, "tiny", mode="colocated", router_args=("--drain-timeout-s", str(HANG_S))).start()
    node = stack.procs["colocated0"]
    try:
        streams = start_streams(stack.url, [tiny_greedy(STREAM)] * 4)
        router = stack.procs["router"]
        with _stopped(node):
            router.send_signal(signal.SIGTERM)
            assert _refused(stack.url)
            assert not any(s.complete for s in streams), "a stream had ended before SIGTERM: the test proves nothing"
        _join(streams)
        assert all(s.complete for s in streams), [(len(s.token_ids), s.error) for s in streams]
        assert router.wait(timeout=HANG_S) == 0
        assert node.poll() is None  # a router's drain leaves its nodes alone

        stack.start_router(("--drain-timeout-s", "0.2"))
        streams = start_streams(stack.url, [tiny_greedy(STREAM)] * 2)
        with _stopped(node):  # the streams cannot end within the grace
            stack.procs["router"].send_signal(signal.SIGTERM)
            _join(streams)
            assert stack.procs["router"].wait(timeout=60) == 0
        assert all(not s.done and "shutting down" in s.error for s in streams), [s.error for s in streams]
    finally:
        stack.close()


@contextmanager
def _stopped(proc: subprocess.Popen):
    """The process stopped (SIGSTOP) for the block: it answers nothing and makes no progress (far less than the
    stack's --node-timeout-s, so the router does not count it lost)."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def _wait_draining(stack: Stack, role: str) -> None:
    """Until the router has heard that the node of `role` drains (its stats say so within 0.5 s)."""

    def draining() -> bool:
        nodes = httpx.get(stack.url + "/health", timeout=10).json()["nodes"]
        return any(n["draining"] for n in nodes if n["role"] == role)

    assert wait_until(draining, 30), f"the router never saw the {role} node drain"


def test_decode_node_sigterm_finishes_its_streams_or_past_its_grace_fails_them_clearly(tmp_path):
    stack = Stack(tmp_path, "tiny", mode="disagg", decode_args=("--drain-timeout-s", str(HANG_S))).start()
    try:
        streams = start_streams(stack.url, [tiny_greedy(STREAM)] * 3)
        decode = stack.procs["decode0"]
        with _stopped(decode):  # SIGTERM is handled when it runs again, the streams surely unfinished
            decode.send_signal(signal.SIGTERM)
            assert not any(s.complete for s in streams), "a stream had ended before SIGTERM: the test proves nothing"
        _wait_draining(stack, "decode")
        r = httpx.post(stack.url + "/v1/completions", json=SHORT, timeout=30)  # no other decode node: refused
        assert r.status_code == 503, r.text
        _join(streams)
        assert all(s.complete for s in streams), [(len(s.token_ids), s.error) for s in streams]
        assert decode.wait(timeout=HANG_S) == 0
        assert stack.procs["prefill0"].poll() is None and stack.procs["router"].poll() is None

        # a grace of 1 ms: no host decodes 300 tokens in it (the grace runs in the node, which must run)
        stack.restart_node("decode0", "decode", ("--drain-timeout-s", "0.001"))
        stack.wait_healthy(timeout=60)
        streams = start_streams(stack.url, [tiny_greedy(300)] * 2)
        # each stream's second token comes from the decode node: it holds both (a request whose KV is still on its
        # way when the node exits fails as the node's loss instead, "failed (disconnected)")
        assert wait_until(lambda: all(len(s.token_ids) >= 2 for s in streams), 60), [s.error for s in streams]
        stack.procs["decode0"].send_signal(signal.SIGTERM)
        _join(streams)
        assert all(not s.done and "drain period" in s.error for s in streams), [s.error for s in streams]
        assert stack.procs["decode0"].wait(timeout=60) == 0
        stack.wait_kv_free(dead=(stack.infos["decode0"]["listen"],))  # the prefill node's pool (decode0's is gone)
    finally:
        stack.close()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def test_pdserve_up_forwards_sigterm_and_every_child_exits(tmp_path):
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "--log-level",
        "WARNING",
        "up",
        "--model",
        "tiny",
        "--mode",
        "colocated",
        "--port",
        str(port),
        "--no-pin",
        "--drain-timeout-s",
        str(HANG_S),
    ]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert "is serving" in up.stdout.readline()
        children = _children(up.pid)
        assert len(children) == 2, children
        streams = start_streams(f"http://127.0.0.1:{port}", [tiny_greedy(STREAM)] * 2)
        up.send_signal(signal.SIGTERM)
        _join(streams)
        assert all(s.complete for s in streams), [(len(s.token_ids), s.error) for s in streams]
        assert up.wait(timeout=HANG_S) == 0
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


def test_a_stopped_router_says_so_and_its_nodes_drain_without_waiting_for_it(tmp_path):
    """A router that stops tells each node it routes nothing there any more (an empty Pending), so a node that drains
    after it does not wait for its answer; one that was killed never answers, and the node waits
    pdserve.nodes.base.ROUTER_ANSWER_S for it, then says so: the line this test looks for either way."""
    for stop in (signal.SIGTERM, signal.SIGKILL):
        folder = tmp_path / stop.name
        folder.mkdir()
        stack = Stack(folder, "tiny", engine_args=MOCK, node_logs=True).start(router=False)
        try:
            # one router process for SIGKILL: the workers of several would get SIGTERM from their parent's death
            stack.start_router(("--router-workers", "1") if stop == signal.SIGKILL else ())
            assert httpx.post(stack.url + "/v1/completions", json=SHORT, timeout=HANG_S).status_code == 200
            router, node = stack.procs.pop("router"), stack.procs["colocated0"]
            router.send_signal(stop)
            router.wait(timeout=HANG_S)
            node.send_signal(signal.SIGTERM)
            assert node.wait(timeout=HANG_S) == 0
        finally:
            stack.close()
        log = (folder / "colocated0.log").read_text()
        waited = "1 router(s) did not answer within" in log
        assert waited == (stop == signal.SIGKILL), log[-2000:]


def test_a_model_node_stopped_cleanly_writes_nothing_as_it_exits(tmp_path):
    """A model node's whole output (at --log-level WARNING), stopped by SIGTERM after serving: nothing, so nothing of
    the interpreter's teardown either (say a native extension's leak report, seen once when the node froze its heap
    before exiting, which kept triton's objects alive past its extension's own check)."""
    stack = Stack(tmp_path, "tiny", node_logs=True).start()
    try:
        assert httpx.post(stack.url + "/v1/completions", json=SHORT, timeout=HANG_S).status_code == 200
    finally:
        stack.close()
    assert stack.procs["colocated0"].returncode == 0
    assert (tmp_path / "colocated0.log").read_text() == ""


def test_a_router_stopped_before_a_node_answered_its_hello_still_says_it_has_gone():
    """A node that has taken a router's Hello counts it among its routers (and, draining, would wait for its answer)
    though the router may not have had the node's HelloAck yet: a router that stops says goodbye to every node it
    greeted. Here the node (a bare zmq socket) never answers, and the router is stopped while it waits."""
    ctx = zmq.Context()
    node = ctx.socket(zmq.ROUTER)
    port = node.bind_to_random_port("tcp://127.0.0.1")

    async def receive() -> tuple[bytes, object]:
        while not node.poll(0):
            await asyncio.sleep(0.01)
        identity, msg, _ = transport.split(node.recv_multipart(), routed=True)
        return identity, msg

    async def run() -> list[tuple[bytes, object]]:
        core = RouterCore(RouterConfig(model="tiny", colocated=(f"tcp://127.0.0.1:{port}",)))
        start = asyncio.create_task(core.start())
        got = [await asyncio.wait_for(receive(), HANG_S)]  # its Hello, left unanswered
        core.start_cancelled.set()
        try:
            await start
        except StartupError:
            pass
        await core.stop()  # returns once what it sent has gone out, or its linger ran out
        got.append(await asyncio.wait_for(receive(), GONE_S))
        return got

    try:
        (hello_from, hello), (bye_from, bye) = asyncio.run(run())
    finally:
        ctx.destroy(linger=0)
    assert isinstance(hello, Hello) and bye == Pending([]) and bye_from == hello_from


def test_pdserve_up_stopped_by_two_signals_at_once_still_stops_every_child_cleanly():
    """`timeout` sends its signal to the launcher and then to its process group, so the launcher gets it twice; a
    SIGTERM and a SIGINT sent back to back are handled one after the other, the second while the first unwinds. The
    second must not cut the stop short: exit 0, no traceback, every child gone."""
    port = free_port()
    argv = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", "up", "--model", "tiny"]
    argv += ["--mode", "colocated", "--port", str(port), "--no-pin"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert "is serving" in up.stdout.readline()
        children = _children(up.pid)
        assert len(children) == 2, children
        up.send_signal(signal.SIGTERM)
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=HANG_S)
        assert up.returncode == 0 and "Traceback" not in err, err[-3000:]
        assert "pdserve: stopping" in err
        assert not [c for c in children if Path(f"/proc/{c}").exists() and _alive(c)], "children left running"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
