"""Per-step costs of the real engine, measured in this process and fitted to the simulator's cost model.

    python -m bench.costs --model small --core 0 --out bench/results/costs-small.json

The engine runs as a node runs it: pinned to one core, one torch thread, float32. Two fits, least squares:

- prefill step (a prefill-only engine, one request's chunk per step, past context 0..1280):
  `t = a + b * tokens + c * tokens * (past + tokens / 2)` (the last term: attention over the chunk's context).
- decode step (batch of B decoding requests, total context C = sum of their lengths):
  `t = a + b * B + c * C`.

Plus the KV bytes per token (the pool's layout) and the KV link's bandwidth and fixed latency (given, or read
from a bench/kv_bandwidth.py JSON). The fitted costs and every raw sample go to the JSON.

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
DECODE_STEPS = 12  # the median of these is the sample: steps on a shared machine have outliers
CORUN_DECODE = (8, 256)  # (batch, prompt tokens) of the decode steps timed alone and beside a neighbour
CORUN_PREFILL = 256  # prompt tokens of the prefill steps timed alone and beside a neighbour
CORUN_REPEATS = 15


@dataclass(frozen=True)
class Costs:
    """The simulator's cost model, in seconds and bytes."""

    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token_ctx_s: float  # x tokens x (past + tokens / 2)
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float  # x the batch's total context
    kv_bytes_per_token: int
    link_bytes_per_s: float
    link_latency_s: float = 0.0
    router_s_per_token: float = 0.0  # the router's CPU per streamed token (bench's router_cpu_us_per_token)
    corun_slowdown_prefill: float = 1.0  # a prefill step's time while another core computes, over its time alone
    corun_slowdown_decode: float = 1.0  # the same for a decode step
    decode_iteration_s: float = 0.0  # a decode node's time per iteration outside its step (its loop; not measured
    # here: a run's nodes report it, busy_time_s - step_time_s)
    prefill_iteration_s: float = 0.0  # the same for a prefill node (offers and their checksums, chores); KV pulls
    # that arrive meanwhile are served before its next step
    client_s_per_token: float = 0.0  # the load generator's CPU per streamed token (bench's client_cpu_us_per_token):
    # on one host it takes a share of the nodes' cores, as the router does
    router_s_per_message: float = 0.0  # the router's CPU per message from a node (one a step), beside its CPU per
    # token (0: all of it counted per token, as bench measures it)

    def __post_init__(self) -> None:
        if self.link_bytes_per_s <= 0 or self.kv_bytes_per_token < 0:
            raise ValueError("the link bandwidth must be positive and the KV bytes per token not negative")
        if min(self.corun_slowdown_prefill, self.corun_slowdown_decode) < 1.0:
            raise ValueError("a co-run slowdown is a ratio of at least 1")

    def prefill_step_s(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill iteration over `chunks` of (new tokens, past tokens), flattened into one forward."""
        tokens = sum(n for n, _ in chunks)
        attention = sum(n * (past + n / 2) for n, past in chunks)
        return self.prefill_base_s + self.prefill_per_token_s * tokens + self.prefill_per_token_ctx_s * attention

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode iteration of `batch` requests whose lengths sum to `context`."""
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * context

    def transfer_s(self, num_tokens: int) -> float:
        """One request's KV of `num_tokens` tokens over the link."""
        return self.link_latency_s + num_tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    @classmethod
    def load(cls, path: Path) -> Costs:
        return cls(**json.loads(Path(path).read_text())["costs"])


# ---- measuring -------------------------------------------------------------------------------------


def _engine(model: str, prefill_only: bool, max_tokens_budget: int):
    from pdserve.config import EngineConfig
    from pdserve.nodes.parts import build_engine

    cfg = EngineConfig(
        model=model, dtype="float32", max_num_seqs=16, max_num_batched_tokens=max_tokens_budget, kv_cache_gb=0.25
    )
    return build_engine(cfg, prefill_only=prefill_only)


def _request(rid: str, prompt_len: int, max_tokens: int):
    from pdserve.engine.request import Request
    from pdserve.wire.params import SamplingParams

    ids = [(7 * i + 3) % 4000 + 10 for i in range(prompt_len)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def measure_prefill(model: str, repeats: int = 3, shapes: tuple = PREFILL_SHAPES) -> list[dict]:
    """(tokens, past, seconds) of single-chunk prefill steps: past tokens are computed first, untimed."""
    from pdserve.engine.request import Status

    samples, engine = [], _engine(model, prefill_only=True, max_tokens_budget=2048)
    for chunk, past in shapes:
        times = []
        for r in range(repeats + 1):  # the first is a warm-up
            req = _request(f"p{chunk}-{past}-{r}", past + chunk, 2)
            engine.add(req)
            if past:
                engine.scheduler.max_num_batched_tokens = past
                engine.step()  # the past: one chunk of `past` tokens
            engine.scheduler.max_num_batched_tokens = chunk
            times.append(_timed_step(engine))
            if not req.is_finished:
                engine.release(req, Status.ABORTED)
        samples.append({"tokens": chunk, "past": past, "s": float(np.median(times[1:]))})
    return samples


def measure_decode(model: str, batches: tuple = DECODE_BATCHES, contexts: tuple = DECODE_CONTEXTS) -> list[dict]:
    """(batch, mean total context, median seconds) of decode steps after the batch's prompts are in."""
    samples = []
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
                times.append(_timed_step(engine))
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


def _least_squares(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative where it can: a negative coefficient is dropped (set to 0) and the rest refitted."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for i, c in zip(keep, coef, strict=True):
                out[i] = max(0.0, float(c))
            return out
        keep.pop(int(np.argmin(coef)))


def fit(
    prefill: list[dict],
    decode: list[dict],
    kv_bytes_per_token: int,
    link_bytes_per_s: float,
    link_latency_s: float = 0.0,
    router_s_per_token: float = 0.0,
    corun: dict | None = None,
) -> Costs:
    p = _least_squares(
        [[1, s["tokens"], s["tokens"] * (s["past"] + s["tokens"] / 2)] for s in prefill], [s["s"] for s in prefill]
    )
    d = _least_squares([[1, s["batch"], s["context"]] for s in decode], [s["s"] for s in decode])
    slow = {role: (corun or {}).get(role, {}).get("slowdown", 1.0) for role in ("prefill", "decode")}
    return Costs(
        *p,
        *d,
        kv_bytes_per_token,
        link_bytes_per_s,
        link_latency_s,
        router_s_per_token,
        slow["prefill"],
        slow["decode"],
    )


def kv_bytes_per_token(model: str) -> int:
    engine = _engine(model, prefill_only=True, max_tokens_budget=16)
    return int(engine.layout.bytes_per_token())


def link_from(path: Path | None, key: str) -> float | None:
    """A bench/kv_bandwidth.py result's GB/s for `key` (e.g. zmq_tcp_GBps_consecutive), in bytes/s."""
    if path is None or not Path(path).exists():
        return None
    return float(json.loads(Path(path).read_text())[key]) * 1e9


# ---- command line ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--core", type=int, default=0, help="pin to this core, one torch thread (as a node runs)")
    p.add_argument("--link-gbps", type=float, default=None, help="KV link GB/s (default: from --kv-bandwidth)")
    p.add_argument("--kv-bandwidth", type=Path, default=RESULTS_DIR / "kv_bandwidth.json")
    p.add_argument("--link-key", default="zmq_tcp_GBps_consecutive")
    p.add_argument("--link-latency-s", type=float, default=0.0)
    p.add_argument("--router-us-per-token", type=float, default=0.0)
    p.add_argument("--corun-core", type=int, default=None, help="measure the co-run slowdowns beside this core")
    p.add_argument("--quick", action="store_true", help="fewer shapes: costs measured right before a run")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "costs-small.json")
    p.add_argument("--busy", choices=["prefill", "decode"], help=argparse.SUPPRESS)  # the co-run neighbour
    a = p.parse_args(argv)
    import torch

    os.sched_setaffinity(0, {a.core})
    torch.set_num_threads(1)
    if a.busy:
        busy_loop(a.model, a.busy)
        return 0
    link = a.link_gbps * 1e9 if a.link_gbps else link_from(a.kv_bandwidth, a.link_key)
    if link is None:
        print("bench.costs: give --link-gbps or a --kv-bandwidth JSON", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    if a.quick:
        prefill = measure_prefill(a.model, 2, QUICK_PREFILL_SHAPES)
        decode = measure_decode(a.model, QUICK_DECODE_BATCHES, QUICK_DECODE_CONTEXTS)
    else:
        prefill, decode = measure_prefill(a.model), measure_decode(a.model)
    corun = measure_corun(a.model, a.corun_core) if a.corun_core is not None else None
    costs = fit(
        prefill, decode, kv_bytes_per_token(a.model), link, a.link_latency_s, a.router_us_per_token / 1e6, corun
    )
    out = {
        "model": a.model,
        "costs": asdict(costs),
        "prefill_samples": prefill,
        "decode_samples": decode,
        "corun": corun,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "link_source": a.link_key,
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["costs"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
