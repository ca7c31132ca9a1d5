"""The GPU engine's parts, tested on the CPU: the Triton kernels (by Triton's interpreter) against torch,
the packed inputs and their padding, the decode-graph buckets, and the batched sampler."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from helpers import optional

from pdserve.engine.backends import PREFILL_TILE_M, Chunk
from pdserve.engine.block_allocator import blocks_for, cdiv
from pdserve.engine.cuda_graphs import bucket_for, bucket_sizes, graphable
from pdserve.engine.request import Request
from pdserve.engine.sampling import Sampler
from pdserve.wire.protocol import SamplingParams


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


@pytest.mark.parametrize(
    "nh,nkv,d,bs,dtype",
    [(4, 4, 16, 16, torch.float32), (8, 2, 64, 16, torch.float32), (4, 1, 32, 32, torch.float32),
     (16, 8, 128, 16, torch.float16)],  # fmt: skip
)
def test_paged_attention_matches_torch(triton, nh, nkv, d, bs, dtype):
    """Decodes and prompt chunks (first chunks and chunks after a cached past), scattered blocks, GQA."""
    from pdserve.engine import triton_attention as ta

    g = torch.Generator().manual_seed(nh * d + bs)
    reqs = [(0, 19), (37, 1), (16, 7), (70, 1), (5, 1), (0, 1)]  # (past, new tokens)
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
    out = torch.full_like(q, float("nan"))
    group = nh // nkv
    decode = torch.tensor([r for r, (_, n) in enumerate(reqs) if n == 1], **i32)
    prefill = torch.tensor([(r, m) for r, (_, n) in enumerate(reqs) if n > 1
                            for m in range(cdiv(n * group, PREFILL_TILE_M))], **i32)  # fmt: skip
    args = (torch.tensor(q_start, **i32), torch.tensor([n for _, n in reqs], **i32),
            torch.tensor([p + n for p, n in reqs], **i32), bt)  # fmt: skip
    scale = 1 / math.sqrt(d)
    ta.paged_attention(q, out, pool, *args, decode, bs, scale, max(16, group))
    ta.paged_attention(q, out, pool, *args, prefill, bs, scale, PREFILL_TILE_M)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for r, ref in _reference(q, pool, q_start, reqs, tables, bs).items():
        got = out[q_start[r] : q_start[r] + reqs[r][1]].float()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_paged_attention_reads_only_its_blocks(triton):
    """Garbage outside a request's blocks (and past its length in its last block) does not reach its output."""
    from pdserve.engine import triton_attention as ta

    nh, nkv, d, bs = 4, 2, 16, 16
    pool = torch.randn(2, nkv, 8 * bs, d)
    i32 = dict(dtype=torch.int32)
    q_start, q_len, ctx_len = (torch.tensor([n], **i32) for n in (0, 1, 20))
    args = (q_start, q_len, ctx_len, torch.tensor([[5, 2]], **i32))
    q = torch.randn(1, nh, d)
    a, b = torch.empty_like(q), torch.empty_like(q)
    ta.paged_attention(q, a, pool, *args, torch.tensor([0], **i32), bs, 0.25, 16)
    mask = torch.ones(8 * bs, dtype=torch.bool)
    mask[5 * bs : 6 * bs] = False
    mask[2 * bs : 2 * bs + 4] = False  # tokens 16..19 live in block 2
    pool[:, :, mask] = 1e4
    ta.paged_attention(q, b, pool, *args, torch.tensor([0], **i32), bs, 0.25, 16)
    torch.testing.assert_close(a, b)


# ---- packed inputs and graph buckets ---------------------------------------------------------------


def test_bucket_sizes_cover_every_batch():
    assert bucket_sizes(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20] and bucket_sizes(1) == [1]
    sizes = bucket_sizes(50)
    for n in range(1, 51):
        b = bucket_for(n, sizes)
        assert b >= n and all(s < n for s in sizes if s < b)
    assert bucket_for(51, sizes) is None


def test_graphable_only_pure_decode_steps():
    dec = [Chunk(0, 1, 5, [0]), Chunk(1, 1, 9, [1])]
    assert graphable(dec, [0, 1])
    assert not graphable(dec, [0])  # a row that does not sample
    assert not graphable([*dec, Chunk(2, 4, 0, [2])], [0, 1, 5])  # a prompt chunk
    assert not graphable([Chunk(0, 1, 0, [0])], [0])  # a one-token prompt has no past
    assert not graphable([], [])


