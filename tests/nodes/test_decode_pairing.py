"""A decode node in-process, its KV socket driven by hand as a prefill node would: the pairing of a peer that
pairs again or whose pool is gone (shm, for real), and the KvAck that must wait for the block copy."""

from __future__ import annotations

import gc

import pytest
import torch
import zmq

from pdserve.config import EngineConfig, NodeConfig
from pdserve.kv.pool import KVPool
from pdserve.kv.transfer import ShmBackend
from pdserve.nodes.decode import DecodeNode
from pdserve.wire import transport
from pdserve.wire.messages import PROTOCOL_VERSION, HelloAck, KvAck, KvData, KvHello, KvOffer, KvPull
from pdserve.wire.params import SamplingParams
from tests.helpers import export_tokens

WAIT_MS = 10_000


@pytest.fixture
def node(tiny_models):
    cfg = NodeConfig("decode", EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=32), kv_transport="shm")
    n = DecodeNode(cfg)
    yield n
    n.close()


class Peer:
    """A prefill node's KV connection; each message sent is handled by the node before send() returns."""

    def __init__(self, node: DecodeNode, identity: bytes) -> None:
        self.node, self.identity = node, identity
        self.sock = node.ctx.socket(zmq.DEALER)  # closed with the node's context
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(node.kv_addr)

    def send(self, msg) -> None:
        transport.send(self.sock, msg)
        assert self.node.kv_sock.poll(WAIT_MS), "the decode node got nothing"
        self.node.drain(self.node.kv_sock)

    def recv(self):
        assert self.sock.poll(WAIT_MS), "the decode node answered nothing"
        return transport.recv(self.sock)[1]

    def pair(self, name: str, handle: dict) -> HelloAck:
        self.send(KvHello(PROTOCOL_VERSION, self.node.engine.layout.to_dict(), name, handle))
        return self.recv()

    def offer(self, request_id: str, num_tokens: int = 20) -> None:
        self.send(KvOffer(request_id, list(range(1, num_tokens + 1)), 7, SamplingParams(max_tokens=4), num_tokens))


def _shm_pool(node: DecodeNode) -> ShmBackend:
    owner = ShmBackend()
    owner.storage(node.engine.layout, 8, "cpu")
    return owner


def _mappings(name: str) -> int:
    """How many times this process maps the shared memory segment `name` (its owner here maps it too)."""
    gc.collect()
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def _reserve(node: DecodeNode, peer: Peer, request_id: str) -> list[int]:
    """Offer `request_id`, let the node reserve its blocks and pull; the blocks reserved."""
    peer.offer(request_id)
    node.tick()
    assert isinstance(peer.recv(), KvPull)
    return node.engine.requests[request_id].block_ids


def test_a_peer_that_pairs_again_replaces_its_old_pairing(node):
    first, second = _shm_pool(node), _shm_pool(node)
    try:
        peer, name = Peer(node, b"prefill-0"), first.handle()["name"]
        owners_maps = _mappings(name)
        assert peer.pair("shm", first.handle()).ok and _mappings(name) == owners_maps + 1
        _reserve(node, peer, "r1")
        peer.offer("r2")  # still waiting for blocks
        assert node.engine.pool.allocator.num_used > 0 and len(node.engine.waiting_for_kv()) == 1
        # the same connection pairs again, with another pool (the prefill node restarted behind the same identity)
        assert peer.pair("shm", second.handle()).ok
        assert node.peers[b"prefill-0"].handle["name"] == second.handle()["name"]
        assert _mappings(name) == owners_maps, "the old pool is still mapped"
        assert not node.incoming and not node.engine.requests and node.engine.pool.allocator.num_used == 0
        # the same pool pairs over a new connection (the prefill node reconnected): the old connection is dead
        again = Peer(node, b"prefill-0-again")
        assert again.pair("shm", second.handle()).ok
        assert list(node.peers) == [b"prefill-0-again"]
        peer.offer("r3")
        refusal = peer.recv()
        assert isinstance(refusal, KvAck) and not refusal.ok and "no pairing" in refusal.reason
    finally:
        first.close()
        second.close()


def test_a_gone_prefill_pool_is_unmapped_and_its_transfers_dropped(node):
    owner, other = _shm_pool(node), _shm_pool(node)
    try:
        peer, staying = Peer(node, b"prefill-0"), Peer(node, b"prefill-1")
        assert peer.pair("shm", owner.handle()).ok and staying.pair("shm", other.handle()).ok
        _reserve(node, peer, "r1")
        kept = _reserve(node, staying, "r2")
        name = owner.handle()["name"]
        owner.close()  # the prefill node stops: its segment is unlinked (its own map goes with its object)
        assert _mappings(name) == 1
        node._drop_gone_peers()
        assert _mappings(name) == 0, "a gone prefill node's pool is still mapped"
        assert list(node.peers) == [b"prefill-1"] and list(node.incoming) == ["r2"]
        assert node.engine.pool.allocator.num_used == len(kept)
    finally:
        owner.close()
        other.close()


