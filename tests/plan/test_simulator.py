"""pdserve/plan/sim.py and costs.py: hand-computable cases and monotonicity, no model, no timing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.plan.costs import Costs, fit
from pdserve.plan.plan import make_requests
from pdserve.plan.sim import Arrival, Topology, simulate

# prefill: 1 ms a token; decode: 10 ms a step; KV: 10 bytes a token over 1000 bytes/s (10 ms a token)
COSTS = Costs(0.0, 1e-3, 0.0, 10e-3, 0.0, 0.0, kv_bytes_per_token=10, link_bytes_per_s=1000.0)


def one(prompt: int, output: int, arrival: float = 0.0) -> Arrival:
    return Arrival(arrival, prompt, output)


def workload(*reqs: Arrival) -> list[Arrival]:
    return list(reqs)


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
    w = [r._replace(arrival=0.0) for r in make_requests("chat", 1.0, 48, seed=1)]
    costs = Costs(1e-3, 5e-4, 4e-7, 8e-3, 6e-4, 1.3e-6, 16384, 2.5e9, 0.0, 20e-6)
    base = max(r.token_times[-1] for r in simulate(w, costs, Topology()))
    more = max(r.token_times[-1] for r in simulate(w, costs, Topology(p, d)))
    assert more <= base


def test_the_simulation_is_deterministic() -> None:
    w = make_requests("long-prompt", 4.0, 40, seed=3)
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
    w = [r._replace(arrival=0.0) for r in make_requests("chat", 1.0, 32, seed=4)]
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
