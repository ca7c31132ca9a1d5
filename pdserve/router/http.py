"""The router's HTTP/1.1 connections: a direct path for completion requests, uvicorn's h11 protocol for the rest.

**The direct path.** A completion request (`POST /v1/completions` or `/v1/chat/completions`) of the common shape is
read, answered and framed here, by the router's own handler (`api.DirectApi`), past uvicorn's h11 state machine, the
ASGI middlewares and FastAPI's routing: measured, those cost about half of a short streamed request's router CPU
(docs/router-scaling.md). The common shape: HTTP/1.1, a Host, a Content-Length within --max-request-bytes, no
Transfer-Encoding, Expect or Upgrade, headers well formed and within MAX_HEADER_BYTES, CRLF line ends. Anything else
(another route, a chunked or oversized body, HTTP/1.0, a malformed head) goes to h11 and the ASGI app, byte for byte
as it came, so every refusal of an odd request is theirs. The handler does for its requests what the middlewares do
(the API key, the access log line, error bodies); the answers are the same bytes (`tests/stacks/test_direct_http.py`).

A connection's life: idle -> a request's bytes gather in `pending` while they may still be a direct request (they
go to h11 the moment they cannot) -> head and body whole: an `Exchange` answers it -> its response ends: the
connection is idle again (keep-alive timer armed, bytes that came meanwhile taken next), or closes (the client said
`Connection: close`, or the server is shutting down). h11 only ever sees whole requests of its own, so the two paths
take turns on one kept-open connection.

**Raw chunks on the h11 path.** A streamed completion that came the h11 way (a chunked body, say) still writes its
chunks straight to the connection: its scope carries, under `RAW_CHUNKS`, a `RawChunks` that writes HTTP/1.1 chunks
past the ASGI sends, while its start and end go through ASGI (so h11 stays in step). A server without it (a test's
in-process ASGI transport) gives no `RAW_CHUNKS`, and the response sends its body through ASGI instead.

Flow control: writes are not held back while the client reads slowly; they wait in the connection's buffer (as
events would otherwise wait in the request's inbox).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from pdserve.router.limits import MAX_HEADER_BYTES

RAW_CHUNKS = "pdserve.raw_chunks"  # the scope["extensions"] key
DIRECT_PATHS = {b"/v1/completions": False, b"/v1/chat/completions": True}  # the path: whether it is chat
REQUEST_LINES = tuple(b"POST %s HTTP/1.1" % path for path in DIRECT_PATHS)
HELD_LIMIT = 1 << 20  # bytes a client may send ahead while its direct request is answered, before reads pause
_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")  # h11's token
_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")  # h11's field value, its ends stripped
_NOT_DIRECT = frozenset({b"transfer-encoding", b"expect", b"upgrade"})


class RawChunks:
    """Writes a started response's body as HTTP/1.1 chunks on its connection; False once it cannot (the client left,
    or the response ended)."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle

    def write(self, data: bytes) -> bool:
        c = self.cycle
        if c.disconnected or not c.response_started or c.response_complete or c.transport.is_closing():
            return False
        if data:  # an empty chunk would end the body
            c.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True


# ---- the direct path ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Head:
    """The head of a request the direct path takes."""

    path: str
    chat: bool
    headers: dict[bytes, bytes]  # names lower-cased; the last of a repeated name
    length: int  # the body's, from Content-Length
    close: bool  # the client asked for Connection: close


def may_be_direct(start: bytes) -> bool:
    """Whether a request that begins with `start` (its head not yet whole) may still be one the direct path takes."""
    if len(start) > MAX_HEADER_BYTES:
        return False
    line_end = start.find(b"\r\n")
    if line_end < 0:
        return any((line + b"\r\n").startswith(start) for line in REQUEST_LINES)
    return start[:line_end] in REQUEST_LINES and start.count(b"\n") == start.count(b"\r\n")


def parse_head(head: bytes, body_limit: int) -> Head | None:
    """The head (its bytes up to the blank line) of a request the direct path takes, or None for one it leaves to h11
    (module doc)."""
    if len(head) > MAX_HEADER_BYTES or head.count(b"\n") != head.count(b"\r\n"):
        return None
    line, *fields = head.split(b"\r\n")
    if line not in REQUEST_LINES:
        return None
    path = line[5:-9]
    headers = {}
    for field in fields:
        name, colon, value = field.partition(b":")
        value = value.strip(b" \t")
        if not colon or not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
            return None
        headers[name.lower()] = value
    length = headers.get(b"content-length", b"")
    repeated = head.lower().count(b"\r\ncontent-length:") > 1
    if repeated or not length.isdigit() or int(length) > body_limit or b"host" not in headers:
        return None
    if _NOT_DIRECT.intersection(headers):
        return None
    tokens = {t.strip().lower() for t in headers.get(b"connection", b"").split(b",")}
    return Head(path.decode(), DIRECT_PATHS[path], headers, int(length), b"close" in tokens)


