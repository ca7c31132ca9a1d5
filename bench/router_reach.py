"""How far one router process reaches, simulated (bench/sim.py) with the router's measured CPU costs.

    python -m bench.router_reach --router-us-per-token 20 --router-us-per-message 100 \\
        --node-tok-s 2000 5000 15000 --decode-nodes 8 --node-speed 15000 --out bench/results/router-reach

The decode nodes are GPU-like: a step of `--batch` requests takes batch / node_tok_s seconds whatever their context,
so a full node streams node_tok_s tokens a second; prefill nodes (one per four decode nodes) and the KV link are
fast enough never to be the bottleneck. Each has a device of its own; each router worker a core of its own. The load
is Poisson at `--load` of the decode nodes' capacity, `--prompt-tokens`-token prompts and `--max-tokens` output
tokens, arriving over --seconds or four request lifetimes, whichever is longer. The baseline is one decode node
behind one worker: its TPOT p99 is the nodes' step time and little more. A deployment is served when TPOT p99 stays
within twice the baseline's and no worker is busy 90% of the run or more (a FIFO server that busy is saturated: a
finite run only hides how its queue grows). Two answers:

1. Reach: for each node speed, the most decode nodes one worker serves.
2. Workers: for `--decode-nodes` nodes of `--node-speed`, the fewest workers that serve them, and each worker's
   busy share.

Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from bench.costs import Costs
from bench.metrics import SLO, summarize
from bench.sim import Topology, simulate
from bench.workloads import BenchRequest, Workload, poisson_arrivals

NO_SLO = SLO(float("inf"), float("inf"))
GROWTH = 2.0  # TPOT p99 past this many times the baseline's: the router is the bottleneck
SATURATED = 0.9  # a worker busy this share of the run is saturated: over a longer run its queue grows without bound
MAX_NODES = 64
LIFETIMES = 4  # arrivals span at least this many request lifetimes, so the nodes reach their steady load


def node_costs(node_tok_s: float, batch: int, us_per_token: float, us_per_message: float) -> Costs:
    """A GPU-like deployment: decode steps of `batch` take batch / node_tok_s; prefill and KV are quick."""
    return Costs(
        prefill_base_s=1e-3,
        prefill_per_token_s=1e-6,
        prefill_per_token_ctx_s=0.0,
        decode_base_s=batch / node_tok_s,
        decode_per_seq_s=0.0,
        decode_per_ctx_token_s=0.0,
        kv_bytes_per_token=114_688,
        link_bytes_per_s=25e9,
        router_s_per_token=us_per_token * 1e-6,
        router_s_per_message=us_per_message * 1e-6,
    )


def workload(rate: float, n: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> Workload:
    arrivals = poisson_arrivals(n, rate, np.random.default_rng(seed))
    reqs = tuple(BenchRequest(tuple(range(prompt_tokens)), max_tokens, t) for t in arrivals)
    return Workload("router-reach", reqs, rate)


def run(a: argparse.Namespace, node_tok_s: float, decode: int, workers: int) -> dict:
    costs = node_costs(node_tok_s, a.batch, a.router_us_per_token, a.router_us_per_message)
    topo = Topology(max(1, math.ceil(decode / 4)), decode, a.batch, 8192, router_workers=workers)
    rate = a.load * decode * node_tok_s / a.max_tokens
    lifetime = a.max_tokens * a.batch / node_tok_s  # a request's time on its node
    n = max(a.min_requests, int(rate * max(a.seconds, LIFETIMES * lifetime)))
    counters: dict = {}
    s = summarize(simulate(workload(rate, n, a.prompt_tokens, a.max_tokens), costs, topo, counters), 0.0, NO_SLO)
    busy = [b / s["wall_s"] for b in counters["router"]["worker_busy_s"]]
    return {
        "node_tok_s": node_tok_s,
        "decode": decode,
        "workers": workers,
        "rate": rate,
        "requests": n,
        "tok_per_s": s["output_throughput"],
        "tpot_p50_ms": s["tpot_s"]["p50"] * 1e3,
        "tpot_p99_ms": s["tpot_s"]["p99"] * 1e3,
        "worker_busy": busy,
    }


def served(r: dict, base: dict) -> bool:
    return r["tpot_p99_ms"] <= GROWTH * base["tpot_p99_ms"] and max(r["worker_busy"]) < SATURATED


def reach(a: argparse.Namespace, node_tok_s: float) -> dict:
    """The most decode nodes one worker serves (doubling, then bisecting)."""
    base = run(a, node_tok_s, 1, 1)
    tried = {1: base}
    good, bad = 1, None
    while bad is None and good < MAX_NODES:
        d = min(MAX_NODES, good * 2)
        tried[d] = run(a, node_tok_s, d, 1)
        good, bad = (d, None) if served(tried[d], base) else (good, d)
    while bad is not None and bad - good > 1:
        d = (good + bad) // 2
        tried[d] = run(a, node_tok_s, d, 1)
        good, bad = (d, bad) if served(tried[d], base) else (good, d)
    return {
        "node_tok_s": node_tok_s,
        "max_decode_nodes": good,
        "capped": bad is None,
        "base": base,
        "runs": [tried[d] for d in sorted(tried)],
    }


def workers_needed(a: argparse.Namespace) -> dict:
    base = run(a, a.node_speed, 1, 1)
    runs = []
    for w in range(1, a.max_workers + 1):
        runs.append(run(a, a.node_speed, a.decode_nodes, w))
        if served(runs[-1], base):
            return {"workers": w, "base": base, "runs": runs}
    return {"workers": None, "base": base, "runs": runs}


def markdown(study: dict) -> str:
    c = study["config"]
    lines = [
        f"Simulated (bench/sim.py): router {c['router_us_per_token']:g} µs a token + "
        f"{c['router_us_per_message']:g} µs a message (measured by bench.router); decode steps of {c['batch']} "
        f"requests; Poisson load at {c['load']:.0%} of the decode nodes' capacity, {c['prompt_tokens']}-token "
        f"prompts, {c['max_tokens']} output tokens.",
        "",
        "| decode node tok/s | decode nodes one worker serves | their tok/s | worker busy there |",
        "|---|---|---|---|",
    ]
    for r in study["reach"]:
        at = next(x for x in r["runs"] if x["decode"] == r["max_decode_nodes"])
        most = f"{r['max_decode_nodes']}{'+' if r['capped'] else ''}"
        lines.append(f"| {r['node_tok_s']:,.0f} | {most} | {at['tok_per_s']:,.0f} | {at['worker_busy'][0]:.0%} |")
    w = study["workers"]
    lines += [
        "",
        f"{c['decode_nodes']} decode nodes at {c['node_speed']:,.0f} tok/s each: "
        + (
            f"**{w['workers']} worker(s)** keep TPOT p99 within {GROWTH:g}x one node's "
            f"({w['base']['tpot_p99_ms']:.1f} ms), each busy less than {SATURATED:.0%}."
            if w["workers"]
            else f"more than {c['max_workers']} workers."
        ),
        "",
        "| workers | tok/s | TPOT p50 ms | TPOT p99 ms | busiest worker |",
        "|---|---|---|---|---|",
    ]
    for r in w["runs"]:
        lines.append(
            f"| {r['workers']} | {r['tok_per_s']:,.0f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | "
            f"{max(r['worker_busy']):.0%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router_reach", description=__doc__.split("\n\n")[0])
    p.add_argument("--router-us-per-token", type=float, required=True)
    p.add_argument("--router-us-per-message", type=float, default=0.0)
    p.add_argument("--node-tok-s", type=float, nargs="+", default=[2000.0, 5000.0, 15000.0])
    p.add_argument("--batch", type=int, default=64, help="decode requests a step (max_num_seqs)")
    p.add_argument("--decode-nodes", type=int, default=8)
    p.add_argument("--node-speed", type=float, default=15000.0, help="tok/s of each of --decode-nodes")
    p.add_argument("--max-workers", type=int, default=16)
    p.add_argument("--load", type=float, default=0.8, help="offered load as a share of the decode capacity")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seconds", type=float, default=4.0, help="simulated seconds of arrivals")
    p.add_argument("--min-requests", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("bench/results/router-reach"))
    a = p.parse_args(argv)
    study = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "reach": [reach(a, s) for s in a.node_tok_s],
        "workers": workers_needed(a),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(study, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(markdown(study))
    print(markdown(study))
    return 0


if __name__ == "__main__":
    sys.exit(main())
