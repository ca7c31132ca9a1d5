"""The GPU benchmark: one command, a few minutes on one GPU host (docs/gpu.md).

    python -m bench.gpu                    # qwen3-0.6b in bf16, 256 ShareGPT-like requests, 128 concurrent
    python -m bench.gpu --device cpu --model tiny --requests 16 --concurrency 8   # a CPU smoke test
    python -m bench.gpu --workload steady  # the fixed workloads (`WORKLOADS`): steady, 128 x (700 prompt, 256
    python -m bench.gpu --workload burst   # output); burst, 256 sharegpt_like; all sent at once, --max-num-seqs
                                           # 128, --max-num-batched-tokens 4096, no large run

1. Builds the checkpoint (the built-in `qwen3-0.6b`: Qwen3-0.6B's shape, random bf16 weights).
2. Measures the device's copy bandwidth (a device-to-device copy on the benchmark device; between the
   prefill and the decode device too when they differ).
3. Runs `sharegpt_like` (256 requests, prompt median 176 and output median 63: ~60k prompt and ~20.8k
   output tokens) at most `--concurrency` requests in flight, on each system in turn, each warmed up
   first: pdserve colocated (one node on the device), pdserve disaggregated over cuda_ipc (prefill on
   cuda:0, decode on cuda:1 when there are two GPUs, else both on cuda:0; over shm on the CPU), both
   through `pdserve up` and driven over HTTP by bench/http_client.py; then HF continuous batching
   (transformers' manager) and HF static batching (`generate`, batches of `--concurrency`), in-process.
4. For the pdserve systems, from the router's /metrics (node counters, diffed over the run) and /proc:
   - each node's steps beside their floor (bench.floors' `group_floors`, on the node's counters of its steps by
     floor group): decode-only steps, grouped by batch size (1-8, 9-32, 33-128, 129-256), beside the memory
     floor (the weights read per step, every parameter except the embedding table plus the LM head, and the
     KV its batch reads, at the device copy's read+write bandwidth); steps with prompt chunks beside the
     compute floor (2 FLOPs a layer weight a token and 2 an LM head weight a row sampled, at the bf16 GEMM peak
     measured on the device, bench.floors.gemm_peak_flops);
   - KV transfer bandwidth (the prefill node's bytes over its transfer time, pull to ack) beside a
     device-to-device copy between the same devices (bytes copied per second);
   - the router's CPU time per streamed token.
5. For every run, the steady-state decode throughput: output tokens per second over the window in which
   at least 90% of `--concurrency` requests are decoding (between their first and last token), which the
   run's tail (few long requests) does not dilute; then a larger run (`--large-run`, 1,024 requests at most
   256 in flight) on the pdserve systems (`--large-systems`), each started with --max-num-seqs 256.
6. Kernels per step: `bench.kernels` counts the kernels of a decode and a mixed step through the GPU path
   on the device, for the model's layer count (on the CPU only under TRITON_INTERPRET=1). Triton
   compilations inside the measured window: each pdserve stack compiles into its own fresh Triton cache
   folder (TRITON_CACHE_DIR), whose new entries between the warm-up and the run's end are counted. CUDA
   graphs: from the node counters over the run, the share of each node's steps, tokens and decode tokens
   computed by replayed graphs, and the graphs captured within the run (beside those captured at start).
7. Writes <out>/gpu.json, gpu.md and gpu.png (and the stacks' logs under <out>/logs/), where <out> is
   `--out-dir`, else $OUT when set, else bench/runs/gpu (git-ignored). The report is rewritten after each system,
   so a run cut short still leaves what it measured.

`--stack SYSTEM URL PID TRITON_CACHE` runs a pdserve system on a stack another process started and stops (the GPU
kit shares one between its stages): bench.gpu drives it as its own, for the main and the large run, reads the
router's CPU below PID and counts Triton compilations in TRITON_CACHE (the folder the stack compiles into), and
leaves it running; its engine settings are the starter's.

`--budget-s` bounds the whole command: a system is skipped when less than `--min-system-s` (45 s) is left to start
it, and requests still unfinished when the time is up are reported as failed. Each run ends 15 s before the time is up
when bench.gpu stopped a stack of its own after it, else 3 s before.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench import report, systems
from bench.baselines import kv_bytes_per_token, load_hf_model
from bench.floors import StepWeights, floor_rows, gemm_peak_flops, group_floors
from bench.metrics import SLO
from bench.run_bench import environment, run_workload, warm_up
from bench.workloads import Workload, fixed_lengths, make_workload
from pdserve.engine.scheduler import GROUP_COUNTS, GROUP_KEYS
from pdserve.process import unwind_once

SYSTEMS = ("colocated", "disagg", "hf_cb", "static")


@dataclass(frozen=True)
class Preset:
    """A fixed GPU workload (docs/gpu-step.md), with the engine budget it is measured at: every request sent at once."""

    requests: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt_len: int = 0  # fixed prompt and output lengths; 0: sharegpt_like's
    output_len: int = 0


WORKLOADS = {
    "sharegpt": None,  # --requests sharegpt_like requests, at most --concurrency in flight (also --max-num-seqs)
    "steady": Preset(128, 128, 4096, prompt_len=700, output_len=256),  # 128 x (700 prompt, 256 output)
    "burst": Preset(256, 128, 4096),  # 256 sharegpt_like requests
}
SHAREGPT_SHAPE = {"prompt_median": 176.0, "output_median": 63.0}  # 256 requests: 60,145 + 20,782 tokens
MIN_SYSTEM_S = 45.0  # by default, a system is not started with less time left than this (--min-system-s)
FINISH_MARGIN_S = 15.0  # kept back from a run's time limit to stop the stack bench.gpu started, and write the report
REPORT_MARGIN_S = 3.0  # kept back from the run of a system it started no stack for (shared, in-process)
COPY_BYTES = 256 * 2**20
COPY_REPEATS = 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STEADY_SHARE = 0.9  # the steady state: at least this share of --concurrency decoding
STEADY_HEADER = (
    "| run | system | in flight | steady window (s) | of the run | steady tok/s | whole-run tok/s | "
    "Triton compilations in the run (at start) |\n|---|---|---|---|---|---|---|---|"
)
KV_HEADER = "| path | transfers | GB | GB/s | vs copy |\n|---|---|---|---|---|"
GRAPH_HEADER = (
    "| system | node | steps | eager steps | steps in graphs | tokens in graphs | decode tokens in graphs "
    "| graphs captured in the run (at start) |\n|---|---|---|---|---|---|---|---|"
)
RUN_KINDS = ("steps", "tokens", "decode_tokens")


@dataclass(frozen=True)
class GpuBenchConfig:
    model: str = "qwen3-0.6b"
    workload: str = "sharegpt"
    device: str = "cuda:0"
    dtype: str = "bfloat16"
    requests: int = 256
    concurrency: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_gb: float = 16.0
    systems: tuple[str, ...] = SYSTEMS
    budget_s: float = 420.0
    min_system_s: float = MIN_SYSTEM_S
    count_kernels: bool = True  # bench.kernels' count (it builds the model once more): --no-kernel-count skips it
    seed: int = 0
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.05
    hf_cuda_graphs: bool = False
    engine_args: tuple[str, ...] = ()  # passed on to `pdserve up` as they are
    large_requests: int = 1024  # the larger run; 0: none
    large_concurrency: int = 256
    large_systems: tuple[str, ...] = ("colocated",)
    out_dir: Path = field(default=Path(__file__).parent / "runs" / "gpu")
    name: str = "gpu"
    progress: bool = True
    max_num_seqs: int = 0  # 0: --concurrency
    shared: tuple[systems.SharedStack, ...] = ()  # --stack: pdserve systems on stacks another process runs

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, not {self.workload!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device must be cpu or cuda:N, not {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: this machine has no CUDA device; try --device cpu")
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
        if min(self.concurrency, self.max_num_batched_tokens) < 1 or self.requests < 0:
            raise ValueError("--concurrency and --max-num-batched-tokens must be at least 1, --requests at least 0")
        if self.large_requests < 0 or (self.large_requests and self.large_concurrency < 1):
            raise ValueError("--large-run takes a request count (0: none) and a concurrency of at least 1")
        if not self.requests and not (self.large_requests and set(self.systems) & set(self.large_systems)):
            raise ValueError("--requests 0 (no main run) runs the large run alone: give --large-run and its systems")
        if set(self.large_systems) - {"colocated", "disagg"}:
            raise ValueError("--large-systems: colocated and/or disagg")
        if self.kv_cache_gb <= 0 or self.budget_s <= 0 or self.min_system_s < 0:
            raise ValueError("--kv-cache-gb and --budget-s must be positive, --min-system-s not negative")
        shared = [s.system for s in self.shared]
        if set(shared) - {"colocated", "disagg"} or len(set(shared)) < len(shared):
            raise ValueError("--stack: one stack each for colocated and/or disagg")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, not {self.dtype!r}")

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_s, self.slo_tpot_s)

    @property
    def num_seqs(self) -> int:
        """The engines' --max-num-seqs."""
        return self.max_num_seqs or self.concurrency

    @property
    def decoding(self) -> int:
        """The most requests decoding at once: those in flight, within --max-num-seqs."""
        return min(self.concurrency, self.num_seqs)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def decode_device(self) -> str:
        """Disaggregated: the decode node on the next GPU when there is one."""
        if not self.on_gpu:
            return "cpu"
        index = torch.device(self.device).index or 0
        return f"cuda:{index + 1}" if torch.cuda.device_count() > index + 1 else self.device


