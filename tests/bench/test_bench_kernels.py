"""bench.kernels: what it counts (work-launching ATen ops as CUDA would launch them, Triton launches) and the
decode step's kernel count on a model of qwen3-0.6b's layout (4 of its 28 layers: a layer's launches do not
depend on how many there are, and the interpreter runs every launch in Python) through the fused Triton path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers import optional

optional("triton")

from bench import kernels as bk  # noqa: E402


def test_counter_counts_work_not_views_and_expands_composites():
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    counter = bk.KernelCounter()
    with torch.inference_mode(), counter:
        y = F.linear(x, w)  # composite: t (a view) + mm
        y.view(2, 32).transpose(0, 1)[0]  # views only
        torch.empty(3)  # an allocation
        y.to(torch.bfloat16)  # a cast: one kernel
        y.to(torch.float32)  # already float32: nothing
        y.add_(1)  # in place: one kernel
    assert counter.ops == {"aten::mm": 1, "aten::_to_copy": 1, "aten::add_": 1}


def test_a_decode_step_launches_at_most_ten_kernels_a_layer_and_twenty_besides():
    layers = 4
    runner = bk.build_runner(layers)
    ops = bk.count_step(runner, bk.step_chunks(bk.StepShape(decodes=2), mixed=False))
    total = sum(ops.values())
    assert total <= bk.limit(layers), ops
    # the mechanism: each layer is its 4 GEMMs (and the LM head's), the fused kernels and one attention launch
    assert ops["aten::mm"] == 4 * layers + 1
    assert ops["triton::_add_rms_norm_kernel"] == 2 * layers + 1
    for kernel in ("_qk_norm_rope_store_kernel", "_silu_mul_kernel", "_paged_attention_kernel"):
        assert ops[f"triton::{kernel}"] == layers
    assert not {"aten::pow", "aten::mean", "aten::rsqrt", "aten::silu", "aten::neg"} & set(ops)  # nothing unfused


def test_a_mixed_step_launches_what_a_decode_step_does():
    """Prompt chunks and decode tokens share one attention launch a layer."""
    runner = bk.build_runner(2)
    shape = bk.StepShape(decodes=2, chunk=5, chunk_past=16)
    decode = bk.count_step(runner, bk.step_chunks(shape, mixed=False))
    mixed = bk.count_step(runner, bk.step_chunks(shape, mixed=True))
    assert mixed["triton::_paged_attention_kernel"] == decode["triton::_paged_attention_kernel"] == 2
    assert mixed == decode


def test_a_split_decode_step_adds_one_combine_launch_a_layer():
    """Two decodes of 600-token contexts on a device of 64 multiprocessors: attention reads each context in 2 slices
    (split-K), and each layer launches the combine once beside its one attention launch, within the budget."""
    layers = 2
    runner = bk.build_runner(layers, num_blocks=96)
    runner.backend.multiprocessors = 64
    chunks = bk.step_chunks(bk.StepShape(decodes=2, decode_past=600), mixed=False)
    assert runner.backend.layout(2, 2, bk.flat_inputs(chunks)[-1]).splits == 2
    ops = bk.count_step(runner, chunks)
    assert ops["triton::_paged_attention_kernel"] == ops["triton::_combine_kernel"] == layers
    assert sum(ops.values()) <= bk.limit(layers), ops
