"""bench.gpu's pure parts: the steady-state window, the runs it plans, and its report (no GPU, no stack)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench import gpu
from pdserve.checkpoint import BUILTIN_MODELS, hf_config
from tests.helpers import optional


def _rec(first: float, last: float, n: int) -> dict:
    """A request whose n tokens arrive evenly from `first` to `last`."""
    step = (last - first) / (n - 1)
    return {"send_s": 0.0, "token_s": [first + i * step for i in range(n)]}


def test_steady_state_counts_only_while_enough_requests_decode():
    # 4 in flight, threshold ceil(0.9 * 4) = 4: all four decode from t=1 to t=5; then a long tail of one request
    records = [_rec(1, 5, 5), _rec(1, 5, 5), _rec(1, 5, 5), _rec(1, 20, 20)]
    st = gpu.steady_state(records, concurrency=4)
    assert st["threshold"] == 4 and st["window_s"] == pytest.approx(4.0)
    # inside [1, 5]: tokens after each request's first: 3 x 4, and the tail request's tokens at t=2..5
    assert st["tokens"] == 3 * 4 + 4
    assert st["output_throughput"] == pytest.approx(16 / 4.0)
    assert st["share_of_run"] == pytest.approx(4 / 20)
    whole = sum(len(r["token_s"]) for r in records) / 20
    assert st["output_throughput"] > whole  # the tail does not dilute it


def test_steady_state_windows_open_and_close_with_the_running_count():
    records = [_rec(0, 2, 3), _rec(1, 4, 4), _rec(3, 6, 4)]
    assert gpu.steady_windows(records, 2) == [(1, 2), (3, 4)]
    assert gpu.steady_windows(records, 1) == [(0, 6)]  # always at least one decoding from 0 to 6
    assert gpu.steady_state(records, concurrency=10) is None  # never 9 decoding
    assert gpu.steady_state([{"send_s": 0.0, "token_s": [1.0]}], concurrency=1) is None  # no decode at all


def test_the_large_run_goes_to_the_pdserve_systems_both_lists_name():
    config = hf_config(BUILTIN_MODELS["tiny"])
    cfg = gpu.GpuBenchConfig(
        model="tiny",
        device="cpu",
        dtype="float32",
        requests=8,
        concurrency=4,
        systems=("colocated", "static"),
        large_requests=16,
        large_concurrency=8,
        out_dir=Path("/nonexistent"),
    )
    runs = gpu.plan_runs(cfg, config)
    assert [(c.requests, c.concurrency, c.systems) for c, _ in runs] == [
        (8, 4, ("colocated", "static")),
        (16, 8, ("colocated",)),
    ]
    assert [w.label for _, w in runs] == ["sharegpt_like 8/4", "sharegpt_like 16/8"]
    assert len(runs[1][1].requests) == 16
    none = gpu.plan_runs(gpu.GpuBenchConfig(device="cpu", large_requests=0), config)
    assert len(none) == 1
    alone = gpu.plan_runs(dataclasses.replace(cfg, requests=0), config)  # --requests 0: the large run alone
    assert [(c.requests, c.concurrency, c.systems) for c, _ in alone] == [(16, 8, ("colocated",))]
    with pytest.raises(ValueError, match="--requests 0"):
        gpu.GpuBenchConfig(device="cpu", requests=0, large_requests=0)
    with pytest.raises(ValueError, match="--large-systems"):
        gpu.GpuBenchConfig(device="cpu", large_systems=("static",))


def test_parse_args_reads_the_large_run():
    cfg = gpu.parse_args(["--device", "cpu", "--large-run", "0", "0"])
    assert cfg.large_requests == 0
    cfg = gpu.parse_args(["--device", "cpu", "--large-run", "64", "32", "--large-systems", "colocated", "disagg"])
    assert (cfg.large_requests, cfg.large_concurrency, cfg.large_systems) == (64, 32, ("colocated", "disagg"))


def test_a_system_is_skipped_below_min_system_s_and_a_shared_or_in_process_run_keeps_back_only_the_report(
    monkeypatch,
):
    w = gpu.Workload("sharegpt_like", ())
    deadline = gpu.time.monotonic() + 20
    cfg = gpu.parse_args(["--device", "cpu", "--systems", "static", "--requests", "4"])
    assert cfg.min_system_s == gpu.MIN_SYSTEM_S == 45
    assert gpu.run_system(cfg, "static", w, None, {}, deadline)["error"].startswith("skipped: 20 s")
    given = []

    def open_system(cfg, system, hf, until):
        given.append((system, until))
        raise RuntimeError("not started")

    monkeypatch.setattr(gpu, "open_system", open_system)
    for system, argv in (("static", []), ("colocated", []), ("colocated", ["--stack", "colocated", "u", "1", "c"])):
        cfg = gpu.parse_args(["--device", "cpu", "--min-system-s", "0", "--systems", system, *argv])
        assert gpu.run_system(cfg, system, w, None, {}, deadline)["error"] == "RuntimeError: not started"
    margins = [round(deadline - until, 6) for _, until in given]
    assert margins == [gpu.REPORT_MARGIN_S, gpu.FINISH_MARGIN_S, gpu.REPORT_MARGIN_S]  # only its own stack's stop
    with pytest.raises(ValueError, match="--min-system-s not negative"):
        gpu.parse_args(["--device", "cpu", "--min-system-s", "-1"])


def test_the_report_shows_the_steady_state_kernels_and_the_graph_share(tmp_path):
    st = {"threshold": 4, "window_s": 4.0, "share_of_run": 0.2, "tokens": 16, "output_throughput": 4.0}
    summary = {
        "output_throughput": 1.5,
        "request_throughput": 0.2,
        "tpot_s": {"p50": 0.01, "p99": 0.02},
        "ttft_s": {"p50": 0.1, "p99": 0.2},
        "e2e_s": {"mean": 1.0},
        "slo_attainment": 1.0,
        "num_failed": 0,
    }
    result = {
        "system": "colocated",
        "label": "sharegpt_like 8/4",
        "ok": True,
        "summary": summary,
        "concurrency": 4,
        "steady_state": st,
        "step_floors": [
            {
                "node": "colocated",
                "steps": 100,
                "groups": {
                    "decode 1-8": {"floor": "memory", "steps": 90, "mean_s": 0.002, "floor_s": 0.0005, "ratio": 4.0},
                    "decode 9-32": {"floor": "memory", "steps": 0},
                    "prompt chunks": {"floor": "compute", "steps": 10, "mean_s": 0.01, "floor_s": 0.005, "ratio": 2.0},
                },
            }
        ],
        "triton_compilations": 0,
        "triton_compiled_at_start": 7,
    }
    counts = {
        "colocated": {
            "graph_steps": 90,
            "eager_steps": 10,
            "graph_tokens": 950,
            "eager_tokens": 50,
            "graph_decode_tokens": 400,
            "eager_decode_tokens": 0,
            "graph_captures": 0,
        }
    }
    result["graphs"] = [gpu.graph_share(counts, "colocated", {"colocated": {"graph_captures": 12}})]
    assert gpu.graph_share(counts, "decode", {}) is None  # a role without steps
    kernels = {
        "counted": True,
        "layers": 28,
        "limit": 300,
        "steps": [{"kind": "decode", "total": 265, "per_layer": 9.0, "fixed": 13, "ops": {}}],
    }
    run = {
        "config": {
            "name": "t",
            "model": "tiny",
            "dtype": "float32",
            "concurrency": 4,
            "max_num_batched_tokens": 64,
            "kv_cache_gb": 0.25,
            "budget_s": 60.0,
        },
        "hardware": {
            "device": "cpu",
            "gpus": 0,
            "prefill_device": "cpu",
            "decode_device": "cpu",
            "copy_GBps": 1.0,
            "memory_GBps": 2.0,
            "bf16_peak_flops_per_s": 1e12,
            "kv_copy_GBps": 1.0,
        },
        "workload": {"requests": 8, "prompt_tokens": 100, "output_tokens": 50},
        "model_figures": {"weight_bytes_per_step": 1e6, "kv_bytes_per_token": 1024},
        "runs": [
            {},
            {
                "label": "sharegpt_like 16/8",
                "concurrency": 8,
                "systems": ["colocated"],
                "workload": {"requests": 16, "prompt_tokens": 200, "output_tokens": 90},
            },
        ],
        "kernels": kernels,
        "checkpoint_s": 0.1,
        "results": [result],
    }
    md = gpu.markdown(run)
    assert "| sharegpt_like 8/4 | colocated | 4 | 4.0 | 20% | 4 | 2 | 0 (7) |" in md
    assert "| decode | 265 | 9.0 | 13 |" in md and "limit for a decode step 300" in md
    assert "| colocated | colocated | decode 1-8 | memory | 90 | 2.00 | 0.500 | 4.0x |" in md  # each group's floor
    assert "| colocated | colocated | prompt chunks | compute | 10 | 10.00 | 5.000 | 2.0x |" in md
    assert "decode 9-32" not in md and "bf16 GEMM peak 1.00 TFLOP/s" in md  # groups without steps are left out
    assert "| colocated | colocated | 100 | 10 | 90.0% | 95.0% | 100.0% | 0 (12) |" in md
    assert "Then `sharegpt_like 16/8`: 16 requests" in md
    assert "`sharegpt_like`: 8 requests" in md and "--max-num-seqs 4 " in md  # no preset: --concurrency
    burst = {**run, "config": {**run["config"], "concurrency": 256, "max_num_seqs": 128}, "runs": []}
    burst["workload"] = {"name": "burst", "requests": 256, "prompt_tokens": 100, "output_tokens": 50}
    md = gpu.markdown(burst)
    assert "`burst`: 256 requests" in md and "at most 256 in flight; pdserve: --max-num-seqs 128 " in md
    optional("matplotlib")  # the bench extra's plotting: installed by [test], so CI fails without it
    gpu.plot(run, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


def test_compilations_are_the_triton_cache_folders_new_group_files(tmp_path):
    import os

    cache = tmp_path / "cache"
    (cache / "stale").mkdir(parents=True)
    (cache / "stale" / "__grp__old.json").write_text("{}")
    with gpu.triton_cache(cache) as path:
        assert os.environ["TRITON_CACHE_DIR"] == str(path) and gpu.compiled_kernels(path) == 0  # emptied first
        for h, name in (("a1", "_k"), ("b2", "_k"), ("c3", "_j")):
            (path / h).mkdir()
            (path / h / f"__grp__{name}.json").write_text("{}")
            (path / h / f"{name}.json").write_text("{}")  # the kernel's metadata: not a second compilation
        assert gpu.compiled_kernels(path) == 3
    assert os.environ.get("TRITON_CACHE_DIR") != str(cache)


def test_the_fixed_workloads_send_every_request_at_once_with_128_seqs_and_4096_tokens():
    config = hf_config(BUILTIN_MODELS["qwen3-0.6b"])
    steady = gpu.parse_args(["--device", "cpu", "--workload", "steady", "--requests", "9", "--concurrency", "3"])
    burst = gpu.parse_args(["--device", "cpu", "--workload", "burst"])
    for cfg, n in ((steady, 128), (burst, 256)):
        assert (cfg.requests, cfg.concurrency, cfg.num_seqs, cfg.max_num_batched_tokens) == (n, n, 128, 4096)
        assert cfg.decoding == 128 and cfg.large_requests == 0  # the steady state counts what the engine can decode
        (run,) = gpu.plan_runs(cfg, config)  # no large run
        assert run[0] is cfg and len(run[1].requests) == n and run[1].rate is None  # closed: all sent at t=0
        assert gpu.stack_options(cfg, "colocated", 0.0).max_num_seqs == 128
    w = gpu.plan_runs(steady, config)[0][1]
    assert w.label == "steady 128/128"
    assert {(len(r.prompt_token_ids), r.output_len) for r in w.requests} == {(700, 256)}
    assert gpu.workload_summary(w) == {
        "name": "steady",
        "requests": 128,
        "prompt_tokens": 128 * 700,
        "output_tokens": 128 * 256,
        "shape": {"prompt": 700, "output": 256},
    }
    b = gpu.plan_runs(burst, config)[0][1]
    assert b.label == "burst 256/256" and len({r.output_len for r in b.requests}) > 1  # ShareGPT-like lengths
    assert gpu.workload_summary(b)["shape"] == gpu.SHAREGPT_SHAPE
    default = gpu.parse_args(["--device", "cpu"])
    assert default.workload == "sharegpt" and default.num_seqs == default.concurrency == 128
    with pytest.raises(ValueError, match="--workload"):
        gpu.GpuBenchConfig(device="cpu", workload="nope")
