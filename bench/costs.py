"""Per-step costs of the real engine, measured in this process and fitted to the simulator's cost model.

    python -m bench.costs --model small --core 0 --out bench/results/costs-small.json

The engine runs as a node runs it: pinned to one core, one torch thread, float32. Two fits, least squares:

- prefill step (a prefill-only engine, one request's chunk per step, past context 0..1280):
  `t = a + b * tokens + c * tokens * (past + tokens / 2)` (the last term: attention over the chunk's context).
- decode step (batch of B decoding requests, total context C = sum of their lengths):
  `t = a + b * B + c * C`.

Plus the KV bytes per token (the pool's layout) and the KV link's bandwidth and fixed latency (given, read from a
bench/kv_bandwidth.py JSON, or fitted to the hand-off's time against its tokens measured here: a copy of that many
tokens' KV bytes on the device). The fitted costs and every raw sample go to the JSON.

On a GPU (`--device cuda`, as the GPU kit runs it) the same code measures the same three curves with larger shapes
(`--sizes gpu`) in bfloat16; `--sizes tiny` runs that path in seconds on the CPU (tests/bench/test_costs.py):

    python -m bench.costs --device cuda --model MODEL --out bench/results/costs-h200.json

Co-running (`--corun-core N`): the cores of one host are not independent. A step slows down while a node pinned
to another core also computes (shared caches, memory bandwidth, or SMT siblings under a virtual machine's
vCPUs). A neighbour process pinned to core N runs the other role's steps without pause (prefill chunks of 512
tokens beside the decode steps measured, decode steps of 16 beside the prefill steps), and each role's slowdown is
its step time with the neighbour over its step time alone (alone measured before and after, and averaged).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.plan.costs import Costs, fit, fit_link

__all__ = ["Costs", "fit", "measure_decode", "measure_handoff", "measure_prefill"]

RESULTS_DIR = Path(__file__).parent / "results"
PREFILL_SHAPES = (
    (16, 0),
    (64, 0),
    (128, 0),
    (256, 0),
    (512, 0),
    (512, 512),
    (512, 1024),
    (512, 1280),
    (128, 1024),
    (256, 512),
)  # (chunk tokens, past tokens)
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_CONTEXTS = (64, 256, 768)
QUICK_PREFILL_SHAPES = ((16, 0), (128, 0), (512, 0), (512, 512), (256, 1024))  # --quick: costs right before a run
QUICK_DECODE_BATCHES = (1, 4, 16)
QUICK_DECODE_CONTEXTS = (64, 512)
# --device cuda: a GPU's steps are flat until the batch fills the device, so larger shapes
GPU_PREFILL_SHAPES = ((128, 0), (512, 0), (1024, 0), (2048, 0), (512, 1024), (1024, 1024), (256, 1536))
GPU_DECODE_BATCHES = (1, 8, 32, 64, 128)
GPU_DECODE_CONTEXTS = (256, 1024, 1792)
HANDOFF_TOKENS = (16, 128, 512, 1024, 2048)  # a hand-off's tokens: its time against them fits the link
# --sizes tiny: the same code path in seconds on the CPU (a test)
TINY_PREFILL_SHAPES = ((8, 0), (16, 0), (32, 0), (16, 16))
TINY_DECODE_BATCHES = (1, 2)
TINY_DECODE_CONTEXTS = (16, 32)
TINY_HANDOFF_TOKENS = (16, 64, 256)
SIZES = {  # --sizes: (prefill shapes, repeats, decode batches, decode contexts, hand-off tokens)
    "full": (PREFILL_SHAPES, 3, DECODE_BATCHES, DECODE_CONTEXTS, HANDOFF_TOKENS),
    "quick": (QUICK_PREFILL_SHAPES, 2, QUICK_DECODE_BATCHES, QUICK_DECODE_CONTEXTS, HANDOFF_TOKENS),
    "gpu": (GPU_PREFILL_SHAPES, 3, GPU_DECODE_BATCHES, GPU_DECODE_CONTEXTS, HANDOFF_TOKENS),
    "tiny": (TINY_PREFILL_SHAPES, 1, TINY_DECODE_BATCHES, TINY_DECODE_CONTEXTS, TINY_HANDOFF_TOKENS),
}
DECODE_STEPS = 12  # the median of these is the sample: steps on a shared machine have outliers
CORUN_DECODE = (8, 256)  # (batch, prompt tokens) of the decode steps timed alone and beside a neighbour
CORUN_PREFILL = 256  # prompt tokens of the prefill steps timed alone and beside a neighbour
CORUN_REPEATS = 15


# ---- measuring -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What the steps run on: a model on a device (a node's: one CPU core in float32, or a GPU)."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 16
    kv_cache_gb: float = 0.25

    def sync(self) -> None:
        """Wait for the device (a GPU step may return before its kernels end)."""
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)


def _target(model: str | Target) -> Target:
    return model if isinstance(model, Target) else Target(model)


def _engine(model: str | Target, prefill_only: bool, max_tokens_budget: int):
    from pdserve.config import EngineConfig
    from pdserve.nodes.parts import build_engine

    t = _target(model)
    cfg = EngineConfig(
        model=t.model,
        dtype=t.dtype,
        device=t.device,
        max_num_seqs=t.max_num_seqs,
        max_num_batched_tokens=max_tokens_budget,
        kv_cache_gb=t.kv_cache_gb,
        prefix_caching=False,  # the timed prompts repeat: each step must compute every token it is timed for
    )
    return build_engine(cfg, prefill_only=prefill_only)


def _request(rid: str, prompt_len: int, max_tokens: int):
    from pdserve.engine.request import Request
    from pdserve.wire.params import SamplingParams

    ids = [(7 * i + 3) % 4000 + 10 for i in range(prompt_len)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _timed_step(engine, target: Target | None = None) -> float:
    t0 = time.perf_counter()
    engine.step()
    if target:
        target.sync()
    return time.perf_counter() - t0


def _tokens_run(engine) -> int:
    """Tokens the engine's steps have computed since it started (eager and graphed)."""
    return engine.run_counts["eager_tokens"] + engine.run_counts["graph_tokens"]


