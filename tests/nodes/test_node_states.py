"""The prefill and decode nodes' state machines in-process (no subprocess): their sockets are driven by hand as the
router and the peer node would, and leases are run out by moving their start into the past, not by sleeping.
Prefill: the KV lease (renewed by KvWaiting, freed when it runs out), typed errors to the router. Decode: the
offer queue (FCFS for free blocks, KvWaiting notices, pulls as blocks free), aborts, cancels and refusals."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zmq

from pdserve.config import EngineConfig, NodeConfig
from pdserve.engine.request import Status
from pdserve.nodes.decode import DecodeNode
from pdserve.nodes.prefill import PrefillNode
from pdserve.wire import transport
from pdserve.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    Generate,
    Hello,
    HelloAck,
    KvAck,
    KvCancel,
    KvHello,
    KvOffer,
    KvPull,
    KvWaiting,
    Stats,
    TokenEvent,
    TokenEvents,
)
from pdserve.wire.params import ErrorCode, FinishReason, Role, SamplingParams

WAIT_MS = 10_000
PROMPT = list(range(1, 21))  # 20 tokens: with the first token, 2 blocks of 16
PARAMS = SamplingParams(max_tokens=4, temperature=0)


def _recv(sock: zmq.Socket, skip=(Stats,)):
    """The next message on a test socket that is not one of `skip` (stats come on their own schedule)."""
    while True:
        assert sock.poll(WAIT_MS), "nothing arrived"
        identity, msg, _ = transport.split(sock.recv_multipart(copy=False), routed=sock.type == zmq.ROUTER)
        if not isinstance(msg, skip):
            return identity, msg


class FakeRouter:
    """The router's connection to a node's front socket; each message sent is handled before send() returns."""

    def __init__(self, node) -> None:
        self.node = node
        self.sock = node.ctx.socket(zmq.DEALER)  # closed with the node's context
        self.sock.connect(node.front_addr)
        self.send(Hello(PROTOCOL_VERSION, Role.ROUTER))
        assert _recv(self.sock)[1].ok

    def send(self, msg) -> None:
        transport.send(self.sock, msg)
        assert self.node.front.poll(WAIT_MS)
        self.node.drain(self.node.front)

    def events(self) -> list[TokenEvent]:
        msg = _recv(self.sock)[1]
        assert isinstance(msg, TokenEvents), msg
        return msg.all()


# ---- the prefill node ------------------------------------------------------------------------------


@pytest.fixture
def prefill(tiny_models):
    cfg = NodeConfig("prefill", EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=32), kv_lease_s=30.0)
    node = PrefillNode(cfg)
    decode = node.ctx.socket(zmq.ROUTER)  # the decode node's KV socket
    decode_addr = f"tcp://127.0.0.1:{decode.bind_to_random_port('tcp://127.0.0.1')}"
    yield node, FakeRouter(node), decode, decode_addr
    node.close()


def _prefill_and_pair(node: PrefillNode, router: FakeRouter, decode: zmq.Socket, addr: str, rid: str):
    """Generate `rid` there, run the engine to its first token, pair with the fake decode node and get the offer;
    returns the prefill node's identity on the decode socket."""
    router.send(Generate(rid, PROMPT, PARAMS, decode_addr=addr))
    for _ in range(100):
        if rid in node.transfers:
            break
        node.loop_once()
    assert rid in node.transfers and router.events()[0].token_ids, "no first token"
    for _ in range(WAIT_MS // 10):
        if decode.poll(10):
            break
        node.tick()  # its monitor sees the connection and sends KvHello
    identity, hello = _recv(decode)
    assert isinstance(hello, KvHello)
    transport.send(decode, HelloAck(True, Role.DECODE, {"transport": "zmq"}), identity=identity)
    _drain_peer(node)
    _, offer = _recv(decode)
    assert isinstance(offer, KvOffer) and offer.request_id == rid
    return identity


def _drain_peer(node: PrefillNode) -> None:
    [peer] = node.peers.values()
    assert peer.link.sock.poll(WAIT_MS)
    node.drain(peer.link.sock)


def _run_out(node: PrefillNode, rid: str) -> None:
    node.transfers[rid].started = time.monotonic() - node.cfg.kv_lease_s - 1


def test_every_step_counts_even_one_that_only_computes_prompt_chunks(tiny_models):
    """A 20-token prompt under an 8-token budget takes 3 steps, two of which sample nothing: the node counts 3, and
    their time (bench and the simulator read the mean step from these counters)."""
    engine = EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=32, max_num_batched_tokens=8)
    node = PrefillNode(NodeConfig("prefill", engine))
    try:
        router = FakeRouter(node)
        router.send(Generate("r", PROMPT, PARAMS, decode_addr="tcp://127.0.0.1:9"))
        for _ in range(3):
            node.loop_once()
        assert router.events()[0].token_ids, "no first token after 3 steps"
        assert node.counters["steps"] == 3 and node.counters["busy_time_s"] >= node.counters["step_time_s"] > 0
        # each is a step with a prompt chunk, counted in that floor group: 8 + 8 + 4 tokens, reading 8 + 16 + 20;
        # only the last samples (its last row's logits: the first token)
        c = node.counters
        assert (c["steps_prompt_chunks_count"], c["steps_prompt_chunks_tokens"]) == (3, 20)
        assert c["steps_prompt_chunks_samples"] == 1
        assert c["steps_prompt_chunks_context_tokens"] == 8 + 16 + 20 and c["steps_decode_1_8_count"] == 0
        assert 0 < c["steps_prompt_chunks_time_s"] <= c["step_time_s"]
    finally:
        node.close()


