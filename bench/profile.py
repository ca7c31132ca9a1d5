"""Where an engine step's time goes: torch.profiler on one step, in-process on an Engine (docs/gpu.md).

    python -m bench.profile --device cuda:0 --model qwen3-0.6b --out profile.json   # 128 and 256 decoding, a 2k chunk
    python -m bench.profile --device cpu --model tiny --out profile.json            # the same on tiny sizes

1. The bf16 GEMM peak (bench.floors.gemm_peak_flops): one large bf16 matmul (8,192^3; on the CPU 512^3), timed
   over a few repeats after a warm-up: 2 N^3 / seconds. The one figure every FLOP/s here is set beside.
2. An engine (pdserve.nodes.parts.build_engine) gets `--batches` requests of short prompts; once all of them
   decode, one step is profiled (CUDA activity on a GPU, CPU activity on the CPU, where each of pdserve's C
   kernels runs in a range of its own name): per kernel, its calls, its time and its share of the step.
   Attention's and the GEMMs' bytes (the KV read; the weights read) over their time give GB/s; the step's host
   CPU time (time.process_time) stands beside.
3. One step that runs a `--chunk`-token prompt chunk: the same table, and the GEMMs' FLOP/s (2 x the layers'
   weights x tokens, and 2 x the LM head's weights x rows sampled) beside the peak.
4. Every step the engine ran meanwhile is recorded (requests, tokens, decode tokens, rows sampled, context,
   seconds), and
   bench.floors' `step_floors` sets them beside their floors: decode-only steps, grouped by batch size (1-8,
   9-32, 33-128, 129-256), beside the memory floor (weights + KV read at the device copy's read+write
   bandwidth); steps with prompt chunks beside the compute floor (their FLOPs at the bf16 peak of 1.).
Writes `<out>` (JSON) and `<out minus .json>.md`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import record_function

from bench.floors import StepWeights, floor_rows, gemm_peak_flops, step_floors, sync
from bench.gpu import copy_gbps

GEMM_NAMES = ("gemm", "matmul", "addmm", "aten::mm", "linear", "cutlass", "nvjet", "sm90_xmma")
ATTENTION_NAMES = ("attention", "attn", "flash", "paged", "_combine_kernel")  # (split-K attention's combine)
TOP_KERNELS = 25
DECODE_TOKENS = 256  # each decoding request's max_tokens: more than the steps until the last one decodes


def build(model: str, device: str, dtype: str, max_seqs: int, chunk: int):
    from pdserve.config import EngineConfig
    from pdserve.nodes.parts import build_engine

    kv_gb = 16.0 if device.startswith("cuda") else 0.25
    cfg = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(chunk, max_seqs) + max_seqs,
        kv_cache_gb=kv_gb,
    )
    return build_engine(cfg)


class NamedKernels:
    """pdserve's C kernels (`pdserve.runner.kernels.CpuKernels`) with each call inside a profiler range named after
    it, `pdserve::<kernel>`: they are ctypes calls, which torch.profiler does not see, so without the ranges a CPU
    step's table holds no decode attention, RMSNorm, SiLU or RoPE (only the engine that bench.profile builds)."""

    def __init__(self, ops) -> None:
        self._ops = ops

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        if name.startswith("_") or not callable(fn):
            return fn

        def call(*args, **kwargs):
            with record_function(f"pdserve::{name}"):
                return fn(*args, **kwargs)

        return call


def name_cpu_kernels(engine) -> None:
    """On the CPU, wrap the C kernels of the engine's backend (if it runs them) in NamedKernels."""
    from pdserve.runner.kernels import CpuKernels

    backend = engine.runner.backend
    if isinstance(getattr(backend, "k", None), CpuKernels):
        backend.k = NamedKernels(backend.k)


def add(engine, tag: str, n: int, prompt_len: int, max_tokens: int, start: int = 0) -> None:
    """n requests of prompt_len tokens: ids 3 and up, cycling below 1,003 and the model's vocabulary."""
    from pdserve.engine.request import Request
    from pdserve.wire.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    cycle = min(1000, engine.runner.model.config.vocab_size - 3)
    for i in range(n):
        engine.add(Request(f"{tag}{i}", [(start + 7 * i + j) % cycle + 3 for j in range(prompt_len)], params))


def timed_step(engine, records: list[dict]) -> dict:
    """One engine step (launch, then finish), recorded: requests, tokens, decode tokens, rows sampled, context,
    seconds."""
    device = str(engine.runner.device)
    sync(device)
    t, cpu = time.perf_counter(), time.process_time()
    step = engine.launch()
    engine.finish(step)
    sync(device)
    r = {"seconds": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}
    batch = step.batch if step is not None else None
    if batch is not None:
        r |= {
            "requests": len(batch.scheduled),
            "tokens": batch.num_tokens,
            "decode_tokens": batch.num_decode_tokens,
            "samples": batch.num_samples,
            "context": batch.num_context_tokens,
        }
        records.append(r)
    return r


