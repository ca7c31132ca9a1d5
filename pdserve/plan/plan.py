"""DistServe's question for a pdserve deployment: on N GPUs, which serves more requests a second within both SLOs,
the best prefill:decode split or N colocated replicas?

For a workload and its SLOs, each deployment's goodput is the highest Poisson rate at which at least 90% of the
requests meet both the TTFT and the TPOT SLO, found by doubling then bisection over simulated runs (sim.py) with the
step costs of a cost file. Disaggregated: every split pP + dD of the N GPUs (one node a GPU), the KV of each request
sent over a GPU-to-GPU link of the bandwidth given (`--link-gbps`; else the cost file's). Colocated: N replicas, each a
colocated node, the router spreading requests over them. Goodput is reported per GPU (req/s / N).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.config import PLAN_WORKLOADS, PlanConfig
from pdserve.plan.costs import Costs
from pdserve.plan.sim import Arrival, SimRequest, Topology, simulate

TARGET = 0.9  # the share of requests within both SLOs that counts as served
BISECTIONS = 8
GPU_COUNTS = (2, 4, 8)


@dataclass(frozen=True)
class Lengths:
    """A workload's request lengths: log-normal around a median (prompt, output), clipped to [lo, hi]."""

    prompt: tuple[int, int, int]  # (median, lo, hi)
    output: tuple[int, int, int]


# DistServe's three kinds of load (chat, summarisation, writing), in tokens a 2048-token window holds
WORKLOADS = dict(
    zip(
        PLAN_WORKLOADS,
        (
            Lengths(prompt=(256, 16, 1024), output=(128, 8, 512)),  # chat: short to medium both ways
            Lengths(prompt=(1280, 512, 1792), output=(32, 4, 128)),  # long-prompt: long in, short out
            Lengths(prompt=(128, 16, 512), output=(640, 128, 1024)),  # long-answer: short in, long out
        ),
        strict=True,
    )
)


def make_requests(workload: str, rate: float, n: int, seed: int = 0) -> list[Arrival]:
    """`n` requests of `workload`, Poisson arrivals at `rate` req/s, deterministic for a seed."""
    lengths, rng = WORKLOADS[workload], random.Random(seed)

    def draw(median: int, lo: int, hi: int) -> int:
        return min(hi, max(lo, round(rng.lognormvariate(math.log(median), 0.5))))

    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(Arrival(t, draw(*lengths.prompt), draw(*lengths.output)))
    return out


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met_by(self, r: SimRequest) -> bool:
        tpot = r.tpot
        return r.ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def attainment(costs: Costs, topo: Topology, slo: SLO, workload: str, rate: float, n: int, seed: int) -> float:
    """The share of `n` requests at `rate` that meet both SLOs."""
    done = simulate(make_requests(workload, rate, n, seed), costs, topo)
    return sum(slo.met_by(r) for r in done) / len(done)


def goodput(costs: Costs, topo: Topology, slo: SLO, workload: str, n: int, seed: int = 0) -> float:
    """The highest rate (req/s) with >= 90% attainment: the rate doubled from 1 req/s a node until it fails, then
    bisected. 0.0 if even a trickle (1/64 req/s a node) misses."""

    def ok(rate: float) -> bool:
        return attainment(costs, topo, slo, workload, rate, n, seed) >= TARGET

    lo, hi = 0.0, float(topo.num_nodes)
    while ok(hi):
        lo, hi = hi, 2 * hi
    if lo == 0.0 and not ok(hi / 64):
        return 0.0
    lo = max(lo, hi / 64) if lo == 0.0 else lo
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class Row:
    """One deployment of N GPUs and its goodput."""

    gpus: int
    name: str  # "2P2D", "4 colocated"
    goodput_rps: float

    @property
    def per_gpu(self) -> float:
        return self.goodput_rps / self.gpus