def test_packed_inputs_padded_for_a_graph(triton, tiny_models):
    """A decode step packed into a larger bucket: real rows first, padding rows store nowhere, padding
    requests attend to nothing; the views read the packed values back."""
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), attention_backend="triton", num_kv_blocks=32))
    backend = engine.runner.backend
    chunks = [Chunk(0, 1, 20, [3, 7]), Chunk(1, 1, 3, [5])]
    lay = backend.layout(4, 0, [], pad_requests=4, width=6)
    host = backend.pack(lay, [11, 12], [20, 3], [7 * 16 + 4, 5 * 16 + 3], [], chunks)
    assert host.numel() == lay.size() - (6 - 2) * 4  # only the 2 block-table columns in use travel
    dev = torch.full((lay.size(),), 77, dtype=torch.int32)  # a graph's buffer, stale past the copied prefix
    dev[: host.numel()] = host
    inp = backend.views(dev, lay)
    assert inp.input_ids.tolist() == [11, 12, 0, 0] and inp.positions.tolist() == [20, 3, 0, 0]
    assert inp.slot_mapping.tolist() == [116, 83, -1, -1]
    m = inp.attn
    assert m.q_len.tolist() == [1, 1, 0, 0] and m.ctx_len.tolist() == [21, 4, 0, 0]
    assert m.decode_work.tolist() == [0, 1, 2, 3] and m.prefill_work.shape == (0, 2)
    assert m.block_tables[0, :2].tolist() == [3, 7] and m.block_tables[1, 0] == 5
    assert inp.sample_index is None  # a graph samples every row


def test_packed_inputs_of_a_mixed_step(triton, tiny_models):
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), attention_backend="triton", num_kv_blocks=32))
    backend = engine.runner.backend  # tiny: 4 heads, 2 KV heads, so 2 query rows per token
    chunks = [Chunk(0, 1, 20, [3, 7]), Chunk(1, 40, 0, [1, 2, 4])]
    inp = backend.inputs(list(range(41)), [20, *range(40)], list(range(41)), [0, 40], chunks)
    m = inp.attn
    assert m.decode_work.tolist() == [0]
    assert m.prefill_work.tolist() == [[1, t] for t in range(cdiv(40 * 2, PREFILL_TILE_M))]
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
    params = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.3, top_k=20, seed=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.7, seed=99),
              SamplingParams(temperature=0.5, top_k=30, top_p=0.9, seed=3),
              SamplingParams(temperature=1.0)]  # fmt: skip
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


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the forward on the static inputs."""

    replays = 0

    def __init__(self, runner, inp, logits) -> None:
        self.runner, self.inp, self.logits = runner, inp, logits

    def replay(self) -> None:
        _EagerReplay.replays += 1
        self.logits.copy_(self.runner.forward(self.inp))


def test_graph_replay_path_equals_transformers(triton, tiny_models):
    """Decode steps through DecodeGraphs (bucketing, packing into a bucket's fixed buffer, padding rows and
    requests, reading the first n rows of logits), with each graph replay standing in as an eager forward
    over the static inputs: token for token the transformers output."""
    from helpers import hf_greedy, mixed_workload
    from test_engine import greedy_requests, run_engine

    from pdserve.config import EngineConfig
    from pdserve.engine.cuda_graphs import Captured, DecodeGraphs
    from pdserve.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), attention_backend="triton", max_num_seqs=6))
    runner = engine.runner
    graphs = DecodeGraphs(runner, max_batch=6, max_blocks=12)
    for b in graphs.sizes:
        lay, buffer, inp = graphs.static_inputs(b)
        logits = torch.empty(b, runner.model.config.vocab_size)
        graphs.captured[b] = Captured(_EagerReplay(runner, inp, logits), lay, buffer, inp, logits)
    runner.graphs = graphs
    prompts, outs = mixed_workload(6, 512, seed=2, max_prompt=24, max_out=10)  # the decodes are what replays
    got = run_engine(engine, greedy_requests(prompts, outs))
    assert [got[str(i)] for i in range(6)] == hf_greedy(tiny_models["qwen3"], prompts, outs)
    assert graphs.sizes == [1, 2, 4, 6] and _EagerReplay.replays > 5
