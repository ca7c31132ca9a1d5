"""What every node process shares: the router-facing socket, the loop, stats and shutdown.

The loop: launch an engine step, drain every socket that has messages, finish the step and emit its
tokens, then the periodic chores (stats heartbeat, leases). It blocks in poll only when the engine is
idle. On a GPU the launch returns while the device computes the step, so the host's share of the
iteration runs meanwhile: the messages are read and handled (new requests, aborts, KV transfers), and
the previous step's tokens, held back until the next launch, are sent to the router. On the CPU a
step's tokens go out as soon as it finishes, before the next one is computed. With --async-scheduling
the step finished in an iteration is the one launched in the iteration before (`Engine.due`): step N+1
is scheduled and queued before step N's tokens are taken in (docs/async-scheduling.md). Counters:
step_time_s is the wall time from a step's launch to its finish (the I/O between included),
busy_time_s that of whole iterations with work; the difference is what a busy node spends outside its
steps (tokens out on the CPU, chores, and time it lost its core). Each step also counts into its floor group
(`step_group`: decode-only steps by batch size, 1-8 to 129-256; steps with prompt chunks): steps_<group>_count,
_time_s, _context_tokens (the KV its attention reads), _tokens and _samples (the rows whose logits it computes), from
which bench.gpu sets each group beside its floor (bench.floors).

Shutdown: SIGINT stops at once. SIGTERM drains: the node says so in its stats (the router stops
picking it and answers with the requests it still routes here, some perhaps still on their way), refuses
new Generate requests (the router dispatches them elsewhere), finishes what it holds and what the
router still counts here, and exits; what it still holds after --drain-timeout-s is failed with a
clear error first. A second SIGTERM stops at once.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import signal
import time
from collections import deque

import zmq

from pdserve.config import NodeConfig
from pdserve.engine.draws import TokenLogprob
from pdserve.engine.engine import DeviceLost, Engine, TokenOutput, pin_process
from pdserve.engine.request import Request
from pdserve.kv.backend import KvBackend
from pdserve.kv.mock import MockKvBackend
from pdserve.kv.peers import accepted_transports, default_host_id
from pdserve.nodes.parts import build_engine
from pdserve.wire import transport
from pdserve.wire.codec import ProtocolError
from pdserve.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    Generate,
    Hello,
    HelloAck,
    Logprobs,
    Pending,
    Stats,
    TokenEvent,
    TokenEvents,
    router_of,
)
from pdserve.wire.params import ErrorCode, FinishReason, Role

log = logging.getLogger("pdserve.nodes.base")
ROUTER_ANSWER_S = 3.0  # how long a draining node waits for the router's list of what it still routes here


def token_event(o: TokenOutput) -> TokenEvent:
    """The router's event for one engine output, with the log-probabilities the request asked for."""
    logprobs = None if o.logprob is None else wire_logprobs([o.logprob])
    prompt = None if o.prompt_logprobs is None else wire_logprobs(o.prompt_logprobs)
    tokens = [] if o.token_id is None else [o.token_id]
    return TokenEvent(o.request.request_id, tokens, o.finish_reason, o.error, logprobs, prompt, o.error_code)


def error_event(request_id: str, why: str, code: ErrorCode) -> TokenEvent:
    """The last event of a request this node fails: `why` for people, `code` for the router's HTTP status."""
    return TokenEvent(request_id, [], FinishReason.ERROR, why, error_code=code)


def kv_backends(cfg: NodeConfig) -> dict[str, KvBackend]:
    """The KV transfer backends of a prefill or decode node, preferred first, by transport name. A mock node's move
    no KV (kv/mock.py); only a model node imports the real ones (and torch)."""
    names = accepted_transports(cfg.kv_transport, cfg.engine.device)
    if cfg.engine.engine == "mock":
        return {n: MockKvBackend(n, header_only=cfg.engine.mock_kv == "header") for n in names}
    from pdserve.kv.transfer import make_backend

    return {n: make_backend(n) for n in names}


def wire_logprobs(scores: list[TokenLogprob]) -> Logprobs:
    return Logprobs([s.logprob for s in scores], [s.top_ids for s in scores], [s.top_logprobs for s in scores])


