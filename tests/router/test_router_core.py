"""The router's state machine in-process, without sockets or nodes: RouterCore's node connections are given fake
sockets, and node events are handed to it as its reader tasks would. What a client's stream receives, in order."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from pdserve.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.errors import HTTP_STATUS
from pdserve.router.nodes import NodeConn
from pdserve.wire.codec import encode
from pdserve.wire.messages import Abort, Generate, TokenEvent, TokenEvents
from pdserve.wire.params import ErrorCode, FinishReason, Role, SamplingParams
from tests.helpers import FakeNodeSock

ERROR, STOP, LENGTH = FinishReason.ERROR, FinishReason.STOP, FinishReason.LENGTH


@pytest.fixture
def core():
    cfg = RouterConfig(model="tiny", prefill=("tcp://p0", "tcp://p1"), decode=("tcp://d0",), decode_kv=("tcp://k0",))
    c = RouterCore(cfg)
    for m in c.links.membership._members:  # what _sync_members would connect, with fake sockets, marked up
        c.nodes.append(NodeConn(m.role, m.addr, m.kv_addr, sock=FakeNodeSock(), up=True))
    yield c
    c.links.ctx.destroy(linger=0)


def _node(core: RouterCore, addr: str):
    return next(n for n in core.nodes if n.addr == addr)


def _events(flight) -> list[TokenEvent]:
    out, flight.inbox.events = flight.inbox.events, []
    return out


def _submit(core: RouterCore, prompt=(1, 2, 3), max_tokens: int = 5):
    flight = core.submit(list(prompt), SamplingParams(max_tokens=max_tokens))
    prefill, decode = flight.nodes
    return flight, prefill, decode


def test_decode_tokens_that_beat_the_first_token_are_delivered_after_it(core):
    flight, prefill, decode = _submit(core)
    rid = flight.request_id
    assert isinstance(prefill.sock.sent[-1], Generate) and prefill.sock.sent[-1].decode_addr == "tcp://k0"
    core._deliver(TokenEvent(rid, []), decode)  # "KV landed"
    core._deliver(TokenEvent(rid, [11]), decode)
    core._deliver(TokenEvent(rid, [12]), decode)
    assert _events(flight) == [], "a decode token went out before the first token"
    core._deliver(TokenEvent(rid, [10]), prefill)
    core._deliver(TokenEvent(rid, [13, 14], LENGTH), decode)
    got = _events(flight)
    assert [t for ev in got for t in ev.token_ids] == [10, 11, 12, 13, 14]
    assert got[-1].finish_reason == LENGTH and flight.output == [10, 11, 12, 13, 14]
    assert rid not in core.flights and not prefill.requests and not decode.requests


def test_events_after_the_end_or_of_an_old_id_are_not_delivered_again(core):
    flight, prefill, decode = _submit(core)
    rid = flight.request_id
    core._deliver(TokenEvent(rid, [10]), prefill)
    core._deliver(TokenEvent(rid, [11], STOP), decode)
    core._deliver(TokenEvent(rid, [11], STOP), decode)  # a duplicate of the last event
    core._deliver(TokenEvent(rid, [12]), decode)
    assert [ev.token_ids for ev in _events(flight)] == [[10], [11]]


def test_a_lost_prefill_node_before_the_first_token_dispatches_again_and_drops_the_old_ids_events(core):
    flight, prefill, decode = _submit(core)
    old = flight.request_id
    core._deliver(TokenEvent(old, []), decode)  # held until the first token, which never comes from there
    core.links.node_down(prefill, "test")
    new = flight.request_id
    assert new != old and flight.attempts == 2 and flight.nodes[0] is not prefill
    assert Abort(old) in decode.sock.sent, "the decode node still holds the old id"
    core._deliver(TokenEvent(old, [99]), decode)  # a late event of the old id
    other = flight.nodes[0]
    core._deliver(TokenEvent(new, [10]), other)
    core._deliver(TokenEvent(new, [11], STOP), flight.nodes[1])
    assert [t for ev in _events(flight) for t in ev.token_ids] == [10, 11]


def test_a_lost_prefill_node_after_the_kv_landed_does_not_concern_the_request(core):
    flight, prefill, decode = _submit(core)
    rid = flight.request_id
    core._deliver(TokenEvent(rid, [10]), prefill)
    core._deliver(TokenEvent(rid, []), decode)  # "KV landed": the prefill node is no longer needed
    core.links.node_down(prefill, "test")
    assert flight.request_id == rid and flight.attempts == 1
    core._deliver(TokenEvent(rid, [11], STOP), decode)
    assert [ev.token_ids for ev in _events(flight)] == [[10], [11]]


def _resumed(core: RouterCore, max_tokens: int):
    """A request that streamed [10, 11] (prompt [1, 2, 3]), then lost its decode node, with another one up: its
    flight, and its id before it was dispatched again."""
    core.nodes.append(NodeConn(Role.DECODE, "tcp://d1", "tcp://k1", sock=FakeNodeSock(), up=True))
    flight, prefill, decode = _submit(core, prompt=(1, 2, 3), max_tokens=max_tokens)
    rid = flight.request_id
    core._deliver(TokenEvent(rid, [10]), prefill)
    core._deliver(TokenEvent(rid, []), decode)
    core._deliver(TokenEvent(rid, [11]), decode)
    core.links.node_down(decode, "test")
    return flight, rid


def test_a_request_resumes_from_the_streamed_tokens_when_its_decode_node_is_lost(core):
    flight, rid = _resumed(core, max_tokens=5)
    resent = flight.nodes[0].sock.sent[-1]
    assert isinstance(resent, Generate) and resent.request_id == flight.request_id != rid
    assert resent.prompt_token_ids == [1, 2, 3, 10, 11] and resent.params.max_tokens == 3
    assert flight.nodes[1].addr == "tcp://d1"


def test_a_resumed_requests_decode_tokens_that_beat_its_new_first_token_are_delivered_after_it(core):
    """Dispatched again after its decode node was lost, the request has a first token already, from its first
    dispatch; its new decode node's tokens may still beat the new prefill node's token over the other socket, and
    wait for it as on the first dispatch."""
    flight, _ = _resumed(core, max_tokens=6)
    new, (prefill2, decode2) = flight.request_id, flight.nodes
    core._deliver(TokenEvent(new, []), decode2)  # "KV landed"
    core._deliver(TokenEvent(new, [13]), decode2)  # beats the new prefill node's token
    core._deliver(TokenEvent(new, [12]), prefill2)
    core._deliver(TokenEvent(new, [14, 15], LENGTH), decode2)
    assert [t for ev in _events(flight) for t in ev.token_ids] == [10, 11, 12, 13, 14, 15]
    assert flight.output == [10, 11, 12, 13, 14, 15] and new not in core.flights


def test_a_prefill_node_that_saw_its_decode_peer_go_dispatches_the_request_again(core):
    """The prefill node may see the decode node's socket close before the router does: its error event says the
    node failed (NODE_FAILED), and the request is dispatched again, not failed; a transfer that failed otherwise
    (KV_TRANSFER_FAILED: refused, lease out) still reaches the client."""
    core.nodes.append(NodeConn(Role.DECODE, "tcp://d1", "tcp://k1", sock=FakeNodeSock(), up=True))
    flight, prefill, decode = _submit(core)
    old = flight.request_id
    core._deliver(TokenEvent(old, [10]), prefill)
    lost = TokenEvent(old, [], ERROR, error="decode node k0 disconnected", error_code=ErrorCode.NODE_FAILED)
    core._deliver(lost, prefill)
    assert [ev.token_ids for ev in _events(flight)] == [[10]], "the error reached the client"
    assert flight.request_id != old and flight.attempts == 2
    resent = flight.nodes[0].sock.sent[-1]
    assert isinstance(resent, Generate) and resent.request_id == flight.request_id
    assert resent.prompt_token_ids == [1, 2, 3, 10] and resent.params.max_tokens == 4
    other, prefill2 = _submit(core)[:2]
    failed = TokenEvent(other.request_id, [], ERROR, error="lease out", error_code=ErrorCode.KV_TRANSFER_FAILED)
    core._deliver(failed, prefill2)
    [ev] = _events(other)
    assert ev.error_code == ErrorCode.KV_TRANSFER_FAILED and other.attempts == 1


def test_with_no_node_left_the_request_fails_with_a_typed_error(core):
    flight, prefill, decode = _submit(core)
    core.links.node_down(decode, "test")
    [ev] = _events(flight)
    assert ev.finish_reason == ERROR and ev.error_code == ErrorCode.NODE_FAILED and "decode" in ev.error
    assert HTTP_STATUS[ev.error_code] == 503


def test_a_node_error_reaches_the_client_with_its_code_and_the_request_is_aborted_elsewhere(core):
    flight, prefill, decode = _submit(core)
    rid = flight.request_id
    core._deliver(TokenEvent(rid, [], ERROR, "lease ran out", error_code=ErrorCode.KV_TRANSFER_FAILED), prefill)
    [ev] = _events(flight)
    assert ev.error_code == ErrorCode.KV_TRANSFER_FAILED and rid not in core.flights
    assert Abort(rid) in decode.sock.sent


def test_what_a_node_sent_before_it_disconnected_is_read_before_it_is_marked_down(core):
    """A node that fails its requests and exits (a drain period run out): its error events are on the socket when
    the monitor reports the disconnect, which the router may read first. The client gets the node's error, not "the
    node failed (disconnected)". Real sockets for the decode node."""
    flight, prefill, decode = _submit(core)
    peer = core.links.ctx.socket(zmq.ROUTER)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    decode.sock = core.links.ctx.socket(zmq.DEALER)
    decode.monitor = decode.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    decode.sock.connect(f"tcp://127.0.0.1:{port}")
    decode.sock.send(b"hello")
    identity, _ = peer.recv_multipart()
    error = TokenEvent(flight.request_id, [], ERROR, "its drain period ran out", error_code=ErrorCode.INTERNAL)
    peer.send_multipart([identity, encode(TokenEvents([error]))])
    peer.close(linger=5000)
    assert decode.monitor.poll(30_000), "no disconnect reported"
    core.links._read_monitor(decode)
    [ev] = _events(flight)
    assert not decode.up and ev.error == "its drain period ran out", ev.error


