"""bench/sim.py and bench/costs.py: hand-computable cases and monotonicity, no model, no timing."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

import pytest

from bench.costs import Costs, fit
from bench.sim import Topology, simulate
from bench.workloads import BenchRequest, Workload, make_workload

# prefill: 1 ms a token; decode: 10 ms a step; KV: 10 bytes a token over 1000 bytes/s (10 ms a token)
COSTS = Costs(0.0, 1e-3, 0.0, 10e-3, 0.0, 0.0, kv_bytes_per_token=10, link_bytes_per_s=1000.0)


def one(prompt: int, output: int, arrival: float = 0.0) -> BenchRequest:
    return BenchRequest(tuple(range(prompt)), output, arrival)


def workload(*reqs: BenchRequest) -> Workload:
    return Workload("hand", tuple(reqs))


def test_one_request_on_1p1d_is_prefill_then_transfer_then_decode_steps() -> None:
    (rec,) = simulate(workload(one(100, 3)), COSTS, Topology())
    ttft, xfer, step = 0.1, 100 * 10 / 1000.0, 10e-3  # the first token is sampled on the prefill node
    assert rec.token_times == pytest.approx([ttft, ttft + xfer + step, ttft + xfer + 2 * step])


def test_a_long_prompt_runs_in_chunks_of_the_token_budget_with_its_attention_cost() -> None:
    costs = Costs(2e-3, 1e-3, 1e-6, 10e-3, 0.0, 0.0, kv_bytes_per_token=0, link_bytes_per_s=1.0)
    (rec,) = simulate(workload(one(700, 1)), costs, Topology(max_num_batched_tokens=512))
    first = 2e-3 + 512e-3 + 1e-6 * 512 * 256
    second = 2e-3 + 188e-3 + 1e-6 * 188 * (512 + 94)
    assert rec.token_times == pytest.approx([first + second])


def test_router_cpu_delays_every_token_it_streams() -> None:
    costs = Costs(0.0, 1e-3, 0.0, 10e-3, 0.0, 0.0, 10, 1000.0, router_s_per_token=1e-3)
    (rec,) = simulate(workload(one(100, 2)), costs, Topology())
    assert rec.token_times == pytest.approx([0.101, 0.1 + 1.0 + 0.01 + 0.001])


def test_the_router_pays_once_for_a_message_and_then_for_each_token_in_it() -> None:
    """One prefill step's two first tokens, then one decode step's two tokens: two messages of two tokens, each
    5 ms for the message and 1 ms a token, the tokens handed out in turn."""
    costs = replace(COSTS, kv_bytes_per_token=0, router_s_per_message=5e-3, router_s_per_token=1e-3)
    counters: dict = {}
    a, b = simulate(workload(one(10, 2), one(10, 2)), costs, Topology(), counters)
    assert a.token_times == pytest.approx([0.026, 0.036]) and b.token_times == pytest.approx([0.027, 0.037])
    assert counters["router"]["busy_s"] == pytest.approx(2 * (5e-3 + 2e-3))


def test_router_workers_each_get_their_own_requests_and_a_message_of_each_step() -> None:
    """The same two requests behind two workers: each worker gets one, and a message of each of the two steps with
    one token in it, on a loop of its own (no waiting behind the other worker's token)."""
    costs = replace(COSTS, kv_bytes_per_token=0, router_s_per_message=5e-3, router_s_per_token=1e-3)
    counters: dict = {}
    a, b = simulate(workload(one(10, 2), one(10, 2)), costs, Topology(router_workers=2), counters)
    assert a.token_times == pytest.approx([0.026, 0.036]) and b.token_times == pytest.approx([0.026, 0.036])
    assert counters["router"]["worker_busy_s"] == pytest.approx([2 * (5e-3 + 1e-3)] * 2)


def test_the_router_spreads_simultaneous_requests_over_prefill_nodes() -> None:
    w = workload(one(100, 1), one(100, 1))
    both = [r.ttft for r in simulate(w, COSTS, Topology(num_prefill=2))]
    assert both == pytest.approx([0.1, 0.1])
    assert sorted(r.ttft for r in simulate(w, COSTS, Topology(num_prefill=1))) == pytest.approx([0.2, 0.2])


def test_decode_admits_at_most_max_num_seqs() -> None:
    w = workload(one(10, 3), one(10, 3))
    recs = simulate(w, Costs(0.0, 1e-3, 0.0, 10e-3, 0.0, 0.0, 0, 1.0), Topology(max_num_seqs=1))
    ends = sorted(r.token_times[-1] for r in recs)
    assert ends[1] - ends[0] == pytest.approx(2 * 10e-3)  # the second one's two decode steps follow the first's


def test_a_prompt_that_arrives_during_a_step_waits_for_its_end() -> None:
    (a, b) = simulate(workload(one(100, 1), one(10, 1, arrival=0.05)), COSTS, Topology())
    assert a.ttft == pytest.approx(0.1)
    assert b.token_times[0] == pytest.approx(0.1 + 0.01)


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 2), (3, 3)])
def test_more_nodes_never_make_a_closed_workload_slower(p: int, d: int) -> None:
    w = make_workload("sharegpt_like", 1000, 2048, seed=1, num_requests=48)
    costs = Costs(1e-3, 5e-4, 4e-7, 8e-3, 6e-4, 1.3e-6, 16384, 2.5e9, 0.0, 20e-6)
    base = max(r.token_times[-1] for r in simulate(w, costs, Topology()))
    more = max(r.token_times[-1] for r in simulate(w, costs, Topology(p, d)))
    assert more <= base