def plan(costs: Costs, slo: SLO, workload: str, gpus: int, base: Topology, n: int, seed: int = 0) -> list[Row]:
    """Every split of `gpus` GPUs and `gpus` colocated replicas, each with its goodput, best first. `n` requests a
    GPU at each rate: a run long against a request's lifetime on any N, so that a large deployment is not judged on
    its start alone."""
    n *= gpus
    rows = [Row(gpus, f"{gpus} colocated", goodput(costs, replace(base, num_colocated=gpus), slo, workload, n, seed))]
    for p in range(1, gpus):
        topo = replace(base, num_prefill=p, num_decode=gpus - p, num_colocated=0)
        rows.append(Row(gpus, f"{p}P{gpus - p}D", goodput(costs, topo, slo, workload, n, seed)))
    return sorted(rows, key=lambda r: -r.goodput_rps)


def table(results: Sequence[list[Row]]) -> str:
    """A Markdown table: per N, the best split's goodput a GPU against the colocated replicas', and the answer (a
    goodput of 0: the SLOs missed even at a trickle)."""
    lines = [
        "| GPUs | best split | goodput/GPU (req/s) | colocated goodput/GPU | disaggregate? | next splits |",
        "|---|---|---|---|---|---|",
    ]
    for rows in results:
        colo = next(r for r in rows if r.name.endswith("colocated"))
        splits = [r for r in rows if r is not colo]
        best = splits[0]
        if colo.goodput_rps:
            ratio = best.goodput_rps / colo.goodput_rps
            answer = f"yes, {ratio:.2f}x" if ratio > 1 else f"no ({ratio:.2f}x)"
        else:  # the replicas miss the SLOs even at a trickle: no ratio to give
            answer = "yes (colocated: 0)" if best.goodput_rps else "none meets the SLOs"
        rest = ", ".join(f"{r.name} {r.per_gpu:.2f}" for r in splits[1:4])
        lines.append(f"| {best.gpus} | {best.name} | {best.per_gpu:.2f} | {colo.per_gpu:.2f} | {answer} | {rest} |")
    return "\n".join(lines)


def answer(cfg: PlanConfig) -> str:
    """`pdserve plan`: the assumptions, then the table for `cfg.gpus` GPUs (or 2, 4 and 8); written to `cfg.out`
    too if given. ValueError: a missing input or a cost file that cannot be read."""
    cfg.check_given()
    costs = Costs.load(cfg.costs)
    if cfg.link_gbps:
        costs = replace(costs, link_bytes_per_s=cfg.link_gbps * 1e9, link_latency_s=0.0)
    slo, base = (
        SLO(cfg.slo_ttft, cfg.slo_tpot),
        Topology(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens),
    )
    counts = (cfg.gpus,) if cfg.gpus else GPU_COUNTS
    results = [plan(costs, slo, cfg.workload, n, base, cfg.num_requests, cfg.seed) for n in counts]
    text = "\n".join((*assumptions(cfg, costs), "", table(results)))
    if cfg.out:
        Path(cfg.out).write_text(text + "\n")
    return text


def assumptions(cfg: PlanConfig, costs: Costs) -> tuple[str, ...]:
    """What the answer rests on, said in lines."""
    link = "--link-gbps" if cfg.link_gbps else "the cost file's link"
    return (
        f"workload {cfg.workload}: {cfg.num_requests} Poisson requests a GPU at each rate tried (seed {cfg.seed})",
        f"SLO: TTFT <= {cfg.slo_ttft:g} s and TPOT <= {cfg.slo_tpot:g} s for {TARGET:.0%} of requests",
        f"GPU-to-GPU KV link: {costs.link_bytes_per_s / 1e9:.3g} GB/s ({link}), "
        f"{costs.kv_bytes_per_token} KV bytes a token",
        f"costs: {cfg.costs}; a node: --max-num-seqs {cfg.max_num_seqs}, "
        f"--max-num-batched-tokens {cfg.max_num_batched_tokens}; one GPU a node",
    )
