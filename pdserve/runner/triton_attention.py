"""Triton kernels for the GPU: paged attention over the block tables (the KV store is fused into the rotary
kernel of `triton_layers.py`).

`paged_attention` serves every new token of an iteration straight from the paged pool, decode
tokens and prompt chunks alike, in one launch, with no gather into contiguous copies:
- one program per (work item, KV head); a work item is a request and a tile of its query rows;
- a tile's rows are (token, query head of the group) pairs, so the query heads that share a KV
  head (grouped-query attention) read each key once; a decode token fills one tile's first G rows,
  a prompt chunk as many tiles as its rows need;
- a work item whose tile is -1 (padding: a replayed CUDA graph launches a fixed number of them,
  `cuda_graphs.py`), or past its request's rows, reads nothing and stores nothing; the rows of a
  request with no context (a graph's padding rows) get 0;
- keys are read in tiles of BLOCK_N tokens through the block table, with an online softmax in
  float32 (flash attention), causal within the chunk and open to the request's cached past.

The same code runs on the CPU under `TRITON_INTERPRET=1`, where the tests compare it with a torch
reference. Import this module only where Triton is installed (`available()` tells).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_tr", "stride_tc"])  # they follow the batch size: one compile for all
def _paged_attention_kernel(
    q_ptr,
    o_ptr,
    pool_ptr,
    q_start_ptr,
    q_len_ptr,
    ctx_len_ptr,
    tables_ptr,
    work_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_pool_kv,
    stride_pool_h,
    stride_pool_s,
    stride_tr,
    stride_tc,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (work item w, KV head h). work[w] = (request r, query tile m); m = -1: padding, no work.

    Rows of the tile: i = m * BLOCK_M + arange(BLOCK_M); token t = i // G, query head h * G + i % G.
    """
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.load(work_ptr + w * 2)
    m = tl.load(work_ptr + w * 2 + 1)
    q_len = tl.load(q_len_ptr + r)
    live = (m >= 0) & (m * BLOCK_M < q_len * G)  # the tile has rows: else it reads no key
    ctx_len = tl.load(ctx_len_ptr + r)
    q_start = tl.load(q_start_ptr + r)
    past = ctx_len - q_len

    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    tok = rows // G
    head = kvh * G + rows % G
    row_ok = (tok < q_len) & (rows >= 0)  # a padding tile (-1) has no rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dmask[None, :], other=0.0)  # [M, D]
    q_pos = tl.where(row_ok, past + tok, ctx_len - 1)  # padding rows attend like the last token (never stored)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = pool_ptr + kvh * stride_pool_h
    v_base = k_base + stride_pool_kv
    last_tok = tl.minimum(m * BLOCK_M + BLOCK_M - 1, q_len * G - 1) // G
    end = tl.where(live, tl.minimum(ctx_len, past + last_tok + 1), 0)  # causal: no key after the tile's last token
    for start in range(0, end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [N] key positions
        j_ok = j < end
        block = tl.load(tables_ptr + r.to(tl.int64) * stride_tr + (j // BLOCK_SIZE) * stride_tc, mask=j_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
        kv_off = slot[:, None] * stride_pool_s + d[None, :]
        k = tl.load(k_base + kv_off, mask=j_ok[:, None] & dmask[None, :], other=0.0)  # [N, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, N]
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        s = tl.where((j[None, :] <= q_pos[:, None]) & j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_off, mask=j_ok[:, None] & dmask[None, :], other=0.0)  # [N, D]
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows saw no key
    o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])


def paged_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    pool_layer: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_tables: torch.Tensor,
    work: torch.Tensor,
    block_size: int,
    scale: float,
    block_m: int,
) -> None:
    """Attention of the new tokens q [T, nh, d] into out [T, nh, d], for the work items `work`.

    Per request r: its rows are q[q_start[r] : q_start[r] + q_len[r]], its context (those rows' own
    keys included, already stored) is ctx_len[r] tokens in the blocks block_tables[r] (any strides). `work` is [n, 2]:
    (request id, query tile of `block_m` rows), the tile -1 for a padding item that does nothing.
    """
    n = work.shape[0]
    if n == 0:
        return
    nh, d = q.shape[1], q.shape[2]
    nkv = pool_layer.shape[1]
    _paged_attention_kernel[(n, nkv)](
        q,
        out,
        pool_layer,
        q_start,
        q_len,
        ctx_len,
        block_tables,
        work,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        pool_layer.stride(0),
        pool_layer.stride(1),
        pool_layer.stride(2),
        *block_tables.stride(),
        scale,
        G=nh // nkv,
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=block_m,
        BLOCK_N=32 if d > 64 and q.dtype == torch.float32 else 64,
        BLOCK_SIZE=block_size,
        IEEE=q.dtype == torch.float32,
    )