def test_the_simulation_is_deterministic() -> None:
    w = make_workload("long_prefill", 1000, 2048, seed=3, rate=4.0)
    runs = [[r.token_times for r in simulate(w, COSTS, Topology(2, 1))] for _ in range(2)]
    assert runs[0] == runs[1]


def test_fit_recovers_the_coefficients_of_exact_samples() -> None:
    prefill = [
        {"tokens": n, "past": p, "s": 1e-3 + 5e-4 * n + 2e-7 * n * (p + n / 2)}
        for n, p in [(16, 0), (128, 0), (512, 0), (512, 512), (256, 1024)]
    ]
    decode = [{"batch": b, "context": c, "s": 8e-3 + 6e-4 * b + 1e-6 * c} for b, c in [(1, 64), (4, 900), (16, 300)]]
    c = fit(prefill, decode, 16384, 1e9)
    got = [
        c.prefill_base_s,
        c.prefill_per_token_s,
        c.prefill_per_token_ctx_s,
        c.decode_base_s,
        c.decode_per_seq_s,
        c.decode_per_ctx_token_s,
    ]
    assert got == pytest.approx([1e-3, 5e-4, 2e-7, 8e-3, 6e-4, 1e-6], rel=1e-6)


def test_fit_takes_the_measured_corun_slowdowns_and_costs_refuse_a_speedup() -> None:
    samples = [{"tokens": 16, "past": 0, "s": 1e-3}], [{"batch": 1, "context": 64, "s": 8e-3}]
    c = fit(*samples, 16384, 1e9, corun={"prefill": {"slowdown": 1.7}, "decode": {"slowdown": 2.1}})
    assert (c.corun_slowdown_prefill, c.corun_slowdown_decode) == (1.7, 2.1)
    assert fit(*samples, 16384, 1e9).corun_slowdown_decode == 1.0
    with pytest.raises(ValueError, match="slowdown"):
        replace(c, corun_slowdown_decode=0.5)


def test_costs_refuse_a_link_without_bandwidth() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        Costs(0.0, 1e-3, 0.0, 1e-2, 0.0, 0.0, 10, 0.0)


@pytest.mark.parametrize("cores,slowdown", [((0, 1), 2.0), ((0, 0), 5.0)])
def test_steps_on_one_host_slow_each_other(cores: tuple[int, int], slowdown: float) -> None:
    """A decode step (10 ms) runs from 10 ms; a prefill step (20 ms) starts beside it at 11 ms. Either on another
    core with a co-run slowdown of 2, or on the same core (then the slowdown does not apply): each at half speed
    while both run, so the decode steps end at 29 and 49 ms and the prefill at 50 ms."""
    costs = replace(COSTS, kv_bytes_per_token=0, corun_slowdown_prefill=slowdown, corun_slowdown_decode=slowdown)
    a, b = simulate(workload(one(10, 3), one(20, 1, arrival=0.011)), costs, Topology(cores=cores))
    assert a.token_times == pytest.approx([0.010, 0.029, 0.049])
    assert b.token_times == pytest.approx([0.050])


@pytest.mark.parametrize(
    "credit,decode,prefill",
    [(0.006, [0.010, 0.024, 0.044], 0.050), (1.0, [0.010, 0.020, 0.040], 0.050), (0.0, [0.010, 0.029, 0.049], 0.050)],
)
def test_wakeup_sharing_lets_a_node_that_waited_run_first_within_its_credit(
    credit: float, decode: list[float], prefill: float
) -> None:
    """The case above on one core, shared as CFS does. The prefill node gets 10 ms of CPU (0-10 ms) while the
    decode node waits; the decode node's first step (virtual runtime 0) is placed at 10 ms minus the credit. With
    6 ms: placed at 4 ms, it runs alone from 10 ms, the prefill (at 10) arrives at 11 ms and waits till the decode
    node reaches 10 (16 ms), then both share: the step ends at 16 + 2 x 4 = 24 ms; the next step, level with the
    prefill, shares all the way (44 ms); the prefill ends at 50 ms as before, the core never idle. With 1 s (as
    good as unbounded) the first step runs alone (20 ms); with none, it is the fair case (29, 49 ms)."""
    costs = replace(COSTS, kv_bytes_per_token=0)
    topo = Topology(cores=(0, 0), core_sharing="wakeup", sleeper_credit_s=credit)
    a, b = simulate(workload(one(10, 3), one(20, 1, arrival=0.011)), costs, topo)
    assert a.token_times == pytest.approx(decode)
    assert b.token_times == pytest.approx([prefill])


