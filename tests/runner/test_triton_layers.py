"""The fused layer kernels (Triton, run by its interpreter on the CPU) against the Hugging Face modules they
replace, in bfloat16, float16 and float32. The kernels use no `tl.dot`, so the interpreter computes them as a
GPU would (its bf16 `tl.dot` caveat does not arise); bf16/fp16 results must match torch to one rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import optional

optional("triton")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _tol(dtype: torch.dtype) -> dict:
    """One unit in the last place of the dtype (float32: the reduction order's few ulps)."""
    return {
        torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
        torch.float16: dict(atol=1e-3, rtol=1e-3),
        torch.float32: dict(atol=1e-5, rtol=1e-5),
    }[dtype]


def _norm(hidden: int, dtype: torch.dtype, gen: torch.Generator):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(hidden, eps=1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_matches_the_module(dtype, hidden):
    from pdserve.runner import triton_layers as tk

    g = torch.Generator().manual_seed(hidden)
    norm = _norm(hidden, dtype, g)
    h = torch.randn(5, hidden, generator=g).to(dtype)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    want_h = h + x  # the decoder layer's residual add, in the dtype
    got_h = h.clone()
    got = tk.add_rms_norm(got_h, x, norm.weight, norm.variance_epsilon)
    assert torch.equal(got_h, want_h)  # the residual is one rounding of the float32 sum, as torch's add
    torch.testing.assert_close(got, norm(want_h), **_tol(dtype))
    alone = tk.add_rms_norm(h.clone(), None, norm.weight, norm.variance_epsilon)  # no residual: the norm alone
    torch.testing.assert_close(alone, norm(h), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_store_matches_the_modules(dtype, with_norm):
    """q/k RMSNorm (Qwen3) or none (Llama), rotary as `apply_rotary_pos_emb`, k and v into their slots; a
    padding row (slot -1) stores nothing; GQA (8 query heads over 2 KV heads)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from pdserve.runner import triton_layers as tk

    g = torch.Generator().manual_seed(int(with_norm))
    T, nh, nkv, d, S = 6, 8, 2, 32, 40
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.tensor([0, 3, 17, 30, 5, 1]).float()[:, None] * inv_freq[None]
    emb = torch.cat((angles, angles), dim=-1)  # [T, d], as HF's rotary embedding
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.tensor([3, 4, 17, -1, 30, 0], dtype=torch.int32)
    qn, kn = (_norm(d, dtype, g), _norm(d, dtype, g)) if with_norm else (None, None)
    q, k, v = (t.view(T, -1, d) for t in qkv.split([nh * d, nkv * d, nkv * d], dim=-1))
    if with_norm:
        q, k = qn(q), kn(k)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)

    pool = torch.zeros(2, nkv, S, d, dtype=dtype)
    got_qkv = qkv.clone()
    got_q = tk.qk_norm_rope_store(
        got_qkv, nh, nkv, d, qn.weight if qn else None, kn.weight if kn else None, 1e-6, cos, sin, pool, slots
    )
    assert got_q.data_ptr() == got_qkv.data_ptr() and got_q.shape == (T, nh, d)  # rotated in place
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    real = slots >= 0
    stored = slots[real].long()
    torch.testing.assert_close(pool[0][:, stored].transpose(0, 1), want_k[real], **_tol(dtype))
    assert torch.equal(pool[1][:, stored].transpose(0, 1), v[real])
    untouched = [s for s in range(S) if s not in stored.tolist()]
    assert not pool[:, :, untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    from pdserve.runner import triton_layers as tk

    g = torch.Generator().manual_seed(0)
    inter = tk.SILU_BLOCK + 40  # two column blocks, the second partly masked
    gate_up = (3 * torch.randn(3, 2 * inter, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([-1000.0, -100.0, -89.0, 50.0])  # exp overflows: silu is -0, not nan
    gate, up = gate_up.chunk(2, dim=-1)
    got = tk.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, **_tol(dtype))
    assert torch.isfinite(got).all()
