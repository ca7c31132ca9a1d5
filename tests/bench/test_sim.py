"""bench/sim.py: its validation against bench's runs, its fits and its command line (the simulator's own cases are in
tests/plan/test_simulator.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

import pytest

from bench.sim import Costs, Topology, simulate
from bench.workloads import BenchRequest, Workload, make_workload

COSTS = Costs(0.0, 1e-3, 0.0, 10e-3, 0.0, 0.0, kv_bytes_per_token=10, link_bytes_per_s=1000.0)


def one(prompt: int, output: int, arrival: float = 0.0) -> BenchRequest:
    return BenchRequest(tuple(range(prompt)), output, arrival)


def workload(*reqs: BenchRequest) -> Workload:
    return Workload("hand", tuple(reqs))


RUN_TOPOLOGY = Topology(2, 1, cores=(0, 1, 0))


def simulated_run(w: Workload, costs: Costs, topo: Topology = RUN_TOPOLOGY) -> dict:
    """A run_bench JSON of a disagg run (2P1D on 2 cores unless `topo` says otherwise), made by the simulator with
    `costs`."""
    from bench.metrics import SLO, summarize

    counts: dict = {}
    recs = simulate(w, costs, topo, counts)
    records = [
        {
            "send_s": r.send_time,
            "token_s": r.token_times,
            "expected_output_len": r.expected_output_len,
            "prompt_len": r.num_prompt_tokens,
        }
        for r in recs
    ]
    result = {
        "system": "disagg",
        "ok": True,
        "workload": w.name,
        "label": w.label,
        "records": records,
        "summary": summarize(recs, 0.0, SLO(2.0, 0.2)),
        "node_counters": counts,
        "router_cpu_us_per_token": costs.router_s_per_token * 1e6,
        "client_cpu_us_per_token": costs.client_s_per_token * 1e6,
    }
    args = ["--num-prefill", str(topo.num_prefill), "--num-decode", str(topo.num_decode)]
    config = {
        "engine_args": args + ([] if topo.cores else ["--no-pin"]),
        "max_batch": 16,
        "max_num_batched_tokens": 512,
        "slo_ttft_s": 2.0,
        "slo_tpot_s": 0.2,
    }
    return {"config": config, "environment": {"cpu_count": 2}, "results": [result]}


RUN_COSTS = replace(
    COSTS,
    corun_slowdown_prefill=1.5,
    corun_slowdown_decode=1.3,
    decode_iteration_s=2e-3,
    prefill_iteration_s=3e-3,
    router_s_per_token=1e-4,
    client_s_per_token=5e-5,
)


def test_validate_sets_hand_computed_predictions_beside_a_measured_run() -> None:
    """A run measured by hand: one request (100 prompt tokens, 3 out) on 1P1D, each node on its own device, that
    took 25% longer to prefill and twice as long a decode step as COSTS say. Predicted by hand from COSTS: first
    token 0.1 s (100 x 1 ms), hand-off 1.01 s (1 s of transfer, one 10 ms step), decode steps 10 ms. Calibrated:
    the step costs scaled to the measured mean steps (1.25x prefill, 1.5x decode): a first token at 0.125 s, a
    hand-off of 1.015 s (the transfer is no step), 15 ms decode steps."""
    from bench.metrics import SLO, RequestRecord, summarize
    from bench.sim import validate

    times = [0.125, 1.125 + 0.125, 1.125 + 0.125 + 0.02]  # measured: TTFT, + hand-off, + one decode interval
    rec = RequestRecord(0.0, 3, 100, times)
    result = {
        "system": "disagg",
        "ok": True,
        "workload": "hand",
        "label": "hand",
        "summary": summarize([rec], 0.0, SLO(2.0, 0.2)),
        "records": [{"send_s": 0.0, "token_s": times, "expected_output_len": 3, "prompt_len": 100}],
        "node_counters": {
            "prefill": {"steps": 1, "step_time_s": 0.125, "busy_time_s": 0.125},
            "decode": {"steps": 2, "step_time_s": 0.03, "busy_time_s": 0.03},
        },
    }
    config = {
        "engine_args": ["--num-prefill", "1", "--num-decode", "1", "--no-pin"],
        "max_batch": 16,
        "max_num_batched_tokens": 512,
        "slo_ttft_s": 2.0,
        "slo_tpot_s": 0.2,
    }
    rows = {
        r["metric"]: r
        for r in validate({"config": config, "environment": {"cpu_count": 2}, "results": [result]}, COSTS)
    }
    want = {
        "TTFT p50": (0.1, 0.125, 0.125),
        "hand-off p50": (1.01, 1.125, 1.015),
        "decode ITL p50": (0.01, 0.02, 0.015),
        "prefill mean step": (0.1, 0.125, 0.125),
        "decode mean step": (0.01, 0.015, 0.015),
    }  # (predicted, measured, calibrated)
    for metric, (pred, meas, calib) in want.items():
        row = rows[metric]
        assert (row["predicted"], row["measured"], row["calibrated"]) == pytest.approx((pred, meas, calib)), metric
        assert row["error"] == pytest.approx(pred / meas - 1) and row["calibrated_error"] == pytest.approx(
            calib / meas - 1
        ), metric


def test_a_run_the_simulator_made_is_predicted_exactly() -> None:
    """The run's deployment (2P1D on 2 cores, from its engine arguments) and CPU per token are read back from its
    JSON: a misread topology or cost would show as an error."""
    from bench.sim import validate

    w = make_workload("sharegpt_like", 1000, 2048, seed=2, rate=3.0, num_requests=24)
    rows = validate(simulated_run(w, RUN_COSTS), RUN_COSTS)
    assert len(rows) == 11
    assert all(abs(r["error"]) < 1e-9 and abs(r["calibrated_error"]) < 1e-9 for r in rows)


def test_a_calibration_run_supplies_what_the_costs_cannot_see() -> None:
    """A separate run fits the host CPU per token, the loops' time outside the steps and the stack's step cost level
    (here 1.25x prefill and 1.1x decode the in-process costs): predictions from the fitted costs then match."""
    from bench.sim import calibrated_costs, scaled, validate

    run = simulated_run(make_workload("sharegpt_like", 1000, 2048, seed=2, rate=3.0, num_requests=24), RUN_COSTS)
    # a calibration run: 1P1D, each node on a core of its own, the router and load generator beside them
    other = simulated_run(
        make_workload("sharegpt_like", 1000, 2048, seed=5, num_requests=8), RUN_COSTS, Topology(cores=(0, 1))
    )
    in_process = replace(
        scaled(RUN_COSTS, 1 / 1.25, 1 / 1.1),
        decode_iteration_s=0.0,
        prefill_iteration_s=0.0,
        router_s_per_token=0.0,
        client_s_per_token=0.0,
    )
    fitted = calibrated_costs(in_process, other)
    assert asdict(fitted) == pytest.approx(asdict(RUN_COSTS), rel=1e-3)  # CALIBRATION_ROUNDS of refinement
    assert all(abs(r["error"]) < 1e-2 for r in validate(run, in_process, predict_with=fitted))
    without = validate(run, in_process)  # the run's CPU per token, but the in-process step costs and no loop time
    assert max(abs(r["error"]) for r in without) > 0.05
    kept = calibrated_costs(in_process, other, steps=False)
    assert kept.decode_base_s == in_process.decode_base_s and kept.decode_iteration_s > 0
    with pytest.raises(ValueError, match="busy_time_s"):
        calibrated_costs(in_process, {**other, "results": [{**other["results"][0], "node_counters": {}}]})


def test_unpinned_work_takes_an_idle_core_else_shares_the_busy_ones_evenly() -> None:
    """The router's and load generator's CPU (Cores.run_unpinned): on one idle core when there is one (never faster
    than a core); split over both when both cores are busy, each step then losing its half of it."""
    from bench.sim import Clock, Cores

    @dataclass(eq=False)
    class Pinned:  # a task pinned to a core, as a node's step is
        core: int

    def ends(pinned: tuple[int, ...]) -> dict[str, float]:
        clock, done = Clock(), {}
        cores = Cores(clock, COSTS, Topology(cores=(0, 1)))
        for i, core in enumerate(pinned):  # a 10 ms step on each of these cores
            cores.run(Pinned(core), 10e-3, lambda i=i: done.setdefault(f"step{i}", clock.now))
        cores.run_unpinned(2e-3, lambda: done.setdefault("unpinned", clock.now))
        clock.run()
        return done

    assert ends(()) == pytest.approx({"unpinned": 2e-3})
    assert ends((0,)) == pytest.approx({"unpinned": 2e-3, "step0": 10e-3})
    assert ends((0, 1)) == pytest.approx({"unpinned": 2e-3, "step0": 11e-3, "step1": 11e-3})


def test_the_routers_cpu_splits_into_a_cost_per_message_and_one_per_token() -> None:
    """bench.sim --fit-router: runs whose router CPU is exactly 300 µs a message (a node step) and 50 µs a token."""
    from bench.sim import router_costs

    def run(prefill_steps: int, decode_steps: int, tokens: int) -> dict:
        cpu = 300e-6 * (prefill_steps + decode_steps) + 50e-6 * tokens
        counters = {"prefill": {"steps": prefill_steps}, "decode": {"steps": decode_steps}}
        result = {
            "system": "disagg",
            "ok": True,
            "label": "w",
            "router_cpu_s": cpu,
            "node_counters": counters,
            "summary": {"total_output_tokens": tokens},
        }
        return {"results": [result]}

    per_message, per_token, fits = router_costs([run(7, 300, 2400), run(40, 2000, 3700), run(10, 800, 2400)])
    assert (per_message, per_token) == pytest.approx((300e-6, 50e-6))
    assert all(f["fitted_s"] == pytest.approx(f["cpu_s"]) for f in fits)
    with pytest.raises(ValueError, match="two or more"):
        router_costs([run(7, 300, 2400)])


def test_the_command_line_refuses_runs_a_fit_cannot_use(tmp_path, capsys) -> None:
    """bench.sim's fits from run_bench JSONs: too few runs, or a calibration run without node counters, is a usage
    error (exit 2, the reason said), not a traceback."""
    from bench.sim import main

    run = simulated_run(make_workload("sharegpt_like", 1000, 2048, seed=5, num_requests=8), RUN_COSTS)
    one = tmp_path / "run.json"
    one.write_text(json.dumps(run))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({**run, "results": [{**run["results"][0], "node_counters": {}}]}))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"costs": asdict(RUN_COSTS)}))
    out = tmp_path / "out.json"
    for argv, why in (
        (["--fit-router", str(one)], "two or more"),
        (["--costs", str(costs), "--validate", str(one), "--calibration", str(bare)], "busy_time_s"),
        (["--costs", str(costs), "--write-calibrated", str(out)], "needs"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and why in capsys.readouterr().err
