"""Decode attention's achieved bandwidth: the bytes one paged-attention launch must read over its time.

    python -m bench.attention --device cuda --json attention.json     # on a GPU: the target shapes
    TRITON_INTERPRET=1 python -m bench.attention --device cpu          # a tiny shape: proves the code path

A decode step's attention reads, for each request, its whole context's keys and values of one layer
(2 x KV heads x head_dim x context elements) and its block-table row; its queries and outputs are a row
each, negligible beside them, and not counted. So bandwidth = `attention_bytes` / the launch's time
(its split-K combine included): the closer to the device's copy bandwidth (`copy_bandwidth`, a device
copy's bytes read + written over its time), the nearer the kernel is to the memory's limit.

On a GPU it times (128 requests, 1,024-token context) and (8 requests, 8,192) at qwen3-0.6b's layout
(16 query heads, 8 KV heads, head_dim 128, bfloat16, 16-token blocks) with CUDA events, every request's
blocks scattered through the pool, and the split count the engine would choose (`num_splits`). Targets:
70% of the copy bandwidth at 128 x 1k, 50% at 8 x 8k. On the CPU it runs a tiny shape under Triton's
interpreter (its time says nothing about a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

TARGET_SHAPES = [(128, 1024, 0.70), (8, 8192, 0.50)]  # (requests, context, target: fraction of copy bandwidth)
TINY_SHAPE = (2, 96)  # the CPU's: under the interpreter
COPY_BYTES = 1 << 30  # the copy that measures the device's bandwidth


@dataclass(frozen=True)
class AttnLayout:
    """What attention reads per token and layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @classmethod
    def of_model(cls, name: str = "qwen3-0.6b", block_size: int = 16) -> AttnLayout:
        from pdserve.checkpoint import BUILTIN_MODELS

        spec = BUILTIN_MODELS[name]
        dtype = getattr(torch, spec.dtype)
        return cls(spec.num_heads, spec.num_kv_heads, spec.head_dim, dtype, block_size)


def attention_bytes(requests: int, context: int, lay: AttnLayout) -> int:
    """Bytes one layer's decode attention reads: every request's keys and values, and its block-table row."""
    elem = torch.finfo(lay.dtype).bits // 8
    kv = requests * context * 2 * lay.num_kv_heads * lay.head_dim * elem
    tables = requests * math.ceil(context / lay.block_size) * 4  # int32 block ids
    return kv + tables


@dataclass
class Case:
    """One launch's arguments: `requests` decodes of `context` tokens in scattered blocks."""

    q: torch.Tensor  # [B, nh, d]
    out: torch.Tensor  # [B, nh, d]
    pool: torch.Tensor  # [2, nkv, blocks * bs, d]
    meta: tuple[torch.Tensor, ...]  # q_start, q_len, ctx_len, block_tables, work
    tile: int
    splits: int


def build_case(requests: int, context: int, lay: AttnLayout, device: torch.device, splits: int) -> Case:
    from pdserve.runner.backends import TILE_M

    bs = lay.block_size
    per = math.ceil(context / bs)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(requests * per, generator=g).to(torch.int32)  # every request's blocks scattered
    i32 = dict(dtype=torch.int32, device=device)
    meta = (
        torch.arange(requests, **i32),  # q_start
        torch.ones(requests, **i32),  # q_len
        torch.full((requests,), context, **i32),  # ctx_len
        blocks.view(requests, per).to(device),
        torch.stack([torch.arange(requests), torch.zeros(requests, dtype=torch.int64)], 1).to(**i32),  # work [B, 2]
    )
    pool = torch.randn(2, lay.num_kv_heads, requests * per * bs, lay.head_dim, dtype=lay.dtype, device=device)
    q = torch.randn(requests, lay.num_heads, lay.head_dim, dtype=lay.dtype, device=device)
    tile = max(TILE_M, 1 << (lay.num_heads // lay.num_kv_heads - 1).bit_length())
    return Case(q, torch.empty_like(q), pool, meta, tile, splits)


def launch(case: Case, lay: AttnLayout) -> None:
    from pdserve.runner import triton_attention as ta

    scale = 1 / math.sqrt(lay.head_dim)
    ta.paged_attention(case.q, case.out, case.pool, *case.meta, lay.block_size, scale, case.tile, case.splits)


def timed(fn, device: torch.device, iters: int) -> float:
    """Seconds a call of fn takes, averaged over `iters` after one untimed call (CUDA events on a GPU)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, iters: int = 20) -> float:
    """The device's copy bandwidth, bytes/s: a copy's bytes read and written over its time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, iters)


@dataclass
class Measured:
    requests: int
    context: int
    splits: int
    bytes: int
    seconds: float
    gb_s: float
    copy_gb_s: float | None = None
    fraction: float | None = None  # of the copy bandwidth
    target: float | None = None


def measure(requests: int, context: int, lay: AttnLayout, device: torch.device, iters: int = 50) -> Measured:
    """Time one layer's decode attention at a shape, with the split count the engine would choose."""
    from pdserve.runner.backends import multiprocessors
    from pdserve.runner.triton_attention import num_splits

    splits = num_splits(requests * lay.num_kv_heads, context, multiprocessors(device))
    case = build_case(requests, context, lay, device, splits)
    seconds = timed(lambda: launch(case, lay), device, iters)
    nbytes = attention_bytes(requests, context, lay)
    return Measured(requests, context, splits, nbytes, seconds, nbytes / seconds / 1e9)


def run(device: torch.device, lay: AttnLayout | None = None) -> list[Measured]:
    """The target shapes beside the copy bandwidth on a GPU; the tiny shape (one call, no target) elsewhere."""
    lay = lay or AttnLayout.of_model()
    if device.type != "cuda":
        return [measure(*TINY_SHAPE, lay, device, iters=1)]
    copy = copy_bandwidth(device) / 1e9
    out = []
    for requests, context, target in TARGET_SHAPES:
        m = measure(requests, context, lay, device)
        m.copy_gb_s, m.fraction, m.target = copy, m.gb_s / copy, target
        out.append(m)
    return out


def report(results: list[Measured]) -> str:
    lines = ["| requests | context | splits | MB read | us | GB/s | copy GB/s | of copy | target |", "|" + "---|" * 9]
    for m in results:
        copy = "-" if m.copy_gb_s is None else f"{m.copy_gb_s:.0f}"
        frac = "-" if m.fraction is None else f"{m.fraction:.0%}"
        target = "-" if m.target is None else f">= {m.target:.0%}"
        lines.append(
            f"| {m.requests} | {m.context} | {m.splits} | {m.bytes / 1e6:.1f} | {m.seconds * 1e6:.1f} | "
            f"{m.gb_s:.1f} | {copy} | {frac} | {target} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("on the CPU, run with TRITON_INTERPRET=1 (Triton's interpreter runs the kernel)")
    results = run(device)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "results": [asdict(m) for m in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
