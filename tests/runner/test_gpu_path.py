"""The GPU engine's parts, tested on the CPU: the Triton kernels (by Triton's interpreter) against torch,
the packed inputs and their padding, the step graphs' buckets, and the batched sampler. The step graphs' whole
path (bucketed, padded, over fixed buffers) is tested in tests/runner/test_step_graphs.py."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.request import Request
from pdserve.kv.block_allocator import blocks_for, cdiv
from pdserve.runner.backends import TILE_M, Chunk
from pdserve.runner.cuda_graphs import Bucket, pick, plan, token_counts
from pdserve.runner.sampling import Sampler
from pdserve.wire.params import SamplingParams
from tests.helpers import optional


@pytest.fixture
def triton():
    """The Triton kernels' tests need triton (run here by its interpreter); the buckets' and the sampler's do not."""
    return optional("triton")


def _reference(q, pool, q_start, reqs, tables, bs):
    """SDPA of each request's rows against its blocks, causal within the chunk: {request: [n, nh, d]}."""
    out = {}
    for r, (past, n) in enumerate(reqs):
        slots = torch.tensor([tables[r][p // bs] * bs + p % bs for p in range(past + n)])
        k, v = pool[0][:, slots].float(), pool[1][:, slots].float()  # [nkv, L, d]
        qq = q[q_start[r] : q_start[r] + n].transpose(0, 1).float()  # [nh, n, d]
        mask = torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(qq[None], k[None], v[None], attn_mask=mask, enable_gqa=True)
        out[r] = o[0].transpose(0, 1)
    return out


def _paged_case(reqs, nh, nkv, d, bs, dtype, seed):
    """Requests of (past, new tokens) in scattered, out-of-order blocks: (q, pool, q_start, tables, args, work) for
    paged_attention, the work list in reverse order with padding items last."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(blocks_for(p + n, bs) for p, n in reqs) + 5
    pool = torch.randn(2, nkv, num_blocks * bs, d, generator=g).to(dtype)
    free = random.Random(0).sample(range(num_blocks), num_blocks)  # scattered, out of order
    tables, q_start, T = [], [], 0
    for past, n in reqs:
        tables.append([free.pop() for _ in range(blocks_for(past + n, bs))])
        q_start.append(T)
        T += n
    width = max(map(len, tables))
    i32 = dict(dtype=torch.int32)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32)
    q = torch.randn(T, nh, d, generator=g).to(dtype)
    tile = max(TILE_M, nh // nkv)
    work = [(r, m) for r, (_, n) in enumerate(reqs) for m in range(cdiv(n * nh // nkv, tile))]
    work = torch.tensor(work[::-1] + [(0, -1), (3, -1)], **i32)  # any order; padding items last
    args = (
        torch.tensor(q_start, **i32),
        torch.tensor([n for _, n in reqs], **i32),
        torch.tensor([p + n for p, n in reqs], **i32),
        bt,
    )
    return q, pool, q_start, tables, args, work, tile


def _check_paged(reqs, nh, nkv, d, bs, dtype, splits=1, split_min=256):
    from pdserve.runner import triton_attention as ta

    q, pool, q_start, tables, args, work, tile = _paged_case(reqs, nh, nkv, d, bs, dtype, seed=nh * d + bs)
    out = torch.full_like(q, float("nan"))
    ta.paged_attention(q, out, pool, *args, work, bs, 1 / math.sqrt(d), tile, splits, split_min)
    tol = 1e-5 if dtype == torch.float32 else 2e-3 if dtype == torch.float16 else 1e-2
    for r, ref in _reference(q, pool, q_start, reqs, tables, bs).items():
        got = out[q_start[r] : q_start[r] + reqs[r][1]].float()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "nh,nkv,d,bs,dtype",
    [
        (4, 4, 16, 16, torch.float32),
        (8, 2, 64, 16, torch.float32),
        (4, 1, 32, 32, torch.float32),
        (16, 8, 128, 16, torch.float16),
    ],
)
def test_paged_attention_matches_torch(triton, nh, nkv, d, bs, dtype):
    """Decodes and prompt chunks (first chunks and chunks after a cached past), scattered blocks, GQA: one launch
    over every request's tiles, and padding items that change nothing."""
    _check_paged([(0, 19), (37, 1), (16, 7), (70, 1), (5, 1), (0, 1)], nh, nkv, d, bs, dtype)


@pytest.mark.parametrize(
    "dtype,splits",
    [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 4), (torch.float16, 16)],
)
def test_split_paged_attention_matches_torch(triton, dtype, splits):
    """Split-K: ragged contexts in scattered blocks, read in slices of at least 64 keys and combined: a long context
    fills every slice, a short one only its first; a prompt chunk's early rows see slices that are all after them."""
    reqs = [(300, 1), (70, 1), (5, 1), (0, 1), (130, 9)]  # (past, new tokens)
    _check_paged(reqs, 4, 2, 32, 16, dtype, splits=splits, split_min=64)


def test_split_count_fills_the_device_with_long_contexts():
    from pdserve.runner.triton_attention import MAX_SPLITS, SPLIT_MIN_TOKENS, num_splits

    sms = 132
    assert num_splits(128 * 8, 1024, sms) == 1  # a full batch already fills the device
    assert num_splits(8 * 8, 8192, sms) == 5  # 64 programs: 5 slices make 2 waves of 132
    assert num_splits(1 * 8, 2048, sms) == 2048 // SPLIT_MIN_TOKENS  # no slice under SPLIT_MIN_TOKENS keys
    assert num_splits(1, 1 << 20, sms) == MAX_SPLITS
    assert num_splits(8, SPLIT_MIN_TOKENS - 1, sms) == 1 and num_splits(0, 4096, sms) == 1
    for programs in (1, 7, 64, 300):
        for context in (1, 500, 4096, 100_000):
            s = num_splits(programs, context, sms)
            assert 1 <= s <= MAX_SPLITS and (s == 1 or context // s >= SPLIT_MIN_TOKENS)


def test_paged_attention_reads_only_its_blocks(triton):
    """Garbage outside a request's blocks (and past its length in its last block) does not reach its output."""
    from pdserve.runner import triton_attention as ta

    nh, nkv, d, bs = 4, 2, 16, 16
    pool = torch.randn(2, nkv, 8 * bs, d)
    i32 = dict(dtype=torch.int32)
    q_start, q_len, ctx_len = (torch.tensor([n], **i32) for n in (0, 1, 20))
    args = (q_start, q_len, ctx_len, torch.tensor([[5, 2]], **i32))
    q = torch.randn(1, nh, d)
    a, b = torch.empty_like(q), torch.empty_like(q)
    ta.paged_attention(q, a, pool, *args, torch.tensor([[0, 0]], **i32), bs, 0.25, 16)
    mask = torch.ones(8 * bs, dtype=torch.bool)
    mask[5 * bs : 6 * bs] = False
    mask[2 * bs : 2 * bs + 4] = False  # tokens 16..19 live in block 2
    pool[:, :, mask] = 1e4
    ta.paged_attention(q, b, pool, *args, torch.tensor([[0, 0]], **i32), bs, 0.25, 16)
    torch.testing.assert_close(a, b)


def test_rows_with_no_context_get_zeros(triton):
    """A graph's padding rows are a request with no context: its rows come out 0, not what the buffer held."""
    from pdserve.runner import triton_attention as ta

    i32 = dict(dtype=torch.int32)
    q, pool = torch.randn(3, 4, 16), torch.randn(2, 2, 32, 16)
    out = torch.full_like(q, float("nan"))
    args = (torch.tensor([0], **i32), torch.tensor([3], **i32), torch.tensor([0], **i32), torch.zeros(1, 2, **i32))
    ta.paged_attention(q, out, pool, *args, torch.tensor([[0, 0]], **i32), 16, 0.25, 16)
    assert torch.equal(out, torch.zeros_like(q))


# ---- packed inputs and graph buckets ---------------------------------------------------------------


def test_token_counts_of_bench_gpus_settings():
    """--max-num-seqs 128: every 16 tokens up to 128 (decode steps), then 4 an octave: 28 buckets up to 2,048
    tokens (44 before), 32 up to 4,096 (52 before)."""
    mixed = [*range(160, 257, 32), *range(320, 513, 64), *range(640, 1025, 128), *range(1280, 2049, 256)]
    assert token_counts(2048, 128) == [1, 2, 4, 8, *range(16, 129, 16), *mixed]
    assert token_counts(4096, 128) == token_counts(2048, 128) + [2560, 3072, 3584, 4096]
    assert token_counts(20, 6) == [1, 2, 4, 6, 8, 16, 20] and token_counts(1, 16) == [1]
    assert token_counts(4096, 256)[:20] == [1, 2, 4, 8, *range(16, 257, 16)]  # decode steps up to 256 requests


@pytest.mark.parametrize("max_tokens,max_seqs", [(2048, 128), (4096, 128), (512, 16), (3000, 200), (24, 8), (7, 3)])
def test_token_counts_hold_every_step_and_pad_little(max_tokens, max_seqs):
    """Every step size up to the budget has a bucket; a decode step (at most --max-num-seqs tokens) pads by at most
    15 tokens, a larger (mixed) one by at most a quarter; a full decode step and the budget are buckets."""
    sizes = token_counts(max_tokens, max_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_tokens
    assert min(max_seqs, max_tokens) in sizes
    for t in range(1, max_tokens + 1):
        b = next(s for s in sizes if s >= t)
        assert b - t <= (15 if t <= max(max_seqs, 128) else max(15, t // 4)), (t, b)


def test_pick_the_smallest_bucket_that_holds_a_step():
    buckets = plan(512, 16)
    assert buckets[:5] == [Bucket(1, 1, 1), Bucket(2, 2, 2), Bucket(4, 4, 4), Bucket(8, 8, 8), Bucket(16, 16, 16)]
    assert buckets[-1] == Bucket(512, 16, 16)
    assert pick(buckets, 3, 3, 3) == Bucket(4, 4, 4)  # three decodes
    assert pick(buckets, 40, 5, 5) == Bucket(48, 16, 16)  # a prompt chunk beside decodes
    assert pick(buckets, 5, 1, 5) == Bucket(8, 8, 8)  # a 5-token prompt echoed: 4 prompt rows and its last
    assert pick(buckets, 512, 16, 16) == Bucket(512, 16, 16)
    assert pick(buckets, 100, 1, 100) is None  # more scored rows than any bucket computes: eager
    assert pick(buckets, 513, 1, 1) is None


def _engine(tiny_models):
    from pdserve.config import EngineConfig
    from pdserve.nodes.parts import build_engine

    return build_engine(EngineConfig(model=str(tiny_models["qwen3"]), attention_backend="triton", num_kv_blocks=32))


def test_packed_inputs_padded_for_a_graph(triton, tiny_models):
    """A mixed step packed into a larger bucket: real rows first, padding rows store nowhere and attend to no
    context, padding requests have no rows, padding work items (tile -1) no work, padding sampled rows read row 0;
    the views read the packed values back."""
    backend = _engine(tiny_models).runner.backend  # tiny: 4 heads, 2 KV heads, so 2 query rows per token
    chunks = [Chunk(0, 1, 20, [3, 7]), Chunk(1, 2, 0, [5])]
    lay = backend.bucket_layout(4, 4, 4, width=6)
    assert lay.requests == 5 and lay.tiles == backend.max_tiles(4, 5) == 1 + 5
    host = backend.pack(lay, [11, 12, 13], [20, 0, 1], [7 * 16 + 4, 5 * 16, 5 * 16 + 1], [0, 2], chunks)
    assert host.numel() == lay.size() - (6 - 2) * 5  # only the 2 block-table columns in use travel
    dev = torch.full((lay.size(),), 77, dtype=torch.int32)  # a graph's buffer, stale past the copied prefix
    dev[: host.numel()] = host
    inp = backend.views(dev, lay)
    assert inp.input_ids.tolist() == [11, 12, 13, 0] and inp.positions.tolist() == [20, 0, 1, 0]
    assert inp.slot_mapping.tolist() == [116, 80, 81, -1] and inp.sample_index.tolist() == [0, 2, 0, 0]
    m = inp.attn
    # the padding row (3) is a request of its own with no context; then one padding request, no rows
    assert m.q_start.tolist()[:3] == [0, 1, 3] and m.q_len.tolist() == [1, 2, 1, 0, 0]
    assert m.ctx_len.tolist() == [21, 2, 0, 0, 0]
    assert m.work.tolist() == [[0, 0], [1, 0], [2, 0], [0, -1], [0, -1], [0, -1]]
    assert m.block_tables[0, :2].tolist() == [3, 7] and m.block_tables[1, 0] == 5


def test_packed_inputs_of_a_mixed_step(triton, tiny_models):
    backend = _engine(tiny_models).runner.backend
    chunks = [Chunk(0, 1, 20, [3, 7]), Chunk(1, 40, 0, [1, 2, 4])]
    inp = backend.inputs(list(range(41)), [20, *range(40)], list(range(41)), [0, 40], chunks)
    m = inp.attn
    assert m.work.tolist() == [[0, 0]] + [[1, t] for t in range(cdiv(40 * 2, TILE_M))]  # one list, no padding
    assert m.q_start.tolist() == [0, 1] and m.ctx_len.tolist() == [21, 40]
    assert m.block_tables.tolist() == [[3, 7, 0], [1, 2, 4]]
    assert inp.sample_index.tolist() == [0, 40]


# ---- the batched sampler ---------------------------------------------------------------------------


def _req(rid: str, params: SamplingParams, outputs: int = 0) -> Request:
    return Request(rid, [1, 2, 3], params, output_token_ids=[0] * outputs)


def test_seeded_draws_do_not_depend_on_the_batch():
    sampler = Sampler()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    params = [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.3, top_k=20, seed=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.7, seed=99),
        SamplingParams(temperature=0.5, top_k=30, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0),
    ]
    reqs = [_req(str(i), p, outputs=i) for i, p in enumerate(params)]
    together = sampler(logits, reqs).tokens
    alone = [sampler(logits[i : i + 1], [r]).tokens[0] for i, r in enumerate(reqs)]
    assert [together[i] for i in (0, 1, 3, 4)] == [alone[i] for i in (0, 1, 3, 4)]
    assert together[2] == int(logits[2].argmax())
    other = Sampler()  # another process, another salt: the seeded draws are the same there
    assert [other(logits, reqs).tokens[i] for i in (0, 1, 3, 4)] == [together[i] for i in (0, 1, 3, 4)]


def test_sampler_respects_top_k_and_top_p():
    sampler = Sampler()
    logits = torch.linspace(0, 8, 64)[None].repeat(200, 1)  # token 63 most likely
    top3 = [_req(f"k{i}", SamplingParams(temperature=5.0, top_k=3, seed=i)) for i in range(200)]
    assert set(sampler(logits, top3).tokens) <= {61, 62, 63}
    probs = (logits[0] / 1.0).softmax(-1)
    keep = int((probs.sort(descending=True).values.cumsum(0) < 0.5).sum()) + 1  # smallest set reaching 0.5
    top_p = [_req(f"p{i}", SamplingParams(temperature=1.0, top_p=0.5, seed=i)) for i in range(200)]
    drawn = set(sampler(logits, top_p).tokens)
    assert drawn <= set(range(64 - keep, 64)) and len(drawn) > 1


def test_sampler_draws_from_the_distribution():
    """Gumbel-max over the hashed noise: frequencies follow softmax(logits / T) (a loose chi-square bound)."""
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    reqs = [_req(f"r{i}", SamplingParams(temperature=1.0, seed=i)) for i in range(4000)]
    counts = torch.bincount(torch.tensor(sampler(logits, reqs).tokens), minlength=4).float()
    expected = logits[0].softmax(-1) * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30, (counts, expected)  # 3 degrees of freedom: p < 1e-5 for a correct sampler


def test_step_draws_differ_and_repeat():
    sampler = Sampler()
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [sampler(logits, [_req("a", p, outputs=i)]).tokens[0] for i in range(8)]
    assert len(set(draws)) > 4  # each token index draws anew
    assert draws == [sampler(logits, [_req("b", p, outputs=i)]).tokens[0] for i in range(8)]  # the seed decides