class Buckets:
    """A histogram a node observes and ships in its Stats (the router exposes it as a Prometheus histogram)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def to_wire(self) -> dict:
        return {"bounds": self.bounds, "counts": list(self.counts), "sum": self.sum}


class NodeBase:
    role: Role

    def __init__(self, cfg: NodeConfig) -> None:
        self.started = time.monotonic()
        pin_process(cfg.engine)
        self.cfg = cfg
        self.host_id = cfg.host_id or default_host_id()
        self.engine = self.make_engine()
        self.engine.guides.prepare()  # the grammar tokenizer, now: no first guided request stalls the loop for it
        self.drain_deadline: float | None = None  # set by SIGTERM
        self.last_words = False  # messages queued when it closes still go out (a drained node's, a lost device's)
        self.ctx = zmq.Context()
        self.keys = transport.load_keys(cfg.zmq_keys) if cfg.zmq_keys else None
        self.auth = transport.start_authenticator(self.ctx, self.keys)
        self.front = self.ctx.socket(zmq.ROUTER)
        transport.configure(self.front)
        self.front.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a router reconnecting under its routing id takes it over
        self.front_addr = self.bind(self.front, cfg.listen, "--listen")
        self.poller = zmq.Poller()
        self.poller.register(self.front, zmq.POLLIN)
        self.handlers = {self.front: self.handle_front}
        self.routers: dict[bytes, None] = {}  # the routing ids of the routers that said Hello, the latest last
        self.counters = {"requests": 0, "tokens_out": 0, "steps": 0, "step_time_s": 0.0, "busy_time_s": 0.0}
        self.counters |= self.engine.floor_counts(None, 0.0)  # per floor group: steps, seconds, context, tokens, rows
        self.held: list[TokenOutput] = []  # a step's outputs, not published yet
        self.launches: deque[tuple[float, float]] = deque(maxlen=64)  # (start, end) of the latest steps' launch()
        self._next_stats = 0.0
        self._stop = False
        self._drain_announced = False
        self.router_pending: dict[bytes, set[str]] = {}  # while draining: what each router still counts here
        self._cache_reset = True  # the next Stats carries the whole prefix cache, not its changes
        self.engine.follow_cache()  # for the router's view of it

    def make_engine(self) -> Engine:
        return build_engine(self.cfg.engine)

    def bind(self, sock: zmq.Socket, addr: str, flag: str) -> str:
        """Bind `sock` to `addr`, which `flag` gave. An address zmq cannot bind (taken, not this host's, malformed)
        is a start-up mistake: the node closes what it opened and raises ValueError, one line naming both."""
        try:
            return transport.bind(sock, addr, self.keys)
        except zmq.ZMQBaseError as e:
            self.close()
            why = getattr(e, "strerror", None) or e
            raise ValueError(
                f"{flag} {addr}: cannot listen there ({why}); give a free address of this host, "
                f"e.g. {flag} tcp://127.0.0.1:0"
            ) from None

    # ---- lifecycle ----------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_signal)
        self.write_ready()
        try:
            while not self._stop:
                self.loop_once()
                if self.draining:
                    self._drain_step()
        except DeviceLost as e:  # its step's requests failed; the router sees the node go, and the launcher says so
            log.error("%s", e)
            self.last_words = True
            raise SystemExit(1) from None
        finally:
            self.close()

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def _on_term(self, *_: object) -> None:
        if self.draining:
            self._stop = True
        else:
            self.drain_deadline = time.monotonic() + self.cfg.drain_timeout_s

    def _drain_step(self) -> None:
        self._announce_drain()
        if not self.holds_work():
            silent = self._silent_routers()
            if silent:
                log.warning(
                    "%s node: %d router(s) did not answer within %gs (gone without a goodbye); not waiting longer",
                    self.role,
                    silent,
                    ROUTER_ANSWER_S,
                )
            log.info("%s node drained; exiting", self.role)
            self._stop = True
        elif time.monotonic() > self.drain_deadline:
            why = f"the {self.role} node is shutting down and its drain period of {self.cfg.drain_timeout_s}s ran out"
            log.warning("%s; failing what it still holds", why)
            self.fail_all(why)
            self._stop = True

    def _announce_drain(self) -> None:
        """Tell the router before refusing anything, so that it knows to dispatch the refused requests elsewhere."""
        if not self._drain_announced:
            self._drain_announced = True
            log.info("%s node stopping (SIGTERM): finishing what it holds, taking nothing new", self.role)
            self.send_stats()

    def holds_work(self) -> bool:
        """Whether requests still depend on this node: held here, or routed here and not arrived yet."""
        started = self.drain_deadline - self.cfg.drain_timeout_s
        waiting = self._silent_routers() > 0 and time.monotonic() - started < ROUTER_ANSWER_S
        return bool(self.engine.requests or self.held) or waiting or any(self.router_pending.values())

    def _silent_routers(self) -> int:
        """The routers that said Hello and have not answered the draining stats (a live one answers at once, one that
        stopped said so as it went; one that was killed never will)."""
        return sum(r not in self.router_pending for r in self.routers)

    def fail_all(self, why: str) -> None:
        """End every request held here with an error event (after the tokens it has; the node is shutting down)."""
        self.flush()
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self.emit([error_event(rid, why, ErrorCode.DRAINING)])

    def loop_once(self) -> None:
        t0 = time.perf_counter()
        step = self.engine.launch()  # on a GPU: returns while the device computes it
        if step is not None:  # (on the CPU the step's whole computation)
            self.launches.append((t0, time.perf_counter()))
        self.flush()  # the previous step's tokens, held back (GPU) to go out while this one computes
        idle = step is None and not (self.engine.has_work() or self.engine.in_flight or self.busy())
        ready = self.poller.poll(50 if idle else 0)
        started = time.perf_counter() if idle else t0  # an idle node's wait for a message is not busy time
        for sock, _ in ready:
            self.drain(sock)
        step = self.engine.due(step)  # scheduling ahead: the step before the one just launched
        outputs = self.engine.finish(step)
        # a step's time runs from its launch to its finish, the I/O between included; a prefill step of prompt
        # chunks only (no first token yet) counts too
        if step is not None:
            self.count_step(step.batch, time.perf_counter() - t0)
        self.held.extend(outputs)
        if not self.engine.overlapped:  # the CPU has computed the step already: nothing to overlap
            self.flush()
        self.tick()
        if outputs or not idle:
            self.counters["busy_time_s"] += time.perf_counter() - started
        if self.engine.lost:  # every later step would fail the same way: the failed steps' errors go out, then it exits
            while self.engine.in_flight:  # a step launched after the one that failed: its requests fail with it
                self.held.extend(self.engine.finish(self.engine.in_flight[0]))
            self.flush()
            raise DeviceLost(f"{self.role} node: its device can run no more steps ({self.engine.lost}); exiting")

    def count_step(self, batch, seconds: float) -> None:
        """A finished step into the counters: all steps, and its floor group's (`step_group`): steps, seconds,
        context tokens, tokens, rows sampled."""
        self.counters["steps"] += 1
        self.counters["step_time_s"] += seconds
        for k, n in self.engine.floor_counts(batch, seconds).items():
            self.counters[k] += n

    def flush(self) -> None:
        """Publish the outputs held back from the last step."""
        held, self.held = self.held, []
        if held:
            self.on_outputs(held)

    def busy(self) -> bool:
        """Work outside the engine that should keep the loop from sleeping."""
        return False

    def _on_signal(self, *_: object) -> None:
        self._stop = True

    def ready_info(self) -> dict:
        return {"role": self.role, "pid": os.getpid(), "listen": self.front_addr}

    def write_ready(self) -> None:
        if self.cfg.ready_file:
            tmp = self.cfg.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.ready_info(), f)
            os.replace(tmp, self.cfg.ready_file)
        log.info("%s node ready in %.1f s: %s", self.role, time.monotonic() - self.started, self.ready_words())

    def ready_words(self) -> str:
        """Where this node serves, in words (its ready line)."""
        return f"takes requests from the router at {self.front_addr}"

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=1000 if self.draining or self.last_words else 0)  # its last messages go out

    # ---- messages -----------------------------------------------------------------------------
    def drain(self, sock: zmq.Socket) -> None:
        handler = self.handlers[sock]
        while sock.poll(0):
            parts = sock.recv_multipart(copy=False)
            try:
                identity, msg, frames = transport.split(parts, routed=sock.type == zmq.ROUTER)
            except ProtocolError as e:
                log.warning("dropped a malformed message: %s", e)
                continue
            try:
                handler(identity, msg, frames)
            except Exception:  # one peer's bad message must not take the node down for everyone
                log.exception("handling a %s failed; dropped it", type(msg).__name__)

    def handle_front(self, identity: bytes, msg, frames: list) -> None:
        if isinstance(msg, Hello):
            self.on_hello(identity, msg)
        elif isinstance(msg, Generate):
            self.on_generate(msg)
        elif isinstance(msg, Abort):
            self.on_abort(msg.request_id)
        elif isinstance(msg, Pending):
            self.router_pending[identity] = set(msg.request_ids)
        else:
            log.warning("unexpected %s on the router socket", type(msg).__name__)

    def on_hello(self, identity: bytes, msg: Hello) -> None:
        ok = msg.protocol_version == PROTOCOL_VERSION
        reason = "" if ok else f"protocol {msg.protocol_version} here is {PROTOCOL_VERSION}"
        if ok:
            self.routers.pop(identity, None)
            self.routers[identity] = None
            self._cache_reset = True  # every router gets the whole cache: the changes are taken once, for all
        info = {
            "layout": self.engine.layout.to_dict(),
            "max_model_len": self.engine.max_model_len,
            "kv_capacity_tokens": self.engine.kv_stats()[2],
            "max_num_batched_tokens": self.cfg.engine.max_num_batched_tokens,
            "prefix_caching": self.cfg.engine.prefix_caching,
        }
        transport.send(self.front, HelloAck(ok, self.role, info, reason), identity=identity)
        self.send_stats()

    def on_generate(self, msg: Generate) -> bool:
        """A request from the router joins the engine; False (and an error event) when it is refused."""
        if self.draining:
            self._announce_drain()
            self.emit([error_event(msg.request_id, f"the {self.role} node is shutting down", ErrorCode.DRAINING)])
            return False
        why = self.engine.check_fits(len(msg.prompt_token_ids), msg.params.max_tokens)
        if why:
            self.emit([error_event(msg.request_id, why, ErrorCode.INVALID_REQUEST)])
            return False
        self.counters["requests"] += 1
        try:
            self.engine.add(Request(msg.request_id, list(msg.prompt_token_ids), msg.params))
        except ValueError as e:  # a duplicate id, or a grammar this node cannot use
            self.emit([error_event(msg.request_id, str(e), ErrorCode.INVALID_REQUEST)])
            return False
        return True

    def on_abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        self.counters["tokens_out"] += len(outputs)
        self.emit([token_event(o) for o in outputs])

    def emit(self, events: list[TokenEvent]) -> None:
        """Each event to the router that dispatched its request: one message per router."""
        by_router: dict[bytes, list[TokenEvent]] = {}
        for ev in events:
            router = self.router_of(ev.request_id)
            if router is not None:
                by_router.setdefault(router, []).append(ev)
        for router, evs in by_router.items():
            transport.send(self.front, TokenEvents.of(evs), identity=router)

    def router_of(self, request_id: str) -> bytes | None:
        """The router that dispatched `request_id`: the one whose routing id leads it (router_of), or else (a
        router that names none) the latest to say Hello."""
        router = router_of(request_id).encode()
        if router in self.routers:
            return router
        return next(reversed(self.routers), None)

    # ---- chores -------------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_stats:
            self._next_stats = now + self.cfg.stats_interval_s
            self.send_stats()

    def stats(self) -> Stats:
        """Load, counters, and the prefix cache's changes since the last Stats (the whole cache after a Hello)."""
        (running, waiting), (used, free, _) = self.engine.queue_lengths(), self.engine.kv_stats()
        counters = {
            **self.counters,
            "preemptions": self.engine.num_preemptions(),
            **self.engine.cache_counters(),
            **self.engine.run_counters(),
        }
        stored, evicted = self.engine.cache_changes(whole=self._cache_reset)
        reset, self._cache_reset = self._cache_reset, False
        return Stats(
            self.role,
            running,
            waiting,
            used,
            free,
            counters,
            self.draining,
            self.num_held(),
            stored,
            evicted,
            reset,
            self.histograms(),
        )

    def histograms(self) -> dict:
        """This node's histograms for Stats.histograms (none but the decode node's)."""
        return {}

    def num_held(self) -> int:
        """Entries in this node's request tables (the engine's, and its role's own)."""
        return len(self.engine.requests)

    def send_stats(self) -> None:
        """The heartbeat, to every router: each picks nodes by their load."""
        stats = self.stats()
        for router in self.routers:
            transport.send(self.front, stats, identity=router)
