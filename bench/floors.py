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
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.workloads import Workload

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

BATCH_GROUPS = ((1, 8), (9, 32), (33, 128), (129, 256))


def memory_floor_s(record: dict, weight_bytes: int, kv_bytes_per_token: int, copy_gbps: float) -> float:
    """A decode-only step's floor: its weights and its batch's KV read once, at the device copy's bandwidth (a copy
    reads and writes each byte: `copy_gbps` counts the bytes copied, so read+write moves twice them)."""
    return (weight_bytes + record["context"] * kv_bytes_per_token) / (2 * copy_gbps * 1e9)


def compute_floor_s(record: dict, flops_per_token: float, peak_flops: float) -> float:
    """A step with prompt chunks: its FLOPs (`flops_per_token` x its tokens) at the measured bf16 GEMM peak."""
    return record["tokens"] * flops_per_token / peak_flops


def step_floors(records: list[dict], weights: tuple[int, int], kv_bytes_per_token: int, copy_gbps: float, peak: float):
    """Decode-only steps against the memory floor, grouped by batch size (BATCH_GROUPS); steps with prompt chunks
    against the compute floor (2 FLOPs per weight per token). `weights`: (their bytes, their count). Each group: its
    steps, mean seconds, mean floor, and their ratio."""
    weight_bytes, flops_per_token = weights[0], 2 * weights[1]
    decode = [r for r in records if r["decode_tokens"] == r["tokens"]]
    chunked = [r for r in records if r["decode_tokens"] != r["tokens"]]
    groups = {}
    for lo, hi in BATCH_GROUPS:
        rows = [r for r in decode if lo <= r["requests"] <= hi]
        floors = [memory_floor_s(r, weight_bytes, kv_bytes_per_token, copy_gbps) for r in rows]
        groups[f"decode {lo}-{hi}"] = _group(rows, floors, "memory")
    floors = [compute_floor_s(r, flops_per_token, peak) for r in chunked]
    groups["prompt chunks"] = _group(chunked, floors, "compute")
    return groups


def _group(rows: list[dict], floors: list[float], floor: str) -> dict:
    if not rows:
        return {"floor": floor, "steps": 0}
    mean_s = sum(r["seconds"] for r in rows) / len(rows)
    mean_floor = sum(floors) / len(floors)
    return {"floor": floor, "steps": len(rows), "mean_s": mean_s, "floor_s": mean_floor, "ratio": mean_s / mean_floor}
