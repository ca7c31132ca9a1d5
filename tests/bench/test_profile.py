"""bench.profile: the weights a step reads, by which its GEMMs' GB/s and FLOP/s and its steps' floors are set."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from bench.profile import build, main, model_bytes
from pdserve.checkpoint import ModelSpec, write_random_checkpoint


@pytest.mark.parametrize("dtype, tied", [("float32", False), ("bfloat16", True)])
def test_the_weights_a_step_reads_are_every_weight_of_the_model(tmp_path, dtype, tied):
    """The runner takes the layers' projections (and an untied LM head) over from the model's modules: they count,
    a tied head once. float32 on the CPU: oneDNN's packed copies; bfloat16: plain tensors, as on a GPU."""
    spec = ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024, tie_embeddings=tied)
    write_random_checkpoint(tmp_path / "m", spec)
    (nbytes, count), _ = model_bytes(build(str(tmp_path / "m"), "cpu", dtype, 4, 64))
    config = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    with torch.device("meta"):
        every = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert count == every and nbytes == every * getattr(torch, dtype).itemsize


def test_every_profiled_step_runs_its_gemms_on_the_cpu(tmp_path):
    """CPU mode's sizes (tiny: a 512-token vocabulary) run every step the GPU's do: the prompt chunk's ids start at
    503, so they must wrap below the vocabulary, or that step fails in the embedding and profiles nothing."""
    out = tmp_path / "profile.json"
    assert main(["--device", "cpu", "--model", "tiny", "--out", str(out)]) == 0
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == ["decode-4", "decode-8", "chunk-64"]
    assert all(s["gemm"]["seconds"] > 0 for s in steps.values()), {n: s["gemm"] for n, s in steps.items()}
