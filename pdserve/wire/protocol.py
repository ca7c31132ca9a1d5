"""The wire protocol between router, prefill, decode and colocated nodes. Torch-free.

Every message is a frozen dataclass registered by an explicit type tag. A message travels as one
msgpack map (`use_bin_type=True`) with the tag under "t"; tensors never go in here, they follow as
raw frames (see transport.py). Decoding looks the tag up in `_REGISTRY` only, refuses unknown or
missing fields, checks every field against the type its message declares (nested messages included;
token ids, block ids and shapes are `Ids`, non-negative), and bounds what a peer can make us allocate.
No pickle anywhere.
"""

from __future__ import annotations

import array
import dataclasses
import enum
import functools
import hashlib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, NewType

import msgpack

# 2: KV head-major, [2, nkv, n, d] per layer; 3: log-probabilities, KvHello transports; 4: Stats.draining, Pending;
# 5: guided decoding (SamplingParams.grammar, grammar_prefix), KV checksums (KvOffer.kv_checksums), Stats.num_held,
#    error codes (TokenEvent.error_code, KvAck.error_code), no StatsRequest, enum-checked finish reasons and roles;
# 6: SamplingParams.resumed (a resumed seeded request draws on from where its stream stands)
# 7: partial KV transfers (KvPull.first_block), the checksums travel with the KV (KvData.kv_checksums, not KvOffer),
#    prefix cache events in Stats (cache_stored, cache_evicted, cache_reset)
# 8: plain token events travel flat in TokenEvents.tokens
PROTOCOL_VERSION = 8
MAX_LOGPROBS = 20  # the most alternatives per position a request may ask for (OpenAI's limit)
MAX_HEADER_BYTES = 64 * 1024 * 1024  # one control message; tensor frames are bounded separately
MAX_LIST_LEN = 4 * 1024 * 1024


class ProtocolError(ValueError):
    """A peer sent something we refuse to decode."""


class InvalidField(ValueError):
    """One field of a request's parameters is out of its range: `field` names it (the API's error `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


Id = NewType("Id", int)  # a token id, block id, count or size: an int >= 0


class Role(enum.StrEnum):
    """Who speaks on a connection: the router, or a node of one role (`pdserve <role>`)."""

    ROUTER = "router"
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


NODE_ROLES = (Role.COLOCATED, Role.PREFILL, Role.DECODE)


class KvTransport(enum.StrEnum):
    """How KV moves from a prefill node to a decode node (kv/transfer.py), as --kv-transport names it."""

    ZMQ = "zmq"
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    AUTO = "auto"  # shm / cuda_ipc with a decode node on the same host, zmq with the others


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token or EOS
    LENGTH = "length"  # max_tokens, or the model's context
    ABORT = "abort"  # the client left, or a stop string ended it in the router
    ERROR = "error"  # the event's error_code and error say why


class ErrorCode(enum.StrEnum):
    """Why a request failed, as the node or router that failed it knows it; the router maps it to an HTTP status
    (router/errors.py). The error text beside it is for people."""

    INVALID_REQUEST = "invalid_request"  # it can never be served as asked (e.g. larger than a node's KV pool)
    CAPACITY = "capacity"  # the server is overloaded: no first token within the queue timeout
    NODE_FAILED = "node_failed"  # a node it depended on was lost, and no other could take it over
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # its KV did not reach the decode node (refused, lease out, peer gone)
    DRAINING = "draining"  # the node or the router is shutting down
    INTERNAL = "internal"  # an engine error, or a message the node cannot act on


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: Id = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[Id, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: tuple[Id, ...] = ()
    logprobs: int | None = None  # each sampled token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo), computed in its forward
    presence_penalty: float = 0.0  # minus this from the logit of each token already generated
    frequency_penalty: float = 0.0  # minus this times how often each token was generated
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: positive ones / it, negative * it
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (sampled rows)
    logit_bias: tuple[tuple[Id, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are generated
    grammar: str = ""  # guided decoding: an llguidance grammar (JSON text, never code) the output must match
    grammar_prefix: Id = 0  # how many of the prompt's last tokens the grammar has matched (a request resumed)
    resumed: Id = 0  # how many of the prompt's last tokens the request generated before it was dispatched again

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidField("max_tokens", "max_tokens must be at least 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (type(value) is int and 0 <= value <= MAX_LOGPROBS):
                raise InvalidField(name, f"{name} must be an integer from 0 to {MAX_LOGPROBS}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidField("temperature", "temperature must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidField("top_p", "top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidField("top_k", "top_k must be -1 (disabled) or a positive integer")
        self._check_processors()

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidField(name, f"{name} must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidField("repetition_penalty", "repetition_penalty must be a finite number > 0")
        if not 0 <= self.min_p <= 1:
            raise InvalidField("min_p", "min_p must be in [0, 1]")
        if any(type(t) is not int or t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise InvalidField("logit_bias", "logit_bias maps token ids to biases in [-100, 100]")
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidField("min_tokens", "min_tokens must be an integer from 0 to max_tokens")
        if self.grammar and (self.ignore_eos or self.min_tokens):
            raise InvalidField(
                "grammar",
                "a grammar (response_format) ends the output at EOS: it cannot be combined "
                "with ignore_eos or min_tokens",
            )

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before the draw (penalties, bias, min_tokens); min_p acts in the draw."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy too (dividing logits by them would overflow)."""
        return self.temperature < 1e-5 or self.top_k == 1


