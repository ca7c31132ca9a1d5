"""The short way of a token in the middle of an answer, in-process (fake node sockets): RouterCore hands a steady
request's tokens over without the first-token and hand-off checks (`Flight.steady`), and a plain choice's stream
writes them without a Delta (`ChoiceView.plain_text`). Each is checked to be taken where it should and nowhere else,
and to give what the long way gives: the same events, metrics and bytes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.config import RouterConfig
from pdserve.router import api
from pdserve.router.core import RouterCore
from pdserve.router.nodes import NodeConn
from pdserve.router.stream import ChoiceView, Outbox, SseStream
from pdserve.router.text import load_model_info
from pdserve.wire.codec import encode
from pdserve.wire.messages import TokenEvent, TokenEvents
from pdserve.wire.params import FinishReason, SamplingParams
from tests.helpers import FakeNodeSock

LENGTH = FinishReason.LENGTH


def _core(**addrs) -> RouterCore:
    core = RouterCore(RouterConfig(model="tiny", **addrs))
    for m in core.links.membership._members:
        core.nodes.append(NodeConn(m.role, m.addr, m.kv_addr, sock=FakeNodeSock(), up=True))
    return core


@pytest.fixture
def disagg():
    core = _core(prefill=("tcp://p0",), decode=("tcp://d0", "tcp://d1"), decode_kv=("tcp://k0", "tcp://k1"))
    yield core
    core.links.ctx.destroy(linger=0)


@pytest.fixture
def colocated():
    core = _core(colocated=("tcp://c0",))
    yield core
    core.links.ctx.destroy(linger=0)


def _step(core: RouterCore, node: NodeConn, *events: TokenEvent) -> None:
    """A node's message of one step, as it comes off the wire."""
    core.links._on_message(node, [encode(TokenEvents.of(list(events)))])


def _long_way_calls(core: RouterCore, monkeypatch) -> list[str]:
    """The request ids of the events that went the long way (through `_put`)."""
    calls: list[str] = []
    put = core._put
    monkeypatch.setattr(
        core, "_put", lambda flight, ev, *a, **k: calls.append(ev.request_id) or put(flight, ev, *a, **k)
    )
    return calls


def _taken(flight) -> list[list[int]]:
    out, flight.inbox.events = flight.inbox.events, []
    return [ev.token_ids for ev in out]


def test_a_handed_off_requests_decode_tokens_take_the_short_way_once_its_first_are_out(disagg, monkeypatch):
    long_way = _long_way_calls(disagg, monkeypatch)
    flight = disagg.submit([1, 2, 3], SamplingParams(max_tokens=6))
    rid, (prefill, decode) = flight.request_id, flight.nodes
    _step(disagg, decode, TokenEvent(rid, []))  # "KV landed"
    _step(disagg, decode, TokenEvent(rid, [11]))  # beats the first token: held
    assert flight.steady is None
    _step(disagg, prefill, TokenEvent(rid, [10]))  # the first token, then the held one
    assert flight.steady is decode, "the decode node's first token is out"
    assert long_way == [rid, rid]
    for t in (12, 13, 14):
        _step(disagg, decode, TokenEvent(rid, [t]))
    assert long_way == [rid, rid], "a steady token went the long way"
    _step(disagg, decode, TokenEvent(rid, [15], LENGTH))  # the last event: the long way (it ends the request)
    assert long_way == [rid, rid, rid]
    assert _taken(flight) == [[10], [11], [12], [13], [14], [15]] and flight.output == [10, 11, 12, 13, 14, 15]
    assert rid not in disagg.flights and not decode.requests and not prefill.requests
    m = disagg.metrics
    assert m.generation_tokens.value == 6 and sum(m.itl.counts) == 5, "a gap between two tokens was not observed"


def test_a_prefill_nodes_tokens_never_take_it(disagg, monkeypatch):
    long_way = _long_way_calls(disagg, monkeypatch)
    flight = disagg.submit([1, 2, 3], SamplingParams(max_tokens=6))
    rid, prefill = flight.request_id, flight.nodes[0]
    _step(disagg, prefill, TokenEvent(rid, [10]))
    assert flight.steady is None
    _step(disagg, prefill, TokenEvent(rid, [11]))
    assert long_way == [rid, rid]


def test_a_colocated_requests_tokens_after_its_first_take_it(colocated, monkeypatch):
    long_way = _long_way_calls(colocated, monkeypatch)
    flight = colocated.submit([1, 2, 3], SamplingParams(max_tokens=4))
    rid, node = flight.request_id, flight.nodes[0]
    _step(colocated, node, TokenEvent(rid, [10]))
    assert flight.steady is node
    _step(colocated, node, TokenEvent(rid, [11, 12]))
    _step(colocated, node, TokenEvent(rid, [13], LENGTH))
    assert long_way == [rid, rid] and _taken(flight) == [[10], [11, 12], [13]]
    assert colocated.metrics.generation_tokens.value == 4 and sum(colocated.metrics.itl.counts) == 2


