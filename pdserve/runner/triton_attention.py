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
  float32 (flash attention), causal within the chunk and open to the request's cached past;
- split-K (flash-decoding): with `splits` > 1 the grid has a third axis, and program (w, h, s) reads
  only the s-th slice of its tile's keys, writing that slice's partial max, sum and unnormalised output
  in float32; a second small kernel (`_combine_kernel`) rescales and adds the slices of every row. A
  few requests of long contexts then fill the GPU. The split count is a plain argument (not a compile
  constant), fixed per captured graph; a short context fills only its first slices, the others read
  nothing and leave an empty partial. `num_splits` chooses it.

Why two kernels and not one: fusing the combine into the last program of each tile (an atomic ticket)
needs a zeroed counter buffer that resets itself and cross-program memory fences; the combine kernel
reads only the partials (splits x (head_dim + 2) floats a row), and runs only when the step splits, so
a step that does not split keeps one attention launch a layer.

The same code runs on the CPU under `TRITON_INTERPRET=1`, where the tests compare it with a torch
reference. Import this module only where Triton is installed (`available()` tells).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.runner.triton_interpreter import fix_interpreter

fix_interpreter()

MAX_SPLITS = 16  # the most slices a tile's keys are split into
SPLIT_MIN_TOKENS = 256  # a slice reads at least this many keys: shorter slices cost more to combine than they save
WAVES = 2  # split until the programs fill the device's multiprocessors this many times


