"""The per-device parts of a forward: how inputs reach the device, the layer's small ops, and attention.

The runner (`model.py`) is one forward for every device; what differs is chosen once, per device,
as one of these backends:
- `TorchBackend`: torch's ops and one SDPA call per request over a view (or gather) of the pool.
  The reference path; it runs anywhere.
- `CpuKernelBackend`: pdserve's C kernels on the CPU in float32 (`kernels.py`): fused residual add +
  RMSNorm, silu*mul, rotary + KV store in one pass, and every decode token of the iteration in one
  paged-attention call per layer. Prompt chunks keep SDPA.
- `TritonBackend`: the GPU path: the iteration's integer inputs packed into one pinned host buffer and
  copied to the device at once; a layer's small ops as fused Triton kernels (`triton_layers.py`: residual
  add + RMSNorm, q/k norms + rotary + KV store, silu*mul), and paged attention straight from the block
  tables (`triton_attention.py`), one launch for decode tokens and prompt chunks alike: a layer is its 4
  GEMMs and 5 kernels (6 when attention splits a long context's keys, split-K). Its inputs can be packed into a
  bucket's fixed shapes (`bucket_layout`), which
  CUDA graphs replay (`cuda_graphs.py`). Under `TRITON_INTERPRET=1` it runs on the CPU, which is how the tests run it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kv.block_allocator import blocks_for, cdiv
from pdserve.kv.pool import KVPool
from pdserve.runner import kernels
from pdserve.runner.copies import to_device

TILE_M = 16  # query rows of an attention tile, (token, query head) pairs: a decode token's query heads of one KV
# head fill its first G; tl.dot needs at least 16
SEGMENT_ALIGN = 4  # int32s (16 bytes): where each segment of the packed inputs may start


@dataclass
class Chunk:
    """One request's slice of the iteration's flattened tokens."""

    start: int  # first row in [T]
    length: int  # new tokens this iteration
    past: int  # tokens already in the KV before this iteration
    block_ids: list[int]  # its KV blocks (at least those covering past + length)


@dataclass
class StepInputs:
    """One iteration's flat inputs as host arrays (int64): what `TritonBackend.pack_step` lays out. Built from the
    persistent rows with vectorised gathers (`ModelRunner.gather`), or from lists and chunks (`of_chunks`)."""

    ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T]
    sample: np.ndarray  # [S] rows of [T] whose logits are computed
    q_start: np.ndarray  # [R] each request's first row
    q_len: np.ndarray  # [R] its new tokens
    past: np.ndarray  # [R] its tokens in the KV before this iteration
    tables: np.ndarray  # [R, W] int32 block ids, W >= the columns the longest request uses; 0 past a request's own

    @classmethod
    def of_chunks(cls, ids, positions, slots, sample, chunks: list[Chunk], block_size: int) -> StepInputs:
        width = max((blocks_for(c.past + c.length, block_size) for c in chunks), default=1)
        tables = np.zeros((len(chunks), width), dtype=np.int32)  # [R, W]
        for r, c in enumerate(chunks):
            n = blocks_for(c.past + c.length, block_size)
            tables[r, :n] = c.block_ids[:n]

        def arr(values) -> np.ndarray:
            return np.asarray(values, dtype=np.int64).reshape(-1)

        return cls(
            *(arr(v) for v in (ids, positions, slots, sample)),
            *(arr([getattr(c, f) for c in chunks]) for f in ("start", "length", "past")),
            tables,
        )


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]: where each token's K and V go in the pool
    sample_index: torch.Tensor | None  # [S] rows of [T] whose logits are sampled; None: every row
    attn: object  # the backend's attention metadata


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm module applied as one `F.rms_norm` call in float32: bitwise the module's output
    (it runs the same ops in the same order), about 1.5-2x faster at decode sizes. Other dtypes, where
    the module upcasts, and norms of another shape run the module itself."""
    eps = getattr(norm, "variance_epsilon", None)
    if x.dtype != torch.float32 or eps is None:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, eps)


