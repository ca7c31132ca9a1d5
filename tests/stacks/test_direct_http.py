"""The router's direct path for completion requests (pdserve/router/http.py): which requests it takes, how it frames
their answers on a connection it shares with h11, and (served) that its answers are the bytes the ASGI path gives."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import httpx
import pytest
import uvicorn

from pdserve.checkpoint import resolve_model
from pdserve.router.http import Exchange, RouterHttp, may_be_direct, parse_head
from pdserve.router.limits import MAX_HEADER_BYTES
from tests.stack import Stack

LIMIT = 1000  # --max-request-bytes of the heads parsed here
BODY = b'{"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}'


def request(
    path: str = "/v1/completions", body: bytes = BODY, *extra: str, length: bool = True, version: str = "HTTP/1.1"
) -> bytes:
    lines = [f"POST {path} {version}", "Host: 127.0.0.1", "Content-Type: application/json", *extra]
    lines += [f"Content-Length: {len(body)}"] if length else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def head_of(raw: bytes) -> bytes:
    return raw.partition(b"\r\n\r\n")[0]


# ---- which requests the direct path takes ----------------------------------------------------------------------


def test_a_completion_or_chat_request_of_the_common_shape_is_taken():
    head = parse_head(head_of(request()), LIMIT)
    assert (head.path, head.chat, head.length, head.close) == ("/v1/completions", False, len(BODY), False)
    chat = parse_head(head_of(request("/v1/chat/completions", b"{}", "Connection: close")), LIMIT)
    assert (chat.path, chat.chat, chat.length, chat.close) == ("/v1/chat/completions", True, 2, True)
    assert parse_head(head_of(request(body=b"x" * LIMIT)), LIMIT) is not None  # at the limit


@pytest.mark.parametrize(
    "raw",
    [
        request("/v1/completions?x=1"),
        request("/v1/models"),
        b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
        request(version="HTTP/1.0"),
        request("/v1/completions", BODY, "Transfer-Encoding: chunked", length=False),
        request("/v1/completions", BODY, "Expect: 100-continue"),
        request("/v1/completions", BODY, "Upgrade: websocket"),
        request(body=b"x" * (LIMIT + 1)),  # RequestLimits answers it 413
        request(length=False),
        request("/v1/completions", BODY, f"Content-Length: {len(BODY)}"),  # repeated
        request("/v1/completions", BODY, f"Content-Length : {len(BODY)}", length=False),
        request("/v1/completions", BODY, "X-A: 1", " folded"),  # obsolete line folding
        request("/v1/completions", BODY, "X-A: a\x00b"),
        request().replace(b"Host: 127.0.0.1\r\n", b""),
        request().replace(b"\r\nContent-Type", b"\nContent-Type"),  # a bare LF
        request("/v1/completions", BODY, "X-A: " + "a" * MAX_HEADER_BYTES),  # RequestLimits answers it 431
    ],
    ids=[
        "query",
        "route",
        "method",
        "http1.0",
        "chunked",
        "expect",
        "upgrade",
        "too-large",
        "no-length",
        "two-lengths",
        "space-before-colon",
        "folded",
        "nul",
        "no-host",
        "bare-lf",
        "huge-head",
    ],
)
def test_a_request_of_any_other_shape_is_left_to_h11(raw):
    assert parse_head(head_of(raw), LIMIT) is None


def test_a_head_still_coming_is_held_only_while_it_may_be_direct():
    whole = request()
    assert all(may_be_direct(whole[:n]) for n in range(1, len(head_of(whole))))
    assert not may_be_direct(b"GET ")
    assert not may_be_direct(b"POST /v1/models HTTP/1.1\r\n")
    assert not may_be_direct(b"POST /v1/completions HTTP/1.1\r\nHost: x\n")
    assert not may_be_direct(b"POST /v1/completions HTTP/1.1\r\nX: " + b"a" * MAX_HEADER_BYTES)


# ---- the protocol, on a transport that records what it is given -----------------------------------------------


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    @property
    def out(self) -> bytes:
        return b"".join(self.writes)


class Harness:
    """A RouterHttp on a recording transport: its direct handler and its ASGI app record what reached them; the
    handler answers `direct:<body>` whole, or as a stream of `stream_parts` that waits for `release`."""

    def __init__(self, stream_parts: list[bytes] | None = None) -> None:
        self.direct: list[Exchange] = []
        self.asgi: list[tuple[str, str, bytes]] = []  # method, path, body
        self.stream_parts, self.release = stream_parts, asyncio.Event()
        config = uvicorn.Config(self.app, log_level="warning", interface="asgi3")
        self.proto = RouterHttp(
            config=config, server_state=uvicorn.server.ServerState(), app_state={}, direct=self.handle, body_limit=LIMIT
        )
        self.transport = Transport()
        self.proto.connection_made(self.transport)

    async def handle(self, ex: Exchange) -> None:
        self.direct.append(ex)
        if self.stream_parts is None:
            body = b"direct:" + ex.body
            ex.respond(200, [(b"content-length", str(len(body)).encode())], body)
            return
        ex.start_stream([(b"content-type", b"text/event-stream")])
        for part in self.stream_parts:
            ex.write(part)
        await self.release.wait()
        ex.end_stream(b"data: 3\n\n" if self.stream_parts else b"")
        ex.end_stream()  # once only

    async def app(self, scope, receive, send) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.asgi.append((scope["method"], scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"h11!"})

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)


def run(coro) -> None:
    asyncio.run(coro)


def test_a_request_that_comes_a_byte_at_a_time_is_answered_on_the_direct_path_whole():
    async def main():
        h = Harness()
        raw = request()
        for i in range(len(raw)):
            h.proto.data_received(raw[i : i + 1])
            await h.settle()
            assert len(h.direct) == (i == len(raw) - 1)
        assert h.direct[0].body == BODY and not h.asgi
        assert h.transport.out.startswith(b"HTTP/1.1 200 OK\r\n") and h.transport.out.endswith(b"direct:" + BODY)
        assert not h.transport.closed  # kept open for the next request

    run(main())


def test_a_body_that_comes_in_many_reads_is_taken_whole_once_its_last_byte_is_in():
    async def main():
        h = Harness()
        raw = request(body=bytes(range(256)) * 3 + b"z" * (LIMIT - 768))
        for i in range(0, len(raw), 37):
            assert not h.direct
            h.proto.data_received(raw[i : i + 37])
            await h.settle()
        assert [ex.body for ex in h.direct] == [raw.partition(b"\r\n\r\n")[2]] and len(h.direct[0].body) == LIMIT

    run(main())


@pytest.mark.parametrize(
    "raw",
    [request("/v1/completions?x=1"), request(version="HTTP/1.0"), request(body=b"x" * (LIMIT + 1))],
    ids=["query", "http1.0", "too-large"],
)
def test_a_request_the_direct_path_leaves_reaches_the_app_through_h11_as_it_came(raw):
    async def main():
        h = Harness()
        h.proto.data_received(raw[:30])  # still maybe direct: held
        h.proto.data_received(raw[30:])
        await h.settle()
        assert not h.direct and h.asgi == [("POST", "/v1/completions", raw.partition(b"\r\n\r\n")[2])]
        assert h.transport.out.endswith(b"h11!")

    run(main())


GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


def test_the_two_paths_take_turns_on_one_kept_open_connection():
    async def main():
        h = Harness()
        for raw in (request(body=b"one"), GET, request(body=b"two")):
            h.proto.data_received(raw)
            await h.settle()
        assert [ex.body for ex in h.direct] == [b"one", b"two"] and h.asgi == [("GET", "/v1/models", b"")]
        out = h.transport.out
        assert out.index(b"direct:one") < out.index(b"h11!") < out.index(b"direct:two")
        assert out.count(b"HTTP/1.1 200 OK") == 3 and not h.transport.closed

    run(main())


def test_pipelined_requests_are_answered_in_order():
    """Bytes that come while a direct request is answered wait for its end; once h11 has bytes of its own, the rest
    of the pipeline is its too."""

    async def main():
        h = Harness()
        h.proto.data_received(request(body=b"one") + GET + request(body=b"two"))
        await h.settle()
        assert [ex.body for ex in h.direct] == [b"one"]
        assert h.asgi == [("GET", "/v1/models", b""), ("POST", "/v1/completions", b"two")]
        out = h.transport.out
        assert out.index(b"direct:one") < out.index(b"h11!") and out.count(b"h11!") == 2 and not h.transport.closed

    run(main())


def test_connection_close_is_answered_with_it_and_the_connection_closes():
    async def main():
        h = Harness()
        h.proto.data_received(request("/v1/completions", BODY, "Connection: close"))
        await h.settle()
        assert b"\r\nConnection: close\r\n" in h.transport.out and h.transport.closed

    run(main())


def test_a_stream_is_written_in_few_writes_and_ends_with_the_last_chunk():
    async def main():
        h = Harness(stream_parts=[b"data: 1\n\n", b"data: 2\n\n"])
        h.proto.data_received(request())
        await h.settle()
        first, second = h.transport.writes
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked\r\n\r\n" in first
        assert first.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")  # the head goes out with the first chunk
        assert second == b"9\r\ndata: 2\n\n\r\n"
        h.release.set()
        await h.settle()
        assert h.transport.writes[2:] == [b"9\r\ndata: 3\n\n\r\n0\r\n\r\n"]  # the last chunk ends the body
        assert not h.transport.closed

    run(main())


def test_a_client_that_leaves_mid_stream_is_told_to_the_handler_and_writes_stop():
    async def main():
        h = Harness(stream_parts=[b"data: 1\n\n"])
        h.proto.data_received(request())
        await h.settle()
        ex, told = h.direct[0], []
        ex.on_lost = lambda: told.append(True)
        h.proto.connection_lost(None)
        assert told == [True] and await ex.is_disconnected() and ex.write(b"data: 2\n\n") is False
        h.release.set()
        await h.settle()
        assert h.transport.out.count(b"data:") == 1

    run(main())


@pytest.mark.parametrize("fault", ["raises", "returns"])
def test_a_handler_that_leaves_its_response_unfinished_closes_the_connection(fault):
    """Rather than leave the client waiting: as uvicorn does for an ASGI app that raises or returns mid-response."""

    async def main():
        h = Harness()

        async def broken(ex: Exchange) -> None:
            ex.start_stream([])
            ex.write(b"data: 1\n\n")
            if fault == "raises":
                raise RuntimeError("a fault of the handler's own")

        h.proto.direct = broken
        h.proto.data_received(request())
        await h.settle()
        assert h.transport.closed and not h.transport.out.endswith(b"0\r\n\r\n")

    run(main())


def test_a_shutdown_lets_a_stream_end_then_closes_its_connection():
    async def main():
        h = Harness(stream_parts=[])
        h.proto.data_received(request())
        await h.settle()
        h.proto.shutdown()
        assert not h.transport.closed
        h.release.set()
        await h.settle()
        out = h.transport.out
        assert out.endswith(b"0\r\n\r\n") and h.transport.closed

    run(main())


# ---- served: the direct path's answers are the ASGI path's -------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    resolve_model("tiny")
    # one router process whatever --router-workers says: its counter of direct requests is then read fresh
    s = Stack(
        tmp_path_factory.mktemp("direct"),
        "tiny",
        mode="disagg",
        api_key="k",
        engine_args=("--engine", "mock", "--mock-step-s", "0.001,0,0"),
        router_args=("--router-workers", "1"),
    ).start()
    yield s
    s.close()


def exchange(url: str, raw: bytes) -> bytes:
    """Send `raw` on a new connection and read the answer until the server closes it (Connection: close)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(raw)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def chunked(raw: bytes) -> bytes:
    """The same request with its body sent as chunks (which the direct path leaves to h11)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    head = re.sub(rb"\r\nContent-Length: \d+", b"\r\nTransfer-Encoding: chunked", head)
    return head + b"\r\n\r\n" + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


def normalized(answer: bytes) -> bytes:
    """An answer without what differs between two answers to one request: the date, the id, the time, and where a
    chunked body's chunks begin (events that come in one loop pass share a chunk: a matter of timing)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"\r\nTransfer-Encoding: chunked" in head:
        body = dechunked(body)
    answer = re.sub(rb"\r\ndate: [^\r]*", b"", head + b"\r\n\r\n" + body)
    answer = re.sub(rb'"(chatcmpl|cmpl)-[0-9a-f]{32}"', rb'"\1-ID"', answer)
    return re.sub(rb'"created": ?\d+', b'"created":0', answer)