def num_splits(programs: int, context: int, multiprocessors: int) -> int:
    """Slices to split each tile's keys into: enough that `programs` (work items x KV heads) fill `multiprocessors`
    WAVES times, no slice shorter than SPLIT_MIN_TOKENS of the longest `context`, at most MAX_SPLITS."""
    if programs <= 0:
        return 1
    fill = -(-WAVES * multiprocessors // programs)
    return max(1, min(fill, context // SPLIT_MIN_TOKENS, MAX_SPLITS))


# they follow the batch: one compile for all
@triton.jit(do_not_specialize=["stride_tr", "stride_tc", "splits", "split_min", "part_rows"])
def _paged_attention_kernel(
    q_ptr,
    o_ptr,
    part_ptr,
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
    splits,
    split_min,
    part_rows,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (work item w, KV head h, slice s). work[w] = (request r, query tile m); m = -1: padding, no work.

    Rows of the tile: i = m * BLOCK_M + arange(BLOCK_M); token t = i // G, query head h * G + i % G.
    With splits > 1 it writes its slice's partials into part (float32, `part_rows` = T * nh rows a slice):
    [splits, part_rows] maxima, [splits, part_rows] sums, then [splits, part_rows, D] outputs.
    """
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    sid = tl.program_id(2)
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
    k_base = pool_ptr + kvh.to(tl.int64) * stride_pool_h  # int64: a head's offset passes 2^31 in a large pool
    v_base = k_base + stride_pool_kv
    last_tok = tl.minimum(m * BLOCK_M + BLOCK_M - 1, q_len * G - 1) // G
    end = tl.where(live, tl.minimum(ctx_len, past + last_tok + 1), 0)  # causal: no key after the tile's last token
    span = tl.maximum(tl.cdiv(tl.cdiv(end, splits), BLOCK_N), tl.cdiv(split_min, BLOCK_N)) * BLOCK_N
    lo = tl.minimum(sid * span, end)
    hi = tl.minimum(lo + span, end)  # this slice's keys [lo, hi): all of them when splits == 1
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [N] key positions
        j_ok = j < hi
        block = tl.load(tables_ptr + r.to(tl.int64) * stride_tr + (j // BLOCK_SIZE) * stride_tc, mask=j_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
        kv_off = slot[:, None] * stride_pool_s + d[None, :]
        k = tl.load(k_base + kv_off, mask=j_ok[:, None] & dmask[None, :], other=0.0)  # [N, D]
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")  # [M, N]
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        s = tl.where((j[None, :] <= q_pos[:, None]) & j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row whose slice so far is all after it: no NaN
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_off, mask=j_ok[:, None] & dmask[None, :], other=0.0)  # [N, D]
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows saw no key
        o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
    else:
        prow = sid.to(tl.int64) * part_rows + (q_start + tok).to(tl.int64) * (G * tl.num_programs(1)) + head  # [M]
        tl.store(part_ptr + prow, m_i, mask=row_ok)
        tl.store(part_ptr + splits * part_rows + prow, l_i, mask=row_ok)
        o_off = 2 * splits * part_rows + prow[:, None] * D + d[None, :]
        tl.store(part_ptr + o_off, acc, mask=row_ok[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["splits", "part_rows"])
def _combine_kernel(
    o_ptr,
    part_ptr,
    stride_ot,
    stride_oh,
    splits,
    part_rows,
    NH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program (token t, query head h): the slices' partials of row (t, h) rescaled to their common max and
    summed: out = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s; 0 where no slice saw a key."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < splits
    prow = s.to(tl.int64) * part_rows + t * NH + h  # [S]
    m_s = tl.load(part_ptr + prow, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ptr + splits * part_rows + prow, mask=s_ok, other=0.0)
    seen = l_s > 0
    m = tl.max(tl.where(seen, m_s, float("-inf")), 0)
    wgt = tl.where(seen, tl.exp(m_s - m), 0.0)  # [S]
    total = tl.sum(wgt * l_s, 0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    acc_off = 2 * splits * part_rows + prow[:, None] * D + d[None, :]
    acc = tl.load(part_ptr + acc_off, mask=seen[:, None] & dmask[None, :], other=0.0)  # [S, D]
    out = tl.sum(acc * wgt[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=dmask)


def _interpreted() -> bool:
    """Triton's interpreter runs the kernels (the tests, on the CPU): its bf16 `tl.dot` is wrong, so there a bf16
    kernel takes the float32 (IEEE) products, the loads, slices, softmax and stores unchanged."""
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    splits: int = 1,
    split_min: int = SPLIT_MIN_TOKENS,
) -> None:
    """Attention of the new tokens q [T, nh, d] into out [T, nh, d], for the work items `work`.

    Per request r: its rows are q[q_start[r] : q_start[r] + q_len[r]], its context (those rows' own
    keys included, already stored) is ctx_len[r] tokens in the blocks block_tables[r] (any strides). `work` is [n, 2]:
    (request id, query tile of `block_m` rows), the tile -1 for a padding item that does nothing. With `splits` > 1
    (at most MAX_SPLITS) each tile's keys are read in that many slices (of at least `split_min` keys: a short
    context fills only the first) by as many programs, then combined (a second launch); every row of q must belong
    to some request (padding rows to one with no context).
    """
    n = work.shape[0]
    if n == 0:
        return
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, not {splits}")
    T, nh, d = q.shape
    nkv = pool_layer.shape[1]
    rows = T * nh  # partial rows a slice
    part = torch.empty(splits * rows * (d + 2) if splits > 1 else 1, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    _paged_attention_kernel[(n, nkv, splits)](
        q,
        out,
        part,
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
        splits,
        split_min,
        rows,
        G=nh // nkv,
        D=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=32 if d > 64 and q.dtype == torch.float32 else 64,
        BLOCK_SIZE=block_size,
        IEEE=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreted()),
    )
    if splits > 1:
        _combine(out, part, splits)


def build_combine(num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Run the combine kernel once over empty partials (out: zeros), so that it is compiled at start: a model's
    steps all launch it alike (its output contiguous, the split count not a compile constant), but only those that
    split, which the engine's warm-up step does not."""
    out = torch.empty(1, num_heads, head_dim, dtype=dtype, device=device)
    _combine(out, torch.zeros(2 * num_heads * (head_dim + 2), dtype=torch.float32, device=device), 2)


def _combine(out: torch.Tensor, part: torch.Tensor, splits: int) -> None:
    """out [T, nh, d] from the `splits` slices' partials `part` (laid out as `_paged_attention_kernel` writes them)."""
    T, nh, d = out.shape
    block_d = max(16, triton.next_power_of_2(d))
    _combine_kernel[(T, nh)](
        out, part, out.stride(0), out.stride(1), splits, T * nh, NH=nh, D=d, BLOCK_D=block_d, BLOCK_S=MAX_SPLITS
    )
