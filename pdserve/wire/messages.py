"""The wire's messages between router, prefill, decode and colocated nodes, torch-free: frozen dataclasses, each
registered by an explicit type tag in `MESSAGES` (codec.py encodes and decodes them; tensors never go in here, they
follow as raw frames, see transport.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.wire.params import MAX_LOGPROBS, ErrorCode, FinishReason, Id, Role, SamplingParams

# 2: KV head-major, [2, nkv, n, d] per layer; 3: log-probabilities, KvHello transports; 4: Stats.draining, Pending;
# 5: guided decoding (SamplingParams.grammar, grammar_prefix), KV checksums (KvOffer.kv_checksums), Stats.num_held,
#    error codes (TokenEvent.error_code, KvAck.error_code), no StatsRequest, enum-checked finish reasons and roles;
# 6: SamplingParams.resumed (a resumed seeded request draws on from where its stream stands)
# 7: partial KV transfers (KvPull.first_block), the checksums travel with the KV (KvData.kv_checksums, not KvOffer),
#    prefix cache events in Stats (cache_stored, cache_evicted, cache_reset)
# 8: plain token events travel flat in TokenEvents.tokens
# 9: a shared pool's transfer is never pulled: the offer carries the prompt's source blocks and checksums
#    (KvOffer.kv), the decode node copies them at once and its KvAck says from which block (KvAck.first_block)
# 10: histograms in Stats (Stats.histograms: the decode node's hand-off in parts)
# 11: a shared pool's offer carries the CRC-32 of its blocks' last layer only (KvOffer.kv.kv_checksums); the decode
#     node compares every layer it copied with the prefill pool's blocks
PROTOCOL_VERSION = 11


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


EVENT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TokenEvent) if f.default is not dataclasses.MISSING}


def is_plain(ev: TokenEvent) -> bool:
    """Whether every field of `ev` but its request and tokens is at its default (as the codec leaves them out): a field
    added to TokenEvent is then never dropped by the flat form."""
    fields = ev.__dict__
    return all(fields[name] == default for name, default in EVENT_DEFAULTS.items())


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
            if is_plain(ev):
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
    # name -> {"bounds": upper bounds (seconds, +Inf implied), "counts": per bucket (len(bounds) + 1), "sum": total}
    histograms: dict = field(default_factory=dict)


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
    """Prefill -> decode: a request whose prompt KV is ready; the decode node reserves blocks first. Over a shared
    pool (shm, cuda_ipc) `kv` names the prompt's blocks there, with the CRC-32 of their last layer's KV
    (`kv.kv_checksums`, one value; [] off the CPU): the decode node copies them once its blocks are reserved, with no
    pull, checks every layer it copied against those blocks and the last one against that CRC; None: it pulls (zmq)."""

    request_id: str
    prompt_token_ids: list[Id]
    first_token_id: Id
    params: SamplingParams
    num_tokens: Id  # tokens whose KV is shipped (the prompt)
    kv: KvData | None = None


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
    # first message: a CRC-32 per layer of the KV shipped (a shared pool's offer: of its last layer only)
    kv_checksums: list[Id] = field(default_factory=list)


@dataclass(frozen=True)
class KvAck:
    """Decode -> prefill: KV landed (ok) or was refused; either way the prefill node frees its copy. Over a shared
    pool it goes once the decode node's copy is done (never before: the prefill node then frees the source blocks)."""

    request_id: str
    ok: bool
    reason: str = ""
    error_code: ErrorCode | None = None  # why it was refused (None when ok)
    first_block: Id = 0  # a copy out of a shared pool: the first prompt block copied (those before were cached)


@dataclass(frozen=True)
class KvWaiting:
    """Decode -> prefill, periodically: these offers are queued here for free blocks; keep their KV."""

    request_ids: list[str]


@dataclass(frozen=True)
class KvCancel:
    """Prefill -> decode: the request was aborted; forget any offer or reservation."""

    request_id: str


MESSAGES: dict[str, type] = {  # type tag -> message class: the only classes a peer can make us build
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