# ---- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="built-in (qwen3-0.6b, small, tiny) or a checkpoint folder")
    p.add_argument(
        "--workload",
        default="sharegpt",
        choices=list(WORKLOADS),
        help="steady: 128 x (700 prompt, 256 output); burst: 256 sharegpt_like; both sent at once with --max-num-seqs "
        "128 and 4,096 batched tokens (they set --requests, --concurrency and the budget; no large run)",
    )
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a smoke test")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--requests", type=int, default=256, help="0: no main run, the large run alone")
    p.add_argument("--concurrency", type=int, default=128, help="requests in flight; also --max-num-seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gb", type=float, default=None, help="per node; default: 16 on CUDA, 0.25 on the CPU")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole command's time limit")
    p.add_argument(
        "--min-system-s",
        type=float,
        default=MIN_SYSTEM_S,
        help="a system is skipped with less of --budget-s left than this (a caller that bounds each call itself, "
        "as the GPU kit does, gives 0)",
    )
    p.add_argument(
        "--no-kernel-count",
        action="store_true",
        help="skip the kernels-per-step count (a caller that counts them once for several calls, as the GPU kit does)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-s", type=float, default=1.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.05)
    p.add_argument("--hf-cuda-graphs", action="store_true", help="let HF continuous batching use CUDA graphs")
    p.add_argument("--engine-arg", action="append", default=[], help="e.g. --engine-arg=--enforce-eager")
    p.add_argument(
        "--large-run",
        type=int,
        nargs=2,
        default=[1024, 256],
        metavar=("REQUESTS", "CONCURRENCY"),
        help="the larger run after the others (0 0: none)",
    )
    p.add_argument("--large-systems", nargs="+", default=["colocated"], choices=("colocated", "disagg"))
    p.add_argument(
        "--stack",
        nargs=4,
        action="append",
        default=[],
        metavar=("SYSTEM", "URL", "PID", "TRITON_CACHE"),
        help="run SYSTEM (colocated, disagg) on this running stack instead of starting one; it is left running",
    )
    p.add_argument("--out-dir", type=Path, default=None, help="default: $OUT when set, else bench/runs/gpu")
    p.add_argument("--name", default="gpu", help="stem of the result files")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> GpuBenchConfig:
    a = build_parser().parse_args(argv)
    on_gpu = a.device.startswith("cuda")
    out_dir = a.out_dir or (Path(os.environ["OUT"]) if os.environ.get("OUT") else GpuBenchConfig.out_dir)
    cfg = GpuBenchConfig(
        model=a.model,
        workload=a.workload,
        device=a.device,
        dtype=a.dtype or ("bfloat16" if on_gpu else "float32"),
        requests=a.requests,
        concurrency=a.concurrency,
        max_num_batched_tokens=a.max_num_batched_tokens,
        kv_cache_gb=a.kv_cache_gb or (16.0 if on_gpu else 0.25),
        systems=tuple(a.systems),
        budget_s=a.budget_s,
        min_system_s=a.min_system_s,
        count_kernels=not a.no_kernel_count,
        seed=a.seed,
        slo_ttft_s=a.slo_ttft_s,
        slo_tpot_s=a.slo_tpot_s,
        hf_cuda_graphs=a.hf_cuda_graphs,
        engine_args=tuple(a.engine_arg),
        out_dir=out_dir,
        name=a.name,
        progress=not a.no_progress,
        large_requests=a.large_run[0],
        large_concurrency=a.large_run[1],
        large_systems=tuple(a.large_systems),
        shared=tuple(shared_stacks(a.stack)),
    )
    return with_preset(cfg)


