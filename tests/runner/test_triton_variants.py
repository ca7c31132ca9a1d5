"""Nothing compiles after start: every Triton kernel variant a step can need is met during the engine's warm-up.

Triton compiles a kernel once per specialisation key (argument dtypes, pointer 16-byte alignment, integers
equal to 1 or divisible by 16, constexprs). Under the interpreter nothing compiles, so the tests record the
keys each launch would need (`bench.kernels.TritonVariants`) and check that serving varied batches after
warm-up needs no key the warm-up did not meet."""

from __future__ import annotations

import torch

from tests.helpers import optional

optional("triton")

from bench.kernels import TritonVariants  # noqa: E402
from pdserve.runner.backends import SEGMENT_ALIGN, Chunk  # noqa: E402


def test_a_misaligned_pointer_is_another_variant():
    from pdserve.runner import triton_layers as tk

    variants = TritonVariants()
    buf = torch.zeros(70, dtype=torch.int32)
    qkv = torch.zeros(1, 4 * 16)
    pool = torch.zeros(2, 1, 8, 16)
    cos = torch.ones(1, 16)
    with variants.recording():
        for slots in (buf[0:1], buf[4:5], buf[1:2]):  # offsets 0 and 16 bytes alike; 4 bytes another variant
            slots.fill_(-1)
            tk.qk_norm_rope_store(qkv, 2, 1, 16, None, None, 1e-6, cos, cos, pool, slots)
    assert len(variants.keys) == 2


def test_packed_segments_start_16_bytes_aligned(tiny_models):
    from pdserve.config import EngineConfig
    from pdserve.nodes.parts import build_engine

    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"]), attention_backend="triton", num_kv_blocks=32))
    backend = engine.runner.backend
    for rows, chunks in ((3, [Chunk(0, 1, 4, [0]), Chunk(1, 2, 0, [1])]), (7, [Chunk(0, 7, 9, [2])])):
        lay = backend.layout(rows, len(chunks), chunks)
        assert all(off % SEGMENT_ALIGN == 0 for off in lay.offsets.values()), lay.offsets


def test_serving_after_warm_up_needs_no_new_variant(tiny_models):
    """Odd and even token counts, batch sizes 1..5, prompt chunks beside decodes, a 1-token prompt."""
    from pdserve.config import EngineConfig
    from pdserve.nodes.parts import build_engine
    from tests.engine.test_engine import greedy_requests, run_engine
    from tests.helpers import mixed_workload

    warm, served = TritonVariants(), TritonVariants()
    with warm.recording():
        engine = build_engine(
            EngineConfig(
                model=str(tiny_models["qwen3"]), attention_backend="triton", max_num_seqs=5, max_num_batched_tokens=37
            )
        )
    assert {k[0] for k in warm.keys} >= {
        "_add_rms_norm_kernel",
        "_qk_norm_rope_store_kernel",
        "_silu_mul_kernel",
        "_paged_attention_kernel",
        "_combine_kernel",  # split-K's, built at start though the warm-up step does not split
    }
    prompts, outs = mixed_workload(7, 512, seed=5, max_prompt=45, max_out=6)
    prompts.append([11])  # a one-token prompt
    outs.append(3)
    with served.recording():
        run_engine(engine, greedy_requests(prompts, outs))
    assert served.keys and not served.keys - warm.keys, served.keys - warm.keys