def measure_prefill(model: str | Target, repeats: int = 3, shapes: tuple = PREFILL_SHAPES) -> list[dict]:
    """(tokens, past, seconds) of single-chunk prefill steps: past tokens are computed first, untimed."""
    from pdserve.engine.request import Status

    budget = max(2048, *(max(n, past) for n, past in shapes))
    samples, engine, target = [], _engine(model, prefill_only=True, max_tokens_budget=budget), _target(model)
    for chunk, past in shapes:
        times = []
        for r in range(repeats + 1):  # the first is a warm-up
            req = _request(f"p{chunk}-{past}-{r}", past + chunk, 2)
            engine.add(req)
            if past:
                engine.scheduler.max_num_batched_tokens = past
                engine.step()  # the past: one chunk of `past` tokens
            engine.scheduler.max_num_batched_tokens = chunk
            computed = _tokens_run(engine)
            times.append(_timed_step(engine, target))
            if _tokens_run(engine) - computed != chunk:
                raise RuntimeError(f"a timed prefill step ran {_tokens_run(engine) - computed} of its {chunk} tokens")
            if not req.is_finished:
                engine.release(req, Status.ABORTED)
        samples.append({"tokens": chunk, "past": past, "s": float(np.median(times[1:]))})
    return samples


def measure_decode(
    model: str | Target, batches: tuple = DECODE_BATCHES, contexts: tuple = DECODE_CONTEXTS
) -> list[dict]:
    """(batch, mean total context, median seconds) of decode steps after the batch's prompts are in."""
    samples, target = [], _target(model)
    engine = _engine(model, prefill_only=False, max_tokens_budget=2048)
    for ctx in contexts:
        for batch in batches:
            reqs = [_request(f"d{ctx}-{batch}-{i}", ctx, DECODE_STEPS + 4) for i in range(batch)]
            for req in reqs:
                engine.add(req)
            while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in reqs):
                engine.step()  # prompts (and the first decode step, untimed as a warm-up)
            contexts, times = [], []
            for _ in range(DECODE_STEPS):
                contexts.append(sum(r.num_tokens for r in reqs))
                times.append(_timed_step(engine, target))
            samples.append({"batch": batch, "context": float(np.mean(contexts)), "s": float(np.median(times))})
            while engine.has_work():
                engine.step()
    return samples


