"""The benchmark's own arithmetic and plumbing: the GPU floor, node counters, the router's CPU, the load limit."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import transformers

from bench import gpu, run_bench, systems
from bench.http_client import HttpTarget, run_http
from bench.workloads import BenchRequest, Workload, make_workload
from pdserve.checkpoint import ModelSpec, hf_config

METRICS = """# TYPE pdserve:node_steps counter
pdserve:node_steps_total{role="decode",node="tcp://a"} 10
pdserve:node_steps_total{role="decode",node="tcp://b"} 5
pdserve:node_step_time_s_total{role="decode",node="tcp://a"} 0.5
pdserve:node_kv_transfer_bytes_total{role="prefill",node="tcp://c"} 3000000000
pdserve:node_kv_transfer_time_s_total{role="prefill",node="tcp://c"} 1.5
pdserve:nodes_up 3
"""


def test_sharegpt_like_takes_its_medians():
    w = make_workload("sharegpt_like", 151936, 4096, num_requests=256, shape_args=gpu.SHAREGPT_SHAPE)
    assert sum(len(r.prompt_token_ids) for r in w.requests) == 60145 and w.num_output_tokens == 20782
    with pytest.raises(ValueError, match="no shape arguments"):
        make_workload("equal_size", 512, 2048, shape_args={"prompt_median": 3})


def test_decode_context_counts_each_decode_steps_context():
    w = Workload("w", (BenchRequest(tuple(range(10)), 4), BenchRequest((1,), 1)))
    assert gpu.decode_context_tokens(w) == 11 + 12 + 13  # the first token is the prefill's; 1-token output: none


def test_node_counters_are_summed_per_role_and_diffed():
    counts = systems.node_counters(METRICS)
    assert counts["decode"] == {"steps": 15.0, "step_time_s": 0.5}
    assert counts["prefill"]["kv_transfer_bytes"] == 3e9
    diff = systems.counters_diff(counts, {"decode": {"steps": 5.0, "step_time_s": 0.1}})
    assert diff["decode"] == {"steps": 10.0, "step_time_s": 0.4} and diff["prefill"] == counts["prefill"]
    per_node = systems.node_counters_per_node(METRICS, "decode")
    assert per_node == {"steps": {"tcp://a": 10.0, "tcp://b": 5.0}, "step_time_s": {"tcp://a": 0.5}}


def test_a_nodes_steps_are_set_beside_their_floors_from_its_group_counters():
    figures = {"weight_bytes_per_step": 1e9, "body_weights": 4e8, "head_weights": 1e8, "kv_bytes_per_token": 1e6}
    hw = {"copy_GBps": 500.0, "bf16_peak_flops_per_s": 1e15, "kv_copy_GBps": 100.0}
    counts = {
        "decode": {
            "steps": 100.0,
            "steps_decode_9_32_count": 100.0,  # 100 steps of 9-32 requests, 0.2 s in all, 1e5 tokens of KV read
            "steps_decode_9_32_time_s": 0.2,
            "steps_decode_9_32_context_tokens": 1e5,
            "steps_prompt_chunks_count": 0.0,
        },
        "prefill": {"steps": 2.0, "steps_prompt_chunks_count": 2.0, "steps_prompt_chunks_time_s": 0.02},
    }
    counts["prefill"] |= {"steps_prompt_chunks_tokens": 4096.0, "steps_prompt_chunks_samples": 2.0}
    d = gpu.node_floors(counts, "decode", figures, hw)["groups"]
    # the memory floor: (100 x 1 GB + 1e5 x 1 MB) / 100 steps at 1,000 GB/s read + written = 2 ms a step
    assert d["decode 9-32"]["floor_s"] == pytest.approx(2e-3) and d["decode 9-32"]["ratio"] == pytest.approx(1.0)
    assert d["decode 1-8"] == {"floor": "memory", "steps": 0} and d["prompt chunks"]["steps"] == 0
    p = gpu.node_floors(counts, "prefill", figures, hw)["groups"]["prompt chunks"]
    # the compute floor: 2,048 tokens a step x 2 x 4e8 layer weights and 1 row sampled x 2 x 1e8 LM head weights, at
    # 1e15 FLOP/s
    assert p["floor"] == "compute" and p["floor_s"] == pytest.approx((2048 * 8e8 + 2e8) / 1e15)
    assert p["ratio"] == pytest.approx(0.01 / p["floor_s"])
    assert gpu.node_floors({}, "decode", figures, hw) is None
    kv = gpu.kv_transfer(systems.node_counters(METRICS), hw)
    assert kv["GBps"] == pytest.approx(2.0) and kv["share_of_copy"] == pytest.approx(0.02)


@pytest.mark.parametrize("tied", [False, True])
def test_weights_read_per_step_skip_the_embedding_table_but_not_the_head(tied):
    spec = ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024, tie_embeddings=tied)
    config = hf_config(spec)
    model = transformers.AutoModelForCausalLM.from_config(config)
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    assert gpu.step_weights(config, 2) == (body * 2 + 512 * 64 * 2, body, 512 * 64)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_router_pid_and_its_cpu_time_come_from_proc():
    child_argv = "[sys.executable, '-c', 'import sys; sys.stdin.read()', 'pdserve', 'router']"
    code = (
        f"import subprocess, sys; p = subprocess.Popen({child_argv}, stdin=subprocess.PIPE); "
        "print(p.pid, flush=True); sys.stdin.read(); p.kill(); p.wait()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert systems.router_pid(parent.pid) == child
        assert systems.router_pid(child) is None
        assert systems.cpu_seconds(child) >= 0.0
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
    assert systems.cpu_seconds(parent.pid) is None  # gone


class FakeServer:
    """An OpenAI-ish server on a free port that streams `max_tokens` tokens and records peak concurrency.
    It holds every answer until `gate` requests are in flight at once, or for `hold_s` at most."""

    def __init__(self, gate: int, hold_s: float) -> None:
        self.gate, self.hold_s = gate, hold_s
        self.active = self.peak = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.opened = asyncio.Event()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = int(next((h.split(":")[1] for h in head.split("\r\n") if h.lower().startswith("content-length")), 0))
        body = json.loads(await reader.readexactly(length)) if length else {}
        if head.startswith("GET /v1/models"):
            data = json.dumps({"data": [{"id": "fake"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        else:
            self.active += 1
            self.peak = max(self.peak, self.active)
            if self.active >= self.gate:
                self.opened.set()
            try:
                await asyncio.wait_for(self.opened.wait(), self.hold_s)
            except asyncio.TimeoutError:
                pass  # fewer came at once than the gate: the peak says so
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
            for i in range(body["max_tokens"]):
                writer.write(b"data: " + json.dumps({"choices": [{"token_ids": [i]}]}).encode() + b"\n\n")
            writer.write(b"data: [DONE]\n\n")
            self.active -= 1
        await writer.drain()
        writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.parametrize("limit", [2, None])
def test_load_generator_keeps_at_most_max_concurrency_in_flight(limit):
    """Without a limit all six requests are held in flight together; with one, never more than two."""
    server = FakeServer(gate=6, hold_s=0.2 if limit else 30.0)
    try:
        w = Workload("w", tuple(BenchRequest((1, 2), 5) for _ in range(6)))
        target = HttpTarget(f"http://127.0.0.1:{server.port}", max_concurrency=limit)
        _, records = run_http(target, w, progress=False)
    finally:
        server.close()
    assert all(r.ok for r in records) and [r.output_token_ids for r in records] == [[0, 1, 2, 3, 4]] * 6
    assert server.peak <= 2 if limit else server.peak == 6


def _git_ignored(path: Path) -> bool:
    out = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=Path(__file__).parents[2], check=False)
    if out.returncode == 128:
        pytest.skip("not a git checkout")
    return out.returncode == 0


def test_a_bench_run_writes_into_the_ignored_runs_folder_unless_recorded():
    cfg = run_bench.parse_args(["--model", "tiny", "--quick"])
    assert (cfg.out_dir, cfg.name) == (run_bench.RUNS_DIR, "tiny-quick")
    assert _git_ignored(cfg.out_dir / "tiny-quick.json")
    assert not _git_ignored(run_bench.RESULTS_DIR / "tiny-quick.json")  # where --record writes: kept in git


def test_a_recorded_run_goes_to_results_named_by_date_and_commit():
    commit = run_bench.git_commit()
    if not commit:
        pytest.skip("not a git checkout")
    cfg = run_bench.parse_args(["--model", "tiny", "--quick", "--record", "--name", "smoke"])
    assert cfg.out_dir == run_bench.RESULTS_DIR
    assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d-{re.escape(commit)}-smoke", cfg.name)
    assert run_bench.recorded_name(None, "abc1234", "2026-12-01") == "2026-12-01-abc1234"
    with pytest.raises(ValueError, match="git commit"):
        run_bench.recorded_name("smoke", "", "2026-12-01")
    assert run_bench.parse_args(["--record", "--out-dir", "/tmp/x"]).out_dir == Path("/tmp/x")


def test_a_run_without_the_bench_extra_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(run_bench, "BENCH_EXTRA", ("httpx", "no_such_module_of_the_extra"))
    assert run_bench.main(["--model", "tiny", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install -e '.[bench]'" in err and "no_such_module_of_the_extra" in err and "\n" not in err
    assert run_bench.missing_bench_extra() == ["no_such_module_of_the_extra"]


def test_prefix_workloads_share_their_prefixes_and_repeat():
    from bench.prefix_bench import Sizes, multi_turn_messages, shared_prefix

    sizes = Sizes()
    reqs = shared_prefix(sizes, 1000, seed=3)
    assert len(reqs) == sizes.requests and reqs == shared_prefix(sizes, 1000, seed=3)
    prefix = reqs[0].prompt_token_ids[: sizes.prefix]
    assert all(r.prompt_token_ids[: sizes.prefix] == prefix and r.output_len == sizes.output for r in reqs)
    assert len({r.prompt_token_ids for r in reqs}) == len(reqs)  # distinct suffixes
    system, convs = multi_turn_messages(sizes, 1000, seed=3)
    assert len(system) == sizes.system and len(convs) == sizes.conversations
    assert all(len(c) == sizes.turns and all(sizes.message[0] <= len(m) <= sizes.message[1] for m in c) for c in convs)
    assert max(t for r in reqs for t in r.prompt_token_ids) < 1000 - 3  # no special tokens


def test_an_external_servers_prefix_cache_counters_and_best_of_rounds():
    from bench.prefix_bench import best_of, by_system, parse_external_counters

    text = (
        '# HELP vllm:prefix_cache_queries_total Prefix cache queries\nvllm:prefix_cache_queries_total{engine="0",'
        'model_name="small"} 900.0\nvllm:prefix_cache_hits_total{engine="0",model_name="small"} 800.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0"} 5.0\n'
    )
    assert parse_external_counters(text) == {"server": {"prefix_cache_queries": 900.0, "prefix_cache_hits": 800.0}}
    assert parse_external_counters("pdserve:nodes_up 1\n") == {}

    def run(label: str, round_: int, ttft: float, tok_s: float) -> dict:
        part = {"ttft_p50_s": ttft, "ok": 1, "requests": 1, "counters": {}}
        return {
            "label": label,
            "mode": label,
            "prefix_caching": True,
            "round": round_,
            "shared_prefix": part,
            "multi_turn": {**part, "output_tok_s": tok_s, "tokens_added": 10},
        }

    groups = by_system([run("a", 0, 0.3, 10.0), run("b", 0, 0.1, 5.0), run("a", 1, 0.2, 8.0)])
    assert [[r["round"] for r in g] for g in groups] == [[0, 1], [0]]
    best = best_of(groups[0])
    assert (best["shared_ttft_p50_s"], best["multi_tok_s"], best["runs"], best["ok"]) == (0.2, 10.0, 2, "4/4")


def test_each_prefix_run_gives_first_and_later_turns_ttft_apart():
    from bench.prefix_bench import each_run

    part = {"ttft_p50_s": 0.05, "ok": 1, "requests": 1, "counters": {}}
    run = {
        "label": "disagg caching on",
        "mode": "disagg",
        "prefix_caching": True,
        "round": 0,
        "loadavg_before": [0.5],
        "loadavg_after": [0.6],
        "shared_prefix": part,
        "multi_turn": {
            **part,
            "output_tok_s": 100.0,
            "tokens_added": 10,
            "first_turn_ttft_p50_s": 0.2812,
            "later_turn_ttft_p50_s": 0.0631,
        },
    }
    old = {**run, "multi_turn": {**part, "output_tok_s": 90.0, "tokens_added": 10}}  # a run recorded before them
    rows = [line for line in each_run([run, old]) if line.startswith("| 1 |")]
    assert "| 281.2 / 63.1 | 100.0 |" in rows[0] and "| - / - | 90.0 |" in rows[1]
