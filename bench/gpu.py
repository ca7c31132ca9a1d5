"""The GPU benchmark: one command, a few minutes on one GPU host (docs/gpu.md).

    python -m bench.gpu                    # qwen3-0.6b in bf16, 256 ShareGPT-like requests, 128 concurrent
    python -m bench.gpu --device cpu --model tiny --requests 16 --concurrency 8   # a CPU smoke test

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
   - the decode step (decode node, or the colocated node, whose steps also carry prompt chunks):
     mean step time (step_time_s / steps) beside its memory floor: the weights read per step (every
     parameter except the embedding table, plus the LM head) and the mean KV read per step (every
     decode token's context over the run, over the steps), over the memory bandwidth of the device
     copy (bytes read + written per second);
   - KV transfer bandwidth (the prefill node's bytes over its transfer time, pull to ack) beside a
     device-to-device copy between the same devices (bytes copied per second);
   - the router's CPU time per streamed token.
5. Writes <out>/gpu.json, gpu.md and gpu.png (and the stacks' logs under <out>/logs/), where <out> is
   `--out-dir`, else $OUT when set, else bench/runs/gpu (git-ignored). The report is rewritten after each system,
   so a run cut short still leaves what it measured.

`--budget-s` bounds the whole command: a system is skipped when too little time is left to start it,
and requests still unfinished when the time is up are reported as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench import report, systems
from bench.baselines import kv_bytes_per_token, load_hf_model
from bench.metrics import SLO
from bench.run_bench import environment, run_workload, warm_up
from bench.workloads import Workload, make_workload

SYSTEMS = ("colocated", "disagg", "hf_cb", "static")
SHAREGPT_SHAPE = {"prompt_median": 176.0, "output_median": 63.0}  # 256 requests: 60,145 + 20,782 tokens
MIN_SYSTEM_S = 45.0  # a system is not started with less time left than this
FINISH_MARGIN_S = 15.0  # kept back from each run's time limit, to stop the system and write the report
COPY_BYTES = 256 * 2**20
COPY_REPEATS = 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STEP_HEADER = (
    "| system | node | steps | mean batch | mean step (ms) | weights + KV / step (GB) | floor (ms) | step/floor |"
)
KV_HEADER = "| path | transfers | GB | GB/s | vs copy |\n|---|---|---|---|---|"


@dataclass(frozen=True)
class GpuBenchConfig:
    model: str = "qwen3-0.6b"
    device: str = "cuda:0"
    dtype: str = "bfloat16"
    requests: int = 256
    concurrency: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_gb: float = 16.0
    systems: tuple[str, ...] = SYSTEMS
    budget_s: float = 420.0
    seed: int = 0
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.05
    hf_cuda_graphs: bool = False
    engine_args: tuple[str, ...] = ()  # passed on to `pdserve up` as they are
    out_dir: Path = field(default=Path(__file__).parent / "runs" / "gpu")
    name: str = "gpu"
    progress: bool = True

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device must be cpu or cuda:N, not {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: this machine has no CUDA device; try --device cpu")
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
        if min(self.requests, self.concurrency, self.max_num_batched_tokens) < 1:
            raise ValueError("--requests, --concurrency and --max-num-batched-tokens must be at least 1")
        if self.kv_cache_gb <= 0 or self.budget_s <= 0:
            raise ValueError("--kv-cache-gb and --budget-s must be positive")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, not {self.dtype!r}")

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_s, self.slo_tpot_s)

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
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a smoke test")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=128, help="requests in flight; also --max-num-seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gb", type=float, default=None, help="per node; default: 16 on CUDA, 0.25 on the CPU")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole command's time limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-s", type=float, default=1.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.05)
    p.add_argument("--hf-cuda-graphs", action="store_true", help="let HF continuous batching use CUDA graphs")
    p.add_argument("--engine-arg", action="append", default=[], help="e.g. --engine-arg=--enforce-eager")
    p.add_argument("--out-dir", type=Path, default=None, help="default: $OUT when set, else bench/runs/gpu")
    p.add_argument("--name", default="gpu", help="stem of the result files")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> GpuBenchConfig:
    a = build_parser().parse_args(argv)
    on_gpu = a.device.startswith("cuda")
    out_dir = a.out_dir or (Path(os.environ["OUT"]) if os.environ.get("OUT") else GpuBenchConfig.out_dir)
    return GpuBenchConfig(
        model=a.model, device=a.device, dtype=a.dtype or ("bfloat16" if on_gpu else "float32"),
        requests=a.requests, concurrency=a.concurrency, max_num_batched_tokens=a.max_num_batched_tokens,
        kv_cache_gb=a.kv_cache_gb or (16.0 if on_gpu else 0.25), systems=tuple(a.systems), budget_s=a.budget_s,
        seed=a.seed, slo_ttft_s=a.slo_ttft_s, slo_tpot_s=a.slo_tpot_s, hf_cuda_graphs=a.hf_cuda_graphs,
        engine_args=tuple(a.engine_arg), out_dir=out_dir, name=a.name, progress=not a.no_progress,
    )  # fmt: skip


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
        "memory_GBps": 2 * same,  # bytes read + written per second: the bandwidth of the floor
    }
    cross = copy_gbps(cfg.device, cfg.decode_device) if cfg.decode_device != cfg.device else same
    hw["kv_copy_GBps"] = cross  # the copy a KV transfer from prefill to decode device competes with
    return hw


def weight_bytes_per_step(config, itemsize: int) -> int:
    """Bytes of weights one decode step reads: every parameter but the embedding table, plus the LM head."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    numel = sum(p.numel() for p in model.parameters()) - embed.numel()  # a tied head is counted once, as embed
    if head is embed:
        numel += head.numel()
    return numel * itemsize


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
    return {
        "weight_bytes_per_step": weight_bytes_per_step(config, itemsize),
        "kv_bytes_per_token": per_token,
        "decode_kv_bytes": decode_context_tokens(workload) * per_token,
        "decode_tokens": sum(r.output_len - 1 for r in workload.requests),
    }


