"""pdserve's native CPU kernels (csrc/): paged decode attention, and the fused elementwise ops of a layer.

Why, measured on this project's 2-core AVX2 machine, float32:
- Decode attention. SDPA runs one call per request per layer; for a single query token its CPU kernel
  streamed the KV at ~7 GB/s (the machine reads ~28 GB/s) plus ~30 us of fixed cost per call, which
  made attention the largest part of a decode step. `decode_attention` serves every decode token of
  an iteration in one call per layer, reads K and V once straight out of the paged pool through the
  block tables, and splits the work over (request, kv head) pairs on torch's OpenMP threads.
- RMSNorm (with the residual add before it) and the gated MLP's silu(g) * u: torch runs each as
  several small ops; one pass each is 3-4x faster at decode sizes and far more at prefill sizes.

They are plain C, built with the system's C compiler on first use (about a second), cached per source
and CPU under the pdserve cache folder, and loaded with ctypes: no torch headers, no build step at
install time. Where they cannot be built (no compiler, not Linux), `load()` returns None and the
runner uses torch's ops, logging why once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
import subprocess
import sys
from pathlib import Path

import torch

from pdserve import cbuild
from pdserve.checkpoint import cache_dir

log = logging.getLogger("pdserve.kernels")
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("decode_attention.c", "elementwise.c")]
# Compiled with -ffast-math, linked without it: linking a shared object with -ffast-math pulls in
# crtfastmath.o, which would switch the whole process (torch included) to flush-to-zero on load.
CFLAGS = ["-O3", "-ffast-math", "-march=native", "-fopenmp", "-fPIC", "-std=c11"]
LDFLAGS = ["-shared", "-fopenmp"]
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int

_loaded: dict[str, CpuKernels | None] = {}


class CpuKernels:
    """`torch`-facing wrappers of the C functions; every input is checked here, the C side trusts them."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._attention = _bind(
            lib.pd_decode_attention,
            [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _PTR, _INT],
            ctypes.c_int,
        )
        self._rms_norm = _bind(lib.pd_rms_norm, [_PTR, _PTR, _PTR, _I64, _I64, _F32, _INT])
        self._add_rms_norm = _bind(lib.pd_add_rms_norm, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT])
        self._silu_mul = _bind(lib.pd_silu_mul, [_PTR, _PTR, _I64, _I64, _INT])
        self._rope_store = _bind(
            lib.pd_rope_store,
            [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _INT],
        )

    def rope_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q [T, H, d] and k [T, Hkv, d] (cos, sin [T, d]); write k and v into one layer of the pool
        kv [2, Hkv, S, d] at `slots` [T]; return the rotated q, contiguous."""
        _check_pool_layer(kv)
        for x in (q, k, v):
            if x.dim() != 3 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride()[1:] != (kv.shape[3], 1):
                raise ValueError("rope_store takes float32 CPU [T, heads, d] tensors with contiguous heads")
        T, H, d = q.shape
        if k.shape != v.shape or k.shape != (T, kv.shape[1], d):
            raise ValueError(
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit KV {tuple(kv.shape)}"
            )
        cos, sin = _f32(cos), _f32(sin)
        if cos.shape != (T, d) or sin.shape != (T, d):
            raise ValueError(f"rope_store takes cos and sin of [T, d] = {(T, d)}, not {tuple(cos.shape)}")
        if slots.dtype != torch.int64 or slots.device.type != "cpu" or slots.shape != (T,):
            raise ValueError("slots must be T int64 CPU slot indices")
        if T and not 0 <= int(slots.min()) <= int(slots.max()) < kv.shape[2]:
            raise ValueError("a slot is outside the pool")
        slots = slots.contiguous()
        q_out = torch.empty(T, H, d)
        self._rope_store(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            q_out.data_ptr(),
            kv.data_ptr(),
            kv.shape[2],
            slots.data_ptr(),
            T,
            H,
            k.shape[1],
            d,
            torch.get_num_threads(),
        )
        return q_out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., D] / rms over D * weight [D]."""
        x = _f32(x)
        _check_weight(x, weight)
        out = torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // x.shape[-1],
            x.shape[-1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def add_rms_norm(self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """h += x in place (h: a contiguous float32 [..., D]); return rms_norm(h)."""
        x = _f32(x)
        if not (h.is_contiguous() and h.dtype == torch.float32 and h.device.type == "cpu" and h.shape == x.shape):
            raise ValueError("add_rms_norm adds a float32 tensor into a contiguous one of the same shape")
        _check_weight(h, weight)
        out = torch.empty_like(h)
        self._add_rms_norm(
            h.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            h.numel() // h.shape[-1],
            h.shape[-1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2n] (gate then up) -> silu(gate) * up, [..., n]."""
        gate_up = _f32(gate_up)
        if gate_up.shape[-1] % 2:
            raise ValueError("silu_mul takes gate and up side by side: an even last dim")
        n = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], n)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n), n, torch.get_num_threads())
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q [B, H, d] float32; kv one layer [2, Hkv, S, d]; block_tables [B, max_blocks] int32; lens [B]
        int32 (context length, the new token included) -> [B, H, d]."""
        q = _f32(q)
        _check_decode(q, kv, block_tables, lens, block_size)
        B, H, d = q.shape
        out = torch.empty_like(q)
        rc = self._attention(
            q.data_ptr(),
            kv.data_ptr(),
            kv.shape[2],
            block_tables.data_ptr(),
            block_tables.shape[1],
            lens.data_ptr(),
            B,
            H,
            kv.shape[1],
            d,
            block_size,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("decode attention could not allocate its scratch buffer")
        return out


def _bind(fn, argtypes: list, restype=None):
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _f32(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError("the CPU kernels take float32 CPU tensors")
    return x.contiguous()


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if (
        weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or not weight.is_contiguous()
        or weight.shape != x.shape[-1:]
    ):
        raise ValueError(f"a norm weight of shape {tuple(weight.shape)} does not fit {tuple(x.shape)}")


def _check_pool_layer(kv: torch.Tensor) -> None:
    """One layer of the pool: a contiguous float32 CPU [2, Hkv, S, d] with Hkv, S, d >= 1."""
    if kv.dim() != 4 or kv.shape[0] != 2 or min(kv.shape) < 1:
        raise ValueError(f"a pool layer is [2, kv heads, slots, head dim], not {tuple(kv.shape)}")
    if kv.dtype != torch.float32 or kv.device.type != "cpu" or not kv.is_contiguous():
        raise ValueError("a pool layer must be a contiguous float32 CPU tensor")


def _check_decode(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> None:
    """The C side trusts its arguments; this is where they are checked (q is already float32, contiguous)."""
    _check_pool_layer(kv)
    if q.dim() != 3 or q.shape[1] < 1 or q.shape[1] % kv.shape[1] or q.shape[2] != kv.shape[3]:
        raise ValueError(f"query {tuple(q.shape)} does not fit KV {tuple(kv.shape)}")
    for x in (tables, lens):
        if x.dtype != torch.int32 or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("block tables and lengths must be contiguous int32 CPU tensors")
    if tables.dim() != 2 or lens.shape != (q.shape[0],) or tables.shape[0] != q.shape[0] or block_size < 1:
        raise ValueError(f"block tables {tuple(tables.shape)} and lengths {tuple(lens.shape)} for {q.shape[0]} rows")
    if len(lens) and (int(lens.max()) > tables.shape[1] * block_size or int(lens.min()) < 1):
        raise ValueError("a context length is outside what its block table covers")
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < kv.shape[2] // block_size:
        raise ValueError("a block id is outside the pool")


def load() -> CpuKernels | None:
    """The compiled kernels, built on first use; None where they cannot be built here."""
    key = _build_key()
    if key not in _loaded:
        _loaded[key] = _build_and_load(key)
    return _loaded[key]


def _build_key() -> str:
    h = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES))
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
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


def _build_and_load(key: str) -> CpuKernels | None:
    if not sys.platform.startswith("linux"):
        log.warning("CPU kernels: not built on %s; using torch's ops", sys.platform)
        return None
    compiler = cbuild.compiler()
    if compiler is None:
        log.warning("CPU kernels: no C compiler found; using torch's ops")
        return None
    lib_path = cache_dir("kernels") / f"pdserve_cpu-{key}.so"
    try:
        if not lib_path.exists():
            _compile(compiler, lib_path)
        return CpuKernels(ctypes.CDLL(str(lib_path)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("CPU kernels: build failed (%s); using torch's ops", detail.strip()[:500])
        return None


def _compile(compiler: str, lib_path: Path) -> None:
    with cbuild.replacing(lib_path) as tmp:
        objects = [tmp.with_name(f"{tmp.name}.{src.stem}.o") for src in SOURCES]
        try:
            for src, obj in zip(SOURCES, objects, strict=True):
                cbuild.run([compiler, *CFLAGS, "-c", str(src), "-o", str(obj)])
            cbuild.run([compiler, *LDFLAGS, *map(str, objects), "-o", str(tmp), "-lm"])
        finally:
            for obj in objects:
                obj.unlink(missing_ok=True)
