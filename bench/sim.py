"""The simulator of a pdserve deployment (pdserve/plan/sim.py, where its model is written down) on bench's workloads
and metrics, and its validation against bench's runs.

    python -m bench.sim --costs bench/results/costs-small.json --prefill 1 --decode 1 --workload sharegpt_like
    python -m bench.sim --costs bench/results/costs-small.json --colocated 1 --workload sharegpt_like
    python -m bench.sim --validate RUN.json ... [--calibration CAL.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bench.metrics import SLO, RequestRecord, distribution, summarize
from bench.workloads import WORKLOADS, BenchRequest, Workload, make_workload
from pdserve.plan.costs import Costs, least_squares
from pdserve.plan.sim import CFS_SLEEPER_CREDIT_S, CORE_SHARING, Arrival, Clock, Cores, Topology
from pdserve.plan.sim import simulate as simulate_requests

__all__ = ["Clock", "Cores", "Costs", "Topology", "simulate"]


def simulate(workload: Workload, costs: Costs, topo: Topology, counters: dict | None = None) -> list[RequestRecord]:
    """Every request of `workload` through the simulated deployment (pdserve.plan.sim.simulate) as bench's records."""
    arrivals = [Arrival(r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in workload.requests]
    done = simulate_requests(arrivals, costs, topo, counters)
    return [RequestRecord(r.arrival, r.output_len, r.prompt_len, r.token_times) for r in done]


def predict(workload: Workload, costs: Costs, topo: Topology, slo: SLO) -> dict:
    """bench's summary (bench/metrics.py) of the simulated run, plus the router's busy share."""
    counters: dict = {}
    summary = summarize(simulate(workload, costs, topo, counters), 0.0, slo)
    summary["router_busy_share"] = counters["router"]["busy_s"] / summary["wall_s"] if summary["wall_s"] else 0.0
    return summary


# ---- validation against a bench run ----------------------------------------------------------------

COMPARED = (
    ("output tok/s", "output_throughput", None),
    ("TTFT p50", "ttft_s", "p50"),
    ("TTFT p99", "ttft_s", "p99"),
    ("TPOT p50", "tpot_s", "p50"),
    ("TPOT p99", "tpot_s", "p99"),
    ("hand-off p50", "handoff_s", "p50"),
    ("decode ITL p50", "decode_itl_s", "p50"),
    ("prefill mean step", "prefill_step", None),
    ("decode mean step", "decode_step", None),
    ("prefill outside steps", "prefill_outside", None),
    ("decode outside steps", "decode_outside", None),
)


CALIBRATION_ROUNDS = 3
ROLES = ("prefill", "decode")


def stages(token_times: list[list[float]]) -> dict:
    """A request's timeline in two stages after its first token: the hand-off (first token, from the prefill node,
    to the second, from the decode node: KV pull, transfer, admission, one step) and its decode inter-token
    latency (the mean interval after the second token); each's distribution over the requests."""
    handoff = [t[1] - t[0] for t in token_times if len(t) > 1]
    itl = [(t[-1] - t[1]) / (len(t) - 2) for t in token_times if len(t) > 2]
    return {"handoff_s": distribution(handoff), "decode_itl_s": distribution(itl)}


def _flag(args: list[str], name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


def bench_topology(config: dict, cpu_count: int) -> Topology:
    """The deployment of a run_bench JSON's disagg stack (its --engine-arg flags), its nodes on the cores
    `pdserve up` pins them to: node i (prefill nodes first) on core i mod the host's cores."""
    args = list(config.get("engine_args", ()))
    p, d = _flag(args, "--num-prefill", 1), _flag(args, "--num-decode", 1)
    cores = () if "--no-pin" in args else tuple(i % cpu_count for i in range(p + d))
    return Topology(p, d, config["max_batch"], config["max_num_batched_tokens"], cores, host_cores=cpu_count)


def _mean_step(counters: dict, role: str) -> float | None:
    c = counters.get(role, {})
    return c["step_time_s"] / c["steps"] if c.get("steps") else None


def _outside_steps(counters: dict, role: str) -> float | None:
    """A `role` node's mean time per iteration outside its step, from its counters (None if not reported)."""
    c = counters.get(role, {})
    return (c["busy_time_s"] - c["step_time_s"]) / c["steps"] if c.get("steps") and "busy_time_s" in c else None


def _ratio(measured: float | None, simulated: float | None) -> float:
    return measured / simulated if measured and simulated else 1.0


def _stat(summary: dict, key: str, stat: str | None) -> float | None:
    value = summary.get(key)
    return value if stat is None or value is None else value[stat]


def scaled(costs: Costs, prefill: float, decode: float) -> Costs:
    """`costs` with every prefill term times `prefill` and every decode term times `decode`."""
    return replace(
        costs,
        prefill_base_s=costs.prefill_base_s * prefill,
        prefill_per_token_s=costs.prefill_per_token_s * prefill,
        prefill_per_token_ctx_s=costs.prefill_per_token_ctx_s * prefill,
        decode_base_s=costs.decode_base_s * decode,
        decode_per_seq_s=costs.decode_per_seq_s * decode,
        decode_per_ctx_token_s=costs.decode_per_ctx_token_s * decode,
    )


def _simulated(res: dict, costs: Costs, topo: Topology, slo: SLO) -> dict:
    """bench's summary of `res`'s very requests (send times, lengths) simulated, with mean steps per role."""
    reqs = tuple(
        BenchRequest(tuple(range(r["prompt_len"])), r["expected_output_len"], r["send_s"]) for r in res["records"]
    )
    counts: dict = {}
    records = simulate(Workload(res["workload"], reqs), costs, topo, counts)
    summary = {**summarize(records, 0.0, slo), **stages([r.token_times for r in records])}
    return {**summary, **_per_role(counts)}


def _per_role(counters: dict) -> dict:
    """Each role's mean step and mean time outside its steps, from (summed) node counters."""
    steps = {f"{role}_step": _mean_step(counters, role) for role in ROLES}
    return {**steps, **{f"{role}_outside": _outside_steps(counters, role) for role in ROLES}}


def _fitted(res: dict, base: Costs, topo: Topology, slo: SLO, measured: dict, steps: bool = True) -> tuple[Costs, dict]:
    """`base` with each role's step costs (if `steps`) and its loop time outside the steps (where the nodes reported
    it) scaled until `res` simulated gives the means `measured`: nodes beside each other slow each other, so the
    scales are refined CALIBRATION_ROUNDS times. The costs, and the scales."""
    # the scales start from the costs' own loop time, else the one measured
    outside = {
        r: getattr(base, f"{r}_iteration_s") or measured[f"{r}_outside"]
        for r in ROLES
        if measured[f"{r}_outside"] is not None
    }
    factor = {f"{r}_{what}": 1.0 for r in ROLES for what in ("step", "outside")}

    def costs() -> Costs:
        c = scaled(base, factor["prefill_step"], factor["decode_step"])
        return replace(c, **{f"{r}_iteration_s": max(0.0, s) * factor[f"{r}_outside"] for r, s in outside.items()})

    for _ in range(CALIBRATION_ROUNDS):
        cal = _simulated(res, costs(), topo, slo)
        factor = {
            k: f * _ratio(measured[k], cal[k]) if steps or k.endswith("outside") else f for k, f in factor.items()
        }
    return costs(), factor


def _measured(res: dict) -> dict:
    """A run_bench result's summary, stages and per-role means, as `_simulated` gives them."""
    counters = res.get("node_counters") or {}
    return {**res["summary"], **stages([r["token_s"] for r in res["records"]]), **_per_role(counters)}


def calibrated_costs(
    costs: Costs,
    run: dict,
    on_cores: bool = True,
    steps: bool = True,
    core_sharing: str = "fair",
    sleeper_credit_s: float = CFS_SLEEPER_CREDIT_S,
) -> Costs:
    """`costs` completed from a calibration run (a run_bench JSON with a disagg result, not one of the runs
    validated; run it with each node on a core of its own, 1P1D on 2 cores) with what an in-process measurement
    cannot see: the router's and the load generator's CPU per token, each role's loop time outside its steps, and
    (if `steps`) each role's step cost level in the stack, all fitted so that the run simulated (on the host's cores
    unless not `on_cores`, shared as `core_sharing` says) gives the means its nodes reported."""
    res = next(iter(_disagg_results(run)), None)
    if res is None:
        raise ValueError("the calibration run has no successful disagg result")
    measured = _measured(res)
    if any(measured[f"{r}_outside"] is None for r in ROLES):
        raise ValueError("the calibration run's nodes did not report busy_time_s")
    topo = _run_topology(run, on_cores, core_sharing, sleeper_credit_s)
    slo = SLO(run["config"]["slo_ttft_s"], run["config"]["slo_tpot_s"])
    base = replace(costs, **_host_cpu(res), decode_iteration_s=0.0, prefill_iteration_s=0.0)
    return _fitted(res, base, topo, slo, measured, steps)[0]


def _disagg_results(run: dict, system: str = "disagg") -> list[dict]:
    """A run_bench JSON's successful results of `system` (disagg unless said)."""
    return [r for r in run["results"] if r["system"] == system and r["ok"]]


def validate_colocated(run: dict, costs: Costs) -> list[dict]:
    """Each colocated result of a run_bench JSON beside the simulation of its very requests on one colocated node
    (unpinned: a device of its own), with the router's and load generator's CPU per token measured in the run:
    (metric, predicted, measured, error) rows. `calibrated`: the same with the step costs scaled (prefill and decode
    terms alike) until the simulated mean step is the node's own, and its loop time outside the steps added."""
    rows, slo = [], SLO(run["config"]["slo_ttft_s"], run["config"]["slo_tpot_s"])
    config = run["config"]
    topo = Topology(max_num_seqs=config["max_batch"], max_num_batched_tokens=config["max_num_batched_tokens"])
    topo = replace(topo, num_colocated=1)
    for res in _disagg_results(run, "colocated"):
        base, measured = replace(costs, **_host_cpu(res)), _measured(res)
        sim, cal = _simulated(res, base, topo, slo), _simulated(res, _colocated_fit(res, base, topo), topo, slo)
        rows += _compared(res["label"], COMPARED[:5], sim, measured, cal)
    return rows


def _colocated_fit(res: dict, base: Costs, topo: Topology) -> Costs:
    """`base` with its step costs scaled until `res` simulated has its colocated node's mean step, and the node's
    time outside its steps a step (its counters) as loop time."""
    c = res["node_counters"]["colocated"]
    step, outside = c["step_time_s"] / c["steps"], (c["busy_time_s"] - c["step_time_s"]) / c["steps"]
    factor, costs = 1.0, replace(base, decode_iteration_s=max(0.0, outside))
    arrivals = [Arrival(r["send_s"], r["prompt_len"], r["expected_output_len"]) for r in res["records"]]
    for _ in range(CALIBRATION_ROUNDS):
        counts: dict = {}
        simulate_requests(arrivals, scaled(costs, factor, factor), topo, counts)
        factor *= _ratio(step, _mean_step(counts, "colocated"))
    return scaled(costs, factor, factor)


def _run_topology(run: dict, on_cores: bool, core_sharing: str, sleeper_credit_s: float) -> Topology:
    """A run_bench JSON's deployment, its nodes on the host's cores unless not `on_cores` (then each on a device
    of its own), shared as `core_sharing` says."""
    topo = replace(
        bench_topology(run["config"], run["environment"]["cpu_count"]),
        core_sharing=core_sharing,
        sleeper_credit_s=sleeper_credit_s,
    )
    return topo if on_cores else replace(topo, cores=())


def _host_cpu(res: dict) -> dict:
    """The router's and the load generator's CPU per token measured in a run_bench result, as `Costs` fields."""
    return {f"{who}_s_per_token": (res.get(f"{who}_cpu_us_per_token") or 0.0) / 1e6 for who in ("router", "client")}


def validate(
    run: dict,
    costs: Costs,
    on_cores: bool = True,
    predict_with: Costs | None = None,
    core_sharing: str = "fair",
    sleeper_credit_s: float = CFS_SLEEPER_CREDIT_S,
) -> list[dict]:
    """Each disagg result of a run_bench JSON beside the simulation of its very requests: (metric, predicted,
    measured, error) rows. The prediction takes `predict_with` (`calibrated_costs` from a separate run) if given,
    else `costs` with the router's and load generator's CPU per token measured in the run. The `calibrated` column
    reruns the simulation with the run's CPU per token and each role's step costs and time outside its steps
    scaled so that their means equal the ones the nodes reported in the stack (the CPU they really got on shared
    cores): it checks the model's queueing and hand-offs apart from the cost level.
    `core_sharing`, `sleeper_credit_s`: how nodes on one core share it (see 5. above)."""
    rows, topo = [], _run_topology(run, on_cores, core_sharing, sleeper_credit_s)
    slo = SLO(run["config"]["slo_ttft_s"], run["config"]["slo_tpot_s"])
    for res in _disagg_results(run):
        host = _host_cpu(res)
        base = replace(costs, **host)
        measured = _measured(res)
        sim = _simulated(res, predict_with or base, topo, slo)
        fitted, factor = _fitted(res, base, topo, slo, measured)
        cal = _simulated(res, fitted, topo, slo)
        extra = {"router_us_per_token": host["router_s_per_token"] * 1e6, "cost_factors": factor}
        rows += [{**row, **extra} for row in _compared(res["label"], COMPARED, sim, measured, cal)]
    return rows


def _compared(workload: str, compared, sim: dict, measured: dict, cal: dict) -> list[dict]:
    """One row per compared metric that all three hold: predicted, measured and calibrated, and their errors."""
    rows = []
    for label, key, stat in compared:
        pred, meas, calib = _stat(sim, key, stat), _stat(measured, key, stat), _stat(cal, key, stat)
        if pred is None or not meas or calib is None:
            continue
        rows.append(
            {
                "workload": workload,
                "metric": label,
                "predicted": pred,
                "measured": meas,
                "error": pred / meas - 1,
                "calibrated": calib,
                "calibrated_error": calib / meas - 1,
            }
        )
    return rows


def router_costs(runs: list[dict]) -> tuple[float, float, list[dict]]:
    """The router's CPU split into a cost per message from a node and one per token, fitted (least squares, not
    negative) over the disagg results of run_bench JSONs: CPU = a * messages + b * tokens, a message being a node
    step (bench records the nodes' steps per role). (a, b, each result's CPU measured and fitted)."""
    res = [r for run in runs for r in _disagg_results(run) if r.get("router_cpu_s")]
    steps = [sum(c.get("steps", 0.0) for c in (r.get("node_counters") or {}).values()) for r in res]
    tokens = [r["summary"]["total_output_tokens"] for r in res]
    if len(res) < 2 or not all(steps):
        raise ValueError("fitting the router's costs needs two or more disagg results with node counters")
    a, b = least_squares([[m, t] for m, t in zip(steps, tokens, strict=True)], [r["router_cpu_s"] for r in res])
    fits = [
        {"label": r["label"], "messages": m, "tokens": t, "cpu_s": r["router_cpu_s"], "fitted_s": a * m + b * t}
        for r, m, t in zip(res, steps, tokens, strict=True)
    ]
    return a, b, fits


def _fmt(metric: str, value: float) -> str:
    return f"{value:.1f}" if metric.startswith("output") else f"{value * 1e3:.0f} ms"


def validation_markdown(runs: list[tuple[str, dict, list[dict]]]) -> str:
    """One table: per run (name, run_bench JSON, `validate` rows) and metric, predicted vs measured."""
    lines = [
        "| run | load 1-min (start→end) | metric | predicted | measured | error | calibrated | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run, rows in runs:
        env = run["environment"]
        load = f"{env['loadavg_at_start'][0]:.1f}→{env['loadavg_at_end'][0]:.1f}"
        for r in rows:
            m, err, cal_err = r["metric"], r["error"], r["calibrated_error"]
            lines.append(
                f"| {name} {r['workload']} | {load} | {m} | {_fmt(m, r['predicted'])} | {_fmt(m, r['measured'])} | "
                f"{err:+.0%} | {_fmt(m, r['calibrated'])} | {cal_err:+.0%} |"
            )
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", type=Path, default=Path(__file__).parent / "results" / "costs-small.json")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--colocated", type=int, default=0, help="colocated nodes instead of prefill and decode nodes")
    p.add_argument("--workload", default="sharegpt_like", choices=WORKLOADS)
    p.add_argument("--rate", type=float, default=None, help="Poisson requests/s (default: closed, all at t=0)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=8192, help="the model's (small: 8192)")
    p.add_argument("--max-model-len", type=int, default=2048, help="the model's (small: 2048)")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.2)
    p.add_argument("--validate", type=Path, nargs="*", default=[], help="run_bench JSONs: disagg runs vs simulation")
    p.add_argument(
        "--validate-colocated",
        type=Path,
        nargs="*",
        default=[],
        help="run_bench JSONs: their colocated results vs simulation (one colocated node)",
    )
    p.add_argument("--json", action="store_true", help="with --validate: JSON rows instead of a Markdown table")
    p.add_argument(
        "--costs-beside",
        action="store_true",
        help="with --validate: each run X.json with the costs measured right before it, costs-X.json beside it",
    )
    p.add_argument(
        "--own-devices",
        action="store_true",
        help="with --validate: ignore the host's cores (each node "
        "on a device of its own, as the model was before it had cores)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="with --validate: a separate run_bench JSON "
        "(1P1D) that completes the costs: router and load generator CPU per token, the nodes' time "
        "outside their steps, and the step cost level in the stack",
    )
    p.add_argument(
        "--no-step-calibration",
        action="store_true",
        help="with --calibration: keep the step costs as measured in-process",
    )
    p.add_argument(
        "--core-sharing",
        default="fair",
        choices=CORE_SHARING,
        help="how nodes pinned to one core share "
        "it: fair (each 1/k) or wakeup (CFS: a node that waited runs first, within a credit)",
    )
    p.add_argument(
        "--sleeper-credit-ms",
        type=float,
        default=CFS_SLEEPER_CREDIT_S * 1e3,
        help="with --core-sharing wakeup: the most head start a node that waited gets (CFS on 2 CPUs: 6)",
    )
    p.add_argument(
        "--fit-router",
        type=Path,
        nargs="*",
        default=[],
        help="run_bench JSONs: fit the router's CPU per message and per token over their disagg results",
    )
    p.add_argument(
        "--write-calibrated",
        type=Path,
        default=None,
        help="with --calibration: write --costs as that run completes them (a costs JSON for bench.sim_study) and stop",
    )
    a = p.parse_args(argv)
    if not a.sleeper_credit_ms >= 0:
        p.error("--sleeper-credit-ms must be at least 0")
    if a.write_calibrated and not a.calibration:
        p.error("--write-calibrated needs --calibration")
    if a.write_calibrated or a.fit_router or a.validate or a.validate_colocated:
        try:
            return _offline(a)
        except ValueError as e:  # a run without what a fit needs (node counters, a disagg result), too few runs
            p.error(str(e))
    try:
        topo = Topology(
            a.prefill,
            a.decode,
            a.max_num_seqs,
            a.max_num_batched_tokens,
            core_sharing=a.core_sharing,
            sleeper_credit_s=a.sleeper_credit_ms / 1e3,
            num_colocated=a.colocated,
        )
        w = make_workload(a.workload, a.vocab_size, a.max_model_len, a.seed, a.rate, a.num_requests)
    except ValueError as e:
        print(f"bench.sim: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(predict(w, Costs.load(a.costs), topo, SLO(a.slo_ttft_s, a.slo_tpot_s)), indent=1))
    return 0


def _loaded(paths: list[Path]) -> list[tuple[Path, dict]]:
    return [(f, json.loads(f.read_text())) for f in paths]


def _offline(a: argparse.Namespace) -> int:
    """--write-calibrated, --fit-router, --validate or --validate-colocated, from run_bench JSONs."""
    credit, on_cores, steps = a.sleeper_credit_ms / 1e3, not a.own_devices, not a.no_step_calibration
    cal_run = json.loads(a.calibration.read_text()) if a.calibration else None
    if a.write_calibrated:
        fitted = calibrated_costs(Costs.load(a.costs), cal_run, on_cores, steps, a.core_sharing, credit)
        a.write_calibrated.write_text(
            json.dumps({"costs": asdict(fitted), "from": [str(a.costs), str(a.calibration)]}, indent=1) + "\n"
        )
        return 0
    if a.fit_router:
        per_message, per_token, fits = router_costs([json.loads(f.read_text()) for f in a.fit_router])
        print(
            json.dumps(
                {"router_us_per_message": per_message * 1e6, "router_us_per_token": per_token * 1e6, "runs": fits},
                indent=1,
            )
        )
        return 0
    if a.validate_colocated:
        runs = [(f.stem, run, validate_colocated(run, Costs.load(a.costs))) for f, run in _loaded(a.validate_colocated)]
        print(json.dumps([r for *_, rows in runs for r in rows], indent=1) if a.json else validation_markdown(runs))
        return 0
    costs = {f: Costs.load(f.with_name(f"costs-{f.name}") if a.costs_beside else a.costs) for f in a.validate}
    distinct = set(costs.values()) if cal_run else set()  # one fit per costs file, not per run
    fitted = {c: calibrated_costs(c, cal_run, on_cores, steps, a.core_sharing, credit) for c in distinct}
    runs = []
    for f in a.validate:
        pred = fitted.get(costs[f])
        run = json.loads(f.read_text())
        runs.append((f.stem, run, validate(run, costs[f], on_cores, pred, a.core_sharing, credit)))
    print(json.dumps([r for *_, rows in runs for r in rows], indent=1) if a.json else validation_markdown(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
