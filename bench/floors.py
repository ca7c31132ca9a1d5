"""The compute floor (the bare model forward on the same batches), and pdserve's engine overhead over it.

pdserve's `Engine` runs a workload in-process (no router, no
sockets), closed. The engine's runner is wrapped in `TimedRunner`, which times `prepare(batch)` and
`forward(inputs)` inside each `engine.step()` on exactly the batch that step runs. So for every
step we have the whole step's time and the bare forward's (input building + model forward: no
scheduling, no sampling, no bookkeeping). Engine overhead = step time / bare forward time; the
compute floor is the summed bare forward time, the wall time an engine with zero overhead would take.
(The KV-transfer floors live in bench/kv_bandwidth.py.)
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from bench.workloads import Workload
from pdserve.engine.scheduler import GROUP_KEYS, step_group

GROUPS = list(GROUP_KEYS)  # step_group's names, in order

WARMUP_REQUESTS = 2
WARMUP_TOKENS = 4


class TimedRunner:
    """Stands in for an engine's ModelRunner: times prepare() and forward(), delegates everything else."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.prepare_s: list[float] = []
        self.forward_s: list[float] = []

    def prepare(self, batch):
        t = time.perf_counter()
        inputs = self.inner.prepare(batch)
        self.prepare_s.append(time.perf_counter() - t)
        return inputs

    def forward(self, inputs):
        t = time.perf_counter()
        logits = self.inner.forward(inputs)
        self.forward_s.append(time.perf_counter() - t)
        return logits

    def run(self, batch):
        """The engine's entry point: the eager path, timed in its two parts (no CUDA graphs on the CPU)."""
        return self.forward(self.prepare(batch)), False

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _add_all(engine, workload: Workload, tag: str) -> None:
    from pdserve.engine.request import Request
    from pdserve.wire.params import SamplingParams

    for i, r in enumerate(workload.requests):
        params = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
        engine.add(Request(f"{tag}{i}", list(r.prompt_token_ids), params))


def _warm_up(engine, workload: Workload) -> None:
    """The first requests' prompts with a few output tokens each: first-call costs stay out of the timing."""
    from pdserve.engine.request import Request
    from pdserve.wire.params import SamplingParams

    params = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0, ignore_eos=True)
    for i, r in enumerate(workload.requests[:WARMUP_REQUESTS]):
        engine.add(Request(f"warmup{i}", list(r.prompt_token_ids), params))
    while engine.has_work():
        engine.step()


def _timed_steps(engine, timed: TimedRunner, bar: tqdm) -> list[tuple[float, float, float]]:
    """Run the engine dry; (step, prepare, forward) seconds of every step that ran a forward."""
    steps = []
    while engine.has_work():
        n = len(timed.forward_s)
        t = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t
        if len(timed.forward_s) == n + 1:
            steps.append((dt, timed.prepare_s[-1], timed.forward_s[-1]))
        bar.update(sum(1 for o in outputs if o.finish_reason))
    return steps


def engine_overhead(cfg, workload: Workload, progress: bool = True) -> dict:
    """Engine step time vs bare forward time over `workload`, run closed; `cfg` is an EngineConfig."""
    from pdserve.nodes.parts import build_engine

    engine = build_engine(cfg)
    _warm_up(engine, workload)
    timed = TimedRunner(engine.runner)
    engine.runner = timed
    _add_all(engine, workload, "floor")
    with tqdm(
        total=len(workload.requests), desc=f"engine floor/{workload.name}", unit="req", disable=not progress
    ) as bar:
        t0 = time.perf_counter()
        steps = _timed_steps(engine, timed, bar)
        wall = time.perf_counter() - t0
    return _overhead_summary(workload, steps, wall)


def _overhead_summary(workload: Workload, steps: list[tuple[float, float, float]], wall: float) -> dict:
    a = np.asarray(steps, dtype=float)  # [steps, 3]: step, prepare, forward
    bare = a[:, 1] + a[:, 2]
    return {
        "workload": workload.name,
        "num_steps": len(steps),
        "engine_wall_s": wall,
        "compute_floor_s": float(bare.sum()),
        "forward_only_s": float(a[:, 2].sum()),
        "step_time_sum_s": float(a[:, 0].sum()),
        "engine_overhead": float(a[:, 0].sum() / bare.sum()),
        "engine_overhead_step_p50": float(np.median(a[:, 0] / bare)),
        "wall_over_floor": float(wall / bare.sum()),
        "prepare_share_of_bare": float(a[:, 1].sum() / bare.sum()),
        "floor_output_throughput": workload.num_output_tokens / float(bare.sum()),
    }


