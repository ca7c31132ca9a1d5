"""Per-step costs of the real engine, measured in this process and fitted to the simulator's cost model.

    python -m bench.costs --model small --core 0 --out bench/results/costs-small.json

The engine runs as a node runs it: pinned to one core, one torch thread, float32. Two fits, least squares:

- prefill step (a prefill-only engine, one request's chunk per step, past context 0..1280):
  `t = a + b * tokens + c * tokens * (past + tokens / 2)` (the last term: attention over the chunk's context).
- decode step (batch of B decoding requests, total context C = sum of their lengths):
  `t = a + b * B + c * C`.

Plus the KV bytes per token (the pool's layout) and the KV link's bandwidth and fixed latency (given, or read
from a bench/kv_bandwidth.py JSON). The fitted costs and every raw sample go to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

RESULTS_DIR = Path(__file__).parent / "results"
PREFILL_SHAPES = ((16, 0), (64, 0), (128, 0), (256, 0), (512, 0), (512, 512), (512, 1024), (512, 1280),
                  (128, 1024), (256, 512))  # fmt: skip  # (chunk tokens, past tokens)
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_CONTEXTS = (64, 256, 768)
DECODE_STEPS = 12  # the median of these is the sample: steps on a shared machine have outliers


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

    def __post_init__(self) -> None:
        if self.link_bytes_per_s <= 0 or self.kv_bytes_per_token < 0:
            raise ValueError("the link bandwidth must be positive and the KV bytes per token not negative")

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
    from pdserve.engine.engine import Engine

    cfg = EngineConfig(model=model, dtype="float32", max_num_seqs=16, max_num_batched_tokens=max_tokens_budget,
                       kv_cache_gb=0.25)  # fmt: skip
    return Engine(cfg, prefill_only=prefill_only)


def _request(rid: str, prompt_len: int, max_tokens: int):
    from pdserve.engine.request import Request
    from pdserve.wire.protocol import SamplingParams

    ids = [(7 * i + 3) % 4000 + 10 for i in range(prompt_len)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def measure_prefill(model: str, repeats: int = 3) -> list[dict]:
    """(tokens, past, seconds) of single-chunk prefill steps: past tokens are computed first, untimed."""
    from pdserve.engine.request import Status

    samples, engine = [], _engine(model, prefill_only=True, max_tokens_budget=2048)
    for chunk, past in PREFILL_SHAPES:
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


def measure_decode(model: str) -> list[dict]:
    """(batch, mean total context, median seconds) of decode steps after the batch's prompts are in."""
    samples = []
    engine = _engine(model, prefill_only=False, max_tokens_budget=2048)
    for ctx in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
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


def fit(prefill: list[dict], decode: list[dict], kv_bytes_per_token: int, link_bytes_per_s: float,
        link_latency_s: float = 0.0, router_s_per_token: float = 0.0) -> Costs:  # fmt: skip
    p = _least_squares([[1, s["tokens"], s["tokens"] * (s["past"] + s["tokens"] / 2)] for s in prefill],
                       [s["s"] for s in prefill])  # fmt: skip
    d = _least_squares([[1, s["batch"], s["context"]] for s in decode], [s["s"] for s in decode])
    return Costs(*p, *d, kv_bytes_per_token, link_bytes_per_s, link_latency_s, router_s_per_token)


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
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "costs-small.json")
    a = p.parse_args(argv)
    import torch

    os.sched_setaffinity(0, {a.core})
    torch.set_num_threads(1)
    link = a.link_gbps * 1e9 if a.link_gbps else link_from(a.kv_bandwidth, a.link_key)
    if link is None:
        print("bench.costs: give --link-gbps or a --kv-bandwidth JSON", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    prefill, decode = measure_prefill(a.model), measure_decode(a.model)
    costs = fit(prefill, decode, kv_bytes_per_token(a.model), link, a.link_latency_s, a.router_us_per_token / 1e6)
    out = {"model": a.model, "costs": asdict(costs), "prefill_samples": prefill, "decode_samples": decode,
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "link_source": a.link_key,
           "measured": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["costs"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
