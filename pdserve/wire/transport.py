"""ZeroMQ plumbing: one control message (msgpack) first, raw tensor frames after, sent with copy=False.

Nodes bind ROUTER sockets; the router and prefill nodes connect DEALER sockets to them. A socket
monitor turns a peer's disconnect into an event, so a dead node is noticed at once.

With a key folder (`pdserve keys DIR`, `--zmq-keys DIR`) every socket speaks CurveZMQ: nodes are
CURVE servers with the folder's server key pair, and a ZAP handler admits only clients whose public
key is in DIR/authorized; the router and prefill nodes connect as clients with the client key pair.
A peer without an authorized key gets no message through, in either direction.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from pdserve.wire.codec import ProtocolError, decode, encode

log = logging.getLogger("pdserve.transport")
MAX_FRAMES = 4096
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


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


def bind(sock: zmq.Socket, addr: str, keys: CurveKeys | None = None) -> str:
    """Bind to `addr` ("tcp://host:0" picks a free port), as a CURVE server with `keys`; return the address bound."""
    secure_server(sock, keys)
    if keys is None and not is_local(addr):
        log.warning("!" * 100)
        log.warning(
            "%s is reachable from other hosts and NOT authenticated: whoever reaches it can submit work, "
            "read tokens and pull KV. Use --zmq-keys DIR (make it with `pdserve keys DIR`).",
            addr,
        )
        log.warning("!" * 100)
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


def is_local(addr: str) -> bool:
    """Whether only this host can reach `addr` (ipc://, or tcp:// on a loopback address)."""
    if not addr.startswith("tcp://"):
        return True
    host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface or a host name
        return False


# ---- CurveZMQ ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurveKeys:
    folder: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def authorized(self) -> str:
        return os.path.join(self.folder, "authorized")


def make_keys(folder: str) -> None:
    """Write a server and a client key pair into `folder`, and authorize the client's public key."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for name in ("server", "client"):
        _, secret = zmq.auth.create_certificates(folder, name)
        os.chmod(secret, 0o600)
    authorized = os.path.join(folder, "authorized")
    os.makedirs(authorized, exist_ok=True)
    shutil.copy(os.path.join(folder, "client.key"), os.path.join(authorized, "client.key"))


def load_keys(folder: str) -> CurveKeys:
    server_public, server_secret = zmq.auth.load_certificate(os.path.join(folder, "server.key_secret"))
    client_public, client_secret = zmq.auth.load_certificate(os.path.join(folder, "client.key_secret"))
    return CurveKeys(folder, server_public, server_secret, client_public, client_secret)


def secure_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey = keys.server_secret, keys.server_public
        sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey = keys.client_secret, keys.client_public
        sock.curve_serverkey = keys.server_public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys | None) -> ThreadAuthenticator | None:
    """The ZAP handler of a node's context: CURVE clients are admitted by the public keys in DIR/authorized."""
    if keys is None:
        return None
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("pdserve.auth"))
    auth.start()
    auth.configure_curve(domain="*", location=keys.authorized)
    return auth
