"""Mock nodes (`--engine mock`): the real node loop, protocol, scheduler and KV accounting without a model or torch;
made-up tokens that a greedy model's re-dispatch would reproduce; a modelled step time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.systems import node_counters
from pdserve.checkpoint import resolve_model
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.mock import MOCK_TOKENS, StepCost, mock_tokens
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Batch, ScheduledRequest
from pdserve.nodes.parts import build_engine
from pdserve.wire.params import SamplingParams
from tests.helpers import Stream, tiny_greedy, wait_until
from tests.stack import Stack, _address

MOCK = ("--engine", "mock", "--mock-step-s", "0.002,0,0")
# a node started so that, when it exits, it says whether torch or transformers was ever imported in it
REPORTING_NODE = (
    "import atexit, sys; atexit.register(lambda: print('HEAVY', sorted({m.split('.')[0] for m in "
    "sys.modules} & {'torch', 'transformers'}), flush=True)); from pdserve.cli import main; "
    "main(sys.argv[1:])"
)


@pytest.fixture(scope="module", autouse=True)
def _router_tokenizer():
    """The router's model (tiny's tokenizer and config), written here: the router itself then needs no torch."""
    resolve_model("tiny")


def run_engine(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        engine.add(r)
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request.request_id, []).append(o.token_id)
    return got


def test_the_mock_engine_runs_the_real_scheduler_and_draws_the_mock_tokens():
    engine = build_engine(EngineConfig(engine="mock", mock_step_s=(0.0, 0.0, 0.0), num_kv_blocks=8))
    prompts = {"a": list(range(1, 91)), "b": [7] * 20, "c": [300] * 5}
    requests = [Request(rid, p, SamplingParams(max_tokens=30, logprobs=2)) for rid, p in prompts.items()]
    got = run_engine(engine, requests)
    assert got == {rid: mock_tokens(p, 30) for rid, p in prompts.items()}
    assert all(t in MOCK_TOKENS for out in got.values() for t in out)
    assert engine.num_preemptions() > 0, "8 blocks of 16 for requests of 120, 50 and 35 tokens: the pool ran dry"
    assert engine.kv_stats()[:2] == (0, 8) and not engine.requests


def test_mock_tokens_go_on_as_before_after_a_redispatch():
    prompt = [5, 6, 7]
    whole = mock_tokens(prompt, 20)
    assert mock_tokens(prompt + whole[:7], 13) == whole[7:]


def test_a_mock_step_takes_its_modelled_time():
    """A prompt of 10 tokens and two decodes past 10 tokens each (the attended tokens from each chunk's past)."""
    reqs = [Request(str(i), [1] * 10, SamplingParams()) for i in range(3)]
    batch = Batch([ScheduledRequest(reqs[0], 10, True, 0), *(ScheduledRequest(r, 1, True, 10) for r in reqs[1:])])
    attended = 10 * 5 + 2 * (10 + 0.5)
    assert StepCost(1.0, 0.1, 0.01, 0.001).seconds(batch) == pytest.approx(1.0 + 0.1 * 12 + 0.01 * 3 + 0.001 * attended)


def test_a_bench_costs_file_gives_each_role_its_step_costs():
    path = str(Path(__file__).resolve().parents[2] / "bench" / "results" / "costs-mock-4p12d.json")
    prefill = build_engine(EngineConfig(engine="mock", mock_costs=path), prefill_only=True)
    decode = build_engine(EngineConfig(engine="mock", mock_costs=path))
    assert prefill.runner.cost == StepCost(0.005, 5e-05, 0.0, 0.0)
    assert decode.runner.cost == StepCost(0.02, 0.0, 0.002, 0.0)


def test_mock_costs_must_be_a_bench_costs_file(tmp_path):
    """Refused by the config (so by `pdserve up`'s preflight, once), not later by each node."""
    bad = tmp_path / "costs.json"
    for text in ("{}", "a host name\n", '{"costs": {"prefill_base_s": 1}}'):
        bad.write_text(text)
        with pytest.raises(ValueError, match="is not a bench.costs JSON file"):
            EngineConfig(engine="mock", mock_costs=str(bad))
    good = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" / "costs-mock-4p12d.json").read_text())
    good["costs"]["decode_base_s"] = -1.0
    bad.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="negative"):
        EngineConfig(engine="mock", mock_costs=str(bad))
    with pytest.raises(ValueError, match="is not a file"):
        EngineConfig(engine="mock", mock_costs=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="mock-step-s"):
        EngineConfig(engine="mock", mock_step_s=(1.0, -1.0, 0.0))


def test_guided_decoding_is_refused_by_a_mock_engine():
    engine = build_engine(EngineConfig(engine="mock"))
    with pytest.raises(ValueError, match="mock"):
        engine.add(Request("g", [1, 2], SamplingParams(grammar='{"grammars": []}')))


def _reporting_node(tmp_path, role: str, extra: list[str]) -> tuple[subprocess.Popen, dict]:
    ready = tmp_path / f"{role}.json"
    argv = [
        sys.executable,
        "-c",
        REPORTING_NODE,
        "--log-level",
        "WARNING",
        role,
        "--model",
        "tiny",
        *MOCK,
        "--ready-file",
        str(ready),
        "--listen",
        _address(),
        *extra,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"the mock {role} node did not start"
        time.sleep(0.02)
    return proc, json.loads(ready.read_text())


@pytest.mark.parametrize("mode", ["colocated", "disagg-header", "disagg-full"])
def test_mock_nodes_serve_the_mock_tokens_through_the_router_without_torch_or_transformers(tmp_path, mode):
    roles = (
        [("colocated", [])]
        if mode == "colocated"
        else [("decode", ["--kv-listen", _address()]), ("prefill", ["--mock-kv", mode.split("-")[1]])]
    )
    stack = Stack(tmp_path, "tiny")
    try:
        for role, extra in roles:
            stack.procs[role], stack.infos[role] = _reporting_node(tmp_path, role, extra)
        stack.start_router()
        prompt = list(range(10, 90))
        s = Stream(stack.url, tiny_greedy(40, prompt))
        s.run()
        assert s.complete and s.token_ids == mock_tokens(prompt, 40), s.error
        if mode != "colocated":
            assert wait_until(lambda: _kv_moved(stack) == (1, 1), 10), "the nodes' stats never counted the transfer"
        used = stack.wait_kv_free()
        assert used and not any(used.values()), used
        for role, _ in roles:
            proc = stack.procs[role]
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0 and "HEAVY []" in out, (role, out)
    finally:
        stack.close()


def _kv_moved(stack: Stack) -> tuple[float, float]:
    """(transfers the prefill node counts done, KV the decode node counts landed)."""
    counters = node_counters(httpx.get(stack.url + "/metrics", timeout=5).text)
    return counters["prefill"].get("kv_transfers", 0), counters["decode"].get("kv_received", 0)