def test_a_request_dispatched_again_leaves_the_short_way_until_its_new_nodes_tokens(disagg, monkeypatch):
    flight = disagg.submit([1, 2, 3], SamplingParams(max_tokens=8))
    old, (prefill, decode) = flight.request_id, flight.nodes
    _step(disagg, prefill, TokenEvent(old, [10]))
    _step(disagg, decode, TokenEvent(old, []))
    _step(disagg, decode, TokenEvent(old, [11]))
    assert flight.steady is decode
    disagg.links.node_down(decode, "test")
    new, (prefill2, decode2) = flight.request_id, flight.nodes
    assert new != old and flight.steady is None and decode2 is not decode
    long_way = _long_way_calls(disagg, monkeypatch)
    _step(disagg, decode, TokenEvent(old, [99]))  # a late event of the old id: dropped
    _step(disagg, prefill2, TokenEvent(new, [12]))
    _step(disagg, decode2, TokenEvent(new, []))
    _step(disagg, decode2, TokenEvent(new, [13]))
    assert flight.steady is decode2 and long_way == [new, new]
    _step(disagg, decode2, TokenEvent(new, [14]))
    assert long_way == [new, new] and flight.output == [10, 11, 12, 13, 14]


# ---- the stream's short way ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def info():
    return load_model_info("tiny")


def _stream(core: RouterCore, info, long_way: bool = False, **fields) -> tuple[SseStream, list[bytes]]:
    """A streamed completion's stream, attached to a recorder; `long_way`: as every choice went before the short
    way (a Delta per event)."""
    body = api.CompletionBody(model="tiny", prompt=[1, 2, 3], max_tokens=6, stream=True, **fields)
    job = api.make_job(body, [1, 2, 3], info)
    flight = core.submit(job.prompt_ids, job.params)
    job.id, job.created = "x", 1  # the same envelope for every stream
    stream = SseStream(core, info, [job], False, [flight], SimpleNamespace(usage=None), "stream", Outbox())
    if long_way:
        stream.views[0].plain_text = None
    writes: list[bytes] = []
    stream.attach(lambda data: writes.append(data) or True)
    return stream, writes


@pytest.mark.parametrize("fields", [{}, {"return_token_ids": True}, {"stream_options": {"include_usage": True}}])
def test_a_plain_choice_writes_on_the_short_way_what_the_long_way_writes(colocated, info, monkeypatch, fields):
    async def run() -> tuple[list[bytes], list[bytes], list[int]]:
        short, short_writes = _stream(colocated, info, **fields)
        long, long_writes = _stream(colocated, info, long_way=True, **fields)
        assert short.views[0].plain_text is not None
        shown = []
        show = SseStream._show
        monkeypatch.setattr(SseStream, "_show", lambda self, i, ev: shown.append(self is short) or show(self, i, ev))
        ids = [[1000], [32], [3000, 3001], [0], [5], [60, 61]]  # odd ids: bytes that only a later token completes
        for stream in (short, long):
            node, rid = stream.flights[0].nodes[0], stream.flights[0].request_id
            for k, toks in enumerate(ids):
                _step(colocated, node, TokenEvent(rid, toks, LENGTH if k == len(ids) - 1 else None))
                await asyncio.sleep(0)  # the outbox's flush: one write a event
        return short_writes, long_writes, shown

    short_writes, long_writes, shown = asyncio.run(run())
    assert short_writes == long_writes and len(short_writes) == 6
    assert shown.count(True) == 1, "the short way's choice took the long way before its last event"


@pytest.mark.parametrize("fields", [{"stop": ["x"]}, {"logprobs": 1}, {"echo": True}])
def test_a_choice_with_stops_log_probabilities_or_echo_is_not_plain(colocated, info, fields):
    async def run():
        stream, _ = _stream(colocated, info, **fields)
        return stream.views[0].plain_text

    assert asyncio.run(run()) is None


@pytest.mark.parametrize(
    "fields,last,stop_reason",
    [
        ({"stop_token_ids": [7, 9]}, 9, 9),  # a stop token id: named
        ({"stop_token_ids": [7], "ignore_eos": True}, "eos", None),  # EOS ignored, and not a stop id: length's end
        ({"stop_token_ids": ["eos"], "ignore_eos": True}, "eos", "eos"),  # EOS ignored, yet a stop id: named
        ({"stop_token_ids": ["eos"]}, "eos", None),  # EOS ends it first (as vLLM reports it)
        ({}, "eos", None),
    ],
)
def test_the_stop_reason_names_the_stop_token_id_that_ended_the_choice(info, fields, last, stop_reason):
    eos = info.eos_token_ids[0]
    fields = {k: [eos if t == "eos" else t for t in v] if k == "stop_token_ids" else v for k, v in fields.items()}
    last, stop_reason = (eos if x == "eos" else x for x in (last, stop_reason))
    job = api.make_job(api.CompletionBody(model="tiny", prompt=[1, 2], max_tokens=6, **fields), [1, 2], info)
    view = ChoiceView(info, job)
    assert view.delta(TokenEvent("r", [5], None)).stop_reason is None
    end = view.delta(TokenEvent("r", [last], FinishReason.STOP))
    assert (end.finish_reason, end.stop_reason) == (FinishReason.STOP, stop_reason)


def test_the_stop_reason_names_the_stop_string_that_ended_the_choice(info):
    job = api.make_job(api.CompletionBody(model="tiny", prompt=[1, 2], max_tokens=6, stop=["zz", "b"]), [1, 2], info)
    view = ChoiceView(info, job)
    ids = info.tokenizer.encode("abc", add_special_tokens=False)
    deltas, error = view.deltas([TokenEvent("r", [t], None) for t in ids])  # up to the choice's end
    assert error is None and [(d.finish_reason, d.stop_reason) for d in deltas] == [(None, None), ("stop", "b")]
    assert "".join(d.text for d in deltas) == "a"
