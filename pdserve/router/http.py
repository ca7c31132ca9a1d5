"""The router's HTTP/1.1 connections: uvicorn's h11 protocol, plus a way for a streamed body to skip the ASGI path.

A streamed completion writes one small chunk per request per node message. Through ASGI each chunk would pass
every middleware's `send` wrapper, the framework's response loop and h11's state machine before it reaches the
socket, which costs more than everything else the router does for a token. So each request's scope carries, under
`RAW_CHUNKS`, a `RawChunks` that writes HTTP/1.1 chunks straight to the connection. A response that uses it still
starts (status, headers) and ends (the last, empty chunk) through ASGI, so the middlewares see both and h11 stays
in step: it frames the body as chunks itself, and writes nothing between the two.

Offered only where that framing holds: an HTTP/1.1 request (whose response without a Content-Length h11 sends as
chunks) on this protocol. A server without it (a test's in-process ASGI transport) gives no `RAW_CHUNKS`, and the
response sends its body through ASGI instead.

Flow control: writes are not held back while the client reads slowly; they wait in the connection's buffer (as
events would otherwise wait in the request's inbox), and the response's end, sent through ASGI, waits for it to
drain.
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

RAW_CHUNKS = "pdserve.raw_chunks"  # the scope["extensions"] key


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


class RouterHttp(H11Protocol):
    """uvicorn's h11 protocol, with RawChunks offered to each HTTP/1.1 request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asgi_app = self.app
        self.app = self.with_raw_chunks

    async def with_raw_chunks(self, scope, receive, send) -> None:
        cycle = self.cycle  # the cycle whose task calls this: h11 starts no other one before its response ends
        if getattr(send, "__self__", None) is cycle and scope["http_version"] == "1.1":
            scope["extensions"] = {**scope.get("extensions", {}), RAW_CHUNKS: RawChunks(cycle)}
        await self.asgi_app(scope, receive, send)