class AsyncCopyBackend:
    """A cuda_ipc-like fake on the CPU: unpack() only queues the block copy, wait_landed() runs it."""

    name = "async-copy"

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source
        self.queued: list = []

    def attach(self, handle: dict, layout, device: str) -> torch.Tensor:
        return self.source

    def alive(self, handle: dict) -> bool:
        return True

    def forget(self, handle: dict) -> None:
        pass

    def unpack(self, pool: KVPool, dst_blocks, num_tokens, header: KvData, frames, source) -> int:
        n = len(header.src_blocks)
        self.queued.append(lambda: pool.copy_blocks_from(source, list(header.src_blocks), dst_blocks[:n]))
        return pool.layout.num_layers

    def wait_landed(self, pool: KVPool) -> None:
        while self.queued:
            self.queued.pop(0)()

    def close(self) -> None:
        pass


def test_the_ack_waits_for_the_block_copy(node, monkeypatch):
    layout = node.engine.layout
    source = torch.randn(KVPool.shape_for(layout, 8))
    node.backends = {"async-copy": AsyncCopyBackend(source)}
    acks: list[tuple[KvAck, bool]] = []
    real_send = transport.send
    src_blocks, num_tokens = [5, 2], 20

    def spying_send(sock, msg, frames=(), identity=None):
        if isinstance(msg, KvAck):  # has the KV landed when the prefill node is told it may reuse its blocks?
            landed = export_tokens(node.engine.pool, dst_blocks, num_tokens)
            sent = export_tokens(KVPool(layout, 8, data=source), src_blocks, num_tokens)
            acks.append((msg, torch.equal(landed, sent)))
        real_send(sock, msg, frames, identity)

    monkeypatch.setattr(transport, "send", spying_send)
    peer = Peer(node, b"prefill-0")
    assert peer.pair("async-copy", {"pool_id": "p"}).ok
    dst_blocks = _reserve(node, peer, "r1")
    shape = [2, layout.num_kv_heads, num_tokens, layout.head_dim]
    peer.send(KvData("r1", layout.dtype, shape, -1, src_blocks))
    assert isinstance(peer.recv(), KvAck)
    [(ack, landed)] = acks
    assert ack.ok and landed, "the ack went out before the copy out of the prefill pool had finished"
    assert "r1" in node.engine.requests


@pytest.fixture
def auto_node(tiny_models):
    cfg = NodeConfig(
        "decode", EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=32), kv_transport="auto", host_id="host-a"
    )
    n = DecodeNode(cfg)
    yield n
    n.close()


@pytest.mark.parametrize("host_id,chosen", [("host-a", "shm"), ("host-b", "zmq")])
def test_auto_shares_the_pool_on_one_host_and_ships_over_zmq_across_hosts(auto_node, host_id, chosen):
    owner = _shm_pool(auto_node)
    try:
        peer = Peer(auto_node, b"prefill-0")
        hello = KvHello(
            PROTOCOL_VERSION, auto_node.engine.layout.to_dict(), "auto", owner.handle(), host_id, ["shm", "zmq"]
        )
        peer.send(hello)
        ack = peer.recv()
        assert ack.ok and ack.info == {"transport": chosen}, ack
        assert auto_node.peers[b"prefill-0"].backend.name == chosen
        assert _mappings(owner.handle()["name"]) == (2 if chosen == "shm" else 1)  # mapped here only for shm
    finally:
        owner.close()


def test_a_shared_pool_from_another_host_is_refused(node):
    owner = _shm_pool(node)
    try:
        peer = Peer(node, b"prefill-0")
        peer.send(KvHello(PROTOCOL_VERSION, node.engine.layout.to_dict(), "shm", owner.handle(), "elsewhere"))
        ack = peer.recv()
        assert not ack.ok and "one host" in ack.reason, ack
    finally:
        owner.close()


def test_a_stopping_decode_node_unmaps_every_prefill_pool(tiny_models):
    """The node drops its mappings as it closes (its prefill nodes are stopped after it, their pools' owners): only
    the owners' own maps are left, after a copy out of one pool has run (the copies it keeps record hold none) and
    with another request's transfer still waiting."""
    cfg = NodeConfig("decode", EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=32), kv_transport="shm")
    node = DecodeNode(cfg)
    first, second = _shm_pool(node), _shm_pool(node)
    try:
        peers = [Peer(node, f"prefill-{i}".encode()) for i in range(2)]
        for peer, owner in zip(peers, (first, second), strict=True):
            assert peer.pair("shm", owner.handle()).ok
        layout = node.engine.layout
        kv = KvData("r1", layout.dtype, [2, layout.num_kv_heads, 20, layout.head_dim], -1, [0, 1])
        peers[0].send(KvOffer("r1", list(range(1, 21)), 7, SamplingParams(max_tokens=4), 20, kv))  # its blocks there
        node.tick()  # blocks reserved: the copy out of the shared pool goes to the copier
        while not node.copies:  # the copy runs on the copier's thread; the node takes it when poked
            assert node.copier.wake.poll(WAIT_MS), "the copy did not end"
            node.drain(node.copier.wake)
        assert isinstance(peers[0].recv(), KvAck) and "r1" in node.joining
        _reserve(node, peers[1], "r2")  # a transfer that waits holds its peer too
        names = [first.handle()["name"], second.handle()["name"]]
        assert [_mappings(n) for n in names] == [2, 2]
        node.close()
        assert [_mappings(n) for n in names] == [1, 1] and not node.peers and not node.incoming
    finally:
        node.close()
        first.close()
        second.close()