def direct_requests(stack: Stack) -> float:
    text = httpx.get(stack.url + "/metrics", headers=stack.headers, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve:router_direct_http_requests_total")
    )


def dechunked(body: bytes) -> bytes:
    """A chunked body's data, its chunks joined; it must end with the last (empty) chunk."""
    data = b""
    while True:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert rest == b"\r\n", "the body ends with the last chunk"
            return data
        data, body = data + rest[:n], rest[n + 2 :]


AUTH = "Authorization: Bearer k"
CASES = {
    "stream": ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}, AUTH),
    "stream-usage": (
        "/v1/completions",
        {"prompt": [5, 6], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
        AUTH,
    ),
    "whole": ("/v1/completions", {"prompt": [[5, 6], [7, 8]], "max_tokens": 3, "n": 1}, AUTH),
    "chat-stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
        AUTH,
    ),
    "bad-field": ("/v1/completions", {"prompt": [5], "max_tokens": -1}, AUTH),
    "unknown-model": ("/v1/completions", {"prompt": [5], "max_tokens": 1, "model": "other"}, AUTH),
    "unsupported": ("/v1/completions", {"prompt": [5], "max_tokens": 1, "suffix": "x"}, AUTH),
    "malformed": ("/v1/completions", None, AUTH),
    "no-key": ("/v1/completions", {"prompt": [5], "max_tokens": 1}, "X-Other: 1"),
}


@pytest.mark.parametrize("case", CASES)
def test_an_answer_on_the_direct_path_is_the_bytes_of_the_asgi_path(stack, case):
    path, fields, header = CASES[case]
    body = b"{not json" if fields is None else json.dumps({"model": "tiny", **fields}).encode()
    raw = request(path, body, header, "Connection: close")
    before = direct_requests(stack)  # counted before the answer is written: read after it, it is up to date
    direct = exchange(stack.url, raw)
    assert direct_requests(stack) == before + 1, "the first took the direct path"
    asgi = exchange(stack.url, chunked(raw))
    assert direct_requests(stack) == before + 1, "the second went through the ASGI app"
    assert normalized(direct) == normalized(asgi)
    assert direct.startswith(b"HTTP/1.1 ") and (b"data: [DONE]" in direct) == case.endswith(("stream", "usage"))