def shared_stacks(given: list[list[str]]) -> list[systems.SharedStack]:
    try:
        return [systems.SharedStack(s, url, int(pid), Path(cache)) for s, url, pid, cache in given]
    except ValueError:
        raise ValueError("--stack SYSTEM URL PID TRITON_CACHE: PID is a process id") from None


def with_preset(cfg: GpuBenchConfig) -> GpuBenchConfig:
    """cfg with its workload's preset applied: its requests, all in flight at once, its engine budget, no large run."""
    preset = WORKLOADS[cfg.workload]
    if preset is None:
        return cfg
    return dataclasses.replace(
        cfg,
        requests=preset.requests,
        concurrency=preset.requests,
        max_num_seqs=preset.max_num_seqs,
        max_num_batched_tokens=preset.max_num_batched_tokens,
        large_requests=0,
    )


# ---- hardware and model figures --------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_gbps(src_device: str, dst_device: str, nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> float:
    """GB/s copied by `dst.copy_(src)` from one device's memory to another's (or the same)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    dst.copy_(src)  # first touch, lazy init
    for d in {src.device, dst.device}:
        _sync(d)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    for d in {src.device, dst.device}:
        _sync(d)
    seconds = time.perf_counter() - t0
    del src, dst
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return nbytes * repeats / seconds / 1e9


def hardware(cfg: GpuBenchConfig) -> dict:
    same = copy_gbps(cfg.device, cfg.device)
    hw = {
        "device": torch.cuda.get_device_name(cfg.device) if cfg.on_gpu else "cpu",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "prefill_device": cfg.device,
        "decode_device": cfg.decode_device,
        "copy_GBps": same,  # bytes copied per second, on the benchmark device
        "memory_GBps": 2 * same,  # bytes read + written per second: the bandwidth of the memory floor
        "bf16_peak_flops_per_s": gemm_peak_flops(cfg.device),  # the compute floor's
    }
    cross = copy_gbps(cfg.device, cfg.decode_device) if cfg.decode_device != cfg.device else same
    hw["kv_copy_GBps"] = cross  # the copy a KV transfer from prefill to decode device competes with
    return hw


def step_weights(config, itemsize: int) -> StepWeights:
    """The weights of a step's GEMMs (`StepWeights`): the layers' (every parameter but the embedding table and the
    LM head) and the LM head's; a step reads both, and of the embedding table only the rows it looks up."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - embed.numel()  # parameters(): a tied head once, as embed
    if head is not embed:
        body -= head.numel()
    return StepWeights((body + head.numel()) * itemsize, body, head.numel())


