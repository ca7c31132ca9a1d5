"""The router's requests in flight: their dispatch, their re-dispatch when a node they depend on is lost, and the
delivery of their tokens to the streams.

Everything here runs on the router's one event loop, so one task at a time owns the state: HTTP handlers call
`submit` / `abort` and take events from the request's inbox (or have them pushed). The nodes, their sockets and their
health are nodes.py's (`NodeLinks`), which hands this core each node's token messages and tells it when a node is
lost; where a request goes is routing.py's, a policy over a view of the nodes taken at each dispatch.

A request's life in the router:
1. admission: refused (429, Retry-After) while --max-queued-requests requests wait for a first token.
2. submit: the nodes routing.py picks (cache-aware, least loaded; disaggregated, a decode node that holds most
   of the prompt may compute it itself); the router names the prompt's blocks as the nodes do, follows each
   node's cache through its Stats (nodes.py) and adds the blocks a request that ended well leaves on its node at
   once (`leaves_cached`); send Generate (a prefill node also learns the decode node's KV address).
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
from collections import Counter

from pdserve.config import RouterConfig
from pdserve.router import routing
from pdserve.router.flight import Flight
from pdserve.router.metrics import NodeCollector, RouterMetrics
from pdserve.router.nodes import NodeConn, NodeLinks, StartupError, leaves_cached
from pdserve.router.routing import NoNodeAvailable, Policy
from pdserve.wire.messages import ROUTER_ID_END, Abort, Generate, TokenEvent, TokenEvents
from pdserve.wire.params import ErrorCode, FinishReason, Role, SamplingParams, block_hashes, chain_seed

log = logging.getLogger("pdserve.router")
MAX_ATTEMPTS = 3  # dispatches of one request, the first included, before a lost node fails it
EXPIRY_S = 0.25  # how often requests waiting for a first token are checked against --queue-timeout-s
# the enum members of the per-token path, looked up once (on its class, an enum member costs about a microsecond)
ERROR, DECODE, PREFILL = FinishReason.ERROR, Role.DECODE, Role.PREFILL
NODE_FAILED = ErrorCode.NODE_FAILED
__all__ = ["NoNodeAvailable", "Overloaded", "RouterCore", "StartupError"]  # what the API takes from here


class Overloaded(RuntimeError):
    """Too many requests wait for a first token; the client should come back in `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RouterCore:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.routing_id = f"router-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # on every node connection; leads our ids
        self.links = NodeLinks(cfg, self.routing_id, self._on_events, self._node_lost)
        self.nodes = self.links.nodes  # changed in place only: the metrics collector holds this list
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

    @property
    def start_cancelled(self) -> asyncio.Event:
        """Set by a SIGTERM that comes before the nodes answered."""
        return self.links.start_cancelled

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._expire_waiting_often()))
        await self.links.start()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.links.stop()

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

    async def _expire_waiting_often(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_S)
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

    def _node_lost(self, node: NodeConn, why: str) -> None:
        """A node was marked down (nodes.py): its requests are dispatched again."""
        for rid in list(node.requests):
            flight = self.flights.get(rid)
            if flight is not None:
                self._lost(flight, f"{node.role} node {node.addr} failed ({why})", ErrorCode.NODE_FAILED)

    def _on_events(self, msg: TokenEvents, node: NodeConn) -> None:
        self._deliver_tokens(msg.tokens, node)  # each request is in a message once: the plain events first
        for ev in msg.events:
            self._deliver(ev, node)

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

    def _names_layout(self) -> dict | None:
        """The nodes' layout, by which blocks are named, when routing looks at the nodes' caches (cache-aware picks,
        or conditional disaggregation); None when it does not, or no node has told it yet."""
        cfg = self.cfg
        used = cfg.cache_balance_margin >= 0 or (cfg.mode == "disagg" and cfg.local_prefill_max_tokens != 0)
        return self.links.layout() if used else None

    def _block_names(self, prompt: list[int]) -> list[int]:
        """The prompt's block names as the nodes name them ([] when no node caches, or nothing here uses them)."""
        layout = self._names_layout()
        if layout is None or not any(n.cached for n in self.nodes):
            return []
        return block_hashes(prompt, layout["block_size"], chain_seed(layout["model_fingerprint"]))

    def _route(self, prompt: list[int], names: list[int], params: SamplingParams) -> list[NodeConn]:
        """The nodes the request goes to (routing.py decides, on a view of the nodes taken now)."""
        cfg, layout = self.cfg, self.links.layout() or {}
        policy = Policy(cfg.mode, cfg.cache_balance_margin, cfg.max_prefill_queue, layout.get("block_size", 0))
        own = Counter(f.nodes[0] for f in self.waiting if len(f.nodes) == 1) if cfg.max_prefill_queue else Counter()
        views = [n.view(cfg.local_prefill_max_tokens, own[n]) for n in self.nodes]
        picked = routing.route(views, policy, len(prompt), names, scored=params.prompt_logprobs is not None)
        return [self.nodes[i] for i in picked.nodes]

    def _dispatch(self, flight: Flight) -> None:
        """Send the request, from where its stream stands, to the nodes that cache most of it or are least loaded,
        under a new id."""
        rid = f"{self.routing_id}{ROUTER_ID_END}{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        prompt = flight.prompt + flight.output
        params = self._resumed_params(flight)
        names = self._block_names(prompt)
        nodes = self._route(prompt, names, params)
        decode_addr = nodes[1].kv_addr if len(nodes) == 2 else ""
        msg = Generate(rid, prompt, params, decode_addr=decode_addr)
        flight.request_id, flight.nodes, flight.names, flight.steady = rid, nodes, names, None
        flight.dispatched_after = len(flight.output)
        flight.attempts += 1
        self.flights[rid] = flight
        for n in nodes:
            n.requests.add(rid)
        self.links.send(nodes[0], msg)

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
        a message) and hand over; any other goes the long way, as an event."""
        now, gaps, count, flights = time.perf_counter(), [], 0, self.flights
        try:
            for k in range(0, len(tokens), 2):
                request_id, token_ids = tokens[k], tokens[k + 1]
                flight = flights.get(request_id)
                if flight is None:
                    continue  # already ended (aborted, failed, or dispatched again under a new id)
                if flight.steady is not source or not token_ids:
                    self._deliver(TokenEvent(request_id, token_ids), source)  # the long way
                    continue
                gaps.append(now - flight.last_token_at)
                flight.last_token_at = now
                flight.output += token_ids
                count += len(token_ids)
                inbox = flight.inbox
                if inbox.push_tokens is not None:  # a plain event's tokens, where its stream takes them so
                    inbox.push_tokens(token_ids)
                else:
                    inbox.put(TokenEvent(request_id, token_ids))
        finally:  # the gaps of the clocks already moved on, even where a stream's push raised
            self.metrics.itl.observe_all(gaps)
        self.metrics.generation_tokens.inc(count)

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
            if len(flight.output) == flight.dispatched_after and ev.finish_reason != ERROR:
                # two sockets: this dispatch's first token (a resumed request's too) comes from its prefill node
                flight.early.append(ev)
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
                    leaves_cached(source, flight.prompt + flight.output, flight.names, layout)
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
                self.links.send(n, Abort(flight.request_id))

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
