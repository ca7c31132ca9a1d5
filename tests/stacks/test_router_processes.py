"""Several router processes over the same nodes: each node sends a request's events to the router that dispatched
it (its routing id leads the request id), and its heartbeat to every router."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.metrics import RouterMetrics, merge_expositions
from pdserve.wire.messages import router_of
from pdserve.wire.params import FinishReason, SamplingParams
from tests.helpers import each_worker_health, start_streams, tiny_greedy, wait_until
from tests.stack import Stack
from tests.stacks.test_drain import SHORT, _join


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("routers"), "tiny", mode="disagg")
    try:
        for name, role in (("prefill0", "prefill"), ("decode0", "decode")):
            stack.start_node(
                name,
                role,
                ["--listen", "tcp://127.0.0.1:0"] + (["--kv-listen", "tcp://127.0.0.1:0"] if role == "decode" else []),
            )
        yield stack
    finally:
        stack.close()


def _router(stack: Stack) -> RouterCore:
    p, d = stack.infos["prefill0"], stack.infos["decode0"]
    return RouterCore(
        RouterConfig(
            model="tiny",
            prefill=(p["listen"],),
            decode=(d["listen"],),
            decode_kv=(d["kv_listen"],),
            connect_timeout_s=60,
        )
    )


async def _stream(core: RouterCore, prompt: list[int], n: int) -> tuple[str, list[int]]:
    flight = core.submit(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    rid, tokens, events = flight.request_id, [], asyncio.Queue()
    flight.inbox.attach(events.put_nowait)
    while True:
        ev = await asyncio.wait_for(events.get(), 60)
        assert ev.finish_reason != FinishReason.ERROR, ev.error
        tokens += ev.token_ids
        if ev.finish_reason is not None:
            return rid, tokens


def test_each_router_gets_the_events_of_its_own_requests_and_every_heartbeat(disagg):
    async def run():
        routers = [_router(disagg), _router(disagg)]
        seen: list[list[str]] = [[], []]
        for core, log in zip(routers, seen, strict=True):  # every event a router's reader hands its core
            deliver = core._deliver
            core._deliver = lambda ev, node, deliver=deliver, log=log: (log.append(ev.request_id), deliver(ev, node))
        try:
            for core in routers:
                await core.start()
            prompt = list(range(5, 30))
            (rid_a, a), (rid_b, b) = await asyncio.gather(
                _stream(routers[0], prompt, 12), _stream(routers[1], prompt, 12)
            )
            stats_seen = [[n.stats is not None for n in core.nodes] for core in routers]
        finally:
            for core in routers:
                await core.stop()
        return rid_a, a, rid_b, b, seen, stats_seen

    rid_a, a, rid_b, b, seen, stats_seen = asyncio.run(run())
    assert len(a) == 12 and a == b, "both routers streamed the whole greedy answer"
    assert router_of(rid_a) != router_of(rid_b) != ""
    assert set(seen[0]) == {rid_a} and set(seen[1]) == {rid_b}, "a router got another router's events"
    assert stats_seen == [[True, True], [True, True]], "every router hears every node's heartbeat"


def _workers(url: str) -> dict[int, dict]:
    return each_worker_health(url, 120)


def _requests_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return next(s.value for s in samples if s.name == "pdserve:requests_total")


def test_two_router_workers_share_the_port_and_one_that_dies_fails_only_its_streams_and_comes_back(tmp_path):
    stack = Stack(tmp_path, "tiny", mode="colocated", router_args=("--router-workers", "2")).start()
    try:
        workers = _workers(stack.url)
        assert sorted(workers) == [0, 1] and len({h["instance"] for h in workers.values()}) == 1
        for _ in range(6):  # each on a new connection, so on either worker
            assert httpx.post(stack.url + "/v1/completions", json=SHORT, timeout=60).status_code == 200
        assert wait_until(lambda: all(_requests_total(stack.url) == 6 for _ in range(8)), 60), "metrics not summed"
        streams = start_streams(stack.url, [tiny_greedy(300)] * 8)
        workers = _workers(stack.url)
        # both workers must hold streams, or "the other worker's streams went on" checks none: more, up to the node's
        # 16 running requests (all 16 on one worker by chance: 2 in 2^16)
        while min(h["in_flight"] for h in workers.values()) == 0 and len(streams) < 16:
            streams += start_streams(stack.url, [tiny_greedy(300)] * 4)
            workers = _workers(stack.url)
        victim = max(workers.values(), key=lambda h: h["in_flight"])
        assert min(h["in_flight"] for h in workers.values()) > 0, "every stream on one worker"
        assert sum(h["in_flight"] for h in workers.values()) == len(streams)
        os.kill(victim["pid"], signal.SIGKILL)
        _join(streams)
        failed = [s for s in streams if not s.complete]
        assert len(failed) == victim["in_flight"] and all(s.error and not s.done for s in failed)
        assert all(len(s.token_ids) == 300 for s in streams if s.complete), "the other worker's streams went on"
        assert _workers(stack.url)[victim["worker"]]["pid"] != victim["pid"], "the dead worker was started again"
        r = httpx.post(stack.url + "/v1/completions", json={**SHORT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        stack.close()


def test_merged_metrics_sum_the_workers_and_take_the_nodes_figures_once():
    a, b = RouterMetrics(), RouterMetrics()
    a.requests.inc()
    b.requests.inc(2)
    a.ttft.observe(0.1)
    b.ttft.observe(0.3)
    b.success.labels("length").inc()  # a sample only the other worker has
    own = a.render().decode() + 'pdserve:kv_blocks_used{role="decode",node="tcp://d0"} 7.0\n'
    other = b.render().decode() + 'pdserve:kv_blocks_used{role="decode",node="tcp://d0"} 7.0\n'
    families = {f.name: f for f in text_string_to_metric_families(merge_expositions(own, [other]))}
    values = {s.name + str(sorted(s.labels.items())): s.value for f in families.values() for s in f.samples}
    assert values["pdserve:requests_total[]"] == 3
    assert values["pdserve:time_to_first_token_seconds_count[]"] == 2
    assert values["pdserve:time_to_first_token_seconds_sum[]"] == pytest.approx(0.4)
    assert values["pdserve:request_success_total[('finished_reason', 'length')]"] == 1
    assert values["pdserve:kv_blocks_used[('node', 'tcp://d0'), ('role', 'decode')]"] == 7, "a node's figure once"
