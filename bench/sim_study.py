"""Two questions answered by the simulator (bench/sim.py) from CPU-measured costs (bench/costs.py).

    python -m bench.sim_study --costs bench/results/costs-small.json
        --router-us-per-token 60 --router-us-per-message 310

1. P:D: for every split of 2..`max_nodes` nodes, the goodput (highest Poisson rate of `sharegpt_like` with >= 90%
   of requests within the TTFT and TPOT SLO, by bisection); which split reaches `target_rate` with fewest nodes.
2. Router: the best split scaled k times at k times its goodput, with the router's CPU per streamed token and per
   message from a node (`python -m bench.sim --fit-router RUNS` fits both); the largest k whose attainment stays
   >= 90% is how far one router goes before it must be replicated.

Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench.costs import Costs
from bench.metrics import SLO, max_rate_within_slo, summarize
from bench.sim import Topology, simulate
from bench.workloads import make_workload

VOCAB, MAX_LEN = 8192, 2048  # the `small` model's
BISECTIONS = 9
TARGET = 0.9


def attainment(costs: Costs, topo: Topology, rate: float, slo: SLO, n: int, seed: int) -> float:
    w = make_workload("sharegpt_like", VOCAB, MAX_LEN, seed, rate, n)
    return summarize(simulate(w, costs, topo), 0.0, slo)["slo_attainment"]


def goodput(costs: Costs, topo: Topology, slo: SLO, n: int, seed: int, high: float) -> float | None:
    """The highest rate in (0, high] with >= 90% attainment, by bisection (attainment falls as the rate grows)."""
    tried, lo, hi = {}, 0.0, high
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        tried[mid] = attainment(costs, topo, mid, slo, n, seed)
        lo, hi = (mid, hi) if tried[mid] >= TARGET else (lo, mid)
    return max_rate_within_slo(tried, TARGET)


def split_table(costs: Costs, slo: SLO, max_nodes: int, n: int, seed: int, base: Topology) -> list[dict]:
    rows = []
    for total in range(2, max_nodes + 1):
        for p in range(1, total):
            topo = replace(base, num_prefill=p, num_decode=total - p)
            rate = goodput(costs, topo, slo, n, seed, high=20.0 * total)
            rows.append({"prefill": p, "decode": total - p, "nodes": total, "goodput_rps": rate})
    return rows


def router_scaling(costs: Costs, slo: SLO, best: dict, n: int, seed: int, max_k: int) -> list[dict]:
    """The best split k times over at k times its goodput (90% of it, to stand clear of its edge)."""
    rows = []
    for k in (1, 2, 4, 8, 16, 32, 64)[: max_k.bit_length()]:
        topo = Topology(best["prefill"] * k, best["decode"] * k, best["max_num_seqs"], best["budget"])
        rate = 0.9 * best["goodput_rps"] * k
        w = make_workload("sharegpt_like", VOCAB, MAX_LEN, seed, rate, n * k)
        counters: dict = {}
        s = summarize(simulate(w, costs, topo, counters), 0.0, slo)
        busy = counters["router"]["busy_s"] / s["wall_s"]
        rows.append(
            {
                "k": k,
                "nodes": topo.num_prefill + topo.num_decode,
                "rate": rate,
                "attainment": s["slo_attainment"],
                "output_tok_s": s["output_throughput"],
                "router_busy": busy,
            }
        )
    return rows


def markdown(study: dict) -> str:
    c = study["config"]
    lines = [
        f"Simulated from CPU-measured costs ({c['costs']}); `sharegpt_like`, {c['num_requests']} requests, "
        f"SLO TTFT <= {c['slo_ttft_s']} s and TPOT <= {c['slo_tpot_s'] * 1e3:.0f} ms, 90% attainment.",
        "",
        "| P | D | nodes | goodput (req/s) | per node |",
        "|---|---|---|---|---|",
    ]
    for r in study["splits"]:
        g = r["goodput_rps"] or 0.0
        lines.append(f"| {r['prefill']} | {r['decode']} | {r['nodes']} | {g:.2f} | {g / r['nodes']:.2f} |")
    lines += [
        "",
        f"Router at {c['router_us_per_message']:.0f} µs CPU per message from a node and "
        f"{c['router_us_per_token']:.0f} µs per streamed token, best split scaled k times:",
        "",
        "| k | nodes | rate (req/s) | output tok/s | router busy | attainment |",
        "|---|---|---|---|---|---|",
    ]
    for r in study["router"]:
        lines.append(
            f"| {r['k']} | {r['nodes']} | {r['rate']:.1f} | {r['output_tok_s']:.0f} | "
            f"{r['router_busy']:.0%} | {r['attainment']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim_study", description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", type=Path, default=Path(__file__).parent / "results" / "costs-small.json")
    p.add_argument("--router-us-per-token", type=float, default=0.0, help="the router's CPU per streamed token")
    p.add_argument(
        "--router-us-per-message",
        type=float,
        default=0.0,
        help="the router's CPU per message from "
        "a node (one a step; 0: all of it counted per token, as router_cpu_us_per_token)",
    )
    p.add_argument("--slo-ttft-s", type=float, default=1.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.025)
    p.add_argument("--max-nodes", type=int, default=6)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-k", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sim-study")
    a = p.parse_args(argv)
    costs = replace(
        Costs.load(a.costs),
        router_s_per_token=a.router_us_per_token / 1e6,
        router_s_per_message=a.router_us_per_message / 1e6,
    )
    slo, base = SLO(a.slo_ttft_s, a.slo_tpot_s), Topology()
    no_router = replace(costs, router_s_per_token=0.0, router_s_per_message=0.0)
    splits = split_table(no_router, slo, a.max_nodes, a.num_requests, a.seed, base)
    best = max(splits, key=lambda r: ((r["goodput_rps"] or 0) / r["nodes"], -r["nodes"]))
    best = {**best, "max_num_seqs": base.max_num_seqs, "budget": base.max_num_batched_tokens}
    study = {
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}},
        "splits": splits,
        "best_per_node": best,
        "router": router_scaling(costs, slo, best, a.num_requests, a.seed, a.max_k),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{a.out}.json").write_text(json.dumps(study, indent=1))
    Path(f"{a.out}.md").write_text(markdown(study) + "\n")
    print(markdown(study))
    return 0


if __name__ == "__main__":
    sys.exit(main())
