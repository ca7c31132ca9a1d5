"""bench/router.py and bench/router_reach.py: the capacity rule, the router cost fit and the served rule, by hand;
bench/router_path.py run small."""

from __future__ import annotations

import json

import pytest

from bench.router import capacity, parse_args, router_fit, stack_argv
from bench.router_path import main as router_path
from bench.router_reach import served


def _run(c: int, tok_s: float, p99: float, messages: float = 0.0, tokens: int = 0, cpu: float = 0.0) -> dict:
    return {
        "concurrency": c,
        "tok_per_s": tok_s,
        "tpot_p99_ms": p99,
        "failed": 0,
        "node_messages": messages,
        "tokens": tokens,
        "router_cpu_s": cpu,
    }


def test_capacity_is_the_fastest_run_before_tpot_p99_doubles_over_the_lightest():
    runs = [_run(8, 1000, 3.0), _run(16, 2000, 5.9), _run(32, 2500, 6.1), _run(64, 2400, 5.0)]
    assert capacity(runs) == {"tok_per_s": 2400, "concurrency": 64, "base_tpot_p99_ms": 3.0}


def test_the_router_fit_splits_cpu_into_a_cost_per_message_and_per_token():
    runs = [_run(8, 0, 1, messages=m, tokens=t, cpu=70e-6 * m + 38e-6 * t) for m, t in ((100, 200), (300, 3000))]
    fit = router_fit(runs)
    assert fit["us_per_message"] == pytest.approx(70) and fit["us_per_token"] == pytest.approx(38)
    assert router_fit(runs[:1]) is None


def test_a_deployment_is_served_within_twice_the_base_tpot_and_below_saturation():
    base = {"tpot_p99_ms": 4.0}
    assert served({"tpot_p99_ms": 7.9, "worker_busy": [0.5, 0.89]}, base)
    assert not served({"tpot_p99_ms": 8.1, "worker_busy": [0.5]}, base)
    assert not served({"tpot_p99_ms": 5.0, "worker_busy": [0.2, 0.95]}, base)


def test_the_report_sets_vllms_api_server_beside_the_router_per_concurrency():
    from bench.router import markdown

    def runs(us: float) -> list[dict]:
        return [
            {**_run(c, 1000.0 * c, 5.0), "tpot_p50_ms": 4.0, "router_us_per_token": us * c, "client_us_per_token": 9.0}
            for c in (16, 64)
        ]

    def front(us: float) -> dict:
        return {"runs": runs(us), "capacity": capacity(runs(us)), "fit": None}

    result = {
        "date": "d",
        "commit": "c",
        "machine": {"cpu_model": "cpu", "cpu_count": 2, "loadavg_at_start": [1.0]},
        "config": {
            "prefill": 1,
            "decode": 4,
            "mock_step_s": "s",
            "prompt_tokens": 64,
            "max_tokens": 128,
            "concurrency": [16, 64],
        },
        "workers": [{"workers": 1, **front(1.0)}],
        "pdserve_real": {"model": "small", **front(2.0)},
        "vllm": {"model": "small", **front(3.0)},
    }
    text = markdown(result)
    header = "| streams | router, 1 worker(s), mock 1P4D | router, colocated `small` node | vLLM API server, `small` |"
    assert header in text
    assert "| 64 | 64.0 | 128.0 | 192.0 |" in text
    assert "| vLLM API server, `small` | 16 | 16,000 |" in text
    assert "vLLM API server:" not in text  # nothing skipped


def test_a_fronts_cpu_per_token_net_of_idle_takes_off_its_idle_rate_over_the_runs_wall_time():
    from bench.router import net_of_idle

    run = net_of_idle({"router_cpu_s": 1.0, "wall_s": 10.0, "tokens": 1000}, 0.05)
    assert run["router_us_per_token_net"] == pytest.approx(500.0)
    assert net_of_idle({"router_cpu_s": 0.0, "wall_s": 1.0, "tokens": 0}, 0.0)["router_us_per_token_net"] is None


def test_stack_args_reach_the_mock_stacks_pdserve_up_after_its_own_flags():
    cfg = parse_args(["--stack-arg=--no-access-log", "--stack-arg=--node-timeout-s=20"])
    one, two = stack_argv(cfg, 1, 8000), stack_argv(cfg, 2, 8000)
    assert one[-2:] == two[-2:] == ["--no-access-log", "--node-timeout-s=20"]
    assert "--router-workers" not in one and two[-4:-2] == ["--router-workers", "2"]


def test_the_in_process_path_runs_every_stream_to_a_chunk_a_token(capsys):
    """Small and once (no timing asserted): each round checks that the streams wrote a chunk for every token."""
    assert router_path(["--streams", "3", "--steps", "20", "--rounds", "2", "--cold-mb", "1"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert result["streams"] == 3 and len(result["rounds"]) == 2 and result["us_per_token"] > 0