# ---- node counters ---------------------------------------------------------------------------------


def decode_step(counts: dict, role: str, figures: dict, hw: dict) -> dict | None:
    """The node's mean step beside its memory floor (weights + mean KV per step over memory bandwidth)."""
    c = counts.get(role, {})
    steps = c.get("steps", 0)
    if not steps:
        return None
    kv_per_step = figures["decode_kv_bytes"] / steps
    floor_s = (figures["weight_bytes_per_step"] + kv_per_step) / (hw["memory_GBps"] * 1e9)
    mean_s = c["step_time_s"] / steps
    return {
        "node": role,
        "steps": int(steps),
        "mean_batch": c.get("tokens_out", 0) / steps,
        "mean_step_ms": mean_s * 1e3,
        "weights_GB_per_step": figures["weight_bytes_per_step"] / 1e9,
        "kv_GB_per_step": kv_per_step / 1e9,
        "floor_ms": floor_s * 1e3,
        "step_over_floor": mean_s / floor_s,
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


def stack_options(cfg: GpuBenchConfig, mode: str, deadline: float) -> systems.StackOptions:
    devices = ["--device", cfg.device]  # for every role; disagg names both roles' devices too
    if mode == "disagg":
        devices += ["--prefill-device", cfg.device, "--decode-device", cfg.decode_device]
    return systems.StackOptions(
        model=cfg.model, max_num_seqs=cfg.concurrency, max_num_batched_tokens=cfg.max_num_batched_tokens,
        kv_cache_gb=cfg.kv_cache_gb, kv_transport="cuda_ipc" if cfg.on_gpu else "shm",
        log_prefix=cfg.out_dir / "logs" / cfg.name, extra_args=("--dtype", cfg.dtype, *devices, *cfg.engine_args),
        max_concurrency=cfg.concurrency, deadline=deadline,
    )  # fmt: skip


class HfModel:
    """The HF model of the in-process baselines, loaded once, on first use."""

    def __init__(self, path: Path, cfg: GpuBenchConfig) -> None:
        self.path, self.cfg = path, cfg
        self._model = None

    def get(self):
        if self._model is None:
            self._model = load_hf_model(self.path, getattr(torch, self.cfg.dtype), self.cfg.device)
        return self._model


def open_system(cfg: GpuBenchConfig, system: str, hf: HfModel, deadline: float):
    """`system` as a context manager; its runs end by `deadline` (time.monotonic())."""
    if system in ("colocated", "disagg"):
        return systems.pdserve_stack(stack_options(cfg, system, deadline), system, cfg.progress)
    if system == "static":
        return systems.static_batching(hf.get(), cfg.concurrency, cfg.progress, deadline)
    opts = systems.CbOptions(cfg.concurrency, cfg.max_num_batched_tokens, cfg.kv_cache_gb, cfg.concurrency,
                             deadline, cfg.hf_cuda_graphs)  # fmt: skip
    return systems.hf_continuous_batching(hf.get(), opts, cfg.progress)


def _not_run(system: str, w: Workload, why: str) -> dict:
    return {"system": system, "workload": w.name, "label": w.label, "rate": None, "ok": False, "error": why}


def run_system(cfg: GpuBenchConfig, system: str, w: Workload, hf: HfModel, ctx: dict, deadline: float) -> dict:
    left = deadline - time.monotonic()
    if left < MIN_SYSTEM_S:
        return _not_run(system, w, f"skipped: {left:.0f} s of the --budget-s left")
    started = time.monotonic()
    try:
        with open_system(cfg, system, hf, deadline - FINISH_MARGIN_S) as run:
            warm_up(run, system)
            before = systems.settled_counters(run) if isinstance(run, systems.StackRunner) else {}
            result = run_workload(cfg.slo, system, run, w)
            if isinstance(run, systems.StackRunner):
                add_node_figures(result, systems.counters_diff(systems.settled_counters(run), before), system, ctx)
    except Exception as e:  # a system that fails is reported; the others still run
        print(f"bench.gpu: {system} failed: {type(e).__name__}: {e}", file=sys.stderr)
        result = _not_run(system, w, f"{type(e).__name__}: {e}")
    result["seconds"] = time.monotonic() - started
    result.pop("tokens", None)
    return result


def add_node_figures(result: dict, counts: dict, system: str, ctx: dict) -> None:
    result["node_counters"] = counts
    result["decode_step"] = decode_step(counts, "colocated" if system == "colocated" else "decode", ctx["model"],
                                        ctx["hardware"])  # fmt: skip
    result["kv_transfer"] = kv_transfer(counts, ctx["hardware"]) if system == "disagg" else None


# ---- report ----------------------------------------------------------------------------------------


def _step_lines(results: list[dict]) -> list[str]:
    rows = [r for r in results if r.get("decode_step")]
    if not rows:
        return []
    lines = ["", "## Decode step beside its memory floor (node counters over the run)", "", STEP_HEADER]
    lines.append("|---" * 8 + "|")
    for r in rows:
        d = r["decode_step"]
        cells = [r["system"], d["node"], str(d["steps"]), f"{d['mean_batch']:.1f}", f"{d['mean_step_ms']:.2f}",
                 f"{d['weights_GB_per_step']:.3g} + {d['kv_GB_per_step']:.3g}", f"{d['floor_ms']:.3g}",
                 f"{d['step_over_floor']:.1f}×"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _kv_lines(results: list[dict], hw: dict) -> list[str]:
    rows = [r for r in results if r.get("kv_transfer")]
    copy = f"| device copy {hw['prefill_device']} → {hw['decode_device']} | | | {hw['kv_copy_GBps']:.1f} | |"
    lines = ["", "## KV transfer (prefill node counters, pull to ack) beside a device copy", "", KV_HEADER, copy]
    for r in rows:
        k = r["kv_transfer"]
        lines.append(f"| pdserve {r['system']} | {k['transfers']} | {k['GB']:.3g} | {k['GBps']:.3g} | "
                     f"{k['share_of_copy']:.1%} |")  # fmt: skip
    return lines


def markdown(run: dict) -> str:
    c, hw, w, m = run["config"], run["hardware"], run["workload"], run["model_figures"]
    results = run["results"]
    head = [
        f"# pdserve GPU benchmark: {c['name']}",
        "",
        f"Model `{c['model']}` ({c['dtype']}, checkpoint ready in {run['checkpoint_s']:.1f} s) on {hw['device']} "
        f"({hw['gpus']} GPU(s)); `sharegpt_like`: {w['requests']} requests, {w['prompt_tokens']} prompt and "
        f"{w['output_tokens']} output tokens, at most {c['concurrency']} in flight; pdserve: --max-num-seqs "
        f"{c['concurrency']} --max-num-batched-tokens {c['max_num_batched_tokens']} --kv-cache-gb {c['kv_cache_gb']}, "
        f"disagg prefill {hw['prefill_device']} / decode {hw['decode_device']}. Device copy {hw['copy_GBps']:.1f} GB/s "
        f"({hw['memory_GBps']:.1f} GB/s read + written); weights read per decode step "
        f"{m['weight_bytes_per_step'] / 1e9:.3f} GB, KV {m['kv_bytes_per_token'] / 1024:.0f} KiB per token. "
        "`static` and `hf_cb` run in the benchmark process; pdserve over HTTP through its router.",
        "",
        report.TABLE_HEADER,
        "|" + "---|" * 9,
    ]
    base = report.baseline_throughput(results)
    lines = head + [report.table_row(r, base) for r in results]
    lines += _step_lines(results) + _kv_lines(results, hw) + report.router_cpu_lines(results)
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
    """Per system: output tok/s; TPOT p50 and p99; pdserve's mean decode step beside its floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in run["results"]]
    summaries = [r["summary"] if r["ok"] else None for r in run["results"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), layout="constrained")
    axes[0].bar(names, [s["output_throughput"] if s else 0 for s in summaries])
    axes[0].set_title("output tokens/s (higher is better)")
    tpot = [(s["tpot_s"] or {}) if s else {} for s in summaries]
    xs = range(len(names))
    axes[1].bar([x - 0.2 for x in xs], [t.get("p50", 0) * 1e3 for t in tpot], 0.4, label="p50")
    axes[1].bar([x + 0.2 for x in xs], [t.get("p99", 0) * 1e3 for t in tpot], 0.4, label="p99")
    axes[1].set_xticks(list(xs), names)
    axes[1].set_title("TPOT, ms (lower is better)")
    axes[1].legend(fontsize="small")
    steps = [r for r in run["results"] if r.get("decode_step")]
    ys = range(len(steps))
    axes[2].bar([y - 0.2 for y in ys], [r["decode_step"]["mean_step_ms"] for r in steps], 0.4, label="mean step")
    axes[2].bar([y + 0.2 for y in ys], [r["decode_step"]["floor_ms"] for r in steps], 0.4, label="memory floor")
    axes[2].set_xticks(list(ys), [f"{r['system']} ({r['decode_step']['node']})" for r in steps])
    axes[2].set_title("decode step, ms")
    axes[2].legend(fontsize="small")
    c = run["config"]
    fig.suptitle(f"{c['name']}: {c['model']} ({c['dtype']}) on {run['hardware']['device']}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------------


def workload_summary(w: Workload) -> dict:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in w.requests)
    return {"requests": len(w.requests), "prompt_tokens": prompt_tokens, "output_tokens": w.num_output_tokens,
            "shape": SHAREGPT_SHAPE}  # fmt: skip


def prepare(cfg: GpuBenchConfig) -> tuple[Path, Workload, dict]:
    """The checkpoint, the workload, and the run's header (config, environment, hardware, model figures)."""
    import transformers

    from pdserve.engine.checkpoint import resolve_model
    from pdserve.engine.model import max_model_len

    t0 = time.perf_counter()
    path = resolve_model(cfg.model)
    checkpoint_s = time.perf_counter() - t0
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    w = make_workload("sharegpt_like", config.vocab_size, max_model_len(config), cfg.seed, None, cfg.requests,
                      shape_args=SHAREGPT_SHAPE)  # fmt: skip
    run = {
        "config": {**asdict(cfg), "out_dir": str(cfg.out_dir)},
        "environment": environment(),
        "checkpoint_s": checkpoint_s,
        "workload": workload_summary(w),
        "hardware": hardware(cfg),
        "model_figures": model_figures(config, cfg, w),
        "results": [],
    }
    return path, w, run


def exit_on_sigterm() -> None:
    """SIGTERM (`timeout`, a closing terminal) unwinds like Ctrl-C: every started stack is stopped by PID."""

    def handler(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    exit_on_sigterm()
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"bench.gpu: error: {e}", file=sys.stderr)
        return 2
    deadline = started + cfg.budget_s
    (cfg.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    path, w, run = prepare(cfg)
    hf = HfModel(path, cfg)
    ctx = {"model": run["model_figures"], "hardware": run["hardware"]}
    paths = write_report(run, cfg)
    for system in cfg.systems:
        run["results"].append(run_system(cfg, system, w, hf, ctx, deadline))
        run["total_s"] = time.monotonic() - started
        paths = write_report(run, cfg)
    print(markdown(run))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r["ok"] for r in run["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