def kv_tokens_needed(role: Role, num_prompt_tokens: int, max_tokens: int) -> int:
    """The most tokens of KV one request holds on a node of `role`: on a prefill node its prompt and first token,
    elsewhere every token it may reach. The router refuses what no node's pool holds; a node, what its own does not."""
    return num_prompt_tokens + (1 if role == Role.PREFILL else max_tokens)


# ---- prefix caching: the names of full KV blocks -------------------------------------------------
# A full block of KV is named by a 64-bit hash chained over its parent's name and its token ids, the chain
# seeded by the model's fingerprint: equal names mean equal KV (the same tokens at the same positions, after
# the same prefix, on the same weights). Every node and the router name blocks alike, so names travel.


def chain_seed(model_fingerprint: str) -> int:
    """The parent name of a sequence's first block."""
    return _hash64(model_fingerprint.encode())


def block_hashes(token_ids: list[int], block_size: int, parent: int) -> list[int]:
    """Names of the full blocks of `token_ids`, chained from `parent` (the chain seed, or the name of the block
    before the first of them). A partial last block has no name."""
    names = []
    for i in range(len(token_ids) // block_size):
        parent = block_name(parent, token_ids[i * block_size : (i + 1) * block_size])
        names.append(parent)
    return names


def block_name(parent: int, token_ids: list[int]) -> int:
    """The name of a full block holding `token_ids`, after the block named `parent`."""
    return _hash64(parent.to_bytes(8, "little") + array.array("q", token_ids).tobytes())


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


# ---- router <-> node ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """First message on every connection: who I am, and which protocol I speak. Its fields and HelloAck's stay
    plain strings, so that a peer of another protocol version is still answered with the reason it is refused."""

    protocol_version: int
    role: str
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HelloAck:
    ok: bool
    role: str
    info: dict = field(default_factory=dict)
    reason: str = ""


ROUTER_ID_END = "/"  # a request id may begin with its router's routing id, ended by this


def router_of(request_id: str) -> str:
    """The routing id of the router that dispatched `request_id` ("" when the id names none). A router connects to
    every node under one routing id and begins its request ids with it, so every node, the decode node that gets the
    request from a prefill node included, sends the request's events to the router process that dispatched it."""
    head, end, _ = request_id.partition(ROUTER_ID_END)
    return head if end else ""


@dataclass(frozen=True)
class Generate:
    """Router -> colocated or prefill node; or a decode node whose prefix cache holds the prompt but for a few tokens,
    which it computes itself (conditional disaggregation). `decode_addr` names the decode node when a prefill node
    computes the prompt. `request_id` begins with the router's routing id (router_of)."""

    request_id: str
    prompt_token_ids: list[Id]
    params: SamplingParams
    decode_addr: str = ""


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of consecutive tokens: each token's own, and the most likely ids at its position
    with theirs (as many as the request asked for, most likely first)."""

    logprobs: list[float]
    top_ids: list[list[Id]]
    top_logprobs: list[list[float]]

    def __post_init__(self) -> None:
        rows = (self.top_ids, self.top_logprobs)
        if any(len(r) != len(self.logprobs) for r in rows) or any(
            len(i) != len(v) or len(i) > MAX_LOGPROBS for i, v in zip(*rows, strict=True)
        ):
            raise ValueError(
                f"one log-probability per token, and per token matching lists of at most {MAX_LOGPROBS} "
                "alternative ids and log-probabilities"
            )


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request; `finish_reason` set on its last event ("stop", "length", "abort", "error").
    `logprobs` has one entry per token of `token_ids` when the request asked for them; `prompt_logprobs`
    (on the first event) one per prompt token after the first."""

    request_id: str
    token_ids: list[Id]
    finish_reason: FinishReason | None = None
    error: str = ""
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    error_code: ErrorCode | None = None  # set exactly when finish_reason is "error"

    def __post_init__(self) -> None:
        if (self.finish_reason == FinishReason.ERROR) != (self.error_code is not None):
            raise ValueError("an error event carries an error code, and only an error event does")


@dataclass(frozen=True)
class TokenEvents:
    """All the events of one engine step, batched into one message. A plain event (a request's new tokens and nothing
    else: all but a request's last, unless it asked for log-probabilities) travels flat in `tokens`, as its request
    id and token ids ([id, ids, id, ids, ...]): no map to write per event, no event to build on arrival; the others
    in `events`. `of` makes one from a step's events; `all` gives them back."""

    events: list[TokenEvent]
    tokens: list = field(default_factory=list)

    @classmethod
    def of(cls, events: list[TokenEvent]) -> TokenEvents:
        """The message of `events`, the plain ones flat where each event is a different request's (so that taking
        the flat ones first keeps every request's events in order)."""
        if len({ev.request_id for ev in events}) != len(events):
            return cls(events)
        tokens, others = [], []
        for ev in events:
            if _is_plain(ev):
                tokens += (ev.request_id, ev.token_ids)
            else:
                others.append(ev)
        return cls(others, tokens)

    def all(self) -> list[TokenEvent]:
        """Every event of the message, the flat ones first."""
        pairs = zip(self.tokens[::2], self.tokens[1::2], strict=True)
        return [TokenEvent(rid, ids) for rid, ids in pairs] + self.events


@dataclass(frozen=True)
class Stats:
    """Periodic load and counters of a node (doubles as its heartbeat)."""

    role: Role
    num_running: Id
    num_waiting: Id
    kv_blocks_used: Id
    kv_blocks_free: Id
    counters: dict = field(default_factory=dict)
    draining: bool = False  # shutting down: finishes what it holds, takes nothing new
    num_held: Id = 0  # entries in the node's request tables (0 when it holds nothing: no leak)
    cache_stored: list[Id] = field(default_factory=list)  # prefix cache: block names stored since the last Stats
    cache_evicted: list[Id] = field(default_factory=list)  # and evicted
    cache_reset: bool = False  # cache_stored is the whole cache (the first Stats after a Hello)


@dataclass(frozen=True)
class Pending:
    """Router -> a node: the requests it still counts on that node (some may not have reached it yet), in answer to the
    node's draining Stats; empty and unasked from a router that stops (it will route nothing there again)."""

    request_ids: list[str]


# ---- prefill node <-> decode node (KV transfer) ------------------------------------------------


@dataclass(frozen=True)
class KvHello:
    """Prefill -> decode on connect: the layout both sides must agree on before any KV moves, and the
    transports the prefill node can send with, preferred first; the decode node's HelloAck names the one
    it chose (info["transport"])."""

    protocol_version: int
    layout: dict
    transport: str  # the prefill node's --kv-transport (a KvTransport; a string, as in Hello, to be refused)
    pool_handle: dict = field(default_factory=dict)  # shm / cuda_ipc: how to map the prefill pool
    host_id: str = ""  # a shared pool is used only between nodes of the same host id
    transports: list[str] = field(default_factory=list)  # empty: [transport]


@dataclass(frozen=True)
class KvOffer:
    """Prefill -> decode: a request whose prompt KV is ready; the decode node reserves blocks first."""

    request_id: str
    prompt_token_ids: list[Id]
    first_token_id: Id
    params: SamplingParams
    num_tokens: Id  # tokens whose KV is shipped (the prompt)


@dataclass(frozen=True)
class KvPull:
    """Decode -> prefill: blocks are reserved, send the KV now, from block `first_block` of the prompt on (the
    decode node holds the KV of the blocks before, from its prefix cache)."""

    request_id: str
    first_block: Id = 0


@dataclass(frozen=True)
class KvData:
    """Prefill -> decode. zmq: one message per layer, its KV as one raw frame after this header.
    shm/cuda_ipc: one message for all layers (layer = -1), naming the blocks in the shared pool."""

    request_id: str
    dtype: str
    shape: list[Id]  # zmq: [2, num_kv_heads, num_block_tokens, head_dim] of one layer
    layer: int = -1
    src_blocks: list[Id] = field(default_factory=list)
    kv_checksums: list[Id] = field(default_factory=list)  # first message: a CRC-32 per layer of the KV shipped


@dataclass(frozen=True)
class KvAck:
    """Decode -> prefill: KV landed (ok) or was refused; either way the prefill node frees its copy."""

    request_id: str
    ok: bool
    reason: str = ""
    error_code: ErrorCode | None = None  # why it was refused (None when ok)


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
        Hello,
        HelloAck,
        Generate,
        Abort,
        TokenEvent,
        TokenEvents,
        Stats,
        Pending,
        KvHello,
        KvOffer,
        KvPull,
        KvData,
        KvAck,
        KvWaiting,
        KvCancel,
    )
}


