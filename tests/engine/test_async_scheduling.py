"""Asynchronous scheduling in-process, in a GPU's order of calls: step N+1 is launched before step N is finished,
its pending input tokens read from N's sampled ids on the device. Greedy tokens stay transformers', through chunked
prompts, preemption, aborts, stop tokens, sampling, log-probabilities, guided requests and the prefix cache; and
every test checks that steps were in fact launched ahead (`Engine.steps_ahead`)."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.request import Request
from pdserve.nodes.parts import build_engine
from pdserve.wire.params import SamplingParams
from tests.engine.test_engine import greedy_requests, run_engine
from tests.helpers import hf_greedy, mixed_workload, optional


def ahead_engine(model, **kw) -> Engine:
    return build_engine(EngineConfig(model=str(model), async_scheduling=True, **kw))


def run_ahead(engine: Engine, requests: list[Request]) -> dict[str, list]:
    """Run to the end as a node does: launch, then finish the step before (`due`). -> each request's outputs."""
    for r in requests:
        engine.add(r)
    out: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_work() or engine.in_flight:
        for o in engine.finish(engine.due(engine.launch())):
            out[o.request.request_id].append(o)
    return out


def tokens(outputs: dict[str, list]) -> dict[str, list[int]]:
    return {rid: [o.token_id for o in outs] for rid, outs in outputs.items()}


@pytest.mark.parametrize("budget,num_blocks", [(512, None), (64, 40)], ids=["roomy", "chunked-preempting"])
def test_scheduled_ahead_greedy_equals_transformers(tiny_models, budget, num_blocks):
    prompts, outs = mixed_workload(10, 512, seed=11, max_prompt=150, max_out=16)
    engine = ahead_engine(tiny_models["qwen3"], max_num_batched_tokens=budget, num_kv_blocks=num_blocks)
    got = tokens(run_ahead(engine, greedy_requests(prompts, outs)))
    assert [got[str(i)] for i in range(len(prompts))] == hf_greedy(tiny_models["qwen3"], prompts, outs)
    assert engine.steps_ahead > 10, "no step was launched while another was in flight"
    assert engine.pool.allocator.num_free == engine.pool.num_blocks and not engine.in_flight
    if num_blocks is not None:
        assert engine.num_preemptions() > 0, "the small pool should have forced a preemption"


def test_synchronous_engine_never_launches_ahead(tiny_models):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"])))
    engine.add(greedy_requests([[1, 2, 3]], [4])[0])
    step = engine.launch()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.launch()
    engine.finish(step)
    assert engine.steps_ahead == 0 and not engine.ahead


def test_abort_while_two_steps_hold_a_request(tiny_models):
    """Aborted between launching N+1 and finishing N: no output from either step, and its blocks come back only
    once the last step that writes them is done."""
    prompts, outs = mixed_workload(4, 512, seed=6, max_prompt=40, max_out=8)
    engine = ahead_engine(tiny_models["qwen3"], num_kv_blocks=64)
    reqs = greedy_requests(prompts, outs)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add(r)
    first = engine.launch()  # the prompts
    second = engine.launch()  # every request's second token, its input read from `first`'s draw
    victim = reqs[0]  # asks for 8 tokens
    assert victim in first.members and victim in second.members and victim.num_pending == 2
    blocks, alloc = list(victim.block_ids), engine.pool.allocator
    engine.abort(victim.request_id)
    for step, held in ((first, 1), (second, 0)):  # held until `second`, the last step that writes them, is done
        for o in engine.finish(step):
            got[o.request.request_id].append(o.token_id)
        assert [alloc.refs(b) for b in blocks] == [held] * len(blocks)
    while engine.has_work() or engine.in_flight:
        for o in engine.finish(engine.due(engine.launch())):
            got[o.request.request_id].append(o.token_id)
    ref = hf_greedy(tiny_models["qwen3"], prompts, outs)
    assert got["0"] == [] and [got[str(i)] for i in range(1, 4)] == ref[1:]
    assert engine.pool.allocator.num_free == 64 and engine.steps_ahead > 0


