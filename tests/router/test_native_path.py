"""The router's per-token path in C (pdserve/router/native.py) against its Python twin: the same node messages, read by
two routers that differ only in which runs, must leave the same stream bytes, outputs, metrics and faults; and the C
path must be the one that ran where it is built."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from types import SimpleNamespace

import pytest

from pdserve import cbuild
from pdserve.config import RouterConfig
from pdserve.router import api, native
from pdserve.router.core import NodeConn, RouterCore
from pdserve.router.stream import Outbox, SseStream
from pdserve.router.text import load_model_info
from pdserve.wire.codec import encode
from pdserve.wire.messages import TokenEvent, TokenEvents
from pdserve.wire.params import FinishReason, SamplingParams
from tests.helpers import FakeNodeSock

LENGTH = FinishReason.LENGTH


@pytest.fixture(scope="module")
def tokenpath():
    why = native._cannot_build()
    if why:
        pytest.skip(f"the C path cannot be built here: {why}")
    module = native.load()
    assert module is not None, "the C path did not build (see the warning logged)"
    return module


@pytest.fixture(scope="module")
def info():
    return load_model_info("tiny")


def _core(in_c: bool, **addrs) -> RouterCore:
    core = RouterCore(RouterConfig(model="tiny", token_path="auto" if in_c else "python", **addrs))
    assert (core.native is not None) is in_c
    for m in core.membership._members:
        core.nodes.append(NodeConn(m.role, m.addr, m.kv_addr, sock=FakeNodeSock(), up=True))
    return core


def _step(core: RouterCore, node: NodeConn, *events: TokenEvent) -> None:
    core._on_message(node, [encode(TokenEvents.of(list(events)))])


def _stream(core: RouterCore, info, writes: list[bytes], prompt: list[int], **fields) -> SseStream:
    body = api.CompletionBody(model="tiny", prompt=prompt, max_tokens=40, stream=True, **fields)
    job = api.make_job(body, prompt, info)
    flight = core.submit(job.prompt_ids, job.params)
    job.id, job.created = f"x{len(prompt)}", 1  # the same envelope for either router
    stream = SseStream(core, info, [job], False, [flight], SimpleNamespace(usage=None), "stream", Outbox())
    stream.attach(lambda data: writes.append(data) or True)
    return stream


def _fragments(info) -> list[int]:
    """Tokens of the tiny tokenizer whose bytes are not whole UTF-8: a character that only a later token completes."""
    table, found = info.byte_table, []
    for t in range(info.vocab_size):
        data = table.skipping.get(t) or table.learn(t, True)
        if data and data[0] >= 0x80:
            found.append(t)
    assert len(found) > 10, "the tiny tokenizer has byte fragments"
    return found


def _serve(
    in_c: bool,
    steps: list[list[tuple[int, list[int], object]]],
    fields: list[dict],
    monkeypatch,
    prepare=lambda info: None,
) -> dict:
    """Streams of `fields` on a colocated router with a model of its own (its byte table learns as it goes; `prepare`
    sees it first) and a clock that moves 3 ms a reading; `steps`: per node message, (stream, tokens, finish
    reason)."""
    info = load_model_info("tiny")
    prepare(info)
    clock = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock) * 0.003)
    return asyncio.run(_served(in_c, info, steps, fields))


async def _served(in_c: bool, info, steps: list[list[tuple[int, list[int], object]]], fields: list[dict]) -> dict:
    core = _core(in_c, colocated=("tcp://c0",))
    try:
        writes = [[] for _ in fields]
        streams = [_stream(core, info, writes[k], [1, 2, 3 + k], **f) for k, f in enumerate(fields)]
        node = streams[0].flights[0].nodes[0]
        rids = [s.flights[0].request_id for s in streams]
        for events in steps:
            _step(core, node, *(TokenEvent(rids[k], ids, reason) for k, ids, reason in events))
            await asyncio.sleep(0)  # the outbox's flush
        flights = [s.flights[0] for s in streams]
        m = core.metrics
        return {
            "writes": writes,
            "outputs": [f.output for f in flights],
            "tokens": [s.tokens for s in streams],
            "usage": [s.state.usage for s in streams],
            "generated": m.generation_tokens.value,
            "itl": list(m.itl.counts),
            "itl_sum": m.itl.sum,
            "ended": [s.done.done() for s in streams],
            "plain_in_c": [type(f.inbox.push_tokens).__name__ == "Plain" for f in flights],
        }
    finally:
        core.ctx.destroy(linger=0)


def _steps(info, n_streams: int, length: int, seed: int) -> list[list[tuple[int, list[int], object]]]:
    rng, frags = random.Random(seed), _fragments(info)
    steps = []
    for j in range(length):
        events = []
        for k in range(n_streams):
            ids = [
                rng.choice(frags) if rng.random() < 0.4 else rng.randrange(info.vocab_size)
                for _ in range(rng.choice((1, 1, 1, 2, 3)))
            ]
            events.append((k, ids, LENGTH if j == length - 1 else None))
        steps.append(events)
    return steps


FIELDS = [
    {},
    {"return_token_ids": True},
    {"stream_options": {"include_usage": True}},
    {"stop": ["zz"]},
    {"skip_special_tokens": False},
]


def test_c_and_python_leave_the_same_bytes_outputs_and_metrics(tokenpath, info, monkeypatch):
    steps = _steps(info, len(FIELDS), 30, seed=0)
    in_c, in_python = _serve(True, steps, FIELDS, monkeypatch), _serve(False, steps, FIELDS, monkeypatch)
    assert in_c["plain_in_c"] == [True, True, True, False, True], "each plain choice's tokens go to C, no other's"
    assert not any(in_python["plain_in_c"])
    for key in ("writes", "outputs", "tokens", "usage", "generated", "itl", "itl_sum", "ended"):
        assert in_c[key] == in_python[key], key
    assert sum(in_c["itl"]) == len(FIELDS) * 29 and in_c["itl_sum"] > 0, "a gap per message after the first"
    assert all(in_c["ended"]) and all(len(w) == 30 for w in in_c["writes"])


def test_the_c_path_is_what_runs(tokenpath, info, monkeypatch):
    """Steady plain tokens never reach the Python loop or SseStream._on_tokens where C is built: only each stream's
    first tokens do (the long way, as an event)."""
    here = []
    monkeypatch.setattr(RouterCore, "_deliver_tokens_here", lambda *a: here.append("loop") or 0)
    monkeypatch.setattr(SseStream, "_on_tokens", lambda *a: here.append("stream"))
    out = _serve(True, _steps(info, 2, 6, seed=1), [{}, {}], monkeypatch)
    assert here == ["stream", "stream"] and out["generated"] == sum(len(o) for o in out["outputs"]) > 12


def test_a_tokens_fault_ends_its_stream_alike(tokenpath, monkeypatch, caplog):
    """A chunk that cannot be made (a token's bytes fail to load) ends the stream with the same error event."""

    def failing(info) -> None:
        """Token 7's bytes fail to load in this run's own table."""
        table, learn = info.byte_table, info.byte_table.learn

        def learn_or_fail(token_id: int, skip_special: bool) -> bytes:
            if token_id == 7:
                raise RuntimeError("no bytes")
            return learn(token_id, skip_special)

        table.skipping.pop(7, None)
        table.learn = learn_or_fail

    steps = [[(0, [5], None), (1, [6], None)], [(0, [7], None), (1, [8], None)], [(0, [9], LENGTH), (1, [10], LENGTH)]]
    logged = {}
    for c in (True, False):
        with caplog.at_level(logging.ERROR, logger="pdserve.router"):
            caplog.clear()
            logged[c] = _serve(c, steps, [{}, {}], monkeypatch, prepare=failing)
            faults = [r for r in caplog.records if "failed" in r.getMessage()]
            assert len(faults) == 1 and repr(faults[0].exc_info[1]) == "RuntimeError('no bytes')", "logged, its cause"
    in_c, in_python = logged[True], logged[False]
    assert in_c["writes"] == in_python["writes"] and in_c["ended"] == in_python["ended"] == [True, True]
    assert b"internal error while streaming" in b"".join(in_c["writes"][0])
    assert b"internal error" not in b"".join(in_c["writes"][1]), "the other stream went on"


def test_a_disaggregated_requests_tokens_take_the_c_path_after_its_decode_nodes_first(tokenpath, info):
    async def run(in_c: bool) -> tuple[list[bytes], list[int]]:
        core = _core(in_c, prefill=("tcp://p0",), decode=("tcp://d0",), decode_kv=("tcp://k0",))
        try:
            writes: list[bytes] = []
            stream = _stream(core, info, writes, [1, 2, 3])
            flight = stream.flights[0]
            rid, (prefill, decode) = flight.request_id, flight.nodes
            _step(core, decode, TokenEvent(rid, []))  # "KV landed"
            _step(core, decode, TokenEvent(rid, [11]))  # beats the first token: held
            _step(core, prefill, TokenEvent(rid, [10]))
            for t in (12, 13):
                _step(core, decode, TokenEvent(rid, [t]))
                await asyncio.sleep(0)
            _step(core, decode, TokenEvent(rid, [14], LENGTH))
            await asyncio.sleep(0)
            return writes, flight.output
        finally:
            core.ctx.destroy(linger=0)

    assert asyncio.run(run(True)) == asyncio.run(run(False))


def test_a_stream_not_attached_gets_steady_tokens_as_events(tokenpath, info):
    """A request whose inbox is pulled (no push attached) takes steady tokens as events, in C as in Python."""

    def run(in_c: bool) -> list[list[int]]:
        core = _core(in_c, colocated=("tcp://c0",))
        try:
            flight = core.submit([1, 2, 3], SamplingParams(max_tokens=5))
            node, rid = flight.nodes[0], flight.request_id
            for ids in ([10], [11, 12], [13]):
                _step(core, node, TokenEvent(rid, ids))
            assert flight.steady is node
            return [ev.token_ids for ev in flight.inbox.events]
        finally:
            core.ctx.destroy(linger=0)

    assert run(True) == run(False) == [[10], [11, 12], [13]]


def test_a_failed_build_falls_back_to_python_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "cache_dir", lambda kind: tmp_path / kind)
    monkeypatch.setattr(cbuild, "compiler", lambda: "false")  # a compiler that fails
    monkeypatch.setattr(native, "_cannot_build", lambda: "")
    with caplog.at_level("WARNING", logger="pdserve.router"):
        assert native.load() is None and native.load() is None
    assert len([r for r in caplog.records if "did not build" in r.getMessage()]) == 1, "one warning, once"
    assert not list(tmp_path.rglob("*.so*")), "no half-built module was left"


