"""The router's links to its nodes: one zmq socket (and its monitor) per node, the Hello / HelloAck that pairs them,
which nodes there are (membership.py's sources, followed here), and the watchdog that marks silent ones down.

A node's life in the router:
1. join: listed by the membership source (a fixed list, read once, or a Ray deployment's registry, read every
   `membership_interval_s`); its socket connects, in the order listed (ties in routing go to the first).
2. hello: once the socket connects, a Hello goes out; the node's HelloAck (its role, its model layout, its
   limits) marks it up. One serving another model is not used.
3. up: its Stats tell its load, its prefix cache's changes (followed in `cached`) and whether it drains (then it is
   told which requests this router still has there: Pending); its token messages go to the core.
4. down: disconnected, or silent for --node-timeout-s (the watchdog; a Hello goes out again, to win it back): the
   core is told (`on_down`), which dispatches its requests again. A node that speaks again is paired again.
5. leave: no longer listed: down as above, then its sockets close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from pdserve.config import RouterConfig
from pdserve.router.membership import Member, make_membership
from pdserve.router.routing import NodeView
from pdserve.wire import transport
from pdserve.wire.codec import ProtocolError, encode
from pdserve.wire.messages import PROTOCOL_VERSION, Hello, HelloAck, Pending, Stats, TokenEvents
from pdserve.wire.params import Role, block_hashes, chain_seed

log = logging.getLogger("pdserve.router")
MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | transport.HANDSHAKE_FAILED
GOODBYE_LINGER_MS = 200  # how long a stopping router's last message to each node may take to go out
READ_BATCH = 256  # messages read from one socket before the other callbacks and tasks get a turn
WATCHDOG_S = 0.25
RECONNECT_MS = 25  # how often a node's socket retries its connection: a starting node answers this soon after it binds
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enums cost a Python call per use


class StartupError(RuntimeError):
    """The router cannot start serving: its nodes did not answer in time, or it was stopped before they did."""


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

    def view(self, local_prefill_limit: int | None, own_prompts: int = 0) -> NodeView:
        """What routing sees of it; `local_prefill_limit` None: one chunk of its own (--max-num-batched-tokens)."""
        limit = int(self.info.get("max_num_batched_tokens", 0)) if local_prefill_limit is None else local_prefill_limit
        blocks = self.stats.kv_blocks_used if self.stats else 0
        return NodeView(self.role, self.up, self.draining, len(self.requests), blocks, self.cached, own_prompts, limit)


def follow_cache(node: NodeConn, stats: Stats) -> None:
    """Apply a node's prefix cache changes (or, after a Hello, its whole cache) to the router's view of it."""
    if stats.cache_reset:
        node.cached = set(stats.cache_stored)
        return
    node.cached.update(stats.cache_stored)
    node.cached.difference_update(stats.cache_evicted)


def leaves_cached(node: NodeConn, tokens: list[int], names: list[int], layout: dict) -> None:
    """A request that ended well on `node` (the one that sent its last token: colocated, decode, or a prefill node
    for a one-token answer) left its computed full blocks in the node's cache: those of its `tokens` (prompt, then
    output) but the last token's, whose KV was never computed; `names`: its prompt's block names, as dispatched. Add
    their names to the router's view now, rather than when the node's next Stats tells (the next turn of a
    conversation comes at once); that Stats then removes any the node has evicted since."""
    if not node.info.get("prefix_caching"):
        return
    bs = layout["block_size"]
    full = (len(tokens) - 1) // bs
    if full > len(names):
        parent = names[-1] if names else chain_seed(layout["model_fingerprint"])
        names = names + block_hashes(tokens[len(names) * bs : full * bs], bs, parent)
    node.cached.update(names[:full])


class NodeLinks:
    """The nodes and their sockets. `on_events(msg, node)`: a node's TokenEvents; `on_down(node, why)`: a node was
    marked down (its requests are still in its `requests`)."""

    def __init__(
        self,
        cfg: RouterConfig,
        routing_id: str,
        on_events: Callable[[TokenEvents, NodeConn], None],
        on_down: Callable[[NodeConn, str], None],
    ) -> None:
        self.cfg, self.routing_id = cfg, routing_id
        self.on_events, self.on_down = on_events, on_down
        self.started = time.monotonic()  # a node's join is logged with its time since then
        self.ctx = zmq.Context()
        self.membership = make_membership(cfg)
        self.keys = transport.load_keys(cfg.zmq_keys) if cfg.zmq_keys else None
        self.nodes: list[NodeConn] = []  # changed in place only: the metrics collector holds this list
        self.start_cancelled = asyncio.Event()  # set by a SIGTERM that comes before the nodes answered
        self._tasks: list[asyncio.Task] = []

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

    def _check_pairing(self) -> None:
        """Every node must serve the same model layout, or outputs would be garbage."""
        layouts = {n.name: n.info.get("layout", {}) for n in self.nodes}
        if not layouts:
            return
        first_name, first = next(iter(layouts.items()))
        for name, layout in layouts.items():
            if layout.get("model_fingerprint") != first.get("model_fingerprint"):
                raise RuntimeError(f"{name} serves a different model than {first_name}")

    def layout(self) -> dict | None:
        """The nodes' KV layout (block size, model fingerprint), as their HelloAck gave it."""
        return next((n.info.get("layout") for n in self.nodes if isinstance(n.info.get("layout"), dict)), None)

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
        for m in dict.fromkeys(m for m in listed if m not in have):  # in the order listed: ties in routing go first
            self._join(NodeConn(m.role, m.addr, m.kv_addr))

    def _join(self, node: NodeConn) -> None:
        node.sock = self.ctx.socket(zmq.DEALER)
        node.sock.setsockopt(zmq.ROUTING_ID, self.routing_id.encode())
        transport.configure(node.sock)
        transport.secure_client(node.sock, self.keys)
        node.sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        node.monitor = node.sock.get_monitor_socket(MONITORED)
        node.sock.connect(node.addr)
        loop = asyncio.get_running_loop()
        loop.add_reader(node.sock.FD, self._read, node)
        loop.add_reader(node.monitor.FD, self._read_monitor, node)
        loop.call_soon(self._read_monitor, node)  # what came before the loop watched: its wake-up may be past
        self.nodes.append(node)
        log.info("%s joined", node.name)

    def _leave(self, node: NodeConn) -> None:
        self.node_down(node, "it left the cluster")
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
        self.send(node, Hello(PROTOCOL_VERSION, Role.ROUTER))
        node.greeted = True

    def send(self, node: NodeConn, msg: object) -> None:
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
            self.on_events(msg, node)
        elif isinstance(msg, Stats):
            node.stats, node.draining = msg, msg.draining
            node.reports += 1
            follow_cache(node, msg)
            if msg.draining:  # it may exit once nothing routed to it is left
                self.send(node, Pending(sorted(node.requests)))
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
                self.node_down(node, "disconnected")
            elif event & transport.HANDSHAKE_FAILED:
                log.error("%s: the CurveZMQ handshake failed; do both sides use the same --zmq-keys?", node.name)

    # ---- the watchdog -------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_S)
            now = time.monotonic()
            for node in self.nodes:
                if node.up and now - node.last_seen > self.cfg.node_timeout_s:
                    self.node_down(node, f"silent for {self.cfg.node_timeout_s}s")
                    self._hello(node)  # if it serves another peer now, win it back

    def node_down(self, node: NodeConn, why: str) -> None:
        if node.up:
            log.error("%s is down (%s); %d requests in flight there", node.name, why, len(node.requests))
        node.up = False
        node.cached.clear()  # it sends its whole cache again once it is back
        self.on_down(node, why)