# ---- each step beside its own floor ----------------------------------------------------------------

PEAK_N = 8192
TINY_PEAK_N = 512
PEAK_WARMUP = 20  # matmuls before the timing: the clocks rise from idle
PEAK_REPEATS = 10  # timings, each of PEAK_BACK_TO_BACK matmuls queued at once
PEAK_BACK_TO_BACK = 10


def gemm_peak_flops(device: str, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of large matmuls in `dtype` (2 N^3 per product, N = PEAK_N; TINY_PEAK_N on the CPU): after PEAK_WARMUP,
    the best of PEAK_REPEATS timings of PEAK_BACK_TO_BACK matmuls in a row (one launch's gap is not in the figure):
    the peak the compute floor is set at."""
    n = PEAK_N if device.startswith("cuda") else TINY_PEAK_N
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(PEAK_WARMUP):
        a @ b
    best = float("inf")
    for _ in range(PEAK_REPEATS):
        sync(device)
        t = time.perf_counter()
        for _ in range(PEAK_BACK_TO_BACK):
            a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 * PEAK_BACK_TO_BACK / best


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class StepWeights(NamedTuple):
    """The weights of a step's GEMMs: `nbytes`, those a step reads (the layers' and the LM head's; the embedding
    table's rows looked up are not counted); `body`, the layers' weights, each 2 FLOPs per token; `head`, the LM head's,
    each 2 FLOPs per row whose logits are computed (a sampling request's last row: not every token's)."""

    nbytes: int
    body: int
    head: int

    def flops(self, tokens: int, samples: int) -> float:
        return 2.0 * (self.body * tokens + self.head * samples)


def step_floors(records: list[dict], weights: StepWeights, kv_bytes_per_token: int, copy_gbps: float, peak: float):
    """Each step beside its floor (records: requests, tokens, decode_tokens, samples, context, seconds of each
    step): the sums of each group (`step_group`), then `group_floors`."""
    keys = ("seconds", "context", "tokens", "samples")
    sums = {g: {"steps": 0} | dict.fromkeys(keys, 0) for g in GROUPS}
    for r in records:
        g = step_group(r["requests"], r["tokens"], r["decode_tokens"])
        if g is not None:
            sums[g]["steps"] += 1
            for k in keys:
                sums[g][k] += r[k]
    return group_floors(sums, weights, kv_bytes_per_token, copy_gbps, peak)


def group_floors(sums: dict, weights: StepWeights, kv_bytes_per_token: int, copy_gbps: float, peak: float):
    """Decode-only steps against the memory floor, grouped by batch size (STEP_GROUPS): their weights and their
    batch's KV read once, at the device copy's bandwidth (a copy reads and writes each byte: `copy_gbps` counts the
    bytes copied, so read+write moves twice them); steps with prompt chunks against the compute floor: their GEMMs'
    FLOPs (`StepWeights.flops`: the layers' for every token, the LM head's for the rows sampled) at the measured bf16
    GEMM peak. `sums`: {group: steps, seconds, context (tokens of KV read), tokens, samples}, summed over its steps.
    Each group: its steps, mean seconds, mean floor, and their ratio."""
    groups = {}
    for g in GROUPS:
        s = sums.get(g) or {"steps": 0}
        if g == "prompt chunks":
            floor, total = "compute", weights.flops(s.get("tokens", 0), s.get("samples", 0)) / peak
        else:
            floor = "memory"
            read = s["steps"] * weights.nbytes + s.get("context", 0) * kv_bytes_per_token
            total = read / (2 * copy_gbps * 1e9)
        groups[g] = _group(s, total, floor)
    return groups


def _group(s: dict, floor_total_s: float, floor: str) -> dict:
    n = s["steps"]
    if not n:
        return {"floor": floor, "steps": 0}
    mean_s, mean_floor = s["seconds"] / n, floor_total_s / n
    return {"floor": floor, "steps": int(n), "mean_s": mean_s, "floor_s": mean_floor, "ratio": mean_s / mean_floor}


def floor_rows(groups: dict) -> list[str]:
    """Each group's table cells: `| group | floor | count | mean ms | floor ms | ratio |`."""
    rows = []
    for name, g in groups.items():
        if g["steps"]:
            row = f"| {g['mean_s'] * 1e3:.2f} | {g['floor_s'] * 1e3:.3f} | {g['ratio']:.1f}x |"
        else:
            row = "| | | |"
        rows.append(f"| {name} | {g['floor']} | {g['steps']} " + row)
    return rows