def test_wakeup_sharing_is_fair_between_nodes_that_never_wait() -> None:
    """Two decode nodes on one core, each with one request prefilled together on another core (20 ms): level
    virtual runtimes, so they share the core as the fair policy does, and each of their 10 ms steps takes 20 ms."""
    costs = replace(COSTS, kv_bytes_per_token=0)
    reqs = workload(one(10, 3), one(10, 3))
    fair = simulate(reqs, costs, Topology(1, 2, cores=(1, 0, 0)))
    wakeup = simulate(reqs, costs, Topology(1, 2, cores=(1, 0, 0), core_sharing="wakeup"))
    assert wakeup[0].token_times == wakeup[1].token_times == pytest.approx([0.020, 0.040, 0.060])
    assert fair[0].token_times == fair[1].token_times == pytest.approx([0.020, 0.040, 0.060])


def test_topology_refuses_an_unknown_core_sharing_or_a_negative_credit() -> None:
    with pytest.raises(ValueError, match="core sharing"):
        Topology(core_sharing="round-robin")
    with pytest.raises(ValueError, match="credit"):
        Topology(sleeper_credit_s=-1.0)


def test_steps_keep_their_cost_when_the_cores_around_them_change_pace() -> None:
    """Every decode step lasts at least its cost, however often the prefill steps beside it start and end."""
    w = make_workload("sharegpt_like", 1000, 2048, seed=4, num_requests=32)
    costs = Costs(
        1e-3, 5e-4, 4e-7, 8e-3, 6e-4, 1.3e-6, 16384, 2.5e9, corun_slowdown_prefill=1.6, corun_slowdown_decode=1.6
    )
    counts: dict = {}
    recs = simulate(w, costs, Topology(cores=(0, 1)), counts)
    itl = [(r.token_times[-1] - r.token_times[1]) / (len(r.token_times) - 2) for r in recs if len(r.token_times) > 2]
    assert min(itl) >= costs.decode_step_s(1, 0)
    alone: dict = {}
    simulate(w, replace(costs, corun_slowdown_prefill=1.0, corun_slowdown_decode=1.0), Topology(cores=(0, 1)), alone)
    assert (
        counts["decode"]["step_time_s"] / counts["decode"]["steps"]
        > alone["decode"]["step_time_s"] / alone["decode"]["steps"]
    )


def test_the_decode_loop_outside_its_steps_delays_the_next_step() -> None:
    costs = replace(COSTS, kv_bytes_per_token=0, decode_iteration_s=3e-3)
    counts: dict = {}
    (rec,) = simulate(workload(one(10, 3)), costs, Topology(), counts)
    assert rec.token_times == pytest.approx([0.010, 0.020, 0.033])  # step, loop, step
    assert counts["decode"] == pytest.approx({"steps": 2, "step_time_s": 0.020, "busy_time_s": 0.026})


def test_a_pull_that_reaches_the_prefill_node_outside_its_steps_is_served_before_its_next_step() -> None:
    """A's KV pull comes back while the prefill node is still busy after A's step (its offer, chores): the KV goes
    before B's step. With no time outside the steps, B's step starts at once and the pull waits for its end."""
    w = workload(one(10, 3), one(100, 1, arrival=0.005))
    costs = replace(COSTS, kv_bytes_per_token=0, prefill_iteration_s=5e-3)
    a, b = simulate(w, costs, Topology())
    assert a.token_times == pytest.approx([0.010, 0.025, 0.035])  # step, loop (the pull served), KV lands, 2 steps
    assert b.token_times == pytest.approx([0.115])
    a, b = simulate(w, replace(costs, prefill_iteration_s=0.0), Topology())
    assert a.token_times == pytest.approx([0.010, 0.120, 0.130])
    assert b.token_times == pytest.approx([0.110])


def test_without_cores_each_node_has_its_own_device() -> None:
    costs = replace(COSTS, kv_bytes_per_token=0, corun_slowdown_prefill=2.0, corun_slowdown_decode=2.0)
    a, b = simulate(workload(one(10, 3), one(20, 1, arrival=0.011)), costs, Topology())
    assert a.token_times == pytest.approx([0.010, 0.020, 0.030])
    assert b.token_times == pytest.approx([0.031])


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