def steps_until(engine, records: list[dict], done) -> None:
    while engine.has_work() and not done():
        timed_step(engine, records)


# ---- the profile -----------------------------------------------------------------------------------


def profile_step(engine, records: list[dict]) -> tuple[dict, list]:
    """(the step's record, its profiler's key averages)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if str(engine.runner.device).startswith("cuda"):
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        r = timed_step(engine, records)
    return r, prof.key_averages()


def kernel_rows(events, on_gpu: bool, step_s: float) -> list[dict]:
    """Per kernel (on a GPU: device kernels; on the CPU: operators, self time): calls, seconds, share of the step. On
    a GPU an operator's device time is its kernels' (each a device event of its own) and a range's on the device
    timeline is an annotation: only the kernels count, each once."""
    rows = []
    for e in events:
        if on_gpu and (e.device_type == DeviceType.CPU or e.is_user_annotation):
            continue
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us <= 0:
            continue
        rows.append({"kernel": e.key, "calls": e.count, "seconds": us / 1e6, "share": us / 1e6 / step_s})
    return sorted(rows, key=lambda r: -r["seconds"])


def kind(name: str) -> str | None:
    low = name.lower()
    if any(k in low for k in ATTENTION_NAMES):
        return "attention"
    if any(k in low for k in GEMM_NAMES):
        return "gemm"
    return None


def model_bytes(engine) -> tuple[StepWeights, int]:
    """(the weights of a step's GEMMs, bytes of KV per token of context). The layers' weights are every tensor the
    runner and its model hold but the embedding table and the LM head: the runner holds the layers' projections and
    an untied LM head itself (`ModelRunner.weights`, `lm_head`), so the model's parameters alone miss them."""
    runner = engine.runner
    linears = [lin for w in runner.weights for lin in (w.qkv, w.o, w.gate_up, w.down)]
    tensors = [*runner.model.parameters(), *(t for lin in linears for t in (lin.weight, lin.bias) if t is not None)]
    held = {_storage(t): t for t in tensors}  # each tensor once
    for t in (runner.embed.weight, runner.lm_head.weight, runner.model.lm_head.weight):  # (the model's: maybe None)
        if t is not None:
            held.pop(_storage(t), None)
    body = sum(t.numel() for t in held.values())
    head = runner.lm_head.weight
    nbytes = sum(t.numel() * t.element_size() for t in held.values()) + head.numel() * head.element_size()
    return StepWeights(nbytes, body, head.numel()), engine.pool.layout.bytes_per_token()


def _storage(t) -> tuple:
    """What tells tensors on one memory apart: its address (a weight oneDNN reordered on the CPU has none: itself)."""
    return ("onednn", id(t)) if t.is_mkldnn else (t.data_ptr(), t.numel())


def figures(rows: list[dict], record: dict, weights: StepWeights, kv_per_token: int, peak: float) -> dict:
    """Attention's and the GEMMs' time, bytes and GB/s (the KV read; the weights read), FLOP/s beside the peak."""
    out = {}
    for k, nbytes in (("attention", record.get("context", 0) * kv_per_token), ("gemm", weights.nbytes)):
        secs = sum(r["seconds"] for r in rows if kind(r["kernel"]) == k)
        out[k] = {"seconds": secs, "bytes": nbytes, "GBps": nbytes / secs / 1e9 if secs else None}
    gemm_s = out["gemm"]["seconds"]
    flops = weights.flops(record.get("tokens", 0), record.get("samples", 0))
    out["gemm"] |= {"flops": flops, "flops_per_s": flops / gemm_s if gemm_s else None, "peak_flops_per_s": peak}
    out["gemm"]["share_of_peak"] = out["gemm"]["flops_per_s"] / peak if gemm_s else None
    return out


def run(a: argparse.Namespace) -> dict:
    on_gpu = a.device.startswith("cuda")
    peak = gemm_peak_flops(a.device)
    engine = build(a.model, a.device, a.dtype, max(a.batches), a.chunk)
    name_cpu_kernels(engine)
    weights, kv_per_token = model_bytes(engine)
    records: list[dict] = []
    result = {"device": a.device, "model": a.model, "dtype": a.dtype, "bf16_peak_flops_per_s": peak, "steps": {}}
    for n in a.batches:  # a steady decode step at n running requests
        add(engine, f"d{n}-", n, a.prompt, DECODE_TOKENS)
        steps_until(engine, records, lambda n=n: bool(records) and records[-1]["decode_tokens"] == n)
        record, events = profile_step(engine, records)
        result["steps"][f"decode-{n}"] = one(events, record, on_gpu, weights, kv_per_token, peak)
        drop(engine)
    add(engine, "chunk-", 1, a.chunk, 1, start=500)  # a step with a `chunk`-token prompt chunk (nothing cached)
    record, events = profile_step(engine, records)
    result["steps"][f"chunk-{a.chunk}"] = one(events, record, on_gpu, weights, kv_per_token, peak)
    steps_until(engine, records, lambda: False)
    copy = copy_gbps(a.device, a.device)
    result |= {"copy_GBps": copy, "weights": weights._asdict(), "kv_bytes_per_token": kv_per_token}
    result["step_floors"] = step_floors(records, weights, kv_per_token, copy, peak)
    result["step_records"] = records
    return result


def drop(engine) -> None:
    """Abort every request the engine holds (the decoding batch just profiled)."""
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(req.request_id)


def one(events, record: dict, on_gpu: bool, weights: StepWeights, kv_per_token: int, peak: float) -> dict:
    rows = kernel_rows(events, on_gpu, record["seconds"])
    return {"record": record, "kernels": rows[:TOP_KERNELS], **figures(rows, record, weights, kv_per_token, peak)}


# ---- the report ------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    peak = result["bf16_peak_flops_per_s"]
    lines = [f"# Where a step's time goes: {result['model']} on {result['device']} ({result['dtype']})", ""]
    lines += [f"bf16 GEMM peak (one large matmul): {peak / 1e12:.2f} TFLOP/s", ""]
    for name, s in result["steps"].items():
        r = s["record"]
        lines += [
            f"## {name}: {r.get('requests', 0)} requests, {r.get('tokens', 0)} tokens, context {r.get('context', 0)}",
            "",
            f"step {r['seconds'] * 1e3:.2f} ms, host CPU {r['cpu_s'] * 1e3:.2f} ms; attention "
            f"{gbps(s['attention'])}; GEMMs {gbps(s['gemm'])}, {tflops(s['gemm'])}",
            "",
            "| kernel | calls | ms | share of the step |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| `{k['kernel'][:80]}` | {k['calls']} | {k['seconds'] * 1e3:.3f} | {k['share']:.1%} |"
            for k in s["kernels"]
        ]
        lines.append("")
    lines += floor_lines(result)
    return "\n".join(lines)


def floor_lines(result: dict) -> list[str]:
    """Each group of steps beside its floor: decode-only ones the memory floor, prompt chunks the compute floor."""
    lines = [
        f"## Steps beside their floor (device copy {result['copy_GBps']:.0f} GB/s, bf16 peak "
        f"{result['bf16_peak_flops_per_s'] / 1e12:.2f} TFLOP/s)",
        "",
        "| steps | floor | count | mean ms | floor ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    return lines + floor_rows(result["step_floors"])


def gbps(f: dict) -> str:
    return f"{f['seconds'] * 1e3:.2f} ms, {f['bytes'] / 1e6:.1f} MB, " + (
        f"{f['GBps']:.1f} GB/s" if f["GBps"] else "no kernel matched"
    )


def tflops(f: dict) -> str:
    return f"{f['flops_per_s'] / 1e12:.2f} TFLOP/s ({f['share_of_peak']:.0%} of peak)" if f["flops_per_s"] else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batches; default 128 256 (CPU: 4 8)")
    p.add_argument("--prompt", type=int, default=None, help="decoding requests' prompt length (default 512; CPU 16)")
    p.add_argument("--chunk", type=int, default=None, help="the prompt chunk's tokens (default 2048; CPU 64)")
    p.add_argument("--out", type=Path, default=Path("profile.json"))
    a = p.parse_args(argv)
    on_gpu = a.device.startswith("cuda")
    a.dtype = a.dtype or ("bfloat16" if on_gpu else "float32")
    a.batches = a.batches or ([128, 256] if on_gpu else [4, 8])
    a.prompt = a.prompt or (512 if on_gpu else 16)
    a.chunk = a.chunk or (2048 if on_gpu else 64)
    result = run(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    a.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    missing = unmatched(result) if on_gpu else []
    for name, k in missing:
        print(f"bench.profile: no {k} kernel recorded in step {name} (is CUPTI missing?)")
    return 1 if missing else 0


def unmatched(result: dict) -> list[tuple[str, str]]:
    """(step, kind) of each profiled step where no attention or no GEMM kernel was recorded: on a GPU every step has
    both, so an empty one is a profile that failed (no device activity recorded), not a measurement."""
    return [(n, k) for n, s in result["steps"].items() for k in ("attention", "gemm") if not s[k]["seconds"]]


if __name__ == "__main__":
    raise SystemExit(main())
