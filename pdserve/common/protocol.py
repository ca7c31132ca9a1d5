"""The wire protocol between router, prefill, decode and colocated nodes. Torch-free.

Every message is a frozen dataclass registered by an explicit type tag. A message travels as one
msgpack map (`use_bin_type=True`) with the tag under "t"; tensors never go in here, they follow as
raw frames (see transport.py). Decoding looks the tag up in `_REGISTRY` only, refuses unknown or
missing fields, and bounds what a peer can make us allocate. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 3  # 2: KV travels head-major, [2, nkv, n, d] per layer; 3: Stats.draining, Pending
MAX_HEADER_BYTES = 64 * 1024 * 1024  # one control message; tensor frames are bounded separately
MAX_LIST_LEN = 4 * 1024 * 1024


class ProtocolError(ValueError):
    """A peer sent something we refuse to decode."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy too (dividing logits by them would overflow)."""
        return self.temperature < 1e-5 or self.top_k == 1


# ---- router <-> node ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """First message on every connection: who I am, and which protocol I speak."""

    protocol_version: int
    role: str
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HelloAck:
    ok: bool
    role: str
    info: dict = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True)
class Generate:
    """Router -> colocated or prefill node. `decode_addr` names the decode node in disagg mode."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_addr: str = ""


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request; `finish_reason` set on its last event ("stop", "length", "abort", "error")."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str = ""


@dataclass(frozen=True)
class TokenEvents:
    """All the events of one engine step, batched into one message."""

    events: list[TokenEvent]


@dataclass(frozen=True)
class Stats:
    """Periodic load and counters of a node (doubles as its heartbeat)."""

    role: str
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    counters: dict = field(default_factory=dict)
    draining: bool = False  # shutting down: finishes what it holds, takes nothing new


@dataclass(frozen=True)
class StatsRequest:
    pass


@dataclass(frozen=True)
class Pending:
    """Router -> a draining node: the requests it still counts on that node (some may not have reached it yet)."""

    request_ids: list[str]


# ---- prefill node <-> decode node (KV transfer) ------------------------------------------------


@dataclass(frozen=True)
class KvHello:
    """Prefill -> decode on connect: the layout both sides must agree on before any KV moves."""

    protocol_version: int
    layout: dict
    transport: str
    pool_handle: dict = field(default_factory=dict)  # shm / cuda_ipc: how to map the prefill pool


@dataclass(frozen=True)
class KvOffer:
    """Prefill -> decode: a request whose prompt KV is ready; the decode node reserves blocks first."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    params: SamplingParams
    num_tokens: int  # tokens whose KV is shipped (the prompt)


@dataclass(frozen=True)
class KvPull:
    """Decode -> prefill: blocks are reserved, send the KV now."""

    request_id: str


@dataclass(frozen=True)
class KvData:
    """Prefill -> decode. zmq: one message per layer, its KV as one raw frame after this header.
    shm/cuda_ipc: one message for all layers (layer = -1), naming the blocks in the shared pool."""

    request_id: str
    dtype: str
    shape: list[int]  # zmq: [2, num_kv_heads, num_block_tokens, head_dim] of one layer
    layer: int = -1
    src_blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class KvAck:
    """Decode -> prefill: KV landed (ok) or was refused; either way the prefill node frees its copy."""

    request_id: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class KvWaiting:
    """Decode -> prefill, periodically: these offers are queued here for free blocks; keep their KV."""

    request_ids: list[str]


@dataclass(frozen=True)
class KvCancel:
    """Prefill -> decode: the request was aborted; forget any offer or reservation."""

    request_id: str


_REGISTRY: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Hello, HelloAck, Generate, Abort, TokenEvent, TokenEvents, Stats, StatsRequest, Pending,
        KvHello, KvOffer, KvPull, KvData, KvAck, KvWaiting, KvCancel,
    )
}  # fmt: skip
_NESTED = {"params": SamplingParams}


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    return value


def encode(msg: Any) -> bytes:
    tag = type(msg).__name__
    if _REGISTRY.get(tag) is not type(msg):
        raise TypeError(f"{tag} is not a registered message type")
    body = _to_wire(msg)
    body["t"] = tag
    return msgpack.packb(body, use_bin_type=True)


def _build(cls: type, body: Any) -> Any:
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: expected a map, got {type(body).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(body) - names
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    try:
        kwargs = {}
        for name, value in body.items():
            if name in _NESTED:
                value = _build(_NESTED[name], value)
            elif name == "events":
                value = [_build(TokenEvent, v) for v in value]
            elif name in ("stop_token_ids", "eos_token_ids"):
                value = tuple(value)
            kwargs[name] = value
        msg = cls(**kwargs)
    except ProtocolError:
        raise
    except Exception as e:  # whatever a malformed field makes a constructor raise
        raise ProtocolError(f"{cls.__name__}: {e}") from e
    _check_types(msg)
    return msg


_INT_LISTS = ("prompt_token_ids", "token_ids", "shape", "src_blocks", "stop_token_ids", "eos_token_ids")
_INTS = ("first_token_id", "num_tokens", "layer", "protocol_version", "max_tokens", "top_k")
_STRS = ("request_id", "dtype", "role", "decode_addr", "transport")


def _check_types(msg: Any) -> None:
    """Refuse fields of the wrong type, so that a handler never meets a string where it counts tokens."""
    for name in _INTS:
        if hasattr(msg, name) and (type(getattr(msg, name)) is not int or getattr(msg, name) < -1):
            raise ProtocolError(f"{type(msg).__name__}.{name} must be an integer")
    for name in _INT_LISTS:
        value = getattr(msg, name, ())
        if not isinstance(value, (list, tuple)) or any(type(v) is not int or v < 0 for v in value):
            raise ProtocolError(f"{type(msg).__name__}.{name} must be a list of non-negative integers")
    for name in _STRS:
        if hasattr(msg, name) and not isinstance(getattr(msg, name), str):
            raise ProtocolError(f"{type(msg).__name__}.{name} must be a string")


def decode(data: bytes) -> Any:
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=MAX_LIST_LEN, max_map_len=1024)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {e}") from e
    if not isinstance(body, dict) or not isinstance(body.get("t"), str):
        raise ProtocolError("message without a type tag")
    cls = _REGISTRY.get(body.pop("t"))
    if cls is None:
        raise ProtocolError("unknown message type")
    return _build(cls, body)