def decode_context_tokens(workload: Workload) -> int:
    """KV tokens read by every decode step over the run: decode k of a request sees its prompt + k tokens."""
    total = 0
    for r in workload.requests:
        p, n = len(r.prompt_token_ids), r.output_len - 1  # the first token comes from the prefill
        total += n * p + n * (n + 1) // 2
    return total


def model_figures(config, cfg: GpuBenchConfig, workload: Workload) -> dict:
    itemsize = DTYPE_BYTES[cfg.dtype]
    per_token = kv_bytes_per_token(config, itemsize)
    weights = step_weights(config, itemsize)
    return {
        "weight_bytes_per_step": weights.nbytes,
        "body_weights": weights.body,
        "head_weights": weights.head,
        "kv_bytes_per_token": per_token,
        "decode_kv_bytes": decode_context_tokens(workload) * per_token,
        "decode_tokens": sum(r.output_len - 1 for r in workload.requests),
    }


# ---- steady state -----------------------------------------------------------------------------------


def steady_windows(records: list[dict], threshold: int) -> list[tuple[float, float]]:
    """The intervals in which at least `threshold` requests are decoding (first token to last token)."""
    events = sorted(
        ev for r in records if len(r["token_s"]) >= 2 for ev in ((r["token_s"][0], 1), (r["token_s"][-1], -1))
    )
    windows, running, opened = [], 0, None
    for t, delta in events:  # at equal times an end (-1) sorts first: a request ending as another starts
        running += delta
        if running >= threshold and opened is None:
            opened = t
        elif running < threshold and opened is not None:
            if t > opened:
                windows.append((opened, t))
            opened = None
    return windows


def steady_state(records: list[dict], concurrency: int, share: float = STEADY_SHARE) -> dict | None:
    """Output tokens per second over the windows where at least `share` of `concurrency` requests decode (the
    tokens after each request's first, arriving inside a window). None when there is no such window."""
    threshold = max(1, math.ceil(share * concurrency))
    windows = steady_windows(records, threshold)
    seconds = sum(b - a for a, b in windows)
    if not seconds:
        return None
    times = sorted(t for r in records for t in r["token_s"][1:])
    tokens = sum(bisect.bisect_right(times, b) - bisect.bisect_left(times, a) for a, b in windows)
    run_s = max((r["token_s"][-1] for r in records if r["token_s"]), default=0.0)
    return {
        "threshold": threshold,
        "window_s": seconds,
        "share_of_run": seconds / run_s if run_s else None,
        "tokens": tokens,
        "output_throughput": tokens / seconds,
    }


# ---- node counters ---------------------------------------------------------------------------------


def node_floors(counts: dict, role: str, figures: dict, hw: dict) -> dict | None:
    """The node role's steps over the run beside their floors (`group_floors`), from its counters by floor group."""
    c = counts.get(role, {})
    if not c.get("steps"):
        return None
    sums = {}
    for group, prefix in GROUP_KEYS.items():
        n = {k: c.get(f"{prefix}_{k}", 0) for k in GROUP_COUNTS}
        sums[group] = {
            "steps": n["count"],
            "seconds": n["time_s"],
            "context": n["context_tokens"],
            "tokens": n["tokens"],
            "samples": n["samples"],
        }
    weights = StepWeights(figures["weight_bytes_per_step"], figures["body_weights"], figures["head_weights"])
    groups = group_floors(sums, weights, figures["kv_bytes_per_token"], hw["copy_GBps"], hw["bf16_peak_flops_per_s"])
    return {"node": role, "steps": int(c["steps"]), "groups": groups}


def graph_share(counts: dict, role: str, at_start: dict) -> dict | None:
    """The shares of a node role's steps, tokens and decode tokens over the run computed by replayed CUDA graphs, its
    eager steps, and the graphs it captured within the run and before (`at_start`: its counters then)."""
    c = counts.get(role, {})
    total = {k: c.get(f"graph_{k}", 0) + c.get(f"eager_{k}", 0) for k in RUN_KINDS}
    if not total["steps"]:
        return None
    shares = {f"{k}_share": c.get(f"graph_{k}", 0) / n if n else None for k, n in total.items()}
    return {
        "node": role,
        "steps": int(total["steps"]),
        "eager_steps": int(c.get("eager_steps", 0)),
        **shares,
        "captures_in_run": int(c.get("graph_captures", 0)),
        "captures_at_start": int(at_start.get(role, {}).get("graph_captures", 0)),
    }


