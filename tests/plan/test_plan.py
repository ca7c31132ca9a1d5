"""pdserve plan: the colocated node model, the goodput search and the command line (no model, no timing)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from pdserve.cli import main
from pdserve.config import PLAN_WORKLOADS
from pdserve.plan.costs import Costs, fit_link
from pdserve.plan.plan import SLO, WORKLOADS, Row, goodput, make_requests, plan, table
from pdserve.plan.sim import Arrival, Topology, simulate

# prefill: 1 ms a token; decode: 10 ms a step; KV: 10 bytes a token over 1000 bytes/s (10 ms a token)
COSTS = Costs(0.0, 1e-3, 0.0, 10e-3, 0.0, 0.0, kv_bytes_per_token=10, link_bytes_per_s=1000.0)
COLOCATED = Topology(num_colocated=1)


def test_a_colocated_node_runs_a_prompt_then_decodes_with_no_hand_off() -> None:
    counts: dict = {}
    (rec,) = simulate([Arrival(0.0, 100, 3)], COSTS, COLOCATED, counts)
    assert rec.token_times == pytest.approx([0.1, 0.11, 0.12])
    assert set(counts) == {"colocated", "router"} and counts["colocated"]["steps"] == 3


def test_a_colocated_step_mixes_a_prompt_chunk_with_decodes() -> None:
    """B's prompt (50 tokens) joins A's decode in one step of 10 ms + 50 ms: A's second token waits for it."""
    a, b = simulate([Arrival(0.0, 100, 3), Arrival(0.05, 50, 2)], COSTS, COLOCATED)
    assert a.token_times == pytest.approx([0.1, 0.16, 0.17])
    assert b.token_times == pytest.approx([0.16, 0.17])
    assert COSTS.mixed_step_s([(50, 0)], 1, 101) == pytest.approx(0.06)


def test_a_colocated_prompt_is_chunked_under_the_token_budget() -> None:
    (rec,) = simulate([Arrival(0.0, 700, 2)], COSTS, replace(COLOCATED, max_num_batched_tokens=512))
    assert rec.token_times == pytest.approx([0.7, 0.71])  # 512 + 188 tokens in two steps, then a decode


def test_the_router_spreads_requests_over_colocated_replicas() -> None:
    reqs = [Arrival(0.0, 100, 1), Arrival(0.0, 100, 1)]
    assert [r.ttft for r in simulate(reqs, COSTS, replace(COLOCATED, num_colocated=2))] == pytest.approx([0.1, 0.1])
    assert sorted(r.ttft for r in simulate(reqs, COSTS, COLOCATED)) == pytest.approx([0.2, 0.2])  # one step


def test_the_link_is_fitted_from_hand_off_times() -> None:
    samples = [{"tokens": n, "s": 2e-5 + n * 100 / 1e9} for n in (16, 128, 1024)]
    assert fit_link(samples, 100) == pytest.approx((1e9, 2e-5))
    with pytest.raises(ValueError, match="grow"):
        fit_link([{"tokens": n, "s": 1e-3} for n in (16, 128)], 100)


def test_workloads_are_deterministic_and_keep_their_shape() -> None:
    assert set(WORKLOADS) == set(PLAN_WORKLOADS)
    a, b = make_requests("long-prompt", 2.0, 50, seed=1), make_requests("long-prompt", 2.0, 50, seed=1)
    assert a == b and all(512 <= r.prompt_len <= 1792 and r.output_len <= 128 for r in a)
    longer = make_requests("long-answer", 2.0, 50, seed=1)
    assert sum(r.output_len for r in longer) > 4 * sum(r.output_len for r in a)


def test_goodput_is_the_highest_rate_that_meets_the_slos() -> None:
    """Chat on one colocated node: at the rate found, >= 90% of the requests meet both SLOs; at four times it not."""
    slo, arrivals = SLO(1.5, 0.05), 60
    costs = replace(COSTS, kv_bytes_per_token=0)
    rate = goodput(costs, COLOCATED, slo, "chat", arrivals)
    assert rate > 0
    met = [slo.met_by(r) for r in simulate(make_requests("chat", rate, arrivals), costs, COLOCATED)]
    assert sum(met) / len(met) >= 0.9
    worse = [slo.met_by(r) for r in simulate(make_requests("chat", 4 * rate, arrivals), costs, COLOCATED)]
    assert sum(worse) / len(worse) < 0.9


def test_plan_ranks_every_split_and_the_colocated_replicas() -> None:
    rows = plan(replace(COSTS, kv_bytes_per_token=0), SLO(2.0, 0.05), "chat", 3, Topology(), 20)
    assert sorted(r.name for r in rows) == ["1P2D", "2P1D", "3 colocated"]
    assert [r.goodput_rps for r in rows] == sorted((r.goodput_rps for r in rows), reverse=True)


def test_the_table_gives_no_ratio_when_the_replicas_meet_nothing() -> None:
    """A colocated goodput of 0 is no infinite speed-up: the answer says which side meets the SLOs."""

    def rows(split: float, colocated: float) -> list[Row]:
        return sorted([Row(2, "1P1D", split), Row(2, "2 colocated", colocated)], key=lambda r: -r.goodput_rps)

    lines = table([rows(0.0, 0.0), rows(1.0, 0.0), rows(3.0, 2.0), rows(1.0, 2.0)]).splitlines()[2:]
    answers = [line.split(" | ")[4] for line in lines]
    assert answers == ["none meets the SLOs", "yes (colocated: 0)", "yes, 1.50x", "no (0.50x)"]
    assert "inf" not in "\n".join(lines)


@pytest.fixture
def cost_file(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"model": "hand", "costs": asdict(replace(COSTS, link_bytes_per_s=1e9))}))
    return path


def test_plan_answers_for_the_gpus_asked_and_states_its_assumptions(cost_file, tmp_path, capsys) -> None:
    out = tmp_path / "plan.md"
    argv = ["plan", "--costs", str(cost_file), "--slo-ttft", "1", "--slo-tpot", "0.05", "--gpus", "2"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--link-gbps", "25", "--num-requests", "10", "--out", str(out)])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "TTFT <= 1 s and TPOT <= 0.05 s" in text and "25 GB/s (--link-gbps)" in text
    assert "| 2 | 1P1D |" in text and out.read_text() == text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--slo-ttft", "1", "--slo-tpot", "0.05"], "needs --costs"),
        (["--costs", "COSTS", "--slo-tpot", "0.05"], "needs --slo-ttft"),
        (["--costs", "missing.json", "--slo-ttft", "1", "--slo-tpot", "0.05"], "cannot read the cost file"),
        (["--costs", "NOTCOSTS", "--slo-ttft", "1", "--slo-tpot", "0.05"], "is not a cost file"),
        (["--costs", "COSTS", "--slo-ttft", "1", "--slo-tpot", "0.05", "--gpus", "1"], "--gpus must be at least 2"),
        (["--costs", "COSTS", "--slo-ttft", "-1", "--slo-tpot", "0.05"], "--slo-ttft must be positive"),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(argv, message, cost_file, tmp_path, capsys) -> None:
    (tmp_path / "not.json").write_text('{"model": "x"}')
    given = [str(cost_file) if a == "COSTS" else str(tmp_path / "not.json") if a == "NOTCOSTS" else a for a in argv]
    with pytest.raises(SystemExit) as done:
        main(["plan", *given])
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
