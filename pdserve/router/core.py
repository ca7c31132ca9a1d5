"""The router's state: its connections to the nodes, and every request in flight.

Everything here runs on the router's one event loop, so one task at a time owns the state: HTTP
handlers call `submit` / `abort` and take events from the request's inbox (or have them pushed); the event loop
watches each node's socket and its monitor, and reads them (`_read`, `_read_monitor`) when they wake; one watchdog
marks silent or disconnected nodes down and fails their requests.

A request's life in the router:
1. admission: refused (429, Retry-After) while --max-queued-requests requests wait for a first token.
2. submit: pick a live node of each role it needs, draining ones excepted: the one whose prefix cache
   holds the longest prefix of the prompt (the router names the prompt's blocks as the nodes do, and
   follows each node's cache through the changes its Stats carry, and adds the blocks a request that ended
   well leaves on its node at once: `leaves_cached`), unless it holds more than
   --cache-balance-margin requests above the least loaded; among equals the least loaded (fewest
   requests, then fewest KV blocks used; ties go to the node listed first: command-line or
   registration order); send Generate (the prefill node also learns the decode node's KV address).
   Disaggregated, the decode node is picked first: when its cache holds all but at most
   --local-prefill-max-tokens tokens of the prompt (and at least its first block), the Generate goes
   to it alone and it computes the rest of the prompt itself (conditional disaggregation: no prefill
   node, no KV transfer); otherwise a prefill node is picked too.
3. events: the colocated or prefill node sends the first token, the decode node an empty "KV
   landed" event and then the rest; a decode node that prefilled the prompt itself sends them all,
   as a colocated node does.
4. a node it depends on is lost (dead, silent, or failing it because it drains): the request is
   dispatched again, under a new id, to other nodes, its old id aborted on the nodes that remain. It
   resumes where the client's stream stands: the new prompt is the old one plus the tokens already
   streamed, max_tokens what is left (greedy output is unchanged, and so is a seeded sampler's: it
   draws on from the token it stands at). A request whose KV landed on a decode node no longer depends
   on its prefill node. At most MAX_ATTEMPTS dispatches in all; with no node left of a role, it fails (503).
5. end: a final event (stop, length, error), an abort from the client side (disconnect or stop
   string: Abort goes to every node the request touched), no first token within --queue-timeout-s
   (503), or a lost node as above.

Which nodes there are comes from a membership source (membership.py): a fixed list, read once, or a
Ray deployment's registry, read every `membership_interval_s`: new nodes join, gone ones leave (their
requests fail as a dead node's do).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from pdserve.config import RouterConfig
from pdserve.router import native
from pdserve.router.membership import Member, make_membership
from pdserve.router.metrics import NodeCollector, RouterMetrics
from pdserve.wire import transport
from pdserve.wire.codec import ProtocolError, encode
from pdserve.wire.messages import (
    PROTOCOL_VERSION,
    ROUTER_ID_END,
    Abort,
    Generate,
    Hello,
    HelloAck,
    Pending,
    Stats,
    TokenEvent,
    TokenEvents,
)
from pdserve.wire.params import ErrorCode, FinishReason, Role, SamplingParams, block_hashes, chain_seed

log = logging.getLogger("pdserve.router")
MAX_ATTEMPTS = 3  # dispatches of one request, the first included, before a lost node fails it
MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | transport.HANDSHAKE_FAILED
GOODBYE_LINGER_MS = 200  # how long a stopping router's last message to each node may take to go out
READ_BATCH = 256  # messages read from one socket before the other callbacks and tasks get a turn
# the enum members of the per-token path, looked up once (on its class, an enum member costs about a microsecond)
ERROR, DECODE, PREFILL = FinishReason.ERROR, Role.DECODE, Role.PREFILL
NODE_FAILED = ErrorCode.NODE_FAILED
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enums cost a Python call per use


class NoNodeAvailable(RuntimeError):
    pass


class StartupError(RuntimeError):
    """The router cannot start serving: its nodes did not answer in time, or it was stopped before they did."""


class Overloaded(RuntimeError):
    """Too many requests wait for a first token; the client should come back in `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class NodeConn:
    role: Role
    addr: str
    kv_addr: str = ""
    sock: zmq.Socket | None = None
    monitor: zmq.Socket | None = None  # the socket's connection events
    up: bool = False
    greeted: bool = False  # a Hello went out: the node may count this router among its routers
    draining: bool = False  # shutting down: finishes what it holds, takes nothing new
    last_seen: float = 0.0
    stats: Stats | None = None
    reports: int = 0  # Stats messages received since the router started
    info: dict = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)
    cached: set[int] = field(default_factory=set)  # the block names its prefix cache holds, as its Stats tell
    ever_up: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return f"{self.role}@{self.addr}"

    @property
    def member(self) -> Member:
        return Member(self.role, self.addr, self.kv_addr)

    @property
    def usable(self) -> bool:
        return self.up and not self.draining


class Inbox:
    """A request's events on their way from the core to what streams them. Pulled: `put` appends without waking
    anything but the task that waits in `take`, which hands over every event that came since the last take (one node
    message's, unless the stream fell behind), so a task switch serves them all. Pushed (after `attach`): `put` hands
    each event straight to a callback, on the node reader's stack, with no task switch at all."""

    __slots__ = ("events", "waiter", "push", "push_tokens")

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.waiter: asyncio.Future | None = None
        self.push: Callable[[TokenEvent], None] | None = None
        self.push_tokens: Callable[[list[int]], None] | None = None  # plain events' tokens, where the pusher takes them

    def put(self, ev: TokenEvent) -> None:
        if self.push is not None:
            self.push(ev)
            return
        self.events.append(ev)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def attach(
        self, push: Callable[[TokenEvent], None], push_tokens: Callable[[list[int]], None] | None = None
    ) -> None:
        """From now on hand every event to `push` (which must not raise), those that came already first; a plain
        event's tokens to `push_tokens`, where given."""
        self.push, self.push_tokens = push, push_tokens
        events, self.events = self.events, []
        for ev in events:
            push(ev)

    async def take(self) -> list[TokenEvent]:
        while not self.events:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        events, self.events = self.events, []
        return events


@dataclass(eq=False)
class Flight:
    """One request in flight. `request_id` changes when the request is dispatched again."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    inbox: Inbox = field(default_factory=Inbox)
    nodes: list[NodeConn] = field(default_factory=list)  # [colocated] or [prefill, decode]
    start: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    decode_started: bool = False  # disaggregated: the decode node has sent a token
    output: list[int] = field(default_factory=list)  # token ids streamed so far
    attempts: int = 0
    ended: bool = False
    early: list[TokenEvent] = field(default_factory=list)  # decode events that beat the first token
    names: list[int] = field(default_factory=list)  # its block names at the latest dispatch ([]: none taken)
    steady: NodeConn | None = None  # the node whose next plain events are only tokens (RouterCore._deliver_tokens)

    @property
    def handed_off(self) -> bool:
        """Whether its prompt is computed on a prefill node and its KV shipped to its decode node."""
        return bool(self.nodes) and self.nodes[0].role is PREFILL  # [prefill, decode]: once a token, kept cheap


def _put_tokens(inbox: Inbox, request_id: str, token_ids: list[int]) -> None:
    """A steady request's tokens, to an inbox whose stream does not take them bare: as an event."""
    inbox.put(TokenEvent(request_id, token_ids))


def leaves_cached(node: NodeConn, flight: Flight, layout: dict) -> None:
    """A request that ended well on `node` (the one that sent its last token: colocated, decode, or a prefill node
    for a one-token answer) left its computed full blocks in the node's cache: its prompt's and its output's but the
    last token's, whose KV was never computed. Add their names to the router's view now, rather than when the
    node's next Stats tells (the next turn of a conversation comes at once); that Stats then removes any the node
    has evicted since."""
    if not node.info.get("prefix_caching"):
        return
    bs, names = layout["block_size"], flight.names
    tokens = flight.prompt + flight.output
    full = (len(tokens) - 1) // bs
    if full > len(names):
        parent = names[-1] if names else chain_seed(layout["model_fingerprint"])
        names = names + block_hashes(tokens[len(names) * bs : full * bs], bs, parent)
    node.cached.update(names[:full])


def follow_cache(node: NodeConn, stats: Stats) -> None:
    """Apply a node's prefix cache changes (or, after a Hello, its whole cache) to the router's view of it."""
    if stats.cache_reset:
        node.cached = set(stats.cache_stored)
        return
    node.cached.update(stats.cache_stored)
    node.cached.difference_update(stats.cache_evicted)


def cached_prefix(cached: set[int], names: list[int]) -> int:
    """How many of `names`, from the first, are in `cached`."""
    n = 0
    while n < len(names) and names[n] in cached:
        n += 1
    return n


def tokens_to_compute(num_tokens: int, cached_blocks: int, block_size: int) -> int:
    """The tokens of a prompt of `num_tokens` a node computes when its cache holds the prompt's first `cached_blocks`
    blocks: those after the blocks it shares, which never include the block of the last token (its logits give the
    first token), as the scheduler shares them."""
    return num_tokens - min(cached_blocks, (num_tokens - 1) // block_size) * block_size


class RouterCore:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.started = time.monotonic()  # a node's join is logged with its time since then
        self.ctx = zmq.Context()
        self.membership = make_membership(cfg)
        self.keys = transport.load_keys(cfg.zmq_keys) if cfg.zmq_keys else None
        self.nodes: list[NodeConn] = []  # changed in place only: the metrics collector holds this list
        self.flights: dict[str, Flight] = {}
        self.waiting: set[Flight] = set()  # admitted, no first token yet
        self.draining = False
        self.metrics = RouterMetrics()
        self.metrics.registry.register(NodeCollector(self.nodes))
        self.metrics.in_flight.set_function(lambda: len(self.flights))
        self.metrics.waiting.set_function(lambda: len(self.waiting))
        self._ttft_recent = 1.0  # seconds, a moving average: the Retry-After of a refused request
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()
        self.routing_id = f"router-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # on every node connection; leads our ids
        self.start_cancelled = asyncio.Event()  # set by a SIGTERM that comes before the nodes answered
        self.native = native.load() if cfg.token_path == "auto" else None  # the per-token path in C (None: Python)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self._sync_members()
        self._tasks.append(asyncio.create_task(self._watchdog()))
        if self.cfg.ray_address:
            self._tasks.append(asyncio.create_task(self._follow_members()))
        await self._await_nodes()
        self._check_pairing()

    async def _await_nodes(self) -> None:
        """Wait until every node has answered once; a StartupError past --connect-timeout-s, or once the start is
        cancelled (a SIGTERM before the nodes answered)."""
        log.info(
            "waiting up to %g s for the nodes to answer: %s",
            self.cfg.connect_timeout_s,
            ", ".join(n.name for n in self.nodes),
        )
        answered = asyncio.ensure_future(asyncio.gather(*(n.ever_up.wait() for n in self.nodes)))
        cancelled = asyncio.ensure_future(self.start_cancelled.wait())
        await asyncio.wait(
            {answered, cancelled}, timeout=self.cfg.connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        all_answered = answered.done()
        for waiter in (answered, cancelled):
            waiter.cancel()
        await asyncio.gather(answered, cancelled, return_exceptions=True)
        if self.start_cancelled.is_set():
            raise StartupError("stopped before the nodes answered")
        if not all_answered:
            down = ", ".join(n.name for n in self.nodes if not n.up)
            raise StartupError(
                f"nodes did not answer within {self.cfg.connect_timeout_s:g} s: {down} "
                "(are they running, at these addresses?)"
            )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for node in self.nodes:
            self._unwatch(node, linger_ms=GOODBYE_LINGER_MS if self._say_goodbye(node) else 0)
        self.ctx.destroy(linger=0)
        self.membership.close()

    def _say_goodbye(self, node: NodeConn) -> bool:
        """Tell a node this router greeted that it routes nothing there any more (an empty Pending, unasked), so that
        the node, draining later, does not wait for its answer (node.ROUTER_ANSWER_S); greeted, not only answered: the
        node counts a router once it has its Hello. True where it was sent: its socket then closes with a short
        linger, for it to go out."""
        if not node.greeted or node.sock is None or node.sock.closed:  # greeted, even if not answered yet
            return False
        try:
            node.sock.send(encode(Pending([])), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False  # its connection is gone: nothing to tell
        return True

    async def drain(self, grace_s: float) -> None:
        """Take no new requests; wait up to `grace_s` for those in flight, then fail the rest (503)."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for flight in list(self.flights.values()):
            self._fail(
                flight, f"the router is shutting down and its drain period of {grace_s}s ran out", ErrorCode.DRAINING
            )

    def _check_pairing(self) -> None:
        """Every node must serve the same model layout, or outputs would be garbage."""
        layouts = {n.name: n.info.get("layout", {}) for n in self.nodes}
        if not layouts:
            return
        first_name, first = next(iter(layouts.items()))
        for name, layout in layouts.items():
            if layout.get("model_fingerprint") != first.get("model_fingerprint"):
                raise RuntimeError(f"{name} serves a different model than {first_name}")

    # ---- membership ---------------------------------------------------------------------------
    async def _follow_members(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.membership_interval_s)
            try:
                await self._sync_members()
            except Exception as e:  # the registry may be out of reach for a while: keep the nodes we have
                log.warning("cannot read the node list: %s", e)

    async def _sync_members(self) -> None:
        listed = await self.membership.members()
        wanted = set(listed)
        for node in [n for n in self.nodes if n.member not in wanted]:
            self._leave(node)
        have = {n.member for n in self.nodes}
        for m in dict.fromkeys(m for m in listed if m not in have):  # in the order listed: ties in _pick go first
            self._join(NodeConn(m.role, m.addr, m.kv_addr))

    def _join(self, node: NodeConn) -> None:
        node.sock = self.ctx.socket(zmq.DEALER)
        node.sock.setsockopt(zmq.ROUTING_ID, self.routing_id.encode())
        transport.configure(node.sock)
        transport.secure_client(node.sock, self.keys)
        node.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        node.monitor = node.sock.get_monitor_socket(MONITORED)
        node.sock.connect(node.addr)
        loop = asyncio.get_running_loop()
        loop.add_reader(node.sock.FD, self._read, node)
        loop.add_reader(node.monitor.FD, self._read_monitor, node)
        loop.call_soon(self._read_monitor, node)  # what came before the loop watched: its wake-up may be past
        self.nodes.append(node)
        log.info("%s joined", node.name)

    def _leave(self, node: NodeConn) -> None:
        self._node_down(node, "it left the cluster")
        self.nodes.remove(node)
        log.info("%s left", node.name)
        self._unwatch(node)

    def _unwatch(self, node: NodeConn, linger_ms: int = 0) -> None:
        """Stop reading the node's sockets, and close them (what is still to send there may take `linger_ms`)."""
        loop = asyncio.get_running_loop()
        for sock in (node.sock, node.monitor):
            if sock is not None and not sock.closed:
                loop.remove_reader(sock.FD)
        if node.sock is not None and not node.sock.closed:
            node.sock.disable_monitor()
            node.monitor.close(linger=0)
            node.sock.close(linger=linger_ms)

    def _same_model(self, node: NodeConn, info: dict) -> bool:
        """A node that joins must serve the model the others serve, or outputs would be garbage."""
        theirs = [n.info.get("layout", {}).get("model_fingerprint") for n in self.nodes if n.up and n is not node]
        return not theirs or info.get("layout", {}).get("model_fingerprint") == theirs[0]

    # ---- node I/O -----------------------------------------------------------------------------
    def _hello(self, node: NodeConn) -> None:
        self._send(node, Hello(PROTOCOL_VERSION, Role.ROUTER))
        node.greeted = True

    def _send(self, node: NodeConn, msg: object) -> None:
        """Send `msg` to the node (its socket's send queue has no bound: this never waits). A zmq socket's descriptor
        wakes only on a change, and a send may take in the change that a message from the node made: so look for
        messages after it, or one could wait unread until the node sends the next (seen: a prefill node's first
        tokens read 0.6 s late, after the decode node's next hundred tokens)."""
        node.sock.send(encode(msg), zmq.NOBLOCK)
        if node.sock.get(EVENTS) & POLLIN:
            asyncio.get_running_loop().call_soon(self._read, node)

    def _read(self, node: NodeConn) -> None:
        """Every message the node's socket holds (READ_BATCH at a time), when its descriptor wakes or a send may have
        hidden a wake-up."""
        if self._read_batch(node):
            asyncio.get_running_loop().call_soon(self._read, node)

    def _read_all(self, node: NodeConn) -> None:
        """Every message the node's socket holds now. After its peer disconnects a socket still holds what the peer
        sent before; the monitor's event may be read first."""
        while self._read_batch(node):
            pass

    def _read_batch(self, node: NodeConn) -> bool:
        """Up to READ_BATCH of the node's messages; True when that many were read (more may wait)."""
        sock = node.sock
        for _ in range(READ_BATCH):
            if sock.closed or not sock.get(EVENTS) & POLLIN:  # cheaper than the exception of an empty read
                return False
            self._on_message(node, sock.recv_multipart(zmq.NOBLOCK))  # bytes: cheaper than frames for small messages
        return True

    def _on_message(self, node: NodeConn, parts: list) -> None:
        try:
            _, msg, _ = transport.split(parts, routed=False)
        except ProtocolError as e:
            log.warning("%s sent a malformed message: %s", node.name, e)
            return
        node.last_seen = time.monotonic()
        if not node.up and isinstance(msg, Stats):
            self._hello(node)  # marked down for silence, yet alive: pair again
        if isinstance(msg, TokenEvents):
            self._deliver_tokens(msg.tokens, node)  # each request is in a message once: the plain events first
            for ev in msg.events:
                self._deliver(ev, node)
        elif isinstance(msg, Stats):
            node.stats, node.draining = msg, msg.draining
            node.reports += 1
            follow_cache(node, msg)
            if msg.draining:  # it may exit once nothing routed to it is left
                self._send(node, Pending(sorted(node.requests)))
        elif isinstance(msg, HelloAck):
            self._on_hello_ack(node, msg)

    def _on_hello_ack(self, node: NodeConn, msg: HelloAck) -> None:
        if not msg.ok or msg.role != node.role:
            log.error("%s refused the router: %s (role %s)", node.name, msg.reason, msg.role)
            return
        if not isinstance(msg.info, dict) or not self._same_model(node, msg.info):
            log.error("%s serves a different model than the other nodes; not using it", node.name)
            return
        node.info = msg.info
        node.up, node.draining = True, False
        node.ever_up.set()
        log.info("%s is up (joined %.1f s after the router started)", node.name, time.monotonic() - self.started)

    def _read_monitor(self, node: NodeConn) -> None:
        """Every connection event the node's monitor holds."""
        while not node.monitor.closed:
            try:
                event = parse_monitor_message(node.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                node.last_seen = time.monotonic()
                self._hello(node)
            elif event == zmq.EVENT_DISCONNECTED:
                self._read_all(node)  # what it sent before it went comes first (a drained node's last errors)
                self._node_down(node, "disconnected")
            elif event & transport.HANDSHAKE_FAILED:
                log.error("%s: the CurveZMQ handshake failed; do both sides use the same --zmq-keys?", node.name)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for node in self.nodes:
                if node.up and now - node.last_seen > self.cfg.node_timeout_s:
                    self._node_down(node, f"silent for {self.cfg.node_timeout_s}s")
                    self._hello(node)  # if it serves another peer now, win it back
            self._expire_waiting()

    def _expire_waiting(self) -> None:
        limit = self.cfg.queue_timeout_s
        now = time.perf_counter()
        for flight in [f for f in self.waiting if now - f.start > limit]:
            self.metrics.timed_out.inc()
            self._fail(
                flight,
                f"no first token within {limit}s (--queue-timeout-s): the server is overloaded",
                ErrorCode.CAPACITY,
            )

    def _node_down(self, node: NodeConn, why: str) -> None:
        if node.up:
            log.error("%s is down (%s); %d requests in flight there", node.name, why, len(node.requests))
        node.up = False
        node.cached.clear()  # it sends its whole cache again once it is back
        for rid in list(node.requests):
            flight = self.flights.get(rid)
            if flight is not None:
                self._lost(flight, f"{node.role} node {node.addr} failed ({why})", ErrorCode.NODE_FAILED)

    # ---- requests -----------------------------------------------------------------------------
    def check_admission(self) -> None:
        """Raise Overloaded while the queue of requests without a first token is full."""
        if self.draining:
            raise NoNodeAvailable("the router is shutting down")
        if len(self.waiting) >= self.cfg.max_queued_requests:
            self.metrics.rejected.inc()
            raise Overloaded(
                f"{len(self.waiting)} requests are already waiting (--max-queued-requests); retry later",
                max(1, min(60, math.ceil(self._ttft_recent))),
            )

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Flight:
        self.check_admission()
        flight = Flight("", list(prompt_token_ids), params)
        self._dispatch(flight)
        self.waiting.add(flight)
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(len(flight.prompt))
        return flight

    def _pick(self, role: Role, names: list[int] = ()) -> NodeConn:
        """The live node of `role` holding the longest cached prefix of the prompt whose block names are `names`,
        among those within --cache-balance-margin requests of the least loaded (-1: by load only); the least loaded
        among equals (fewest requests, then fewest KV blocks used; ties go to the node listed first)."""
        live = [n for n in self.nodes if n.role == role and n.usable]
        if not live:
            raise NoNodeAvailable(f"no {role} node is up")
        margin = self.cfg.cache_balance_margin
        names = names if margin >= 0 else []
        least = min(len(n.requests) for n in live)
        near = [n for n in live if len(n.requests) <= least + margin] if names else live
        return min(
            near,
            key=lambda n: (-cached_prefix(n.cached, names), len(n.requests), n.stats.kv_blocks_used if n.stats else 0),
        )

    def _layout(self) -> dict | None:
        """The nodes' KV layout (block size, model fingerprint), as their HelloAck gave it."""
        return next((n.info.get("layout") for n in self.nodes if isinstance(n.info.get("layout"), dict)), None)

    def _names_layout(self) -> dict | None:
        """The nodes' layout, by which blocks are named, when routing looks at the nodes' caches (cache-aware picks,
        or conditional disaggregation); None when it does not, or no node has told it yet."""
        cfg = self.cfg
        used = cfg.cache_balance_margin >= 0 or (cfg.mode == "disagg" and cfg.local_prefill_max_tokens != 0)
        return self._layout() if used else None

    def _block_names(self, prompt: list[int]) -> list[int]:
        """The prompt's block names as the nodes name them ([] when no node caches, or nothing here uses them)."""
        layout = self._names_layout()
        if layout is None or not any(n.cached for n in self.nodes):
            return []
        return block_hashes(prompt, layout["block_size"], chain_seed(layout["model_fingerprint"]))

    def _local_prefill_limit(self, decode: NodeConn) -> int:
        """The most prompt tokens `decode` may compute itself (--local-prefill-max-tokens; by default its own
        --max-num-batched-tokens, one chunk; 0: none)."""
        limit = self.cfg.local_prefill_max_tokens
        return int(decode.info.get("max_num_batched_tokens", 0)) if limit is None else limit

    def _prefills_locally(self, decode: NodeConn, prompt: list[int], names: list[int], params: SamplingParams) -> bool:
        """Conditional disaggregation: whether `decode` holds (as its Stats tell) the prompt's first block and all but
        at most its limit of tokens, so that it computes the rest itself. A request scored at every prompt position
        (echo with logprobs) shares no cached block: never."""
        hit, layout = cached_prefix(decode.cached, names), self._layout()
        if not hit or layout is None or params.prompt_logprobs is not None:
            return False
        return tokens_to_compute(len(prompt), hit, layout["block_size"]) <= self._local_prefill_limit(decode)

    def _takes_a_queued_prefill(self, decode: NodeConn, params: SamplingParams) -> bool:
        """Conditional disaggregation by load (--max-prefill-queue): whether every live prefill node holds at least
        that many of this router's requests not yet handed to their decode node, while `decode` holds fewer prompts
        of its own still waiting for their first token, so that it takes the next prompt as a prefill node would.
        Never for a request scored at every prompt position (echo with logprobs)."""
        limit = self.cfg.max_prefill_queue
        if not limit or params.prompt_logprobs is not None:
            return False
        shortest = min((len(n.requests) for n in self.nodes if n.role is PREFILL and n.usable), default=0)
        if shortest < limit:
            return False
        own = sum(1 for f in self.waiting if len(f.nodes) == 1 and f.nodes[0] is decode)
        return own < shortest

    def _dispatch(self, flight: Flight) -> None:
        """Send the request, from where its stream stands, to the nodes that cache most of it or are least loaded,
        under a new id."""
        rid = f"{self.routing_id}{ROUTER_ID_END}{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        prompt = flight.prompt + flight.output
        params = self._resumed_params(flight)
        names = self._block_names(prompt)
        if self.cfg.mode == "colocated":
            nodes = [self._pick(Role.COLOCATED, names)]
            msg = Generate(rid, prompt, params)
        else:
            decode = self._pick(Role.DECODE, names)
            if self._prefills_locally(decode, prompt, names, params) or self._takes_a_queued_prefill(decode, params):
                nodes, msg = [decode], Generate(rid, prompt, params)
            else:
                nodes = [self._pick(Role.PREFILL, names), decode]
                msg = Generate(rid, prompt, params, decode_addr=decode.kv_addr)
        flight.request_id, flight.nodes, flight.names, flight.steady = rid, nodes, names, None
        flight.attempts += 1
        self.flights[rid] = flight
        for n in nodes:
            n.requests.add(rid)
        self._send(nodes[0], msg)

    @staticmethod
    def _resumed_params(flight: Flight) -> SamplingParams:
        """The request's parameters for what is left of it once `flight.output` has been streamed: the tokens
        left, min_tokens likewise, no prompt log-probabilities again (they came with the first token), the count of
        streamed tokens (now the prompt's tail) so that a seeded sampler draws on from there, and for a guided request
        the grammar told to replay them."""
        done, params = len(flight.output), flight.params
        if not done:
            return params
        return dataclasses.replace(
            params,
            max_tokens=params.max_tokens - done,
            min_tokens=max(0, params.min_tokens - done),
            prompt_logprobs=None,
            resumed=done,
            grammar_prefix=done if params.grammar else 0,
        )

    def _lost(self, flight: Flight, why: str, code: ErrorCode) -> None:
        """A node the request depends on is gone: dispatch it again, from where its stream stands. `code`: the
        error the client gets if it cannot be."""
        if flight.attempts >= MAX_ATTEMPTS or self.draining or len(flight.output) >= flight.params.max_tokens:
            self._fail(flight, why, code)
            return
        old = flight.request_id
        self._abort_on_nodes(flight)  # a decode node remembers the abort, so a late offer is refused
        self._unlink(flight)
        flight.early.clear()
        try:
            self._dispatch(flight)
        except NoNodeAvailable as e:
            self._fail(flight, f"{why}; {e}", code)
            return
        self.metrics.redispatched.inc()
        log.warning("request %s: %s; dispatched again as %s", old, why, flight.request_id)

    def _deliver_tokens(self, tokens: list, source: NodeConn) -> None:
        """A node message's plain events (new tokens, nothing else; flat: request id, token ids, ...), the commonest by
        far. A steady request's (`Flight.steady`) are only tokens to count (the gap since its last, one clock reading
        a message) and hand over; any other goes the long way, as an event. The loop runs in C where built
        (native.py), else here."""
        now, gaps = time.perf_counter(), []
        try:
            if self.native is not None:
                count = self.native.deliver(tokens, self.flights, source, now, gaps, self._deliver_plain, _put_tokens)
            else:
                count = self._deliver_tokens_here(tokens, source, now, gaps)
        finally:  # the gaps of the clocks already moved on, even where a stream's push raised
            self.metrics.itl.observe_all(gaps)
        self.metrics.generation_tokens.inc(count)

    def _deliver_tokens_here(self, tokens: list, source: NodeConn, now: float, gaps: list[float]) -> int:
        """The loop of _deliver_tokens in Python (native.deliver's twin): the tokens handed over the short way."""
        flights, count = self.flights, 0
        for k in range(0, len(tokens), 2):
            request_id, token_ids = tokens[k], tokens[k + 1]
            flight = flights.get(request_id)
            if flight is None:
                continue  # already ended (aborted, failed, or dispatched again under a new id)
            if flight.steady is source and token_ids:
                gaps.append(now - flight.last_token_at)
                flight.last_token_at = now
                flight.output += token_ids
                count += len(token_ids)
                inbox = flight.inbox
                if inbox.push_tokens is not None:  # a plain event's tokens, where its stream takes them so
                    inbox.push_tokens(token_ids)
                else:
                    _put_tokens(inbox, request_id, token_ids)
            else:
                self._deliver_plain(request_id, token_ids, source)
        return count

    def _deliver_plain(self, request_id: str, token_ids: list[int], source: NodeConn) -> None:
        """A plain event of a request that is not steady: the long way."""
        self._deliver(TokenEvent(request_id, token_ids), source)

    def _deliver(self, ev: TokenEvent, source: NodeConn) -> None:
        flight = self.flights.get(ev.request_id)
        if flight is None:
            return  # already ended (aborted, failed, or dispatched again under a new id)
        if ev.finish_reason == ERROR and (source.draining or ev.error_code == NODE_FAILED):
            # a node that drains, or the decode node a prefill node shipped to was lost (the prefill node may
            # see its socket close before the router does): dispatch it again
            code = ErrorCode.DRAINING if source.draining else NODE_FAILED
            self._lost(flight, f"{source.name}: {ev.error}", code)
            return
        handed_off = source.role is DECODE and flight.handed_off
        if handed_off:
            if flight.first_token_at is None and ev.finish_reason != ERROR:
                flight.early.append(ev)  # two sockets: keep the prefill node's first token first
                return
            self._left_prefill(flight)  # the decode node has it: a prefill failure no longer concerns it
            if not ev.token_ids and ev.finish_reason is None:
                return  # the "KV landed" notice
        self._put(flight, ev, handed_off, source)
        if ev.token_ids and ev.finish_reason is None and (handed_off or not flight.handed_off):
            flight.steady = source  # its first tokens (handed off: from its decode node) are out (_deliver_tokens)
        if flight.early and source.role is PREFILL:
            early, flight.early = flight.early, []
            for e in early:
                self._deliver(e, flight.nodes[1])

    @staticmethod
    def _left_prefill(flight: Flight) -> None:
        prefill = flight.nodes[0]  # [prefill, decode]
        if prefill.role is PREFILL:
            prefill.requests.discard(flight.request_id)

    def _put(self, flight: Flight, ev: TokenEvent, from_decode: bool = False, source: NodeConn | None = None) -> None:
        """Hand an event to the request's stream; `source`: the node that sent it (None: the router's own)."""
        if ev.token_ids:
            self._observe_tokens(flight, ev.token_ids, from_decode)
        if ev.finish_reason is not None:
            if ev.finish_reason is ERROR:
                self._abort_on_nodes(flight)  # the nodes that still hold it must let it go
            elif source is not None and ev.finish_reason is not FinishReason.ABORT:
                layout = self._names_layout()
                if layout is not None:
                    leaves_cached(source, flight, layout)
            self._end(flight, ev.finish_reason)
        flight.inbox.put(ev)

    def _observe_tokens(self, flight: Flight, token_ids: list[int], from_decode: bool) -> None:
        now, m = time.perf_counter(), self.metrics
        if flight.first_token_at is None:
            flight.first_token_at = now
            self.waiting.discard(flight)
            m.ttft.observe(now - flight.start)
            self._ttft_recent += 0.05 * (now - flight.start - self._ttft_recent)
        elif flight.last_token_at is not None:
            m.itl.observe(now - flight.last_token_at)
        if from_decode and not flight.decode_started:
            flight.decode_started = True
            m.handoff.observe(now - flight.first_token_at)
        flight.last_token_at = now
        flight.output += token_ids
        m.generation_tokens.inc(len(token_ids))

    def _fail(self, flight: Flight, why: str, code: ErrorCode) -> None:
        self._put(flight, TokenEvent(flight.request_id, [], FinishReason.ERROR, why, error_code=code))

    def _unlink(self, flight: Flight) -> None:
        self.flights.pop(flight.request_id, None)
        for n in flight.nodes:
            n.requests.discard(flight.request_id)

    def _end(self, flight: Flight, reason: FinishReason = FinishReason.ABORT) -> None:
        if flight.ended:
            return
        flight.ended = True
        self._unlink(flight)
        self.waiting.discard(flight)
        m, num_tokens = self.metrics, len(flight.output)
        m.success.labels(reason).inc()
        m.e2e.observe(time.perf_counter() - flight.start)
        if reason != FinishReason.ERROR and flight.first_token_at is not None and num_tokens > 1:
            m.decode.observe(flight.last_token_at - flight.first_token_at)
            m.tpot.observe((flight.last_token_at - flight.first_token_at) / (num_tokens - 1))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request everywhere it lives; its nodes free its KV. `reason`: what the client was told."""
        flight = self.flights.get(request_id)
        if flight is None:
            return
        self._abort_on_nodes(flight)
        self._end(flight, reason)

    def _abort_on_nodes(self, flight: Flight) -> None:
        for n in flight.nodes:
            if n.up:
                self._send(n, Abort(flight.request_id))

    def kv_capacity_tokens(self, role: Role) -> int | None:
        """The most tokens one request's KV can take on every node of `role`."""
        caps = [n.info.get("kv_capacity_tokens") for n in self.nodes if n.role == role and n.info]
        caps = [c for c in caps if c]
        return min(caps) if caps else None

    # ---- views --------------------------------------------------------------------------------
    def health(self) -> dict:
        nodes = [
            {"role": n.role, "addr": n.addr, "up": n.up, "draining": n.draining, "in_flight": len(n.requests)}
            for n in self.nodes
        ]
        status = "draining" if self.draining else "ok" if self._serving() else "degraded"
        return {"status": status, "mode": self.cfg.mode, "waiting": len(self.waiting), "nodes": nodes}

    def _serving(self) -> bool:
        roles = (Role.COLOCATED,) if self.cfg.mode == "colocated" else (Role.PREFILL, Role.DECODE)
        return all(any(n.usable for n in self.nodes if n.role == r) for r in roles)
