"""The decode node: receives prompts' KV from prefill nodes and generates the rest of each answer.

A request's life here:
1. Pairing: a prefill node's KvHello is checked (protocol, model fingerprint, dtype, layer and
   head layout, block size, transport); any mismatch is refused with the reason.
2. KvOffer: queued FCFS until blocks for its KV are free in the pool; never dropped. While it waits,
   a KvWaiting notice renews the prefill node's lease on that KV every WAITING_NOTICE_S.
3. Reserved: blocks taken, KvPull sent; the KV lands by the chosen backend; KvAck frees the
   prefill node's copy.
4. WAITING with its KV in place (num_computed_tokens = prompt length, the first token as output),
   the router told so (an event without tokens), admitted at the next iteration; RUNNING: one token
   an iteration, streamed to the router.
5. FINISHED or ABORTED (router's Abort, or the prefill node's KvCancel): KV freed at once. An abort
   that arrives before the offer is remembered, so the late offer is refused.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import zmq

from pdserve.common import protocol as P
from pdserve.common import transport
from pdserve.common.config import NodeConfig
from pdserve.common.kv_transfer import TransferError, make_backend
from pdserve.common.node import NodeBase
from pdserve.common.request import Request

log = logging.getLogger("pdserve.decode")
REMEMBER_ABORTS = 4096
WAITING_NOTICE_S = 0.25
RESERVATION_TIMEOUT_S = 60.0  # blocks reserved for a pull that no KV answered are freed after this


@dataclass
class Incoming:
    identity: bytes
    offer: P.KvOffer
    block_ids: list[int] = field(default_factory=list)
    layers_landed: int = 0
    reserved_at: float = 0.0


class DecodeNode(NodeBase):
    role = "decode"

    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.backend = make_backend(cfg.kv_transport)
        self.kv_sock = self.ctx.socket(zmq.ROUTER)
        transport.configure(self.kv_sock)
        self.kv_addr = transport.bind(self.kv_sock, cfg.kv_listen, self.keys)
        self.poller.register(self.kv_sock, zmq.POLLIN)
        self.handlers[self.kv_sock] = self.handle_kv
        self.sources: dict[bytes, object] = {}  # paired prefill peers -> mapped pool (or None for zmq)
        self.handles: dict[bytes, dict] = {}  # paired prefill peers -> how their pool was mapped
        self.offers: deque[Incoming] = deque()  # waiting for blocks
        self.reserved: dict[str, Incoming] = {}  # blocks held, KV pulled
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.counters.update(kv_received=0, kv_refused=0)
        self._next_notice = 0.0

    def ready_info(self) -> dict:
        return {**super().ready_info(), "kv_listen": self.kv_addr}

    def busy(self) -> bool:
        return bool(self.offers)

    def holds_work(self) -> bool:
        return super().holds_work() or bool(self.offers) or bool(self.reserved)

    def fail_all(self, why: str) -> None:
        for inc in [*self.offers, *self.reserved.values()]:
            rid = inc.offer.request_id
            self._forget(rid)
            self._refuse(inc.identity, rid, why)
            self.emit([P.TokenEvent(rid, [], "error", why)])
        super().fail_all(why)

    def close(self) -> None:
        self.backend.close()
        super().close()

    # ---- from prefill nodes --------------------------------------------------------------------
    def handle_kv(self, identity: bytes, msg, frames: list) -> None:
        if isinstance(msg, P.KvHello):
            self._on_pairing(identity, msg)
        elif identity not in self.sources:
            if isinstance(msg, P.KvOffer):
                self._refuse(identity, msg.request_id, "no pairing handshake on this connection")
        elif isinstance(msg, P.KvOffer):
            self._on_offer(identity, msg)
        elif isinstance(msg, P.KvData):
            self._on_data(identity, msg, frames)
        elif isinstance(msg, P.KvCancel):
            self._forget(msg.request_id)

    def _on_pairing(self, identity: bytes, msg: P.KvHello) -> None:
        layout = self.engine.layout
        reason = ""
        if msg.protocol_version != P.PROTOCOL_VERSION:
            reason = f"protocol version {msg.protocol_version} there, {P.PROTOCOL_VERSION} here"
        elif layout.mismatch(msg.layout):
            reason = f"KV layout mismatch: {layout.mismatch(msg.layout)}"
        elif msg.transport != self.backend.name:
            reason = f"KV transport {msg.transport!r} there, {self.backend.name!r} here"
        if not reason:
            try:
                self.sources[identity] = self.backend.attach(msg.pool_handle, layout, self.cfg.engine.device)
                self.handles[identity] = msg.pool_handle
            except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:  # a handle from the wire
                reason = f"cannot map the prefill pool: {e!r}"
        if reason:
            log.error("refused a prefill node: %s", reason)
        transport.send(self.kv_sock, P.HelloAck(not reason, self.role, {}, reason), identity=identity)

    def _on_offer(self, identity: bytes, offer: P.KvOffer) -> None:
        why = self.engine.check_fits(offer.num_tokens, offer.params.max_tokens)
        rid = offer.request_id
        if rid in self.engine.requests or rid in self.reserved or any(i.offer.request_id == rid for i in self.offers):
            why = f"request {rid} is already here"
        if offer.request_id in self.aborted or why:
            self._refuse(identity, offer.request_id, why)
            return
        self.offers.append(Incoming(identity, offer))

    def _on_data(self, identity: bytes, header: P.KvData, frames: list) -> None:
        inc = self.reserved.get(header.request_id)
        if inc is None or inc.identity != identity:
            return  # cancelled after the pull (or not this peer's)
        try:
            inc.layers_landed += self.backend.unpack(self.engine.pool, inc.block_ids, inc.offer.num_tokens, header,
                                                     frames, self.sources.get(identity))  # fmt: skip
        except TransferError as e:
            del self.reserved[header.request_id]
            self.engine.pool.allocator.free(inc.block_ids)
            self._refuse(identity, header.request_id, f"bad KV: {e}")
            return
        if inc.layers_landed < self.engine.layout.num_layers:
            return
        del self.reserved[header.request_id]
        o = inc.offer
        req = Request(o.request_id, list(o.prompt_token_ids), o.params, output_token_ids=[o.first_token_id],
                      num_computed_tokens=o.num_tokens, block_ids=inc.block_ids, arrival=time.time())  # fmt: skip
        self.engine.add(req)
        self.counters["kv_received"] += 1
        transport.send(self.kv_sock, P.KvAck(o.request_id, True), identity=identity)
        self.emit([P.TokenEvent(o.request_id, [], None)])  # "KV landed": the request no longer needs its prefill node

    def _refuse(self, identity: bytes, request_id: str, why: str) -> None:
        self.counters["kv_refused"] += 1
        transport.send(self.kv_sock, P.KvAck(request_id, False, why), identity=identity)

    # ---- from the router -----------------------------------------------------------------------
    def on_abort(self, request_id: str) -> None:
        if not self._forget(request_id):
            self.aborted[request_id] = None  # its offer may still be on the way
            while len(self.aborted) > REMEMBER_ABORTS:
                self.aborted.popitem(last=False)

    def _forget(self, request_id: str) -> bool:
        """Drop a request wherever it is here; True if it was here."""
        if self.engine.abort(request_id) is not None:
            return True
        inc = self.reserved.pop(request_id, None)
        if inc is not None:
            self.engine.pool.allocator.free(inc.block_ids)
            return True
        for inc in self.offers:
            if inc.offer.request_id == request_id:
                self.offers.remove(inc)
                return True
        return False

    @staticmethod
    def _reserve(alloc, inc: Incoming) -> bool:
        """Blocks for the prompt's KV and the first token's, so that the request can run once it lands."""
        o = inc.offer
        return alloc.grow(inc.block_ids, o.num_tokens + 1, o.num_tokens + o.params.max_tokens)

    # ---- chores --------------------------------------------------------------------------------
    def tick(self) -> None:
        super().tick()
        alloc = self.engine.pool.allocator
        now = time.monotonic()
        # preempted requests recompute first: blocks freed for them must not go to new imports
        while self.offers and not self.engine.scheduler.waiting_without_kv() and self._reserve(alloc, self.offers[0]):
            inc = self.offers.popleft()
            inc.reserved_at = now
            self.reserved[inc.offer.request_id] = inc
            transport.send(self.kv_sock, P.KvPull(inc.offer.request_id), identity=inc.identity)
        for inc in [i for i in self.reserved.values() if now - i.reserved_at > RESERVATION_TIMEOUT_S]:
            log.warning("no KV arrived for %s in %ss; freeing its blocks", inc.offer.request_id, RESERVATION_TIMEOUT_S)
            self._forget(inc.offer.request_id)
        if now >= self._next_notice:
            self._next_notice = now + WAITING_NOTICE_S
            self._notify_waiting()
            self._drop_gone_peers()

    def _drop_gone_peers(self) -> None:
        """Unmap the pools of prefill nodes that have gone (their shared memory is unlinked)."""
        for identity, handle in list(self.handles.items()):
            if not self.backend.alive(handle):
                log.info("a prefill node's pool is gone; unmapping it")
                del self.handles[identity], self.sources[identity]
                self.backend.forget(handle)

    def _notify_waiting(self) -> None:
        """Tell each prefill node which of its offers still wait here, so its leases do not run out."""
        if not self.offers:
            return
        waiting: dict[bytes, list[str]] = {}
        for inc in self.offers:
            waiting.setdefault(inc.identity, []).append(inc.offer.request_id)
        for identity, ids in waiting.items():
            transport.send(self.kv_sock, P.KvWaiting(ids), identity=identity)
