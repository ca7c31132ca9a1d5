"""Our one native kernel: paged decode attention on the CPU (csrc/decode_attention.c).

Why: SDPA runs one call per request per layer; for a single query token its CPU kernel streamed the
KV at ~7 GB/s (of ~28 GB/s this machine reads) plus ~30 us of fixed cost per call, which made
attention the largest part of a decode step. This kernel serves every decode token of an iteration
in one call per layer, reads K and V once straight out of the paged pool through the block tables,
and splits the work over (request, kv head) pairs on torch's OpenMP threads.

It is plain C built with the system's C compiler on first use (about a second), cached per source
and CPU under the pdserve cache folder, and loaded with ctypes: no torch headers, no build step at
install time. Where it cannot be built (no compiler, not Linux), `load()` returns None and the
runner falls back to SDPA per request, logging why once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from pdserve.common.checkpoint import cache_dir

log = logging.getLogger("pdserve.kernels")
SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
CFLAGS = ["-O3", "-ffast-math", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p

_loaded: dict[str, DecodeAttention | None] = {}


class DecodeAttention:
    """`torch`-facing wrapper of `pd_decode_attention`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.pd_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR,
                       ctypes.c_int]  # fmt: skip
        self._fn = fn

    def __call__(
        self, q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, block_size: int,
        scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """q [B, H, d] float32; kv one layer [2, Hkv, S, d]; block_tables [B, max_blocks] int32; lens [B]
        int32 (context length, the new token included) -> [B, H, d]."""
        q = q.contiguous()
        _check(q, kv, block_tables, lens, block_size)
        B, H, d = q.shape
        out = torch.empty_like(q)
        rc = self._fn(q.data_ptr(), kv.data_ptr(), kv.shape[2], block_tables.data_ptr(), block_tables.shape[1],
                      lens.data_ptr(), B, H, kv.shape[1], d, block_size, scale, out.data_ptr(),
                      torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise MemoryError("decode attention could not allocate its scratch buffer")
        return out


def _check(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> None:
    """The C side trusts its arguments; this is where they are checked."""
    if q.dtype != torch.float32 or kv.dtype != torch.float32 or not kv.is_contiguous() or kv.device.type != "cpu":
        raise ValueError("decode attention takes contiguous float32 CPU tensors")
    if block_tables.dtype != torch.int32 or lens.dtype != torch.int32 or not block_tables.is_contiguous():
        raise ValueError("block tables and lengths must be contiguous int32")
    if q.shape[1] % kv.shape[1] or q.shape[2] != kv.shape[3] or len(lens) != q.shape[0]:
        raise ValueError(f"query {tuple(q.shape)} does not fit KV {tuple(kv.shape)}")
    if len(lens) and (int(lens.max()) > block_tables.shape[1] * block_size or int(lens.min()) < 1):
        raise ValueError("a context length is outside what its block table covers")
    if block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < kv.shape[2] // block_size:
        raise ValueError("a block id is outside the pool")


def load() -> DecodeAttention | None:
    """The compiled kernel, built on first use; None where it cannot be built here."""
    key = _build_key()
    if key not in _loaded:
        _loaded[key] = _build_and_load(key)
    return _loaded[key]


def _build_key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(platform.machine().encode() + _cpu_flags().encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code is only reused on a CPU that has them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_and_load(key: str) -> DecodeAttention | None:
    if not sys.platform.startswith("linux"):
        log.warning("decode attention kernel: not built on %s; using SDPA per request", sys.platform)
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("decode attention kernel: no C compiler found; using SDPA per request")
        return None
    lib_path = cache_dir() / "kernels" / f"decode_attention-{key}.so"
    try:
        if not lib_path.exists():
            _compile(compiler, lib_path)
        return DecodeAttention(ctypes.CDLL(str(lib_path)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("decode attention kernel: build failed (%s); using SDPA per request", detail.strip()[:500])
        return None


def _compile(compiler: str, lib_path: Path) -> None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib_path.with_name(f"{lib_path.name}.tmp{os.getpid()}")
    subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                   text=True, timeout=120)  # fmt: skip
    os.replace(tmp, lib_path)  # atomic: a process building the same kernel at once wins or loses whole