def test_stops_sampling_and_logprobs_match_the_synchronous_engine(tiny_models):
    """A stop token ends a request a step after its next one was launched (that row is wasted and dropped); seeded
    sampling, log-probabilities and echoed prompt log-probabilities are the synchronous engine's, value for value."""
    model = tiny_models["qwen3"]
    prompts, outs = mixed_workload(6, 512, seed=3, max_prompt=60, max_out=12)
    (greedy,) = hf_greedy(model, prompts[:1], [12])

    def requests() -> list[Request]:
        params = [
            SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(greedy[4],), ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True, logprobs=3),
            SamplingParams(max_tokens=10, temperature=0.7, top_k=20, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        ]
        return [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]

    ahead = ahead_engine(model)
    got = run_ahead(ahead, requests())
    sync = build_engine(EngineConfig(model=str(model)))
    want: dict[str, list] = {}
    for r in requests():
        sync.add(r)
        want[r.request_id] = []
    while sync.has_work():
        for o in sync.step():
            want[o.request.request_id].append(o)
    assert {k: [(o.token_id, o.finish_reason) for o in v] for k, v in got.items()} == {
        k: [(o.token_id, o.finish_reason) for o in v] for k, v in want.items()
    }
    for rid in ("r1", "r3"):  # the same values (a batch of another size may round a last bit differently)
        for a, b in zip(got[rid], want[rid], strict=True):
            assert a.logprob.top_ids == b.logprob.top_ids
            assert a.logprob.top_logprobs == pytest.approx(b.logprob.top_logprobs, abs=1e-5)
    echo = [(lp.top_ids, lp.logprob) for lp in got["r3"][0].prompt_logprobs]
    assert echo == [(lp.top_ids, pytest.approx(lp.logprob, abs=1e-5)) for lp in want["r3"][0].prompt_logprobs]
    assert tokens(got)["r0"] == greedy[:5]  # stopped at the stop token
    assert ahead.steps_ahead > 5 and ahead.pool.allocator.num_free == ahead.pool.num_blocks


def test_prefix_cache_names_blocks_once_their_tokens_are_known(tiny_models):
    """A follow-up turn (prompt + answer + more) shares the blocks its first turn computed, generated tokens
    included, exactly as the synchronous engine does; the tokens stay transformers'."""
    model = tiny_models["qwen3"]
    prompt = list(range(10, 50))  # 40 tokens: 2 full blocks
    (answer,) = hf_greedy(model, [prompt], [30])
    follow = prompt + answer + [7, 8, 9]
    seen = []
    for engine in (ahead_engine(model), build_engine(EngineConfig(model=str(model)))):
        drive = (lambda e, r: tokens(run_ahead(e, r))) if engine.ahead else run_engine
        assert drive(engine, greedy_requests([prompt], [30]))["0"] == answer
        second = drive(engine, [Request("f", follow, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))])
        seen.append((engine.cache_counters()["prefix_cache_hits"], second["f"]))
    assert seen[0] == seen[1] and seen[0][0] == 64  # 4 full blocks of prompt and answer, computed on the first turn
    assert seen[0][1] == hf_greedy(model, [follow], [5])[0]


def test_guided_requests_wait_for_their_token_and_match_the_synchronous_engine(tiny_models):
    optional("llguidance")
    from tests.runner.test_grammar import SCHEMAS, guided

    def requests() -> list[Request]:
        reqs = [
            guided("g0", [40, 41, 42], SCHEMAS[1], temperature=0),
            guided("s2", list(range(100, 120)), SCHEMAS[2], temperature=1.0, seed=9),
        ]
        return reqs + [Request("u", [1, 2, 3, 4] * 3, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))]

    model = tiny_models["qwen3"]
    ahead = ahead_engine(model)
    got = tokens(run_ahead(ahead, requests()))
    want = run_engine(build_engine(EngineConfig(model=str(model))), requests())
    assert got == want
    assert ahead.steps_ahead > 10


def test_without_the_device_feed_the_tokens_go_wrong(tiny_models, monkeypatch):
    """The control: the pending rows' inputs really come from the device (left as the host's placeholder, the
    tokens differ)."""
    monkeypatch.setattr("pdserve.runner.model.DeviceFeed.into", lambda self, input_ids: None)
    prompts, outs = mixed_workload(4, 512, seed=11, max_prompt=60, max_out=10)
    got = tokens(run_ahead(ahead_engine(tiny_models["qwen3"]), greedy_requests(prompts, outs)))
    assert [got[str(i)] for i in range(len(prompts))] != hf_greedy(tiny_models["qwen3"], prompts, outs)


def test_a_node_schedules_ahead(tiny_models):
    """A colocated node in-process, in the GPU's order, scheduling ahead: every stream is transformers', steps were
    launched while another was in flight, and every block comes back."""
    from pdserve.config import NodeConfig
    from pdserve.nodes.colocated import ColocatedNode
    from tests.engine.test_overlap import published, start_greedy_workload

    cfg = EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=64, async_scheduling=True)
    node = ColocatedNode(NodeConfig("colocated", cfg))
    try:
        router, trace, prompts, outs = start_greedy_workload(node, overlapped=True)
        for _ in range(200):
            node.loop_once()
            router.collect(published(trace))
            if all(router.finished(str(i)) for i in range(5)) and not node.held:
                break
        assert [router.tokens(str(i)) for i in range(5)] == hf_greedy(tiny_models["qwen3"], prompts, outs)
        assert node.engine.steps_ahead > 5
        assert node.engine.pool.allocator.num_free == 64 and not node.engine.requests and not node.engine.in_flight
    finally:
        node.close()