def _wire_map(value: Any) -> dict:
    """A message (or nested part) as msgpack takes it, called by msgpack for each dataclass it meets, so that lists of
    ids and strings are packed in C, not visited here. A field at its plain default is left out (the decoder fills it
    in), so that a token event is two fields, not seven. Enums are StrEnums, which msgpack packs as their value."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"cannot encode a {type(value).__name__}")
    out = {}
    for name, default in _wire_fields(type(value)):
        v = getattr(value, name)
        if type(v) is not type(default) or v != default:
            out[name] = v
    return out


@functools.cache
def _wire_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each field of a message class; dataclasses.MISSING where the default is none or a
    factory's (a field that is always sent)."""
    return tuple((f.name, f.default) for f in dataclasses.fields(cls))


def encode(msg: Any) -> bytes:
    tag = type(msg).__name__
    if _REGISTRY.get(tag) is not type(msg):
        raise TypeError(f"{tag} is not a registered message type")
    body = _wire_map(msg)
    body["t"] = tag
    return msgpack.packb(body, use_bin_type=True, default=_wire_map)


def _build(cls: type, body: Any) -> Any:
    """A message (or nested part) of type `cls` from its decoded map, every field checked against its type."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: expected a map, got {type(body).__name__}")
    if cls is TokenEvent and (plain := _plain_token_event(body)) is not None:
        return plain
    if cls is TokenEvents:  # one a step and node: the hot path
        if not body.keys() <= {"events", "tokens"} or type(body.get("events")) is not list:
            raise ProtocolError(f"TokenEvents: expected events (a list) and tokens, got {sorted(body)}")
        return TokenEvents([_build(TokenEvent, e) for e in body["events"]], _flat_tokens(body.get("tokens", [])))
    checkers = _field_checkers(cls)
    unknown = body.keys() - checkers.keys()
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    kwargs = {name: checkers[name](value) for name, value in body.items()}
    try:
        return cls(**kwargs)
    except Exception as e:  # a missing field, or a value its __post_init__ refuses
        raise ProtocolError(f"{cls.__name__}: {e}") from e


_EVENT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TokenEvent) if f.default is not dataclasses.MISSING}


def _is_plain(ev: TokenEvent) -> bool:
    """Whether every field of `ev` but its request and tokens is at its default (as `encode` leaves them out): a field
    added to TokenEvent is then never dropped by the flat form."""
    fields = ev.__dict__
    return all(fields[name] == default for name, default in _EVENT_DEFAULTS.items())


def _plain_token_event(body: dict) -> TokenEvent | None:
    """The commonest message part, a request's new tokens and nothing else (its other fields at their defaults, so
    left out by `encode`), checked in a few steps: one arrives per request and step. None for any other event,
    which the general checks take."""
    rid, ids = body.get("request_id"), body.get("token_ids")
    if len(body) != 2 or type(rid) is not str or type(ids) is not list:
        return None
    for t in ids:
        if type(t) is not int or t < 0:
            return None
    ev = object.__new__(TokenEvent)  # what TokenEvent(rid, ids) gives, without a frozen dataclass's slow __init__
    ev.__dict__.update(_EVENT_DEFAULTS, request_id=rid, token_ids=ids)
    return ev


def _flat_tokens(tokens: Any) -> list:
    """TokenEvents.tokens checked: request ids (strings) and lists of token ids (non-negative integers), in turn."""
    if type(tokens) is not list or len(tokens) % 2:
        raise ProtocolError("TokenEvents.tokens must be a list of request ids and token id lists, in turn")
    for k in range(0, len(tokens), 2):
        rid, ids = tokens[k], tokens[k + 1]
        if type(rid) is not str or type(ids) is not list:
            raise ProtocolError("TokenEvents.tokens must be a list of request ids and token id lists, in turn")
        for t in ids:
            if type(t) is not int or t < 0:
                raise ProtocolError("TokenEvents.tokens[] must be non-negative integers")
    return tokens


@functools.cache
def _field_checkers(cls: type) -> dict[str, Any]:
    """Per field of a message class, a function that returns the value as declared or raises (built once)."""
    hints = typing.get_type_hints(cls)
    return {f.name: _checker(hints[f.name], f"{cls.__name__}.{f.name}") for f in dataclasses.fields(cls)}


def _checker(hint: Any, where: str):
    """A function checking a value against the declared type `hint`: nested messages built, lists to tuples
    where declared, ints accepted as floats."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = _checker(next(a for a in args if a is not type(None)), where)
        return lambda v: None if v is None else inner(v)
    if dataclasses.is_dataclass(hint):
        return lambda v: _build(hint, v)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_checker(hint, where)
    if origin is tuple and args and args[-1] is not Ellipsis:  # a fixed-length tuple: one type per place
        places = [_checker(a, f"{where}[{i}]") for i, a in enumerate(args)]

        def fixed(v):
            if not isinstance(v, (list, tuple)) or len(v) != len(places):
                raise ProtocolError(f"{where} must be a list of {len(places)}")
            return tuple(check(x) for check, x in zip(places, v, strict=True))

        return fixed
    if origin in (list, tuple):
        item, as_tuple = _checker(args[0], f"{where}[]"), origin is tuple
        plain = _SCALARS.get(args[0], (None, ""))[0] if args[0] is not float else None  # kept as they are

        def sequence(v):
            if not isinstance(v, (list, tuple)):
                raise ProtocolError(f"{where} must be a list")
            if plain is not None and all(map(plain, v)):
                items = v
            else:
                items = [item(x) for x in v]
            return tuple(items) if as_tuple else list(items)

        return sequence
    ok, name = _SCALARS[hint]

    def scalar(v):
        if not ok(v):
            raise ProtocolError(f"{where} must be {name}")
        return float(v) if hint is float else v

    return scalar


def _enum_checker(cls: type[enum.Enum], where: str):
    values = {m.value: m for m in cls}

    def member(v):
        if type(v) is not str or v not in values:
            raise ProtocolError(f"{where} must be one of {', '.join(values)}")
        return values[v]

    return member


_SCALARS = {
    Id: (lambda v: type(v) is int and v >= 0, "a non-negative integer"),
    int: (lambda v: type(v) is int, "an integer"),
    float: (lambda v: type(v) in (int, float), "a number"),
    str: (lambda v: type(v) is str, "a string"),
    bool: (lambda v: type(v) is bool, "true or false"),
    dict: (lambda v: type(v) is dict, "a map"),
}


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
