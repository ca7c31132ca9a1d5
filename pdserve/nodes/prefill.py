"""The prefill node: computes prompts, samples the first token, ships the KV to a decode node.

A request's life here:
1. Generate arrives from the router with the address of the decode node the router picked.
2. WAITING, then RUNNING: its prompt is computed in chunks, flattened with other requests' chunks
   under the token budget.
3. The first token is sampled and streamed to the router. If it already ends the request (EOS,
   stop token, max_tokens=1), the KV is freed and nothing is shipped.
4. TRANSFERRING: a KvOffer goes to the decode node (after the pairing handshake). The decode node
   reserves blocks and pulls; the KV goes out by the chosen backend; its KvAck frees our copy.
   If the decode node goes quiet about it for --kv-lease-s (no pull, no ack, no KvWaiting notice
   that it is still queued for blocks there), or disconnects or refuses, the KV is freed and the
   router is told the request failed. No block is ever stranded, and no waiting offer is dropped.
   The pull names the first prompt block the decode node lacks (it shares the KV of those before from
   its prefix cache): only the KV from there on is shipped. The first KvData carries a CRC-32 per layer
   of the KV shipped, computed here over our pool, which the decode node checks once the KV has landed.
   `--kv-fault-rate` damages a share of the transfers on purpose (kv/faults.py), for tests and
   drills; a decode node that recomputes a damaged request's KV acknowledges it all the same (with the
   reason), and our copy is freed.
   Over a shared pool (shm, cuda_ipc) there is no pull: the offer names the prompt's blocks in our pool, with the
   CRC-32 of their last layer's KV (which depends on every token before, through every layer below: it tells the
   request's blocks from any other; the decode node compares every layer it copied with our pool itself), and the
   decode node copies them as soon as it has reserved its own, beside its steps; its KvAck says the copy is done and
   checked, and only then are our blocks freed (docs/handoff-edges.md, "Copies out of a shared pool"). The offer goes
   after the step that wrote the last of those blocks has finished (`Engine.finish` waited for its sampled token,
   queued behind its KV writes), so the decode node never reads a block before our writes to it are complete.
5. An Abort from the router at any point frees the KV and cancels the transfer on the decode node.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import zmq

from pdserve.config import NodeConfig
from pdserve.engine.engine import Engine, TokenOutput
from pdserve.engine.request import Request, Status
from pdserve.kv.faults import DELAY_S, FaultInjector
from pdserve.kv.peers import KvPeer, KvTransfer, TransferState
from pdserve.nodes.base import NodeBase, error_event, kv_backends
from pdserve.nodes.parts import build_engine
from pdserve.wire import transport
from pdserve.wire.messages import (
    PROTOCOL_VERSION,
    Generate,
    HelloAck,
    KvAck,
    KvCancel,
    KvHello,
    KvOffer,
    KvPull,
    KvWaiting,
)
from pdserve.wire.params import ErrorCode, Role

log = logging.getLogger("pdserve.prefill")


class DecodeLink(NamedTuple):
    """How a prefill node reaches one decode node: its KV socket, and the monitor of that connection."""

    sock: zmq.Socket
    monitor: zmq.Socket


DecodePeer = KvPeer[DecodeLink]
Transfer = KvTransfer[Request]


class PrefillNode(NodeBase):
    role = Role.PREFILL

    def __init__(self, cfg: NodeConfig) -> None:
        self.backends = kv_backends(cfg)
        self.backend = next(iter(self.backends.values()))  # the preferred one holds the pool (shared if it can)
        super().__init__(cfg)
        self.peers: dict[str, DecodePeer] = {}
        self.transfers: dict[str, Transfer] = {}
        self.decode_addr: dict[str, str] = {}
        self.counters.update(
            kv_offers=0,
            kv_transfers=0,
            kv_transfer_bytes=0,
            kv_skipped_bytes=0,
            kv_transfer_time_s=0.0,
            kv_transfer_failures=0,
            kv_faults_injected=0,
        )
        self.faults = FaultInjector(cfg.kv_fault_rate, cfg.kv_fault_kinds)
        self.delayed: list[tuple[float, str, list]] = []  # (when, request id, messages): transfers delayed on purpose
        self.counters.update({f"kv_pairings_{name}": 0 for name in self.backends})

    def make_engine(self) -> Engine:
        return build_engine(self.cfg.engine, prefill_only=True, pool_storage=self.backend.storage)

    def num_held(self) -> int:
        return super().num_held() + len(self.transfers) + len(self.decode_addr) + len(self.delayed)

    def close(self) -> None:
        super().close()
        for backend in self.backends.values():
            backend.close()

    # ---- from the router ----------------------------------------------------------------------
    def on_generate(self, msg: Generate) -> bool:
        if not msg.decode_addr.startswith(("tcp://", "ipc://")):
            self.emit([error_event(msg.request_id, "no decode node address", ErrorCode.INTERNAL)])
            return False
        taken = super().on_generate(msg)
        if taken:
            self.decode_addr[msg.request_id] = msg.decode_addr
        return taken

    def on_abort(self, request_id: str) -> None:
        t = self.transfers.get(request_id)
        if t is not None:
            self._end_transfer(t, ok=False, why="")
        else:
            self.engine.abort(request_id)
        self.decode_addr.pop(request_id, None)

    # ---- after a step: first tokens ------------------------------------------------------------
    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        super().on_outputs(outputs)
        for o in outputs:
            addr = self.decode_addr.pop(o.request.request_id, "")
            if o.finish_reason is None:
                self._offer(o.request, self._peer(addr))

    def _peer(self, addr: str) -> DecodePeer:
        peer = self.peers.get(addr)
        if peer is None:
            sock = self.ctx.socket(zmq.DEALER)
            transport.configure(sock)
            transport.secure_client(sock, self.keys)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | transport.HANDSHAKE_FAILED)
            sock.connect(addr)
            peer = DecodePeer(DecodeLink(sock, mon), addr)
            self.peers[addr] = peer
            self.poller.register(sock, zmq.POLLIN)  # the monitor is read in tick(), every loop
            self.handlers[sock] = lambda _id, msg, frames, p=peer: self.handle_kv(p, msg, frames)
        return peer

    def _offer(self, req: Request, peer: DecodePeer) -> None:
        t = self.transfers[req.request_id] = Transfer(req, peer, TransferState.QUEUED)
        if peer.refused:
            self._fail(req.request_id, f"decode node {peer.name} refused to pair: {peer.refused}")
        elif peer.paired:
            self._send_offer(t)

    def _send_offer(self, t: Transfer) -> None:
        t.move(TransferState.OFFERED)
        t.started = time.monotonic()  # the lease runs from the offer
        self.counters["kv_offers"] += 1
        req = t.request
        offer = KvOffer(
            req.request_id, req.prompt_token_ids, req.output_token_ids[0], req.params, len(req.prompt_token_ids)
        )
        if t.peer.backend.shared_pool:  # the decode node copies the blocks itself once it has reserved its own
            t.pulled_at = t.started
            offer = self._with_blocks(offer, t)
        if offer is not None:
            transport.send(t.peer.link.sock, offer)

    def _with_blocks(self, offer: KvOffer, t: Transfer) -> KvOffer | None:
        """The offer naming the prompt's blocks in our shared pool, with the CRC-32 of their last layer's KV (a fault
        injected may damage them, drop them, so that the decode node pulls, or delay the whole offer: then None). Our
        copy of the blocks stays as it is until the decode node's KvAck says its copy is done."""
        req = t.request
        last = [self.engine.layout.num_layers - 1]  # the decode node checks the other layers against our pool itself
        [(header, frames)] = self.engine.send_kv(req, t.peer.backend)
        messages = [(dataclasses.replace(header, kv_checksums=self.engine.kv_checksums(req, 0, last)), frames)]
        kind = self.faults.pick()
        if kind == "delay":
            self._inject(kind, req.request_id, [(dataclasses.replace(offer, kv=messages[0][0]), [])], 0)
            return None
        if kind is not None:
            messages = self._inject(kind, req.request_id, messages, len(req.prompt_token_ids))
        return dataclasses.replace(offer, kv=messages[0][0] if messages else None)

    def _queued(self, peer: DecodePeer) -> list[Transfer]:
        """The transfers whose offer waits for the pairing with `peer`, oldest first."""
        return [t for t in self.transfers.values() if t.peer is peer and t.state is TransferState.QUEUED]

    # ---- from decode nodes ---------------------------------------------------------------------
    def handle_kv(self, peer: DecodePeer, msg, frames: list) -> None:
        if isinstance(msg, HelloAck):
            self._on_pairing(peer, msg)
        elif isinstance(msg, KvPull):
            self._on_pull(msg)
        elif isinstance(msg, KvAck):
            t = self.transfers.get(msg.request_id)
            if t is not None:
                if msg.ok and t.state is TransferState.OFFERED:  # copied out of our shared pool, never pulled
                    t.move(TransferState.PULLED)
                    t.first_block = msg.first_block
                self._end_transfer(t, msg.ok, msg.reason, msg.error_code or ErrorCode.KV_TRANSFER_FAILED)
        elif isinstance(msg, KvWaiting):
            now = time.monotonic()
            for rid in msg.request_ids:
                t = self.transfers.get(rid)
                if t is not None and t.peer is peer:
                    t.started = now  # still queued there: renew the lease

    def _on_pairing(self, peer: DecodePeer, msg: HelloAck) -> None:
        chosen = msg.info.get("transport", self.backend.name) if isinstance(msg.info, dict) else self.backend.name
        if msg.ok and chosen not in self.backends:
            msg = HelloAck(False, msg.role, {}, f"it chose KV transport {chosen!r}, which this node does not offer")
        if not msg.ok:
            peer.refused = msg.reason
            log.error("decode node %s refused to pair: %s", peer.name, msg.reason)
            for t in self._queued(peer):
                self._fail(t.request.request_id, f"decode node {peer.name} refused to pair: {msg.reason}")
        else:
            peer.paired, peer.refused, peer.backend = True, "", self.backends[chosen]
            self.counters[f"kv_pairings_{chosen}"] += 1
            log.info("paired with decode node %s; KV goes over %s", peer.name, chosen)
            for t in self._queued(peer):
                self._send_offer(t)

    def _on_pull(self, pull: KvPull) -> None:
        t = self.transfers.get(pull.request_id)
        if t is None or t.state is not TransferState.OFFERED:  # aborted meanwhile (the decode node got a KvCancel)
            return
        req, first = t.request, pull.first_block
        if self.engine.prompt_kv(req, first)[1] <= 0:  # nothing of the prompt left to ship
            self._end_transfer(
                t,
                ok=False,
                why=f"the decode node pulled KV from block {first} of a {len(req.prompt_token_ids)}-token prompt",
            )
            return
        t.pulled(first)
        t.started = t.pulled_at  # the lease runs on from the pull
        messages = self._with_checksums(self.engine.send_kv(req, t.peer.backend, first), req, first)
        kind = self.faults.pick()
        if kind is not None:
            shipped = self.engine.prompt_kv(req, first)[1]
            messages = self._inject(kind, pull.request_id, list(messages), shipped)
        for header, frames in messages:
            transport.send(t.peer.link.sock, header, frames)

    def _with_checksums(self, messages, req: Request, first_block: int):
        """The transfer's messages, the first carrying a CRC-32 per layer of the KV shipped."""
        for i, (header, frames) in enumerate(messages):
            if i == 0:
                header = dataclasses.replace(header, kv_checksums=self.engine.kv_checksums(req, first_block))
            yield header, frames

    def _inject(self, kind: str, request_id: str, messages: list, num_tokens: int) -> list:
        """Damage one transfer on purpose (--kv-fault-rate); a delayed one is sent later by tick()."""
        self.counters["kv_faults_injected"] += 1
        log.info("injecting a KV transfer fault: %s %s", kind, request_id)
        if kind == "delay":
            self.delayed.append((time.monotonic() + DELAY_S, request_id, messages))
            return []
        used, free, _ = self.engine.kv_stats()
        return self.faults.damage(kind, messages, num_tokens, used + free)

    def _send_delayed(self) -> None:
        now = time.monotonic()
        due = [d for d in self.delayed if d[0] <= now]
        self.delayed = [d for d in self.delayed if d[0] > now]
        for _, rid, messages in due:
            t = self.transfers.get(rid)  # (gone: aborted or failed meanwhile)
            for header, frames in messages if t is not None else ():
                transport.send(t.peer.link.sock, header, frames)

    def _end_transfer(self, t: Transfer, ok: bool, why: str, code: ErrorCode = ErrorCode.KV_TRANSFER_FAILED) -> None:
        """The transfer is over: our copy of the KV is freed; if it failed for a reason (`why`), the router is told."""
        rid = t.request.request_id
        self.transfers.pop(rid, None)
        if ok and t.state is TransferState.PULLED and not why:  # (ok with a reason: the decode node recomputed it)
            self._count_transfer(t)
        self.engine.release(t.request, Status.FINISHED if ok else Status.ABORTED)
        if not ok and t.peer.paired:  # the decode node may still hold an offer or blocks for it
            transport.send(t.peer.link.sock, KvCancel(rid))
        if not ok and why:
            self.counters["kv_transfer_failures"] += 1
            self.emit([error_event(rid, why, code)])

    def _count_transfer(self, t: Transfer) -> None:
        """A transfer that landed: the KV bytes shipped, and those the decode node had cached (not shipped)."""
        per_token = self.engine.layout.bytes_per_token()
        shipped = self.engine.prompt_kv(t.request, t.first_block)[1]
        self.counters["kv_transfers"] += 1
        self.counters["kv_transfer_bytes"] += shipped * per_token
        self.counters["kv_skipped_bytes"] += (len(t.request.prompt_token_ids) - shipped) * per_token
        self.counters["kv_transfer_time_s"] += time.monotonic() - t.pulled_at

    def _fail(self, request_id: str, why: str) -> None:
        t = self.transfers.get(request_id)
        if t is not None:
            self._end_transfer(t, ok=False, why=why)

    def fail_all(self, why: str) -> None:
        for t in list(self.transfers.values()):
            self._end_transfer(t, ok=False, why=why, code=ErrorCode.DRAINING)
        self.decode_addr.clear()
        super().fail_all(why)

    # ---- chores --------------------------------------------------------------------------------
    def tick(self) -> None:
        super().tick()
        for peer in list(self.peers.values()):
            for event in transport.monitor_events(peer.link.monitor):
                self._on_peer_event(peer, event)
            self.drain(peer.link.sock)  # lease renewals that came in during a long step count
        if self.delayed:
            self._send_delayed()
        now = time.monotonic()
        for t in [t for t in self.transfers.values() if now - t.started > self.cfg.kv_lease_s]:
            self._end_transfer(t, ok=False, why=f"KV transfer lease of {self.cfg.kv_lease_s}s ran out")

    def _on_peer_event(self, peer: DecodePeer, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            hello = KvHello(
                PROTOCOL_VERSION,
                self.engine.layout.to_dict(),
                self.cfg.kv_transport,
                self.backend.handle(),
                self.host_id,
                list(self.backends),
            )
            transport.send(peer.link.sock, hello)
        elif event & transport.HANDSHAKE_FAILED:
            log.error("decode node %s: the CurveZMQ handshake failed; check --zmq-keys on both sides", peer.name)
        elif event == zmq.EVENT_DISCONNECTED:
            peer.paired = False
            for t in [t for t in self.transfers.values() if t.peer is peer]:
                if t.state is not TransferState.QUEUED:
                    self._end_transfer(
                        t, ok=False, why=f"decode node {peer.name} disconnected", code=ErrorCode.NODE_FAILED
                    )  # the router dispatches it again