def kv_transfer(counts: dict, hw: dict) -> dict | None:
    c = counts.get("prefill", {})
    if not c.get("kv_transfer_time_s"):
        return None
    gbps = c["kv_transfer_bytes"] / c["kv_transfer_time_s"] / 1e9
    return {
        "transfers": int(c.get("kv_transfers", 0)),
        "GB": c["kv_transfer_bytes"] / 1e9,
        "GBps": gbps,
        "copy_GBps": hw["kv_copy_GBps"],
        "share_of_copy": gbps / hw["kv_copy_GBps"],
        "failures": int(c.get("kv_transfer_failures", 0)),
    }


# ---- systems ---------------------------------------------------------------------------------------


def stack_argv(cfg: GpuBenchConfig, mode: str, port: int) -> list[str]:
    """The `pdserve up` bench.gpu starts `mode` with: a caller that shares a stack with it starts the same."""
    return systems.stack_argv(stack_options(cfg, mode, None), mode, port)


def stack_options(cfg: GpuBenchConfig, mode: str, deadline: float | None) -> systems.StackOptions:
    devices = ["--device", cfg.device]  # for every role; disagg names both roles' devices too
    if mode == "disagg":
        devices += ["--prefill-device", cfg.device, "--decode-device", cfg.decode_device]
    return systems.StackOptions(
        model=cfg.model,
        max_num_seqs=cfg.num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        kv_cache_gb=cfg.kv_cache_gb,
        kv_transport="cuda_ipc" if cfg.on_gpu else "shm",
        log_prefix=cfg.out_dir / "logs" / cfg.name,
        extra_args=("--dtype", cfg.dtype, *devices, *cfg.engine_args),
        max_concurrency=cfg.concurrency,
        deadline=deadline,
    )


class HfModel:
    """The HF model of the in-process baselines, loaded once, on first use."""

    def __init__(self, path: Path, cfg: GpuBenchConfig) -> None:
        self.path, self.cfg = path, cfg
        self._model = None

    def get(self):
        if self._model is None:
            self._model = load_hf_model(self.path, getattr(torch, self.cfg.dtype), self.cfg.device)
        return self._model


def shared_of(cfg: GpuBenchConfig, system: str) -> systems.SharedStack | None:
    return next((s for s in cfg.shared if s.system == system), None)


def open_system(cfg: GpuBenchConfig, system: str, hf: HfModel, deadline: float):
    """`system` as a context manager; its runs end by `deadline` (time.monotonic())."""
    shared = shared_of(cfg, system)
    if shared is not None:
        return systems.shared_stack(shared, stack_options(cfg, system, deadline), cfg.progress)
    if system in ("colocated", "disagg"):
        return systems.pdserve_stack(stack_options(cfg, system, deadline), system, cfg.progress)
    if system == "static":
        return systems.static_batching(hf.get(), cfg.num_seqs, cfg.progress, deadline)
    opts = systems.CbOptions(
        cfg.num_seqs, cfg.max_num_batched_tokens, cfg.kv_cache_gb, cfg.concurrency, deadline, cfg.hf_cuda_graphs
    )
    return systems.hf_continuous_batching(hf.get(), opts, cfg.progress)


def _not_run(system: str, w: Workload, why: str) -> dict:
    return {"system": system, "workload": w.name, "label": w.label, "rate": None, "ok": False, "error": why}