# ---- torch: the reference path ----------------------------------------------------------------------


@dataclass
class Span:
    """One request's chunk, attended by SDPA."""

    start: int
    length: int
    past: int
    ctx_slots: torch.Tensor | slice  # its past + length slots; a slice when they are contiguous
    mask: torch.Tensor | None  # [length, past + length] bool, for a chunk after a past


@dataclass
class SpanMeta:
    spans: list[Span]
    decode: DecodeGroup | None = None  # CpuKernelBackend only


class TorchBackend:
    name = "torch"

    def __init__(self, pool: KVPool, scale: float, apply_rope, device: torch.device) -> None:
        self.pool, self.scale, self.apply_rope, self.device = pool, scale, apply_rope, device

    # ---- inputs ---------------------------------------------------------------------------------
    def inputs(
        self, ids: list[int], positions: list[int], slots: list[int], sample: list[int], chunks: list[Chunk]
    ) -> ForwardInputs:
        dev = self.device
        return ForwardInputs(
            input_ids=to_device(ids, dev, torch.long),
            positions=to_device(positions, dev, torch.long),
            slot_mapping=to_device(slots, dev, torch.long),
            sample_index=to_device(sample, dev, torch.long),
            attn=SpanMeta([self._span(c) for c in chunks]),
        )

    def _span(self, c: Chunk) -> Span:
        bs, total = self.pool.block_size, c.past + c.length
        ctx = self.pool.context_slots(c.block_ids[: blocks_for(total, bs)], total)
        mask = _chunk_mask(c.past, c.length)
        return Span(c.start, c.length, c.past, ctx, None if mask is None else to_device(mask, self.device))

    # ---- the layer's small ops ------------------------------------------------------------------
    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(norm, x)

    def add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """h += x (the residual), then the next norm of h."""
        h += x
        return rms_norm(norm, h)

    def act(self, mlp: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate then up) -> act(gate) * up, [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return mlp.act_fn(gate) * up

    # ---- attention ------------------------------------------------------------------------------
    def attention(
        self, attn: nn.Module, qkv: torch.Tensor, splits: list[int], rope, kv_pool: torch.Tensor, inp: ForwardInputs
    ) -> torch.Tensor:
        """From the QKV projection [T, (nh + 2 nkv) * d] (split as `splits`): q/k norms where the model has them,
        then `attend`: [T, nh, d]."""
        T, d = qkv.shape[0], self.pool.layout.head_dim
        q, k, v = (t.view(T, -1, d) for t in qkv.split(splits, dim=-1))  # [T, heads, d] each
        if hasattr(attn, "q_norm"):
            q, k = self.norm(attn.q_norm, q), self.norm(attn.k_norm, k)
        return self.attend(q, k, v, rope, kv_pool, inp)

    def attend(self, q, k, v, rope, kv_pool: torch.Tensor, inp: ForwardInputs) -> torch.Tensor:
        """Rotate q and k [T, heads, d], store k and v in kv_pool [2, nkv, S, d], attend: [T, nh, d]."""
        q, k = self.apply_rope(q, k, *rope, unsqueeze_dim=1)
        kv_pool.index_copy_(2, inp.slot_mapping, torch.stack((k, v)).transpose(1, 2))  # [2, nkv, T, d]
        return self.attend_spans(q, kv_pool, inp.attn.spans)

    def attend_spans(self, q: torch.Tensor, kv_pool: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        out = torch.empty_like(q)  # [T, nh, d]
        for sp in spans:
            out[sp.start : sp.start + sp.length] = self._span_attention(q, kv_pool, sp)
        return out

    def _span_attention(self, q: torch.Tensor, kv_pool: torch.Tensor, sp: Span) -> torch.Tensor:
        """Attention of one request's new tokens against its KV in the pool (theirs included): [length, nh, d]."""
        qs = q[sp.start : sp.start + sp.length].transpose(0, 1)  # [nh, Lq, d]
        # a view of the pool when its blocks are consecutive, else a gather
        kv = kv_pool[:, :, sp.ctx_slots] if isinstance(sp.ctx_slots, slice) else kv_pool.index_select(2, sp.ctx_slots)
        o = F.scaled_dot_product_attention(
            qs[None],  # [1, nh, Lq, d]
            kv[0][None],  # [1, nkv, Lk, d]
            kv[1][None],
            attn_mask=sp.mask,
            is_causal=sp.past == 0 and sp.length > 1,  # a first chunk; later ones carry a mask (none for one token)
            scale=self.scale,
            enable_gqa=True,
        )  # [1, nh, Lq, d]
        return o[0].transpose(0, 1)


def _chunk_mask(past: int, n: int) -> torch.Tensor | None:
    """Causal mask of a chunk of n new tokens after `past` cached ones: [n, past + n] bool."""
    if past == 0 or n == 1:
        return None
    return torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]


# ---- CPU: pdserve's C kernels -----------------------------------------------------------------------


@dataclass
class DecodeGroup:
    """The iteration's single-token decodes, attended in one kernel call per layer."""

    rows: slice | torch.Tensor  # their positions in [T]: a slice when they are adjacent
    block_tables: torch.Tensor  # [n, max_blocks] int32, padded with 0
    lens: torch.Tensor  # [n] int32: context length, the new token included


class CpuKernelBackend(TorchBackend):
    name = "cpu"

    def __init__(
        self, pool: KVPool, scale: float, apply_rope, device: torch.device, ops: kernels.CpuKernels, silu_gated: bool
    ) -> None:
        super().__init__(pool, scale, apply_rope, device)
        self.k, self.silu_gated = ops, silu_gated

    def inputs(self, ids, positions, slots, sample, chunks) -> ForwardInputs:
        decodes = [c for c in chunks if c.length == 1 and c.past > 0]
        spans = [self._span(c) for c in chunks if not (c.length == 1 and c.past > 0)]
        inp = super().inputs(ids, positions, slots, sample, [])
        inp.attn = SpanMeta(spans, self._decode_group(decodes) if decodes else None)
        return inp

    def _decode_group(self, decodes: list[Chunk]) -> DecodeGroup:
        bs = self.pool.block_size
        lens = [c.past + 1 for c in decodes]
        width = max(blocks_for(n, bs) for n in lens)
        padded = [c.block_ids[: blocks_for(n, bs)] for c, n in zip(decodes, lens, strict=True)]
        tables = torch.tensor([b + [0] * (width - len(b)) for b in padded], dtype=torch.int32)  # [n, max_blocks]
        rows = [c.start for c in decodes]
        adjacent = rows == list(range(rows[0], rows[0] + len(rows)))
        return DecodeGroup(
            rows=slice(rows[0], rows[0] + len(rows)) if adjacent else torch.tensor(rows, dtype=torch.long),
            block_tables=tables,
            lens=torch.tensor(lens, dtype=torch.int32),
        )

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.k.rms_norm(x, norm.weight, norm.variance_epsilon)

    def add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return self.k.add_rms_norm(h, x, norm.weight, norm.variance_epsilon)

    def act(self, mlp: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up) if self.silu_gated else super().act(mlp, gate_up)

    def attend(self, q, k, v, rope, kv_pool: torch.Tensor, inp: ForwardInputs) -> torch.Tensor:
        q = self.k.rope_store(q, k, v, *rope, kv_pool, inp.slot_mapping)  # rotate q and k, store k and v
        out = self.attend_spans(q, kv_pool, inp.attn.spans)
        dec = inp.attn.decode
        if dec is not None:
            out[dec.rows] = self.k.decode_attention(
                q[dec.rows], kv_pool, dec.block_tables, dec.lens, self.pool.block_size, self.scale
            )
        return out


# ---- GPU: Triton ------------------------------------------------------------------------------------


@dataclass
class PagedMeta:
    """Per request r (padding requests have q_len 0): its rows, context and blocks; and the attention's work list."""

    q_start: torch.Tensor  # [R] int32
    q_len: torch.Tensor  # [R] int32
    ctx_len: torch.Tensor  # [R] int32, the new tokens included
    block_tables: torch.Tensor  # [R, W] int32, a view of a column-major [W, R] buffer
    work: torch.Tensor  # [N, 2] int32: (request, query tile) of every request; padding items (0, -1)
    splits: int = 1  # slices each tile's keys are read in (split-K, `triton_attention.num_splits`)


@dataclass(frozen=True)
class PackLayout:
    """Sizes of one iteration's packed int32 inputs; equal layouts give equal offsets.

    The block tables come last and column-major ([W, R]): the columns a step uses are a prefix of the
    buffer, so only that prefix is copied, however wide a graph's tables are (as wide as the longest
    request can be); columns past a request's length are never read. Every segment starts on a
    SEGMENT_ALIGN boundary (16 bytes): Triton specialises a kernel on its pointers' 16-byte alignment, so
    aligned segments make one variant of each kernel for every batch, built at warm-up.
    """

    rows: int  # T (padded)
    samples: int  # S (padded): rows whose logits are computed
    requests: int  # R (padded)
    width: int  # W, block table columns
    tiles: int  # N (padded): attention work items
    splits: int = 1  # the attention's split-K slices: fixed per layout, so per captured graph

    def segments(self) -> list[tuple[str, tuple[int, ...]]]:
        T, R = self.rows, self.requests
        return [
            ("ids", (T,)),
            ("positions", (T,)),
            ("slots", (T,)),
            ("sample", (self.samples,)),
            ("q_start", (R,)),
            ("q_len", (R,)),
            ("ctx_len", (R,)),
            ("work", (self.tiles, 2)),
            ("block_tables", (self.width, R)),
        ]

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        """Where each segment starts, in int32s: each on a SEGMENT_ALIGN boundary."""
        out, off = {}, 0
        for name, shape in self.segments():
            out[name] = off
            off += cdiv(math.prod(shape), SEGMENT_ALIGN) * SEGMENT_ALIGN
        return out

    def size(self) -> int:
        return self.prefix(self.width)

    def prefix(self, width: int) -> int:
        """The int32s up to and including the block tables' first `width` columns."""
        return self.offsets["block_tables"] + width * self.requests


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(
        self, pool: KVPool, scale: float, apply_rope, device: torch.device, num_heads: int, silu_gated: bool
    ) -> None:
        super().__init__(pool, scale, apply_rope, device)
        from pdserve.runner import triton_attention, triton_layers

        self.ta, self.tl = triton_attention, triton_layers
        self.num_heads, self.silu_gated = num_heads, silu_gated
        self.group = num_heads // pool.layout.num_kv_heads  # query heads per KV head
        self.tile = max(TILE_M, 1 << (self.group - 1).bit_length())  # rows of an attention tile
        self.multiprocessors = multiprocessors(device)
        triton_attention.build_combine(num_heads, pool.layout.head_dim, pool.data.dtype, device)
        self._staging = [torch.empty(0, dtype=torch.int32)] * 2  # two: one step's copy may still read the other
        self._segments: dict[tuple[int, PackLayout], dict] = {}  # (staging buffer, layout) -> its numpy views
        self._turn = 0

    # ---- inputs: one host buffer, one copy ------------------------------------------------------
    def layout(self, rows: int, samples: int, chunks: list[Chunk]) -> PackLayout:
        """The exact layout of an eager step of `rows` tokens, from its chunks."""
        past = np.array([c.past for c in chunks], dtype=np.int64)
        q_len = np.array([c.length for c in chunks], dtype=np.int64)
        return self._layout(rows, samples, past, q_len)

    def bucket_layout(self, rows: int, requests: int, samples: int, width: int) -> PackLayout:
        """The fixed layout of a CUDA graph's bucket: any step of at most `rows` tokens, `requests` requests and
        `samples` sampled rows packs into it. One request more holds the padding rows (`pack`), and the work list
        the most tiles such a step can have; its split count is for the longest context the tables hold (a shorter
        one fills only the first slices)."""
        tiles = self.max_tiles(rows, requests + 1)
        return PackLayout(rows, samples, requests + 1, width, tiles, self.splits(tiles, width * self.pool.block_size))

    def splits(self, tiles: int, context: int) -> int:
        """Split-K slices for `tiles` work items over contexts of up to `context` tokens."""
        programs = tiles * self.pool.layout.num_kv_heads
        return self.ta.num_splits(programs, context, self.multiprocessors)

    def tiles(self, length: int) -> int:
        """Attention tiles of a request's `length` new tokens: its (token, query head of a KV head) rows, `tile` at a
        time (a decode token: one)."""
        return cdiv(length * self.group, self.tile)

    def max_tiles(self, rows: int, requests: int) -> int:
        """The most tiles `requests` requests of `rows` new tokens in all can have: each request's rows fill whole
        tiles but its last, so sum(ceil(L_r * G / M)) < rows * G / M + requests."""
        return cdiv(rows * self.group, self.tile) + requests

    def layout_of(self, step: StepInputs) -> PackLayout:
        """The exact layout of an eager step, from its arrays."""
        return self._layout(len(step.ids), len(step.sample), step.past, step.q_len)

    def _layout(self, rows: int, samples: int, past: np.ndarray, q_len: np.ndarray) -> PackLayout:
        """An eager step's layout: its widest block table, its attention tiles (a decode token: one) and the split
        count for its longest context."""
        context = past + q_len
        width = int(blocks_for(context, self.pool.block_size).max(initial=1))
        tiles = int(self.tiles(q_len).sum())
        return PackLayout(rows, samples, len(q_len), width, tiles, self.splits(tiles, int(context.max(initial=0))))

    def pack(self, lay: PackLayout, ids, positions, slots, sample, chunks: list[Chunk]) -> torch.Tensor:
        """`pack_step` of inputs given as lists and chunks."""
        return self.pack_step(lay, StepInputs.of_chunks(ids, positions, slots, sample, chunks, self.pool.block_size))

    def pack_step(self, lay: PackLayout, step: StepInputs) -> torch.Tensor:
        """The iteration's inputs in one int32 host buffer (pinned on a GPU host), laid out as `lay`; only
        the block-table columns in use are returned (a prefix of the layout). Padding rows store nothing
        (slot -1) and form one request with no context, whose attention output is 0 (so that they stay finite);
        padding requests have no rows (q_len 0); padding sampled rows read row 0 (their logits are not used).
        Vectorised: no Python per request."""
        buf = self._staging_of(lay.size())
        seg = self._segments.get((self._turn, lay))
        if seg is None:  # the views of this buffer in this layout, kept while the buffer is (steady steps repeat it)
            seg = self._segments[(self._turn, lay)] = _views(buf.numpy(), lay)
        T, S = len(step.ids), len(step.sample)
        for name, values, pad in (("ids", step.ids, 0), ("positions", step.positions, 0), ("slots", step.slots, -1)):
            seg[name][:T], seg[name][T:] = values, pad
        seg["sample"][:S], seg["sample"][S:] = step.sample, 0
        n = self._pack_requests(seg, step, lay.rows)
        self._pack_work(seg["work"], seg["q_len"][:n])
        width = self._pack_tables(seg["block_tables"], step)
        return buf[: lay.prefix(width)]

    @staticmethod
    def _pack_requests(seg: dict, step: StepInputs, rows: int) -> int:
        """Per request: its first row, rows and context length; the padding rows past the step's T (up to `rows`) as
        one more request, with no context. Returns the requests with rows."""
        n, T = len(step.q_len), len(step.ids)
        for name, values in (("q_start", step.q_start), ("q_len", step.q_len), ("ctx_len", step.past + step.q_len)):
            seg[name][:n], seg[name][n:] = values, 0
        if rows > T:
            seg["q_start"][n], seg["q_len"][n] = T, rows - T
            n += 1
        return n

    def _pack_work(self, work: np.ndarray, q_len: np.ndarray) -> None:
        """The attention's work list [N, 2]: every tile (request, m) of every request's rows, then padding items (tile
        -1, no work)."""
        counts = self.tiles(q_len)  # [n] tiles of each request (`tiles` takes an array as it takes an int)
        total = int(counts.sum())
        if total == len(counts):  # a tile each (a decode step): (request, 0)
            work[:total, 0], work[:total, 1], work[total:] = np.arange(total), 0, (0, -1)
            return
        starts = np.cumsum(counts) - counts  # [n] each request's first item
        work[:total, 0] = np.repeat(np.arange(len(counts)), counts)
        work[:total, 1] = np.arange(total) - np.repeat(starts, counts)
        work[total:] = (0, -1)

    def _pack_tables(self, tables: np.ndarray, step: StepInputs) -> int:
        """Block ids into the column-major tables [W, R]; return the columns in use. The columns past a request's
        own are 0 in `step.tables`: a stale block id is never in reach of a kernel."""
        width = int(blocks_for(step.past + step.q_len, self.pool.block_size).max(initial=1))
        R = len(step.q_len)
        tables[:width, R:] = 0
        tables[:width, :R] = step.tables[:, :width].T  # [W, R]
        return width

    def _staging_of(self, size: int) -> torch.Tensor:
        """A reusable host buffer, one of two taken in turn: the step before the previous one has finished (its
        tokens were read), so its copy out of this buffer has run; the previous step's copy (a step scheduled ahead,
        docs/async-scheduling.md) may still read the other."""
        self._turn ^= 1
        buf = self._staging[self._turn]
        if buf.numel() < size:
            pin = self.device.type == "cuda"
            buf = self._staging[self._turn] = torch.empty(max(size, 2 * buf.numel()), dtype=torch.int32, pin_memory=pin)
            self._segments = {key: seg for key, seg in self._segments.items() if key[0] != self._turn}
        if len(self._segments) > 64:  # layouts come and go (widths, batch sizes): keep the recent ones
            self._segments.clear()
        return buf

    def views(self, dev: torch.Tensor, lay: PackLayout) -> ForwardInputs:
        """ForwardInputs reading the packed buffer `dev` (on the device) in place."""
        seg = _views(dev, lay)
        meta = PagedMeta(seg["q_start"], seg["q_len"], seg["ctx_len"], seg["block_tables"].t(), seg["work"], lay.splits)
        return ForwardInputs(seg["ids"], seg["positions"], seg["slots"], seg["sample"], meta)

    def inputs(self, ids, positions, slots, sample, chunks) -> ForwardInputs:
        return self.step_inputs(StepInputs.of_chunks(ids, positions, slots, sample, chunks, self.pool.block_size))

    def step_inputs(self, step: StepInputs) -> ForwardInputs:
        """The iteration's inputs on the device: one packed copy."""
        lay = self.layout_of(step)
        return self.views(self.pack_step(lay, step).to(self.device, non_blocking=True), lay)

    # ---- the layer's small ops: fused kernels ----------------------------------------------------
    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not _fusable_norm(norm, x):
            return super().norm(norm, x)
        return self.tl.add_rms_norm(x, None, norm.weight, norm.variance_epsilon)

    def add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if not _fusable_norm(norm, h):
            return super().add_norm(h, x, norm)
        return self.tl.add_rms_norm(h, x, norm.weight, norm.variance_epsilon)

    def act(self, mlp: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        return self.tl.silu_mul(gate_up) if self.silu_gated else super().act(mlp, gate_up)

    # ---- attention ------------------------------------------------------------------------------
    def attention(
        self, attn: nn.Module, qkv: torch.Tensor, splits: list[int], rope, kv_pool: torch.Tensor, inp: ForwardInputs
    ) -> torch.Tensor:
        """One kernel for the q/k norms, rotary and the KV store (q rotated in place in qkv), then attention."""
        d = self.pool.layout.head_dim
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        eps = qn.variance_epsilon if qn is not None else 0.0
        q = self.tl.qk_norm_rope_store(
            qkv,
            self.num_heads,
            self.pool.layout.num_kv_heads,
            d,
            None if qn is None else qn.weight,
            None if kn is None else kn.weight,
            eps,
            *rope,
            kv_pool,
            inp.slot_mapping,
        )
        return self.attend_paged(q, kv_pool, inp)

    def attend_paged(self, q: torch.Tensor, kv_pool: torch.Tensor, inp: ForwardInputs) -> torch.Tensor:
        """Paged attention of q [T, nh, d] (any strides) over the pool, its new keys already stored: [T, nh, d]."""
        m = inp.attn
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.ta.paged_attention(
            q,
            out,
            kv_pool,
            m.q_start,
            m.q_len,
            m.ctx_len,
            m.block_tables,
            m.work,
            self.pool.block_size,
            self.scale,
            self.tile,
            m.splits,
        )
        return out


def _views(buf, lay: PackLayout) -> dict:
    """Named views into a packed buffer (a numpy array or a tensor) of layout `lay`; a tensor's are cut in one call."""
    if isinstance(buf, torch.Tensor):
        sizes, named = _cuts(lay)
        pieces = torch.split_with_sizes(buf[: lay.size()], sizes)
        return {name: pieces[i].view(shape) if len(shape) > 1 else pieces[i] for i, name, shape in named}
    out = {}
    for name, shape in lay.segments():
        off = lay.offsets[name]
        out[name] = buf[off : off + math.prod(shape)].reshape(shape)
    return out


@functools.lru_cache(maxsize=256)
def _cuts(lay: PackLayout) -> tuple[list[int], list[tuple[int, str, tuple[int, ...]]]]:
    """The lengths that cut a packed buffer of layout `lay` into its segments and the gaps between them, and each
    segment's (piece, name, shape)."""
    sizes, named, end = [], [], 0
    for name, shape in lay.segments():
        off = lay.offsets[name]
        if off > end:
            sizes.append(off - end)
        named.append((len(sizes), name, shape))
        sizes.append(math.prod(shape))
        end = off + sizes[-1]
    return sizes, named


def _fusable_norm(norm: nn.Module, x: torch.Tensor) -> bool:
    """An RMSNorm over x's rows that the fused kernel computes: eps known, weight as wide as a row, rows contiguous."""
    eps, w = getattr(norm, "variance_epsilon", None), getattr(norm, "weight", None)
    return eps is not None and w is not None and w.shape == x.shape[-1:] and x.dim() == 2 and x.stride(1) == 1


# ---- choosing one --------------------------------------------------------------------------------


def _silu_gated(model_config) -> bool:
    """The model's MLP is silu(gate) * up."""
    return getattr(model_config, "hidden_act", None) == "silu"


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors, which split-K fills; elsewhere (the interpreter) one, so a step splits
    only where a single program would read more than SPLIT_MIN_TOKENS keys."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def triton_available(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices, and on the CPU only under its interpreter (the tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def make_backend(
    setting: str, cpu_kernels: str, pool: KVPool, model_config, scale: float, apply_rope, device: torch.device
) -> TorchBackend:
    """The backend `--attention-backend` asks for: auto picks Triton on CUDA, the C kernels on the CPU
    (as `--cpu-kernels` allows), else torch."""
    dtype = pool.data.dtype
    if setting == "triton" or (setting == "auto" and device.type == "cuda" and triton_available(device)):
        if not triton_available(device):
            raise RuntimeError("--attention-backend triton: Triton is not installed, or not usable on this device")
        return TritonBackend(
            pool, scale, apply_rope, device, model_config.num_attention_heads, _silu_gated(model_config)
        )
    if setting == "auto" and cpu_kernels != "off" and device.type == "cpu" and dtype == torch.float32:
        ops = kernels.load()
        if ops is None and cpu_kernels == "on":
            raise RuntimeError("--cpu-kernels on: the CPU kernels could not be built here (see the log)")
        if ops is not None:
            return CpuKernelBackend(pool, scale, apply_rope, device, ops, _silu_gated(model_config))
    return TorchBackend(pool, scale, apply_rope, device)
