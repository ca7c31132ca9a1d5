"""bench.attention: the bytes decode attention reads (the numerator of its bandwidth), and its run on the CPU, a tiny
shape under Triton's interpreter, through the same launch a GPU times."""

from __future__ import annotations

import json

import torch

from tests.helpers import optional

optional("triton")

from bench import attention as ba  # noqa: E402


def test_bytes_read_are_the_kv_of_every_context_and_the_block_tables():
    lay = ba.AttnLayout.of_model("qwen3-0.6b")
    assert (lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.dtype) == (16, 8, 128, torch.bfloat16)
    kv_per_token = 2 * 8 * 128 * 2  # K and V, 8 KV heads, head_dim 128, 2 bytes
    assert ba.attention_bytes(128, 1024, lay) == 128 * 1024 * kv_per_token + 128 * 64 * 4
    assert ba.attention_bytes(8, 8192, lay) == 8 * 8192 * kv_per_token + 8 * 512 * 4
    assert ba.attention_bytes(1, 17, lay) == 17 * kv_per_token + 2 * 4  # a partial block's id is read too


def test_the_cpu_runs_a_tiny_shape_and_writes_json(tmp_path):
    path = tmp_path / "attention.json"
    assert ba.main(["--device", "cpu", "--json", str(path)]) == 0
    (m,) = json.loads(path.read_text())["results"]
    assert (m["requests"], m["context"]) == ba.TINY_SHAPE
    assert m["bytes"] == ba.attention_bytes(*ba.TINY_SHAPE, ba.AttnLayout.of_model())
    assert m["seconds"] > 0 and m["gb_s"] == m["bytes"] / m["seconds"] / 1e9
    assert m["copy_gb_s"] is None  # the copy bandwidth is a GPU's


def test_the_timed_launch_computes_attention():
    """The case the GPU times is a real decode: its output matches a softmax over each request's gathered blocks."""
    lay = ba.AttnLayout(4, 2, 16, torch.float32, block_size=16)
    case = ba.build_case(2, 40, lay, torch.device("cpu"), splits=1)
    ba.launch(case, lay)
    _, _, _, tables, _ = case.meta
    for r in range(2):
        slots = torch.cat([torch.arange(b * 16, b * 16 + 16) for b in tables[r].tolist()])[:40]
        k, v = case.pool[0][:, slots], case.pool[1][:, slots]  # [nkv, L, d]
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)  # [nh, L, d]
        p = torch.softmax(torch.einsum("hd,hld->hl", case.q[r], k) / 4, -1)
        torch.testing.assert_close(case.out[r], torch.einsum("hl,hld->hd", p, v), atol=1e-5, rtol=1e-5)