class Exchange:
    """One request on the direct path and its answer: a whole response (`respond`), or a streamed one (`start_stream`,
    `write` a chunk at a time, `end_stream`). The head of a stream waits to go out with its first chunk, and its end
    with the last, so a short stream costs few writes."""

    def __init__(self, proto: RouterHttp, head: Head, body: bytes) -> None:
        self.proto, self.transport, self.head, self.body = proto, proto.transport, head, body
        self.status = 0  # once the response has started
        self.lost = False  # the client left before the response ended
        self.on_lost: Callable[[], object] | None = None
        self.unsent = b""  # the stream's head, until its first chunk
        self.ended = False  # the response is whole: a response sent, or a stream's end

    @property
    def where(self) -> str:
        return f"POST {self.head.path}"

    async def is_disconnected(self) -> bool:
        return self.lost

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole response; `headers` name its length."""
        self.status, self.ended = status, True
        if not self.lost:
            self.transport.write(self._head(status, headers) + body)

    def start_stream(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = 200
        self.unsent = self._head(200, [*headers, (b"Transfer-Encoding", b"chunked")])

    def write(self, data: bytes) -> bool:
        """One chunk of the streamed body; False once the client has left."""
        if self.lost or self.ended:
            return False
        if data:  # an empty chunk would end the body
            self.transport.write(b"%b%x\r\n%b\r\n" % (self.unsent, len(data), data))
            self.unsent = b""
        return True

    def end_stream(self, last: bytes = b"") -> None:
        """The body's end, after a last chunk where `last` is given; once."""
        if not self.lost and not self.ended:
            self.transport.write(b"%b%b0\r\n\r\n" % (self.unsent, b"%x\r\n%b\r\n" % (len(last), last) if last else b""))
        self.ended = True

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The status line and headers, as h11 writes them (the names it adds, title-cased, last)."""
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
        closing = self.head.close or self.proto.closing
        for name, value in (*self.proto.server_state.default_headers, *headers):
            lines.append(b"%s: %s\r\n" % (name, value))
        if closing:
            lines.append(b"Connection: close\r\n")
        return b"".join(lines) + b"\r\n"

    def disconnected(self) -> None:
        self.lost = True
        if self.on_lost is not None:
            self.on_lost()


class RouterHttp(H11Protocol):
    """uvicorn's h11 protocol, with the direct path for completion requests (`direct`: the handler, None for none)
    and RawChunks offered to each HTTP/1.1 request of the h11 path."""

    def __init__(
        self, *args, direct: Callable[[Exchange], Awaitable[None]] | None = None, body_limit: int = 0, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.asgi_app = self.app
        self.app = self.with_raw_chunks
        self.direct, self.body_limit = direct, body_limit
        self.pending = bytearray()  # a request's bytes while it may still be a direct one
        self.pending_head: Head | None = None  # its head, once whole and taken
        self.body_at = 0  # where its body begins in `pending`
        self.exchange: Exchange | None = None  # the direct request being answered
        self.held = b""  # bytes that came while it was
        self.closing = False  # the server is shutting down: close once the exchange ends

    async def with_raw_chunks(self, scope, receive, send) -> None:
        cycle = self.cycle  # the cycle whose task calls this: h11 starts no other one before its response ends
        if getattr(send, "__self__", None) is cycle and scope["http_version"] == "1.1":
            scope["extensions"] = {**scope.get("extensions", {}), RAW_CHUNKS: RawChunks(cycle)}
        await self.asgi_app(scope, receive, send)

    def data_received(self, data: bytes) -> None:
        if self.exchange is not None:
            self.held += data
            if len(self.held) > HELD_LIMIT:
                self.flow.pause_reading()
        elif self.pending or (self.direct is not None and self._h11_idle()):
            self._unset_keepalive_if_required()
            self.pending += data
            self._take()
        else:
            super().data_received(data)

    def _h11_idle(self) -> bool:
        """No request of h11's is under way or waiting in its buffer."""
        c = self.conn
        return (
            (self.cycle is None or self.cycle.response_complete)
            and c.our_state is h11.IDLE
            and c.their_state is h11.IDLE
            and not c.trailing_data[0]
        )

    def _take(self) -> None:
        """Answer the pending request on the direct path once it is whole; hand it to h11 once it cannot be direct.
        A large body that comes in many reads is appended to, not copied or searched again at each."""
        if self.pending_head is None:
            end = self.pending.find(b"\r\n\r\n")
            if end < 0:
                if not may_be_direct(bytes(self.pending)):
                    self._to_h11()
                return
            self.pending_head, self.body_at = parse_head(bytes(self.pending[:end]), self.body_limit), end + 4
            if self.pending_head is None:
                self._to_h11()
                return
        head, body_end = self.pending_head, self.body_at + self.pending_head.length
        if len(self.pending) < body_end:
            return  # the body is on its way
        body, self.held = bytes(self.pending[self.body_at : body_end]), bytes(self.pending[body_end:])
        self.pending, self.pending_head = bytearray(), None
        self.exchange = Exchange(self, head, body)
        task = self.loop.create_task(self._answer(self.exchange))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)  # the server's graceful shutdown waits for it

    def _to_h11(self) -> None:
        data, self.pending, self.pending_head = bytes(self.pending), bytearray(), None
        super().data_received(data)

    async def _answer(self, exchange: Exchange) -> None:
        try:
            await self.direct(exchange)
        except Exception:
            self.logger.exception("the direct path's handler failed on %s", exchange.where)
        finally:
            self._answered(exchange)

    def _answered(self, exchange: Exchange) -> None:
        """The handler is done: close (the client asked to, the server stops, or the handler left its response
        unfinished, as uvicorn does for an ASGI app that did), or take what came meanwhile as the next request."""
        self.exchange = None
        self.server_state.total_requests += 1
        if exchange.lost or self.transport.is_closing():
            return
        if exchange.head.close or self.closing or not exchange.ended:
            self.transport.close()
            return
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self.flow.resume_reading()
        held, self.held = self.held, b""
        if held:
            self.data_received(held)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.exchange is not None:
            self.exchange.disconnected()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.exchange is not None:
            self.closing = True  # the response goes on (the router drains); then the connection closes
        elif self.pending:
            self.transport.close()
        else:
            super().shutdown()
