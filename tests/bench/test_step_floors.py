"""bench.floors.step_floors: each step beside its own floor, decode-only ones grouped by batch size."""

from __future__ import annotations

import pytest

from bench.floors import StepWeights, step_floors

WEIGHTS = StepWeights(10**9, 4 * 10**8, 10**8)  # 1 GB read a step; 4e8 weights in the layers, 1e8 in the LM head


def record(requests: int, tokens: int, decode: int, context: int, seconds: float, samples: int | None = None) -> dict:
    samples = requests if samples is None else samples
    return {
        "requests": requests,
        "tokens": tokens,
        "decode_tokens": decode,
        "samples": samples,
        "context": context,
        "seconds": seconds,
    }


def test_decode_steps_are_grouped_by_batch_size_against_the_memory_floor():
    records = [record(1, 1, 1, 100, 0.004), record(8, 8, 8, 800, 0.006), record(9, 9, 9, 0, 0.01)]
    records += [record(128, 128, 128, 1000, 0.02), record(200, 200, 200, 1000, 0.03)]
    # weights 1 GB, 1 MB of KV a token, a 500 GB/s copy: the floor moves 1e9 + context x 1e6 bytes at 1,000 GB/s
    g = step_floors(records, WEIGHTS, 10**6, 500.0, 1e15)
    assert [k for k in g] == ["decode 1-8", "decode 9-32", "decode 33-128", "decode 129-256", "prompt chunks"]
    assert g["decode 1-8"]["steps"] == 2 and g["decode 9-32"]["steps"] == 1
    assert g["decode 1-8"]["floor_s"] == pytest.approx((1.1e9 / 1e12 + 1.8e9 / 1e12) / 2)
    assert g["decode 1-8"]["ratio"] == pytest.approx(0.005 / g["decode 1-8"]["floor_s"])
    assert g["decode 9-32"]["floor_s"] == pytest.approx(1e-3) and g["decode 9-32"]["ratio"] == pytest.approx(10)
    assert g["decode 129-256"]["floor"] == "memory" and g["prompt chunks"] == {"floor": "compute", "steps": 0}


def test_a_step_with_a_prompt_chunk_goes_against_the_compute_floor():
    # 2,048 prompt tokens and 4 decode tokens, 5 rows sampled (the decodes, and the chunk that ends its prompt):
    # 2,052 tokens x 2 FLOPs x 4e8 layer weights, and 5 rows x 2 FLOPs x 1e8 LM head weights, at 1e15 FLOP/s
    g = step_floors([record(5, 2052, 4, 3000, 0.01, samples=5)], WEIGHTS, 10**6, 500.0, 1e15)
    chunks = g["prompt chunks"]
    assert chunks["steps"] == 1 and chunks["floor_s"] == pytest.approx((2052 * 8e8 + 5 * 2e8) / 1e15)
    assert all(g[k]["steps"] == 0 for k in g if k.startswith("decode"))
    # a chunk that does not end its prompt samples only the decodes' rows: the LM head runs 4 times, not 2,052
    g = step_floors([record(5, 2052, 4, 3000, 0.01, samples=4)], WEIGHTS, 10**6, 500.0, 1e15)
    assert g["prompt chunks"]["floor_s"] == pytest.approx((2052 * 8e8 + 4 * 2e8) / 1e15)