def test_kv_waiting_renews_the_lease_and_a_lease_that_runs_out_frees_the_kv(prefill):
    node, router, decode, addr = prefill
    identity = _prefill_and_pair(node, router, decode, addr, "r1")
    held = node.engine.kv_stats()[0]
    assert held > 0
    _run_out(node, "r1")
    transport.send(decode, KvWaiting(["r1"]), identity=identity)  # still queued there for blocks
    _drain_peer(node)
    node.tick()
    assert "r1" in node.transfers and node.engine.kv_stats()[0] == held, "a renewed lease ran out"
    _run_out(node, "r1")
    node.tick()
    assert "r1" not in node.transfers and "r1" not in node.engine.requests and node.engine.kv_stats()[0] == 0
    [ev] = router.events()
    assert ev.finish_reason == FinishReason.ERROR and ev.error_code == ErrorCode.KV_TRANSFER_FAILED
    assert "lease" in ev.error
    assert _recv(decode)[1] == KvCancel("r1"), "the decode node was not told to forget it"


def test_a_refusal_reaches_the_router_with_the_decode_nodes_error_code(prefill):
    node, router, decode, addr = prefill
    identity = _prefill_and_pair(node, router, decode, addr, "r1")
    refusal = KvAck("r1", False, "the request needs 9 KV blocks", ErrorCode.INVALID_REQUEST)
    transport.send(decode, refusal, identity=identity)
    _drain_peer(node)
    [ev] = router.events()
    assert (ev.error_code, ev.error) == (ErrorCode.INVALID_REQUEST, refusal.reason)
    assert not node.transfers and node.engine.kv_stats()[0] == 0


def test_an_abort_frees_the_held_kv_and_cancels_the_offer(prefill):
    node, router, decode, addr = prefill
    _prefill_and_pair(node, router, decode, addr, "r1")
    router.send(Abort("r1"))
    assert not node.transfers and node.engine.kv_stats()[0] == 0
    assert _recv(decode)[1] == KvCancel("r1")


# ---- the decode node -------------------------------------------------------------------------------


class FakePrefill:
    """A prefill node's KV connection to the decode node; each message sent is handled before send() returns."""

    def __init__(self, node: DecodeNode) -> None:
        self.node = node
        self.sock = node.ctx.socket(zmq.DEALER)
        self.sock.connect(node.kv_addr)
        self.send(KvHello(PROTOCOL_VERSION, node.engine.layout.to_dict(), "zmq"))
        assert self.recv().ok

    def send(self, msg) -> None:
        transport.send(self.sock, msg)
        assert self.node.kv_sock.poll(WAIT_MS)
        self.node.drain(self.node.kv_sock)

    def recv(self):
        return _recv(self.sock)[1]

    def offer(self, rid: str, num_tokens: int = len(PROMPT)) -> None:
        self.send(KvOffer(rid, list(range(1, num_tokens + 1)), 7, PARAMS, num_tokens))


@pytest.fixture
def decode(tiny_models):
    cfg = NodeConfig("decode", EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=4))  # two offers' worth
    node = DecodeNode(cfg)
    yield node, FakePrefill(node)
    node.close()


def _tick(node: DecodeNode) -> None:
    node._next_notice = 0.0  # send the KvWaiting notice on this tick
    node.tick()


