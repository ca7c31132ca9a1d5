"""The decode node: receives prompts' KV from prefill nodes and generates the rest of each answer (or computes
itself the few tokens of a prompt its prefix cache lacks).

A request's life here (the engine owns the request, its queue and its blocks; this node moves messages):
0. Conditional disaggregation: a Generate from the router, for a prompt whose KV this node's prefix
   cache holds but for at most --local-prefill-max-tokens tokens, skips steps 1-3: the request joins the
   engine as on a colocated node (WAITING), shares its cached blocks and computes the rest of its prompt
   here; every token, the first included, streams to the router (`local_prefill_requests` counts them).
1. Pairing: a prefill node's KvHello is checked (protocol, model fingerprint, dtype, layer and
   head layout, block size, transport); any mismatch is refused with the reason.
2. KvOffer: the request joins the engine as WAITING_FOR_KV, queued FCFS until the scheduler reserves
   blocks for its KV; never dropped. While it waits, a KvWaiting notice renews the prefill node's
   lease on that KV every WAITING_NOTICE_S.
3. RECEIVING_KV: blocks reserved (`engine.reserve_remote()`), the first of them shared from the prefix
   cache when it holds the prompt's first blocks; KvPull sent, naming the first block to ship (the KV
   of the cached ones is not shipped again); the KV lands by the chosen backend (`engine.receive_kv`);
   once every layer is in, it is checked against the sender's per-layer checksums of what it shipped
   (`engine.kv_landed`) and KvAck frees the prefill node's copy. KV that the backend refuses
   (wrong shape, size, blocks), that fails its checksums, or that has not all arrived within half the
   lease of the pull is never decoded from: by --kv-failure the request recomputes its prompt here
   (`engine.kv_lost`: WAITING, computed up to its first block not shared from the prefix cache, whose
   blocks keep their KV; the prefill node gets a KvAck all the same), or it is refused, which fails it with the reason.
   Over a shared pool (shm, cuda_ipc) there is no pull: the offer names the prompt's blocks in the prefill pool, with
   the CRC-32 of their last layer's KV, and once the scheduler has reserved blocks here the copier's thread copies
   those of every request reserved at that moment as one burst (one batched copy a request; on a GPU on its own
   stream, waited for by one event) and checks each (CPU pools): every layer it copied against the prefill pool's
   blocks, byte for byte (`engine.copy_matches`), and the CRC-32 of the last layer as it landed against the offer's,
   while the node's steps go on; when a copy is done the loop is woken, the request's KV marked landed
   (`engine.kv_landed`) and the KvAck goes: only then does the prefill node free its blocks. On the CPU (an engine
   that computes a step in its launch, not overlapped) the loop waits for the copies it has just started before its
   next step, so that their requests join that step. A request aborted while its copy runs is dropped when the copy
   is done (its blocks are not given to another request before). Counters: kv_copies, kv_copies_overlapped (copies
   that ran while a step did); and the hand-off in parts as histograms (Stats.histograms, observed once the request
   has decoded here): handoff_wait (offer taken → copy started), handoff_copy, handoff_check (the checks of what
   landed), handoff_join (checked → the end of the request's first step here), and handoff_join in parts
   (JOIN_PARTS: handoff_admit, handoff_queue, handoff_step, handoff_out).
4. WAITING with its KV in place (num_computed_tokens = prompt length, the first token as output),
   the router told so (an event without tokens), admitted at the next iteration; RUNNING: one token
   an iteration, streamed to the router.
5. FINISHED or ABORTED (router's Abort, the prefill node's KvCancel, bad KV under --kv-failure fail):
   KV freed at once. An abort that arrives before the offer is remembered, so the late offer
   is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections import OrderedDict

import zmq

from pdserve.config import NodeConfig
from pdserve.engine.engine import TokenOutput
from pdserve.engine.request import Request, Status
from pdserve.kv.backend import TransferError
from pdserve.kv.copier import BlockCopier, Copy
from pdserve.kv.peers import KvPeer, KvTransfer, TransferState, choose_transport
from pdserve.nodes.base import Buckets, NodeBase, kv_backends
from pdserve.wire import transport
from pdserve.wire.messages import (
    PROTOCOL_VERSION,
    Generate,
    HelloAck,
    KvAck,
    KvCancel,
    KvData,
    KvHello,
    KvOffer,
    KvPull,
    KvWaiting,
    TokenEvent,
)
from pdserve.wire.params import ErrorCode, Role

log = logging.getLogger("pdserve.decode")
REMEMBER_ABORTS = 4096
WAITING_NOTICE_S = 0.25
KEEP_COPIES = 64
# kv_copies: copies out of a shared pool done; kv_copies_overlapped: of those, the ones that ran while a step ran
HANDOFF_COUNTERS = ("kv_copies", "kv_copies_overlapped")
# the hand-off's parts on this node, histograms by name (seconds)
HANDOFF_PARTS = ("handoff_wait", "handoff_copy", "handoff_check", "handoff_join")
# handoff_join in parts: checked → marked landed (admitted) between two steps, → its first step's launch, → that
# launch's end (on the CPU the step's computation), → its token taken from the step's outputs
JOIN_PARTS = ("handoff_admit", "handoff_queue", "handoff_step", "handoff_out")
HANDOFF_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


PrefillPeer = KvPeer[bytes]  # linked by the routing id of its connection to our KV socket
Incoming = KvTransfer[Request]  # an offered request's KV: where it comes from, how much of it has landed


class DecodeNode(NodeBase):
    role = Role.DECODE

    def __init__(self, cfg: NodeConfig) -> None:
        self.backends = kv_backends(cfg)  # before the binds: a node that cannot bind closes them
        super().__init__(cfg)
        self.kv_sock = self.ctx.socket(zmq.ROUTER)
        transport.configure(self.kv_sock)
        self.kv_addr = self.bind(self.kv_sock, cfg.kv_listen, "--kv-listen")
        self.poller.register(self.kv_sock, zmq.POLLIN)
        self.handlers[self.kv_sock] = self.handle_kv
        self.peers: dict[bytes, PrefillPeer] = {}  # the paired prefill nodes, by routing id
        self.incoming: dict[str, Incoming] = {}  # offered, KV not landed yet (the engine holds the request)
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.counters.update(
            kv_offers=0, kv_received=0, kv_refused=0, kv_bad=0, kv_recomputed=0, local_prefill_requests=0
        )
        self.counters.update(dict.fromkeys(HANDOFF_COUNTERS, 0))
        self.handoff = {name: Buckets(HANDOFF_BOUNDS) for name in HANDOFF_PARTS + JOIN_PARTS}
        self.copier = BlockCopier(self.ctx, cfg.engine.device)
        # an engine whose launch returns before the step is computed (a GPU's) copies beside its steps; one that
        # computes the step in launch (the CPU's, on the node's one core) would only share that core with the copy,
        # and a copy that ends during step N lets its request join step N + 2: it waits for its copies before the next
        self.copy_beside_steps = self.engine.overlapped
        self.poller.register(self.copier.wake, zmq.POLLIN)
        self.copies: list[Copy] = []  # the latest copies taken, newest last (for tests and logs)
        self.joining: dict[str, Copy] = {}  # copied, not decoded yet, with its offer's time in copy.offered
        self._next_notice = 0.0

    def ready_info(self) -> dict:
        return {**super().ready_info(), "kv_listen": self.kv_addr, "host_id": self.host_id}

    def ready_words(self) -> str:
        return f"{super().ready_words()}, KV from prefill nodes at {self.kv_addr} ({self.cfg.kv_transport})"

    def busy(self) -> bool:
        return bool(self.incoming) and not all(i.copying for i in self.incoming.values())  # a copy's end wakes us

    def num_held(self) -> int:
        return super().num_held() + len(self.incoming)

    def holds_work(self) -> bool:
        return super().holds_work() or bool(self.incoming)

    def fail_all(self, why: str) -> None:
        self.copier.wait_all()  # no copy may write a block freed below
        for rid, inc in list(self.incoming.items()):  # the engine holds these too: super() ends them
            del self.incoming[rid]
            self._refuse(inc.peer.link, rid, why, ErrorCode.DRAINING)
        super().fail_all(why)

    def close(self) -> None:
        if hasattr(self, "copier"):  # (a node that could not bind closes before it has one)
            self.copier.close()
        self.unmap_all()
        for backend in self.backends.values():
            backend.close()
        super().close()

    def unmap_all(self) -> None:
        """Drop every prefill pool this node maps, now: a pool's owner may stop only once no mapping of it is left
        (over cuda_ipc torch warns that its producer exited before the tensors it shared were released), and the
        launcher stops prefill nodes after decode nodes for it. The mapping goes with its last reference."""
        for peer in list(getattr(self, "peers", {}).values()):
            peer.backend.forget(peer.handle)
        for holder in ("peers", "incoming", "joining"):
            getattr(self, holder, {}).clear()
        gc.collect()  # a reference held in a cycle would keep a mapping to the process's exit

    def drain(self, sock: zmq.Socket) -> None:
        if sock is self.copier.wake:
            self._copies_done()
        else:
            super().drain(sock)

    # ---- from prefill nodes --------------------------------------------------------------------
    def handle_kv(self, identity: bytes, msg, frames: list) -> None:
        if isinstance(msg, KvHello):
            self._on_pairing(identity, msg)
        elif identity not in self.peers:
            if isinstance(msg, KvOffer):
                self._refuse(identity, msg.request_id, "no pairing handshake on this connection")
        elif isinstance(msg, KvOffer):
            self._on_offer(self.peers[identity], msg)
        elif isinstance(msg, KvData):
            self._on_data(self.peers[identity], msg, frames)
        elif isinstance(msg, KvCancel):
            self._forget(msg.request_id)

    def _on_pairing(self, identity: bytes, msg: KvHello) -> None:
        handle = msg.pool_handle if isinstance(msg.pool_handle, dict) else {}
        self._drop_superseded(identity, handle)
        reason = self._pairing_mismatch(msg)
        chosen = "" if reason else self._choose_transport(msg)
        if not reason and not chosen:
            reason = f"KV transport {msg.transport!r} there, {self.cfg.kv_transport!r} here"
            reason += "" if self._same_host(msg) else " (a shared pool needs both nodes on one host)"
        if not reason:
            backend = self.backends[chosen]
            try:
                source = backend.attach(handle, self.engine.layout, self.cfg.engine.device)
                self.peers[identity] = PrefillPeer(identity, backend=backend, paired=True, handle=handle, source=source)
            except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:  # a handle from the wire
                reason = f"cannot map the prefill pool: {e!r}"
        if reason:
            log.error("refused a prefill node: %s", reason)
        info = {"transport": chosen} if not reason else {}
        transport.send(self.kv_sock, HelloAck(not reason, self.role, info, reason), identity=identity)

    def _same_host(self, msg: KvHello) -> bool:
        return not msg.host_id or msg.host_id == self.host_id  # no host id (an older peer): as before, try

    def _choose_transport(self, msg: KvHello) -> str:
        return choose_transport(msg.transports or [msg.transport], tuple(self.backends), self._same_host(msg))

    def _pairing_mismatch(self, msg: KvHello) -> str:
        """Why this prefill node cannot pair with us, or "" if it can."""
        layout = self.engine.layout
        if msg.protocol_version != PROTOCOL_VERSION:
            return f"protocol version {msg.protocol_version} there, {PROTOCOL_VERSION} here"
        if not isinstance(msg.layout, dict) or not isinstance(msg.pool_handle, dict):
            return "malformed KvHello (layout and pool handle must be maps)"
        if not isinstance(msg.transports, list) or not all(isinstance(t, str) for t in msg.transports):
            return "malformed KvHello (transports must be a list of names)"
        if layout.mismatch(msg.layout):
            return f"KV layout mismatch: {layout.mismatch(msg.layout)}"
        return ""

    def _on_offer(self, peer: PrefillPeer, offer: KvOffer) -> None:
        self.counters["kv_offers"] += 1  # taken or refused: every offer of a paired peer counts
        why = self.engine.check_fits(offer.num_tokens, offer.params.max_tokens)
        code = ErrorCode.INVALID_REQUEST
        rid = offer.request_id
        if rid in self.engine.requests:
            why, code = f"request {rid} is already here", ErrorCode.INTERNAL
        if offer.num_tokens != len(offer.prompt_token_ids):
            why = f"an offer of {offer.num_tokens} tokens of KV for a prompt of {len(offer.prompt_token_ids)}"
            code = ErrorCode.INTERNAL
        if rid in self.aborted or why:
            self._refuse(peer.link, rid, why, code)
            return
        req = Request(
            rid,
            list(offer.prompt_token_ids),
            offer.params,
            output_token_ids=[offer.first_token_id],
            status=Status.WAITING_FOR_KV,
        )
        try:
            self.engine.add(req)
        except ValueError as e:  # a grammar this node cannot use
            self._refuse(peer.link, rid, str(e), ErrorCode.INVALID_REQUEST)
            return
        inc = self.incoming[rid] = Incoming(req, peer)
        if offer.kv is not None and peer.backend.shared_pool:  # copied once blocks are reserved, never pulled
            inc.offered, inc.offered_at = offer.kv, time.perf_counter()

    def _on_data(self, peer: PrefillPeer, header: KvData, frames: list) -> None:
        inc = self.incoming.get(header.request_id)
        if inc is None or inc.peer is not peer or inc.state is not TransferState.PULLED:
            return  # cancelled after the pull (or not this peer's, or not pulled)
        if header.kv_checksums:
            inc.checksums = list(header.kv_checksums)
        try:
            inc.layers_landed += self.engine.receive_kv(inc.request, peer.backend, header, frames, peer.source)
        except TransferError as e:
            self._kv_failed(inc, f"bad KV: {e}")
            return
        if inc.layers_landed < self.engine.layout.num_layers:
            return
        why = self.engine.kv_landed(inc.request, peer.backend, inc.checksums)
        if why:
            self._kv_failed(inc, why)
            return
        del self.incoming[header.request_id]
        self.counters["kv_received"] += 1
        self._let_prefill_go(inc, KvAck(header.request_id, True))  # after kv_landed: it frees the sender's copy

    def _let_prefill_go(self, inc: Incoming, ack: KvAck) -> None:
        """Free the prefill node's copy of a request's KV, and tell the router it no longer needs that node."""
        transport.send(self.kv_sock, ack, identity=inc.peer.link)
        self.emit([TokenEvent(ack.request_id, [], None)])  # "KV landed", an event without tokens

    def _kv_failed(self, inc: Incoming, why: str) -> None:
        """A pulled request's KV is lost or damaged: never decode from it; recompute it here, or fail it."""
        rid = inc.request.request_id
        del self.incoming[rid]
        self.counters["kv_bad"] += 1
        recompute = self.cfg.kv_failure == "recompute"
        log.warning("request %s: %s; %s", rid, why, "recomputing its prompt here" if recompute else "failing it")
        if not recompute:
            self.engine.abort(rid)
            self._refuse(inc.peer.link, rid, f"the KV transfer failed ({why}; --kv-failure fail)")
            return
        self.counters["kv_recomputed"] += 1
        self.engine.kv_lost(inc.request)
        self._let_prefill_go(inc, KvAck(rid, True, f"recomputed on the decode node: {why}"))

    def _refuse(
        self, identity: bytes, request_id: str, why: str, code: ErrorCode = ErrorCode.KV_TRANSFER_FAILED
    ) -> None:
        self.counters["kv_refused"] += 1
        transport.send(self.kv_sock, KvAck(request_id, False, why, code), identity=identity)

    # ---- from the router -----------------------------------------------------------------------
    def on_generate(self, msg: Generate) -> bool:
        """Conditional disaggregation: a prompt whose KV this node's prefix cache holds but for a few tokens comes
        from the router itself; the engine computes those (chunked prefill) and the whole answer, as a colocated
        node's does."""
        taken = super().on_generate(msg)
        self.counters["local_prefill_requests"] += taken
        return taken

    def on_abort(self, request_id: str) -> None:
        if not self._forget(request_id):
            self.aborted[request_id] = None  # its offer may still be on the way
            while len(self.aborted) > REMEMBER_ABORTS:
                self.aborted.popitem(last=False)

    def _forget(self, request_id: str) -> bool:
        """Drop a request wherever it is here; True if it was here. One whose copy runs is dropped once it is done
        (its blocks must not be given to another request while the copy writes them)."""
        inc = self.incoming.get(request_id)
        if inc is not None and inc.copying:
            inc.cancelled = True
            return True
        self.incoming.pop(request_id, None)
        self.joining.pop(request_id, None)
        return self.engine.abort(request_id) is not None

    # ---- copies out of a shared pool -----------------------------------------------------------
    def _start_copies(self, offered: list[Incoming]) -> None:
        """Copy the offered blocks of the requests whose blocks were just reserved into theirs, one burst on the
        copier's thread (beside the steps), each request's blocks in one batched copy; the blocks they hold from the
        prefix cache are not copied."""
        burst = []
        for inc in offered:
            req, first = inc.request, inc.first_block
            src = list(inc.offered.src_blocks)
            header = dataclasses.replace(inc.offered, src_blocks=src[first:])
            run = functools.partial(self.engine.receive_kv, req, inc.peer.backend, header, [], inc.peer.source)
            prefix = (inc.peer.source, src[:first])  # the prompt's cached blocks, checked as the sender holds them
            check = functools.partial(self._landed_checksums, req, header, inc.peer.source, prefix)
            burst.append(Copy(req.request_id, run, check))
            inc.copying = True
        if burst:
            self.copier.submit(burst)

    def _landed_checksums(self, req: Request, header, source, prefix: tuple) -> list[int]:
        """(On the copier's thread) check a request's copy: every layer it copied against the prefill pool's blocks
        (TransferError if they differ), then the CRC-32 of its last layer's KV as it lies here (the cached blocks as
        the prefill pool holds them), which the sender's, in its offer, must match ([] for a pool off the CPU)."""
        if not self.engine.copy_matches(req, source, header.src_blocks):
            raise TransferError("the KV copied differs from the prefill pool's blocks")
        return self.engine.copied_checksums(req, prefix, [self.engine.layout.num_layers - 1])  # as the offer's

    def _copies_done(self) -> None:
        for copy in self.copier.take():
            self._copy_done(copy)

    def _copy_done(self, copy: Copy) -> None:
        copy.release()  # the records kept hold no mapping of a prefill pool
        self.copies = [*self.copies[-KEEP_COPIES + 1 :], copy]
        inc = self.incoming.get(copy.key)
        if inc is None:
            return
        inc.copying = False
        if inc.cancelled:
            self._forget(copy.key)
            return
        self.counters["kv_copies"] += 1
        self.counters["kv_copies_overlapped"] += self._overlapped(copy)
        if copy.error is not None:
            self._kv_failed(inc, f"bad KV: {copy.error}")
            return
        last = [self.engine.layout.num_layers - 1]  # the offer's one checksum: the last layer's
        why = self.engine.kv_landed(inc.request, inc.peer.backend, list(inc.offered.kv_checksums), copy.checksums, last)
        if why:
            self._kv_failed(inc, why)
            return
        del self.incoming[copy.key]
        self.counters["kv_received"] += 1
        copy.offered, copy.landed = inc.offered_at, time.perf_counter()
        self.joining[copy.key] = copy
        self._let_prefill_go(inc, KvAck(copy.key, True, first_block=inc.first_block))  # the copy is done

    def _overlapped(self, copy: Copy) -> bool:
        """Whether a step's launch (on the CPU: its computation) ran while the copy did."""
        return any(start < copy.done and end > copy.started for start, end in self.launches)

    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        now = time.perf_counter()
        for o in outputs:
            copy = self.joining.pop(o.request.request_id, None)
            if copy is not None:  # its first step here: the hand-off's last part
                self._observe_handoff(copy, now)
        super().on_outputs(outputs)

    def _observe_handoff(self, copy: Copy, first_step: float) -> None:
        parts = (
            copy.started - copy.offered,
            copy.copied - copy.started,
            copy.done - copy.copied,
            first_step - copy.done,
        )
        for name, seconds in zip(HANDOFF_PARTS, parts, strict=True):
            self.handoff[name].observe(seconds)
        launch = next(((s, e) for s, e in self.launches if s >= copy.landed and e <= first_step), None)
        if launch is not None:  # the first launch after it was admitted: the step that ran it
            joined = (copy.landed - copy.done, launch[0] - copy.landed, launch[1] - launch[0], first_step - launch[1])
            for name, seconds in zip(JOIN_PARTS, joined, strict=True):
                self.handoff[name].observe(seconds)

    def histograms(self) -> dict:
        return {name: b.to_wire() for name, b in self.handoff.items()}

    # ---- chores --------------------------------------------------------------------------------
    def tick(self) -> None:
        super().tick()
        now = time.monotonic()
        self._reserve_and_copy()
        if self.copier.in_flight and not self.copy_beside_steps:  # they join the very next step
            self._land_before_step()
        wait = self.cfg.kv_lease_s / 2  # well before the prefill node's lease on the KV runs out
        pulled = [i for i in self.incoming.values() if i.state is TransferState.PULLED and not i.copying]
        for inc in [i for i in pulled if now - i.pulled_at > wait]:
            self._kv_failed(inc, f"not all of its KV arrived within {wait:g}s of the pull")
        if now >= self._next_notice:
            self._next_notice = now + WAITING_NOTICE_S
            self._notify_waiting()
            self._drop_gone_peers()

    def _reserve_and_copy(self) -> None:
        """Blocks for the offers waiting here, as the scheduler gives them: pull, or copy out of a shared pool."""
        offered = []
        for req in self.engine.reserve_remote():
            inc = self.incoming[req.request_id]
            inc.pulled(self.engine.first_block_to_pull(req))
            if inc.offered is not None:
                offered.append(inc)
            else:
                transport.send(self.kv_sock, KvPull(req.request_id, inc.first_block), identity=inc.peer.link)
        self._start_copies(offered)

    def _land_before_step(self) -> None:
        """(On the CPU, before the next step) wait for the copies just started, and copy the offers taken meanwhile,
        so that their requests join the next step."""
        while self.copier.in_flight:
            for copy in self.copier.wait_all():
                self._copy_done(copy)
            self.drain(self.kv_sock)
            self._reserve_and_copy()

    def _drop_gone_peers(self) -> None:
        """Drop the prefill nodes whose pool is gone (shm: unlinked; cuda_ipc: its process ended)."""
        for peer in list(self.peers.values()):
            if not peer.backend.alive(peer.handle):
                self._drop_peer(peer, "its pool is gone")

    def _drop_superseded(self, identity: bytes, handle: dict) -> None:
        """A KvHello replaces the pairing of the same connection, and any older pairing of the same pool
        (the prefill node reconnected): that side has failed the old pairing's transfers already."""
        pool_id = handle.get("pool_id")
        for old in list(self.peers.values()):
            if old.link == identity or (pool_id and old.handle.get("pool_id") == pool_id):
                self._drop_peer(old, "it paired again")

    def _drop_peer(self, peer: PrefillPeer, why: str) -> None:
        """Unmap a prefill peer's pool and forget its offers and reservations: their KV will not come."""
        del self.peers[peer.link]
        peer.backend.forget(peer.handle)
        dead = [rid for rid, i in self.incoming.items() if i.peer is peer]
        for rid in dead:
            self._forget(rid)
        log.info("dropped a prefill node's pairing (%s) and %d of its transfers", why, len(dead))

    def _notify_waiting(self) -> None:
        """Tell each prefill node which of its offers still wait here, so its leases do not run out."""
        waiting: dict[bytes, list[str]] = {}
        for req in self.engine.waiting_for_kv():
            waiting.setdefault(self.incoming[req.request_id].peer.link, []).append(req.request_id)
        for identity, ids in waiting.items():
            transport.send(self.kv_sock, KvWaiting(ids), identity=identity)
