"""pdserve's C kernels against torch: decode attention (on pools with scattered blocks), norms, silu*mul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kv.block_allocator import blocks_for
from pdserve.runner import kernels


@pytest.fixture(scope="module")
def kernel():
    k = kernels.load()
    assert k is not None, "the decode attention kernel did not build (is a C compiler installed?)"
    return k


def _sdpa_reference(q, kv, block_ids, lens, block_size, scale):
    out = []
    for i, (blocks, n) in enumerate(zip(block_ids, lens, strict=True)):
        slots = (torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k, v = kv[0][:, slots], kv[1][:, slots]  # [Hkv, n, d]
        o = F.scaled_dot_product_attention(q[i][:, None][None], k[None], v[None], scale=scale, enable_gqa=True)
        out.append(o[0, :, 0])  # [H, d]
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(8, 4, 64, 16), (4, 4, 20, 4), (8, 1, 32, 8)]
)
def test_decode_attention_matches_sdpa(kernel, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    kv = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=gen)
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 9]
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    block_ids, width = [], max(blocks_for(n, block_size) for n in lens)
    for n in lens:
        need = blocks_for(n, block_size)
        block_ids.append([perm.pop() for _ in range(need)])
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, blocks in enumerate(block_ids):
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    got = kernel.decode_attention(q, kv, tables, torch.tensor(lens, dtype=torch.int32), block_size, scale)
    want = _sdpa_reference(q, kv, block_ids, lens, block_size, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_mismatched_inputs(kernel):
    kv = torch.zeros(2, 4, 64, 16)
    tables, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError):
        kernel.decode_attention(torch.zeros(1, 6, 16), kv, tables, lens, 16, 1.0)  # 6 heads over 4 kv heads
    with pytest.raises(ValueError):
        kernel.decode_attention(torch.zeros(1, 8, 16), kv.double(), tables, lens, 16, 1.0)
    with pytest.raises(ValueError):
        kernel.decode_attention(torch.zeros(1, 8, 16), kv, tables.long(), lens, 16, 1.0)
    with pytest.raises(ValueError):
        kernel.decode_attention(
            torch.zeros(1, 8, 16), kv, tables, torch.full((1,), 65, dtype=torch.int32), 16, 1.0
        )  # > 4 blocks
    with pytest.raises(ValueError):
        kernel.decode_attention(
            torch.zeros(1, 8, 16), kv, torch.full((1, 4), 4, dtype=torch.int32), lens, 16, 1.0
        )  # pool has 4


@pytest.mark.parametrize("shape", [(1, 64), (16, 512), (300, 512), (7, 8, 20)])
def test_norms_and_silu_mul_match_torch(kernel, shape):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(shape, generator=gen), 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    torch.testing.assert_close(kernel.rms_norm(x, w, 1e-6), F.rms_norm(x, shape[-1:], w, 1e-6), rtol=1e-5, atol=1e-6)
    h, r = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    want_h = h + r
    got = kernel.add_rms_norm(h, r, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual is added in place
    torch.testing.assert_close(got, F.rms_norm(want_h, shape[-1:], w, 1e-5), rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernel.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_elementwise_kernels_refuse_what_does_not_fit(kernel):
    with pytest.raises(ValueError):
        kernel.rms_norm(torch.zeros(4, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError):
        kernel.rms_norm(torch.zeros(4, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(ValueError):
        kernel.add_rms_norm(torch.zeros(4, 8), torch.zeros(4, 9), torch.ones(8), 1e-6)
    with pytest.raises(ValueError):
        kernel.silu_mul(torch.zeros(4, 7))


def test_rope_store_matches_hf_rotary_and_writes_the_pool(kernel):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(2)
    T, H, Hkv, d, slots_total = 5, 4, 2, 16, 40
    qkv = torch.randn(T, (H + 2 * Hkv) * d, generator=gen)
    q, k, v = (t.view(T, -1, d) for t in qkv.split([H * d, Hkv * d, Hkv * d], dim=-1))  # strided views
    angles = torch.randn(T, d // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    kv = torch.zeros(2, Hkv, slots_total, d)
    slots = torch.tensor([3, 4, 17, 30, 0])
    got_q = kernel.rope_store(q, k, v, cos, sin, kv, slots)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kv[0][:, slots].transpose(0, 1), want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(kv[1][:, slots].transpose(0, 1), v)
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert not kv[:, :, untouched].any()
    with pytest.raises(ValueError):
        kernel.rope_store(q, k, v, cos, sin, kv, torch.tensor([0, 1, 2, 3, slots_total]))  # a slot outside


def test_decode_attention_refuses_what_it_would_read_out_of_bounds(kernel):
    kv = torch.zeros(2, 4, 64, 16)
    q, tables = torch.zeros(2, 8, 16), torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError):
        kernel.decode_attention(q, kv, tables, torch.ones(2, 2, dtype=torch.int32)[:, 0], 16, 1.0)  # strided lens
    with pytest.raises(ValueError):
        kernel.decode_attention(q, kv, tables[:1], lens, 16, 1.0)  # one table row for two queries
    with pytest.raises(ValueError):
        kernel.decode_attention(q, kv[:1].contiguous(), tables, lens, 16, 1.0)  # no V half
    with pytest.raises(ValueError):
        kernel.rope_store(
            q,
            q[:, :4],
            q[:, :4],
            torch.ones(2, 16),
            torch.ones(2, 16),
            kv[:1].contiguous(),
            torch.zeros(2, dtype=torch.long),
        )


def test_silu_mul_survives_large_negative_gates_and_the_process_keeps_denormals(kernel):
    gate_up = torch.tensor([[-1000.0, -100.0, -89.0, 50.0, 1.0, 1.0, 1.0, 1.0]])
    got = kernel.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate_up[:, :4]) * gate_up[:, 4:], rtol=1e-5, atol=1e-30)
    assert torch.isfinite(got).all()
    tiny = torch.tensor([1e-38]) / 100  # a denormal: flushed to 0 if the library had switched on flush-to-zero
    assert tiny.item() > 0