def test_every_error_code_has_one_http_status():
    assert set(HTTP_STATUS) == set(ErrorCode)
    assert HTTP_STATUS[ErrorCode.INVALID_REQUEST] == 400
    assert all(HTTP_STATUS[c] >= 500 for c in ErrorCode if c is not ErrorCode.INVALID_REQUEST)


def test_nodes_join_in_the_order_listed_and_ties_go_to_the_first(monkeypatch):
    """Which node a tie goes to must not depend on how the addresses sort: `pdserve up` pins decode node i to a
    core by its place in the list, and bench/sim.py breaks ties the same way."""
    addrs, kv = ("tcp://h:9", "tcp://h:10", "tcp://h:8"), ("tcp://h:19", "tcp://h:20", "tcp://h:18")
    c = RouterCore(RouterConfig(model="tiny", prefill=("tcp://h:5",), decode=addrs, decode_kv=kv))
    try:
        monkeypatch.setattr(c.links, "_join", lambda node: c.nodes.append(node))
        asyncio.run(c.links._sync_members())
        assert [n.addr for n in c.nodes] == ["tcp://h:5", *addrs]
        for n in c.nodes:
            n.sock, n.up = FakeNodeSock(), True
        picked = [c.submit([1, 2], SamplingParams(max_tokens=4)).nodes[1].addr for _ in range(4)]
        assert picked == [*addrs, addrs[0]]
    finally:
        c.links.ctx.destroy(linger=0)