def _median_decode_step(engine, batch: int, prompt: int, tag: str) -> float:
    reqs = [_request(f"{tag}-{i}", prompt, CORUN_REPEATS + 4) for i in range(batch)]
    for req in reqs:
        engine.add(req)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in reqs):
        engine.step()
    times = [_timed_step(engine) for _ in range(CORUN_REPEATS)]
    while engine.has_work():
        engine.step()
    return float(np.median(times))


def _median_prefill_step(engine, tokens: int, tag: str) -> float:
    from pdserve.engine.request import Status

    times = []
    for r in range(CORUN_REPEATS):
        req = _request(f"{tag}-{r}", tokens, 2)
        engine.add(req)
        times.append(_timed_step(engine))
        if not req.is_finished:
            engine.release(req, Status.ABORTED)
    return float(np.median(times))


def busy_loop(model: str, role: str) -> None:
    """The neighbour: `role`'s steps back to back until SIGTERM (prefill: 512-token prompts; decode: 16 requests)."""
    engine = _engine(model, prefill_only=role == "prefill", max_tokens_budget=512)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("busy", flush=True)
    for i in itertools.count():
        if not engine.has_work():
            n, size, out = (1, 512, 2) if role == "prefill" else (16, 64, 1_000)
            for j in range(n):
                engine.add(_request(f"busy-{i}-{j}", size, out))
        engine.step()


