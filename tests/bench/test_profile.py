"""bench.profile: the weights a step reads, by which its GEMMs' GB/s and FLOP/s and its steps' floors are set."""

from __future__ import annotations

import pytest
import torch
import transformers

from bench.profile import build, model_bytes
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
