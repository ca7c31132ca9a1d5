"""Built-in checkpoints: a tied, bf16-saved model (the shape of `qwen3-0.6b`, made tiny) loads and serves."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import hf_greedy, mixed_workload
from safetensors import safe_open
from test_engine import greedy_requests, run_engine

from pdserve.config import EngineConfig
from pdserve.engine.checkpoint import BUILTIN_MODELS, ModelSpec, write_random_checkpoint
from pdserve.engine.engine import Engine

TIED_BF16 = ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024, seed=4, tie_embeddings=True, dtype="bfloat16")


def test_qwen3_06b_spec_is_qwen3_06b_shaped():
    s = BUILTIN_MODELS["qwen3-0.6b"]
    shape = (s.num_layers, s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size)
    assert shape == (28, 1024, 3072, 16, 8, 128, 151936)
    assert s.tie_embeddings and s.dtype == "bfloat16"


def test_spec_rejects_an_unknown_save_dtype():
    with pytest.raises(ValueError, match="saved as"):
        ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024, dtype="float8")


def test_tied_bf16_checkpoint_loads_at_float32_and_serves_like_transformers(tmp_path):
    path = tmp_path / "tied"
    write_random_checkpoint(path, TIED_BF16)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert hf.dtype == torch.float32 and hf.lm_head.weight is hf.model.embed_tokens.weight
    prompts, outs = mixed_workload(6, 512, seed=5, max_prompt=60, max_out=8)
    ref = hf_greedy(path, prompts, outs)  # transformers ties the head to the embedding on load
    got = run_engine(Engine(EngineConfig(model=str(path), dtype="float32")), greedy_requests(prompts, outs))
    assert [got[str(i)] for i in range(len(prompts))] == ref