class Neighbour:
    """A `busy_loop` process pinned to `core`, stopped by its PID."""

    def __init__(self, model: str, role: str, core: int) -> None:
        argv = [sys.executable, "-m", "bench.costs", "--model", model, "--core", str(core), "--busy", role]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "busy":
            self.stop()
            raise RuntimeError("the co-run neighbour did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure_corun(model: str, other_core: int) -> dict:
    """Each role's median step alone (before and after) and beside a neighbour on `other_core` running the other
    role; the slowdowns are the ratios."""
    batch, prompt = CORUN_DECODE
    decode, prefill = _engine(model, False, 2048), _engine(model, True, 2048)
    measure = {
        "decode": lambda tag: _median_decode_step(decode, batch, prompt, tag),
        "prefill": lambda tag: _median_prefill_step(prefill, CORUN_PREFILL, tag),
    }
    out = {}
    for role, other in (("decode", "prefill"), ("prefill", "decode")):
        before = measure[role](f"{role}-alone-0")
        neighbour = Neighbour(model, other, other_core)
        try:
            beside = measure[role](f"{role}-beside")
            if neighbour.proc.poll() is not None:
                raise RuntimeError(f"the co-run neighbour exited (code {neighbour.proc.returncode})")
        finally:
            neighbour.stop()
        after = measure[role](f"{role}-alone-1")
        slowdown = max(1.0, 2 * beside / (before + after))
        out[role] = {"alone_s": [before, after], "beside_s": beside, "slowdown": slowdown}
    return out


def kv_bytes_per_token(model: str | Target) -> int:
    """KV bytes a token takes in the pool, from the checkpoint's config (no engine, no pool of its own)."""
    import transformers

    from bench.baselines import kv_bytes_per_token as of_config
    from pdserve.checkpoint import resolve_model
    from pdserve.kv.layout import DTYPE_BYTES

    t = _target(model)
    return of_config(transformers.AutoConfig.from_pretrained(resolve_model(t.model)), DTYPE_BYTES[t.dtype])


def release(target: Target) -> None:
    """Frees an engine measured and dropped (its KV pool, on a GPU, before the next engine allocates its own)."""
    import gc

    gc.collect()
    if target.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def measure_handoff(
    model: str | Target, per_token: int, tokens: tuple = HANDOFF_TOKENS, repeats: int = 5
) -> list[dict]:
    """(tokens, median seconds) of copying `tokens` tokens' KV bytes (the pool's layout) from one buffer to another
    on the device: the hand-off's own data movement on one device (two GPUs' link is `pdserve plan --link-gbps`)."""
    import torch

    target, samples = _target(model), []
    for n in tokens:
        src = torch.ones(n * per_token, dtype=torch.uint8, device=target.device)
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            dst.copy_(src)
            target.sync()
            times.append(time.perf_counter() - t0)
        samples.append({"tokens": n, "bytes": n * per_token, "s": float(np.median(times[1:]))})
    return samples


def link_from(path: Path | None, key: str) -> float | None:
    """A bench/kv_bandwidth.py result's GB/s for `key` (e.g. zmq_tcp_GBps_consecutive), in bytes/s."""
    if path is None or not Path(path).exists():
        return None
    return float(json.loads(Path(path).read_text())[key]) * 1e9


# ---- command line ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: a GPU's steps (bfloat16 unless --dtype)")
    p.add_argument("--dtype", default=None, help="the model's dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--sizes", choices=sorted(SIZES), default=None, help="the shapes (default: full, gpu on a GPU)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the engine's (default: the largest decode batch)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="the KV pool (default: 0.25 GiB, 16 on a GPU)")
    p.add_argument("--core", type=int, default=0, help="on the CPU: pin to this core, one torch thread (as a node)")
    p.add_argument(
        "--link-gbps", type=float, default=None, help="KV link GB/s (default: --kv-bandwidth's, else the hand-off's)"
    )
    p.add_argument("--kv-bandwidth", type=Path, default=RESULTS_DIR / "kv_bandwidth.json")
    p.add_argument("--link-key", default="zmq_tcp_GBps_consecutive")
    p.add_argument("--link-latency-s", type=float, default=0.0)
    p.add_argument("--router-us-per-token", type=float, default=0.0)
    p.add_argument("--corun-core", type=int, default=None, help="measure the co-run slowdowns beside this core")
    p.add_argument("--quick", action="store_true", help="--sizes quick: costs measured right before a run")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "costs-small.json")
    p.add_argument("--busy", choices=["prefill", "decode"], help=argparse.SUPPRESS)  # the co-run neighbour
    a = p.parse_args(argv)
    gpu = a.device.startswith("cuda")
    sizes = a.sizes or ("quick" if a.quick else "gpu" if gpu else "full")
    shapes, repeats, batches, contexts, handoff_tokens = SIZES[sizes]
    target = Target(
        a.model,
        a.device,
        a.dtype or ("bfloat16" if gpu else "float32"),
        a.max_num_seqs or max(16, *batches),
        a.kv_cache_gb or (16.0 if gpu else 0.25),
    )
    import torch

    if not gpu:
        os.sched_setaffinity(0, {a.core})
        torch.set_num_threads(1)
    if a.busy:
        busy_loop(a.model, a.busy)
        return 0
    load_before = os.getloadavg()
    prefill = measure_prefill(target, repeats, shapes)
    release(target)
    decode = measure_decode(target, batches, contexts)
    release(target)
    per_token = kv_bytes_per_token(target)
    handoff = measure_handoff(target, per_token, handoff_tokens)
    measured_link = fit_link(handoff, per_token)
    link, latency, source = _link(a, gpu, measured_link)
    corun = measure_corun(a.model, a.corun_core) if a.corun_core is not None else None
    costs = fit(prefill, decode, per_token, link, latency, a.router_us_per_token / 1e6, corun)
    out = {
        "model": a.model,
        "device": torch.cuda.get_device_name(a.device) if gpu else "cpu",
        "dtype": target.dtype,
        "sizes": sizes,
        "costs": asdict(costs),
        "prefill_samples": prefill,
        "decode_samples": decode,
        "handoff_samples": handoff,
        "handoff_fit": {"link_bytes_per_s": measured_link[0], "link_latency_s": measured_link[1]},
        "corun": corun,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "link_source": source,
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["costs"], indent=1))
    return 0


def _link(a: argparse.Namespace, gpu: bool, measured: tuple[float, float]) -> tuple[float, float, str]:
    """(bytes/s, latency s, where from) of the KV link: --link-gbps, else on the CPU a --kv-bandwidth JSON, else the
    hand-off measured here."""
    if a.link_gbps:
        return a.link_gbps * 1e9, a.link_latency_s, "--link-gbps"
    from_json = None if gpu else link_from(a.kv_bandwidth, a.link_key)
    if from_json:
        return from_json, a.link_latency_s, a.link_key
    return measured[0], measured[1], "hand-off measured on the device"


if __name__ == "__main__":
    sys.exit(main())
