"""ZeroMQ plumbing: one control message (msgpack) first, raw tensor frames after, sent with copy=False.

Nodes bind ROUTER sockets; the router and prefill nodes connect DEALER sockets to them. A socket
monitor turns a peer's disconnect into an event, so a dead node is noticed at once.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.common.protocol import ProtocolError, decode, encode

MAX_FRAMES = 4096


def send(sock: zmq.Socket, msg: Any, frames: list = (), identity: bytes | None = None) -> None:
    """Send `msg` (then `frames` as raw buffers) to `identity` on a ROUTER socket, or plainly."""
    parts = [encode(msg), *frames]
    if identity is not None:
        parts.insert(0, identity)
    sock.send_multipart(parts, copy=False)


def split(parts: list, routed: bool) -> tuple[bytes | None, Any, list]:
    """Multipart message -> (identity, message, frames). Raises ProtocolError on garbage."""
    identity = None
    if routed:
        if len(parts) < 2:
            raise ProtocolError("routed message without a body")
        identity, parts = bytes(parts[0]), parts[1:]
    if len(parts) > MAX_FRAMES:
        raise ProtocolError(f"{len(parts)} frames exceeds {MAX_FRAMES}")
    head = parts[0].bytes if isinstance(parts[0], zmq.Frame) else parts[0]
    return identity, decode(head), parts[1:]


def recv(sock: zmq.Socket, routed: bool = False) -> tuple[bytes | None, Any, list]:
    return split(sock.recv_multipart(copy=False), routed)


def bind(sock: zmq.Socket, addr: str) -> str:
    """Bind to `addr` ("tcp://host:0" picks a free port); return the address actually bound."""
    if addr.startswith("tcp://") and addr.endswith(":0"):
        port = sock.bind_to_random_port(addr[: addr.rindex(":")])
        return f"{addr[: addr.rindex(':')]}:{port}"
    sock.bind(addr)
    return addr


def monitor_events(mon: zmq.Socket) -> list[int]:
    """Drain a monitor socket without blocking: the list of event codes seen."""
    events = []
    while mon.poll(0):
        events.append(recv_monitor_message(mon)["event"])
    return events


MAX_MESSAGE_BYTES = 1 << 30  # one frame: a layer of a long prompt's KV is a few MiB


def configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