@contextmanager
def triton_cache(path: Path):
    """Processes started inside compile their Triton kernels into `path`, emptied first."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old


def compiled_kernels(path: Path) -> int:
    """Kernels compiled into a Triton cache folder: Triton writes one group file (`__grp__*.json`) for each."""
    return sum(1 for _ in path.rglob("__grp__*.json"))


def run_system(cfg: GpuBenchConfig, system: str, w: Workload, hf: HfModel, ctx: dict, deadline: float) -> dict:
    left = deadline - time.monotonic()
    if left < cfg.min_system_s:
        return _not_run(system, w, f"skipped: {left:.0f} s of the --budget-s left")
    started = time.monotonic()
    shared = shared_of(cfg, system)
    starts_stack = system in ("colocated", "disagg") and not shared
    margin = FINISH_MARGIN_S if starts_stack else REPORT_MARGIN_S
    cache = shared.triton_cache if shared else cfg.out_dir / "triton-cache" / f"{system}-{cfg.requests}"
    try:
        with (
            nullcontext() if shared else triton_cache(cache),
            open_system(cfg, system, hf, deadline - margin) as run,
        ):
            warm_up(run, system)
            compiled = compiled_kernels(cache)
            before = systems.settled_counters(run) if isinstance(run, systems.StackRunner) else {}
            result = run_workload(cfg.slo, system, run, w)
            result["concurrency"] = cfg.concurrency
            if shared:
                result["shared_stack"] = shared.url
            result["steady_state"] = steady_state(result.get("records", []), cfg.decoding)
            if isinstance(run, systems.StackRunner):
                result["triton_compiled_at_start"] = compiled
                result["triton_compilations"] = compiled_kernels(cache) - compiled
                after = systems.settled_counters(run)
                add_node_figures(result, systems.counters_diff(after, before), system, ctx, before)
    except Exception as e:  # a system that fails is reported; the others still run
        print(f"bench.gpu: {system} failed: {type(e).__name__}: {e}", file=sys.stderr)
        result = _not_run(system, w, f"{type(e).__name__}: {e}")
    result["seconds"] = time.monotonic() - started
    result.pop("tokens", None)
    return result


def add_node_figures(result: dict, counts: dict, system: str, ctx: dict, at_start: dict) -> None:
    """From the node counters over the run (`counts`; `at_start`: before it): the decode step, CUDA graphs, KV."""
    result["node_counters"] = counts
    roles = ("colocated",) if system == "colocated" else ("prefill", "decode")
    floors = (node_floors(counts, role, ctx["model"], ctx["hardware"]) for role in roles)
    result["step_floors"] = [f for f in floors if f]
    result["graphs"] = [g for g in (graph_share(counts, role, at_start) for role in roles) if g]
    result["kv_transfer"] = kv_transfer(counts, ctx["hardware"]) if system == "disagg" else None


# ---- report ----------------------------------------------------------------------------------------


def _step_lines(results: list[dict], hw: dict) -> list[str]:
    rows = [(r, f) for r in results for f in r.get("step_floors") or ()]
    if not rows:
        return []
    lines = [
        "",
        f"## Steps beside their floor (node counters over the run; device copy {hw['copy_GBps']:.0f} GB/s, bf16 "
        f"peak {hw['bf16_peak_flops_per_s'] / 1e12:.2f} TFLOP/s)",
        "",
        "| system | node | group | floor | steps | mean ms | floor ms | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, f in rows:
        lines += [f"| {r['system']} | {f['node']} " + row for row in floor_rows(f["groups"]) if " | 0 |" not in row]
    return lines


def _steady_lines(results: list[dict]) -> list[str]:
    rows = [r for r in results if r.get("ok")]
    lines = [
        "",
        f"## Steady state: output tok/s while at least {STEADY_SHARE:.0%} of the requests in flight decode",
        "",
        STEADY_HEADER,
    ]
    for r in rows:
        st, whole = r.get("steady_state"), r["summary"]["output_throughput"]
        cells = (
            [f"{st['window_s']:.1f}", f"{st['share_of_run']:.0%}", f"{st['output_throughput']:.0f}"]
            if st
            else ["none", "", ""]
        )
        compiled = f"{r['triton_compilations']} ({r['triton_compiled_at_start']})" if "triton_compilations" in r else ""
        lines.append(
            f"| {r['label']} | {r['system']} | {r.get('concurrency', '')} | "
            + " | ".join(cells)
            + f" | {whole:.0f} | {compiled} |"
        )
    return lines


def _kernel_lines(run: dict) -> list[str]:
    k = run.get("kernels") or {}
    lines = ["", "## Kernels per step (bench.kernels, the GPU path's eager forward and sampling)", ""]
    if not k.get("counted"):
        lines.append(f"Not counted: {k.get('why', 'no count')}.")
    else:
        lines += [
            f"{k['layers']} layers, limit for a decode step {k['limit']}:",
            "",
            "| step | kernels | per layer | outside the layers |",
            "|---|---|---|---|",
        ]
        lines += [f"| {c['kind']} | {c['total']} | {c['per_layer']:.1f} | {c['fixed']} |" for c in k["steps"]]
    return lines


def _graph_lines(results: list[dict]) -> list[str]:
    rows = [(r, g) for r in results for g in r.get("graphs") or ()]
    if not rows:
        return []
    lines = ["", "## Steps replayed as CUDA graphs (node counters over the run)", "", GRAPH_HEADER]
    for r, g in rows:
        shares = [f"{g[f'{k}_share']:.1%}" if g[f"{k}_share"] is not None else "" for k in RUN_KINDS]
        lines.append(
            f"| {r['system']} | {g['node']} | {g['steps']} | {g['eager_steps']} | "
            + " | ".join(shares)
            + f" | {g['captures_in_run']} ({g['captures_at_start']}) |"
        )
    return lines


def _kv_lines(results: list[dict], hw: dict) -> list[str]:
    rows = [r for r in results if r.get("kv_transfer")]
    copy = f"| device copy {hw['prefill_device']} → {hw['decode_device']} | | | {hw['kv_copy_GBps']:.1f} | |"
    lines = ["", "## KV transfer (prefill node counters, pull to ack) beside a device copy", "", KV_HEADER, copy]
    for r in rows:
        k = r["kv_transfer"]
        lines.append(
            f"| pdserve {r['system']} | {k['transfers']} | {k['GB']:.3g} | {k['GBps']:.3g} | {k['share_of_copy']:.1%} |"
        )
    return lines


def markdown(run: dict) -> str:
    c, hw, w, m = run["config"], run["hardware"], run["workload"], run["model_figures"]
    first = (run.get("runs") or [{}])[0].get("concurrency", c["concurrency"])  # the first run's (the large one alone)
    results = run["results"]
    head = [
        f"# pdserve GPU benchmark: {c['name']}",
        "",
        f"Model `{c['model']}` ({c['dtype']}, checkpoint ready in {run['checkpoint_s']:.1f} s) on {hw['device']} "
        f"({hw['gpus']} GPU(s)); `{w.get('name', 'sharegpt_like')}`: {w['requests']} requests, {w['prompt_tokens']} "
        f"prompt and {w['output_tokens']} output tokens, at most {first} in flight; pdserve: --max-num-seqs "
        f"{c.get('max_num_seqs') or first} --max-num-batched-tokens {c['max_num_batched_tokens']} "
        f"--kv-cache-gb {c['kv_cache_gb']}, "
        f"disagg prefill {hw['prefill_device']} / decode {hw['decode_device']}. Device copy {hw['copy_GBps']:.1f} GB/s "
        f"({hw['memory_GBps']:.1f} GB/s read + written), bf16 GEMM peak "
        f"{hw.get('bf16_peak_flops_per_s', 0) / 1e12:.2f} TFLOP/s; weights read per decode step "
        f"{m['weight_bytes_per_step'] / 1e9:.3f} GB, KV {m['kv_bytes_per_token'] / 1024:.0f} KiB per token. "
        "`static` and `hf_cb` run in the benchmark process; pdserve over HTTP through its router.",
        "",
        report.TABLE_HEADER,
        "|" + "---|" * 9,
    ]
    for sh in c.get("shared") or ():
        head[2] += f" pdserve {sh['system']} ran on a stack the caller started ({sh['url']}), with its engine settings."
    for extra in run.get("runs", [])[1:]:
        ew = extra["workload"]
        head[2] += (
            f" Then `{extra['label']}`: {ew['requests']} requests ({ew['prompt_tokens']} prompt, "
            f"{ew['output_tokens']} output tokens), at most {extra['concurrency']} in flight (also "
            f"--max-num-seqs), on {', '.join(extra['systems'])}."
        )
    base = report.baseline_throughput(results)
    lines = head + [report.table_row(r, base) for r in results]
    lines += _steady_lines(results) + _step_lines(results, hw) + _graph_lines(results) + _kernel_lines(run)
    lines += _kv_lines(results, hw)
    lines += report.router_cpu_lines(results)
    lines += ["", f"Total {run.get('total_s', 0):.0f} s of a {c['budget_s']:.0f} s budget."]
    return "\n".join(lines) + "\n"


def write_report(run: dict, cfg: GpuBenchConfig) -> list[Path]:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    paths = [cfg.out_dir / f"{cfg.name}.{ext}" for ext in ("json", "md", "png")]
    paths[0].write_text(json.dumps(run, indent=1, default=str))
    paths[1].write_text(markdown(run))
    plot(run, paths[2])
    return paths


def plot(run: dict, path: Path) -> None:
    """Per system: output tok/s; TPOT p50 and p99; each pdserve node's step groups over their floors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [r["summary"] if r["ok"] else None for r in run["results"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), layout="constrained")
    names = [f"{r['system']}\n{r['label'].removeprefix('sharegpt_like ')}" for r in run["results"]]
    steady = [(r.get("steady_state") or {}).get("output_throughput", 0) for r in run["results"]]
    xs = range(len(names))
    axes[0].bar([x - 0.2 for x in xs], [s["output_throughput"] if s else 0 for s in summaries], 0.4, label="run")
    axes[0].bar([x + 0.2 for x in xs], steady, 0.4, label="steady state")
    axes[0].set_xticks(list(xs), names)
    axes[0].legend(fontsize="small")
    axes[0].set_title("output tokens/s (higher is better)")
    tpot = [(s["tpot_s"] or {}) if s else {} for s in summaries]
    axes[1].bar([x - 0.2 for x in xs], [t.get("p50", 0) * 1e3 for t in tpot], 0.4, label="p50")
    axes[1].bar([x + 0.2 for x in xs], [t.get("p99", 0) * 1e3 for t in tpot], 0.4, label="p99")
    axes[1].set_xticks(list(xs), names)
    axes[1].set_title("TPOT, ms (lower is better)")
    axes[1].legend(fontsize="small")
    bars = [
        (f"{r['system']} {f['node']}\n{g}", v["ratio"])
        for r in run["results"]
        for f in r.get("step_floors") or ()
        for g, v in f["groups"].items()
        if v["steps"]
    ]
    axes[2].barh(range(len(bars)), [b[1] for b in bars])
    axes[2].set_yticks(range(len(bars)), [b[0] for b in bars], fontsize="small")
    axes[2].set_title("mean step / its floor (lower is better)")
    c = run["config"]
    fig.suptitle(f"{c['name']}: {c['model']} ({c['dtype']}) on {run['hardware']['device']}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------------


def workload_summary(w: Workload) -> dict:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in w.requests)
    fixed = w.name.startswith("steady")
    return {
        "name": w.name.split(" ")[0],
        "requests": len(w.requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": w.num_output_tokens,
        "shape": {"prompt": len(w.requests[0].prompt_token_ids), "output": w.requests[0].output_len}
        if fixed
        else SHAREGPT_SHAPE,
    }


def sharegpt(config, cfg: GpuBenchConfig) -> Workload:
    """`sharegpt_like` with cfg's request count, named by its requests and concurrency."""
    from pdserve.runner.model import max_model_len

    w = make_workload(
        "sharegpt_like",
        config.vocab_size,
        max_model_len(config),
        cfg.seed,
        None,
        cfg.requests,
        shape_args=SHAREGPT_SHAPE,
    )
    return dataclasses.replace(w, name=f"sharegpt_like {cfg.requests}/{cfg.concurrency}")


def fixed_workload(config, cfg: GpuBenchConfig) -> Workload:
    """cfg's workload: `steady` (fixed lengths), else `sharegpt_like`; named by its kind, requests and concurrency."""
    preset = WORKLOADS[cfg.workload]
    if preset is None or not preset.prompt_len:
        w = sharegpt(config, cfg)
        return w if preset is None else dataclasses.replace(w, name=f"{cfg.workload} {cfg.requests}/{cfg.concurrency}")
    name = f"{cfg.workload} {cfg.requests}/{cfg.concurrency}"
    return fixed_lengths(name, config.vocab_size, cfg.requests, preset.prompt_len, preset.output_len, cfg.seed)


def plan_runs(cfg: GpuBenchConfig, config) -> list[tuple[GpuBenchConfig, Workload]]:
    """The main run (none with --requests 0), then the larger one on the pdserve systems that both lists name."""
    runs = [(cfg, fixed_workload(config, cfg))] if cfg.requests else []
    large_systems = tuple(s for s in cfg.systems if s in cfg.large_systems)
    if cfg.large_requests and large_systems:
        big = dataclasses.replace(
            cfg, requests=cfg.large_requests, concurrency=cfg.large_concurrency, systems=large_systems
        )
        runs.append((big, sharegpt(config, big)))
    return runs


def kernels_per_step(cfg: GpuBenchConfig, config) -> dict:
    """bench.kernels' counts for the model's layer count on the benchmark device, or why there are none."""
    from bench import kernels

    if not cfg.count_kernels:
        return {"counted": False, "why": "--no-kernel-count"}
    if not kernels.can_count(cfg.device):
        return {"counted": False, "why": "the Triton path runs on a GPU, or on the CPU under TRITON_INTERPRET=1"}
    layers = config.num_hidden_layers
    try:
        counts = kernels.count(layers, device=cfg.device)
    except Exception as e:  # the count is a figure of the report: its failure must not end the run
        return {"counted": False, "why": f"{type(e).__name__}: {e}"}
    return {"counted": True, "layers": layers, "limit": kernels.limit(layers), "steps": [asdict(c) for c in counts]}


def prepare(cfg: GpuBenchConfig) -> tuple[Path, list[tuple[GpuBenchConfig, Workload]], dict]:
    """The checkpoint, the runs (config, workload), and the report's header (config, environment, hardware,
    model figures per run, kernels per step)."""
    import transformers

    from pdserve.checkpoint import resolve_model

    t0 = time.perf_counter()
    path = resolve_model(cfg.model)
    checkpoint_s = time.perf_counter() - t0
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    runs = plan_runs(cfg, config)
    run = {
        "config": {**asdict(cfg), "out_dir": str(cfg.out_dir)},
        "environment": environment(),
        "checkpoint_s": checkpoint_s,
        "workload": workload_summary(runs[0][1]),
        "hardware": hardware(cfg),
        "model_figures": model_figures(config, cfg, runs[0][1]),
        "runs": [
            {
                "label": w.label,
                "concurrency": c.concurrency,
                "systems": list(c.systems),
                "workload": workload_summary(w),
                "model_figures": model_figures(config, c, w),
            }
            for c, w in runs
        ],
        "kernels": kernels_per_step(cfg, config),
        "results": [],
    }
    return path, runs, run


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    # SIGTERM (`timeout`, a closing terminal) unwinds like Ctrl-C: every started stack is stopped by PID
    unwind_once(signal.SIGTERM, exit_code=True)
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"bench.gpu: error: {e}", file=sys.stderr)
        return 2
    deadline = started + cfg.budget_s
    (cfg.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    path, runs, run = prepare(cfg)
    hf = HfModel(path, cfg)
    paths = write_report(run, cfg)
    for (rcfg, w), figures in zip(runs, run["runs"], strict=True):
        ctx = {"model": figures["model_figures"], "hardware": run["hardware"]}
        for system in rcfg.systems:
            run["results"].append(run_system(rcfg, system, w, hf, ctx, deadline))
            run["total_s"] = time.monotonic() - started
            paths = write_report(run, cfg)
    print(markdown(run))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r["ok"] for r in run["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