def test_offers_wait_fcfs_for_blocks_with_notices_and_are_pulled_as_blocks_free(decode):
    node, peer = decode
    for rid in ("r1", "r2", "r3", "r4"):
        peer.offer(rid)
    _tick(node)
    assert [peer.recv() for _ in range(3)] == [KvPull("r1"), KvPull("r2"), KvWaiting(["r3", "r4"])]
    assert [r.request_id for r in node.engine.waiting_for_kv()] == ["r3", "r4"]
    node.on_abort("r1")  # the router aborts a reserved one: its blocks go to the oldest waiting offer
    _tick(node)
    assert [peer.recv() for _ in range(2)] == [KvPull("r3"), KvWaiting(["r4"])]
    peer.send(KvCancel("r2"))  # the prefill node cancels a reserved one
    _tick(node)
    assert peer.recv() == KvPull("r4")
    assert sorted(node.incoming) == ["r3", "r4"] and node.engine.kv_stats()[0] == 4


def test_a_reservation_that_no_kv_answers_is_recomputed_here(decode):
    """KV that has not all landed within half the lease after the pull is never waited for or decoded from: by
    --kv-failure recompute (the default) the request recomputes its prompt in the blocks it holds, and the
    prefill node is told to let its copy go."""
    node, peer = decode
    peer.offer("r1")
    _tick(node)
    assert peer.recv() == KvPull("r1") and node.engine.kv_stats()[0] == 2
    node.incoming["r1"].pulled_at = time.monotonic() - node.cfg.kv_lease_s / 2 - 1
    node.tick()
    ack = peer.recv()
    assert isinstance(ack, KvAck) and ack.ok and "recomputed" in ack.reason
    assert not node.incoming and node.engine.requests["r1"].status is Status.WAITING
    assert node.engine.kv_stats()[0] == 2


def test_kv_that_arrives_after_the_node_gave_up_on_it_is_ignored(decode):
    """Half the KV lands, the node gives up (recompute), then every layer arrives, damaged: none of it is written
    into the blocks the request now recomputes in, nothing is acknowledged again, and the node serves on."""
    node, peer = decode
    peer.offer("r1")
    _tick(node)
    assert peer.recv() == KvPull("r1")
    req = node.engine.requests["r1"]
    (paired,) = node.peers.values()
    backend = paired.backend
    layers = list(node.engine.send_kv(req, backend))  # frames shaped as the prefill node's, from this pool
    damaged = [(h, [np.full_like(f, 0xFF) for f in frames]) for h, frames in layers]
    half = len(layers) // 2
    for header, frames in layers[:half]:
        transport.send(peer.sock, header, frames)
        assert node.kv_sock.poll(WAIT_MS)
        node.drain(node.kv_sock)
    assert node.incoming["r1"].layers_landed == half
    node.incoming["r1"].pulled_at = time.monotonic() - node.cfg.kv_lease_s / 2 - 1
    node.tick()
    ack = peer.recv()
    assert isinstance(ack, KvAck) and "recomputed" in ack.reason and req.status is Status.WAITING
    before = [node.engine.pool.export_blocks(layer, req.block_ids).clone() for layer in range(len(layers))]
    bad, received = node.counters["kv_bad"], node.counters["kv_received"]
    for header, frames in damaged:
        transport.send(peer.sock, header, frames)
        assert node.kv_sock.poll(WAIT_MS)
        node.drain(node.kv_sock)
    after = [node.engine.pool.export_blocks(layer, req.block_ids) for layer in range(len(layers))]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True)), "late KV was written into the pool"
    assert (node.counters["kv_bad"], node.counters["kv_received"]) == (bad, received)
    assert not peer.sock.poll(200), "the late KV was answered"
    assert req.status is Status.WAITING and not node.incoming
    peer.offer("r2")  # and the node takes the next transfer as usual
    _tick(node)
    assert peer.recv() == KvPull("r2")


def test_an_abort_before_the_offer_refuses_the_late_offer(decode):
    node, peer = decode
    node.on_abort("r1")
    peer.offer("r1")
    ack = peer.recv()
    assert isinstance(ack, KvAck) and ack.request_id == "r1" and not ack.ok
    assert not node.incoming and "r1" not in node.engine.requests


def test_an_offer_larger_than_the_pool_is_refused_with_invalid_request(decode):
    node, peer = decode
    peer.offer("big", num_tokens=100)
    ack = peer.recv()
    assert not ack.ok and ack.error_code == ErrorCode.INVALID_REQUEST and "blocks" in ack.reason
    assert not node.incoming
