"""Fused Triton kernels for a decoder layer's small ops on the GPU: three launches where torch takes ~30.

- `add_rms_norm`: the residual add and the next RMSNorm in one pass (`h += x`, then `norm(h)`); without
  a residual, the RMSNorm alone (the first layer's input norm, the final norm);
- `qk_norm_rope_store`: from the QKV projection's output, the q/k RMSNorms (Qwen3), the rotary embedding
  of q and k, and the KV-cache store of k and v, in one program per token; q is rotated in place;
- `silu_mul`: the gated MLP's `silu(gate) * up`.

Each follows the op order of the Hugging Face modules it replaces, rounding to the tensor's dtype
wherever they do (a bf16 product is computed in float32 and rounded, as torch's CUDA kernels do), and
reduces in float32. None uses `tl.dot`, so Triton's interpreter runs them exactly on the CPU in every
dtype (bf16, fp16, fp32): the tests compare them with the torch modules there. Import this module only
where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.runner.triton_interpreter import fix_interpreter

fix_interpreter()

SILU_BLOCK = 1024  # columns of one silu*mul program


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    x_ptr,
    w_ptr,
    out_ptr,
    stride_h,
    stride_x,
    stride_o,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row t): [h[t] += x[t]], out[t] = w * rmsnorm(h[t])."""
    t = tl.program_id(0).to(tl.int64)
    dtype = h_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(h_ptr + t * stride_h + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
        h = _round(h.to(tl.float32) + x.to(tl.float32), dtype)
        tl.store(h_ptr + t * stride_h + cols, h.to(dtype), mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _round(w * _round(hf * rstd, dtype), dtype)
    tl.store(out_ptr + t * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """A float32 value rounded (to nearest even) to the storage dtype and back: the result of one torch op in
    that dtype. bf16 is rounded with integer ops: Triton's interpreter casts float32 to bf16 by truncation
    where a GPU rounds, and this way both give the same bits (NaNs aside)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_halves(x1, x2, w_ptr, half, hmask, eps, D: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm over each row of [heads, D] given as its two halves [heads, HALF] (float32), weight w [D]."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
    w1 = tl.load(w_ptr + half, mask=hmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + D // 2 + half, mask=hmask, other=0.0).to(tl.float32)[None, :]
    return _round(w1 * _round(x1 * rstd, dtype), dtype), _round(w2 * _round(x2 * rstd, dtype), dtype)


@triton.jit
def _rope_halves(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """x * cos + rotate_half(x) * sin on the halves (rotate_half(x) = [-x2, x1]), each op rounded as torch's."""
    o1 = _round(_round(x1 * c1, dtype) - _round(x2 * s1, dtype), dtype)
    o2 = _round(_round(x2 * c2, dtype) + _round(x1 * s2, dtype), dtype)
    return o1, o2


@triton.jit
def _load_heads(base, heads, half, mask, D: tl.constexpr):
    """Rows of [heads, D] at base (head stride D) as two float32 halves [heads, HALF]."""
    off = heads[:, None] * D + half[None, :]
    return tl.load(base + off, mask=mask, other=0.0).to(tl.float32), tl.load(
        base + off + D // 2, mask=mask, other=0.0
    ).to(tl.float32)


@triton.jit
def _store_heads(base, heads, half, mask, x1, x2, D: tl.constexpr):
    off = heads[:, None] * D + half[None, :]
    tl.store(base + off, x1.to(base.dtype.element_ty), mask=mask)
    tl.store(base + off + D // 2, x2.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    pool_ptr,
    slots_ptr,
    stride_t,
    stride_cos,
    stride_sin,
    stride_pool_kv,
    stride_pool_h,
    stride_pool_s,
    eps,
    NH: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Program (token t) over its row of qkv [T, (NH + 2 NKV) * D]: q heads normed and rotated in place; k heads
    normed, rotated and stored at pool[0, :, slot]; v heads stored at pool[1, :, slot] (a negative slot: not
    stored, a padding row)."""
    t = tl.program_id(0).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    half = tl.arange(0, BLOCK_HALF)
    hmask = half < D // 2
    c1 = tl.load(cos_ptr + t * stride_cos + half, mask=hmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_cos + D // 2 + half, mask=hmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_sin + half, mask=hmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_sin + D // 2 + half, mask=hmask, other=0.0).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_t

    qh = tl.arange(0, BLOCK_QH)
    qmask = (qh < NH)[:, None] & hmask[None, :]
    q1, q2 = _load_heads(row, qh, half, qmask, D)
    if HAS_NORM:
        q1, q2 = _rms_norm_halves(q1, q2, qw_ptr, half, hmask, eps, D, dtype)
    q1, q2 = _rope_halves(q1, q2, c1, c2, s1, s2, dtype)
    _store_heads(row, qh, half, qmask, q1, q2, D)

    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        kh = tl.arange(0, BLOCK_KH)
        kmask = (kh < NKV)[:, None] & hmask[None, :]
        k1, k2 = _load_heads(row + NH * D, kh, half, kmask, D)
        if HAS_NORM:
            k1, k2 = _rms_norm_halves(k1, k2, kw_ptr, half, hmask, eps, D, dtype)
        k1, k2 = _rope_halves(k1, k2, c1, c2, s1, s2, dtype)
        dst = pool_ptr + kh.to(tl.int64)[:, None] * stride_pool_h + slot * stride_pool_s + half[None, :]  # int64
        tl.store(dst, k1.to(pool_ptr.dtype.element_ty), mask=kmask)
        tl.store(dst + D // 2, k2.to(pool_ptr.dtype.element_ty), mask=kmask)
        v1, v2 = _load_heads(row + (NH + NKV) * D, kh, half, kmask, D)
        tl.store(dst + stride_pool_kv, v1.to(pool_ptr.dtype.element_ty), mask=kmask)
        tl.store(dst + stride_pool_kv + D // 2, v2.to(pool_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    """Program (row t, column block c): out[t, cols] = silu(x[t, cols]) * x[t, inter + cols]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + t * stride_o + cols, _round(s * u, dtype).to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers ------------------------------------------------------------------------------------


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h [T, N] (+= x [T, N] in place, when x is given) -> weight * rmsnorm(h), [T, N] in h's dtype."""
    T, N = h.shape
    out = torch.empty_like(h)
    if T == 0:
        return out
    has_res = x is not None
    xx = x if has_res else h
    _add_rms_norm_kernel[(T,)](
        h,
        xx,
        weight,
        out,
        h.stride(0),
        xx.stride(0),
        out.stride(0),
        N,
        eps,
        HAS_RESIDUAL=has_res,
        BLOCK=triton.next_power_of_2(N),
    )
    return out


def qk_norm_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool_layer: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """qkv [T, (nh + 2 nkv) * d] (rows contiguous), cos/sin [T, d], pool_layer [2, nkv, S, d], slots [T] (negative:
    not stored): q and k normed (when the norms are given) and rotated, k and v stored. Returns the rotated q,
    a view of qkv: [T, nh, d]."""
    T = qkv.shape[0]
    if qkv.stride(1) != 1:
        raise ValueError("qk_norm_rope_store needs qkv's rows contiguous")
    has_norm = q_norm is not None
    if T:
        _qk_norm_rope_store_kernel[(T,)](
            qkv,
            q_norm if has_norm else qkv,
            k_norm if has_norm else qkv,
            cos,
            sin,
            pool_layer,
            slots,
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            pool_layer.stride(0),
            pool_layer.stride(1),
            pool_layer.stride(2),
            eps,
            NH=num_heads,
            NKV=num_kv_heads,
            D=head_dim,
            BLOCK_QH=triton.next_power_of_2(num_heads),
            BLOCK_KH=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            HAS_NORM=has_norm,
        )
    return qkv[:, : num_heads * head_dim].view(T, num_heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    T, I2 = gate_up.shape
    inter = I2 // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out