def test_the_module_is_built_once_and_cached(tokenpath, tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "cache_dir", lambda kind: tmp_path / kind)
    calls = []
    compile_ = native._compile
    monkeypatch.setattr(native, "_compile", lambda path: calls.append(path) or compile_(path))
    first = native.load()
    assert first is not None and native.load() is first and len(calls) == 1
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load() is not None and len(calls) == 1, "the cached build was not reused"


def test_a_plain_is_made_once_and_refuses_to_run_unmade(tokenpath, info):
    with pytest.raises(TypeError, match="not initialised"):
        tokenpath.Plain.__new__(tokenpath.Plain)([1])

    async def run():
        core = _core(True, colocated=("tcp://c0",))
        try:
            stream = _stream(core, info, [], [1, 2, 3])
            plain = stream.flights[0].inbox.push_tokens
            with pytest.raises(TypeError, match="initialised once"):
                plain.__init__(stream, stream.views[0].detok.source, b"", b"", False, print)
        finally:
            core.ctx.destroy(linger=0)

    asyncio.run(run())


def test_a_learn_that_shortens_the_list_does_not_read_past_it(tokenpath):
    """A token's bytes are learned by Python code, which may change the list being read."""
    loop = asyncio.new_event_loop()
    try:
        ids = [1, 2, 3]
        held = []
        outbox = SimpleNamespace(hold=held.append)
        stream = SimpleNamespace(done=loop.create_future(), outbox=outbox, tokens=0, parts=[])
        table = SimpleNamespace(learn=lambda t, skip: ids.pop() and b"a")
        text = SimpleNamespace(known={}, pending=b"", table=table, skip_special=True)
        plain = tokenpath.Plain(stream, text, b"<", b">", False, print)
        plain(ids)
        assert stream.parts == [b'<"aa">}]}\n\n'] and held == [stream] and stream.tokens == 3
    finally:
        loop.close()


def test_a_cached_module_that_does_not_load_is_built_again(tokenpath, tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "cache_dir", lambda kind: tmp_path / kind)
    ext = native.sysconfig.get_config_var("EXT_SUFFIX")
    broken = tmp_path / "native" / f"{native.NAME}-{native._build_key()}{ext}"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a shared object")
    module = native.load()
    assert module is not None and hasattr(module, "deliver") and broken.stat().st_size > 1000
