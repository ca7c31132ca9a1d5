"""pdserve's own decoder modules (runner/decoder.py) hold what transformers' model of each family holds, compute
what its pieces compute, bitwise, and spare a node the import of transformers' modeling code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from pdserve.checkpoint import ModelSpec, hf_config, write_random_checkpoint
from pdserve.config import eos_token_ids, max_model_len
from pdserve.runner import decoder

SPECS = {
    "qwen3": ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024),
    "qwen3-tied": ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024, tie_embeddings=True),
    "llama": ModelSpec("llama", 512, 64, 128, 2, 4, 2, 16, 1024),
    "qwen2": ModelSpec("qwen2", 512, 64, 128, 2, 4, 2, 16, 1024),
    "mistral": ModelSpec("mistral", 512, 64, 128, 2, 4, 2, 16, 1024),
}


def both(name: str):
    """(ours, transformers') of one spec, the same random weights in each."""
    config = hf_config(SPECS[name])
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    ours = decoder.CausalLM(config).eval()
    ours.load_state_dict(theirs.state_dict())
    ours.tie_weights()
    return ours, theirs


@pytest.mark.parametrize("name", list(SPECS))
def test_the_modules_hold_transformers_parameters_and_buffers(name):
    ours, theirs = both(name)
    assert decoder.covers(ours.config)
    shapes = {n: p.shape for n, p in theirs.named_parameters()}  # a tied head appears once
    assert {n: p.shape for n, p in ours.named_parameters()} == shapes
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == SPECS[name].tie_embeddings
    mine = dict(ours.named_buffers())
    assert mine.keys() == dict(theirs.named_buffers()).keys()
    assert all(torch.equal(mine[n], b) for n, b in theirs.named_buffers())
    assert ours.model.layers[0].self_attn.scaling == theirs.model.layers[0].self_attn.scaling


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pieces_the_runner_calls_compute_transformers_values_bitwise(name, dtype):
    ours, theirs = both(name)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=gen).to(dtype)  # [T, H]
    positions = torch.tensor([[0, 1, 2, 40, 41, 900, 1023]])  # [1, T]
    a, b = ours.model, theirs.model
    assert torch.equal(a.norm(x), b.norm(x))
    assert torch.equal(a.layers[1].input_layernorm(x), b.layers[1].input_layernorm(x))
    assert torch.equal(a.layers[0].mlp.act_fn(x), b.layers[0].mlp.act_fn(x))
    cos, sin = a.rotary_emb(x, positions)
    their_cos, their_sin = b.rotary_emb(x, positions)
    assert torch.equal(cos, their_cos) and torch.equal(sin, their_sin)
    q, k = torch.randn(7, 4, 16, generator=gen).to(dtype), torch.randn(7, 2, 16, generator=gen).to(dtype)
    rotate = sys.modules[type(b.layers[0].self_attn).__module__].apply_rotary_pos_emb
    mine, theirs_qk = decoder.apply_rotary_pos_emb(q, k, cos[0], sin[0]), rotate(q, k, cos[0], sin[0])
    assert all(torch.equal(m, t) for m, t in zip(mine, theirs_qk, strict=True))


def test_a_config_they_do_not_cover_is_left_to_transformers():
    config = hf_config(SPECS["llama"])
    assert decoder.covers(config)
    config.hidden_act = "gelu"
    assert not decoder.covers(config)
    config = hf_config(SPECS["llama"])
    config.rope_parameters = {**config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    assert not decoder.covers(config)


def test_a_runtime_rope_turns_the_step_graphs_off(caplog):
    """transformers recomputes a dynamic RoPE from the longest position, read on the host: no graph can capture
    that, so a runner on a GPU asked for graphs runs eagerly, and says so; a plain RoPE is captured."""
    from pdserve.runner.model import captures_graphs

    plain, dynamic = hf_config(SPECS["llama"]), hf_config(SPECS["llama"])
    dynamic.rope_parameters = {**dynamic.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    with caplog.at_level("WARNING", logger="pdserve.model"):
        assert captures_graphs(plain, True, gpu, "triton")
        assert not caplog.records
        assert not captures_graphs(dynamic, True, gpu, "triton")
        (warning,) = caplog.records
        assert "no CUDA graphs" in warning.getMessage() and "dynamic" in warning.getMessage()
        assert not captures_graphs(dynamic, True, cpu, "triton") and not captures_graphs(plain, False, gpu, "triton")
        assert not captures_graphs(plain, True, gpu, "torch") and len(caplog.records) == 1  # no warning off the GPU


READ = (*decoder.STATED, "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "model_type")


@pytest.mark.parametrize("name", list(SPECS))
def test_a_covered_config_is_read_as_transformers_reads_it(tmp_path, name):
    write_random_checkpoint(tmp_path / "m", SPECS[name])
    ours, theirs = decoder.read_config(tmp_path / "m"), transformers.AutoConfig.from_pretrained(tmp_path / "m")
    assert isinstance(ours, decoder.DecoderConfig)
    assert {k: getattr(ours, k) for k in READ} == {k: getattr(theirs, k) for k in READ}
    assert decoder.head_dim(ours) == decoder.head_dim(theirs) and max_model_len(ours) == max_model_len(theirs)
    assert eos_token_ids(ours) == eos_token_ids(theirs)
    for k in ("attention_bias", "mlp_bias"):
        assert getattr(ours, k, False) == getattr(theirs, k, False)


def test_the_rope_format_before_transformers_5_is_read_too():
    values = {**{k: 1 for k in decoder.STATED}, "model_type": "llama", "hidden_act": "silu", "rope_theta": 500000.0}
    assert decoder.DecoderConfig.of(values).rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}


@pytest.mark.parametrize(
    "change",
    [
        {"rms_norm_eps": None},  # a value left to the family's default
        {"head_dim": None},  # Qwen3's default is 128, not hidden_size / heads
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
        {"model_type": "gemma"},
    ],
)
def test_a_config_not_stated_whole_is_read_by_transformers(tmp_path, change):
    write_random_checkpoint(tmp_path / "m", SPECS["qwen3"])
    values = {**json.loads((tmp_path / "m" / "config.json").read_text()), **change}
    assert decoder.DecoderConfig.of({k: v for k, v in values.items() if v is not None}) is None


def test_loading_a_checkpoint_imports_no_modeling_code(tiny_models):
    """The mechanism: a node that loads a covered checkpoint imports neither transformers' models package (its
    config classes, its modeling code) nor what they bring (transformers' generation code, torch._dynamo)."""
    code = (
        "import sys\n"
        "from pdserve.runner.model import load_model\n"
        f"model = load_model({str(tiny_models['qwen3'])!r}, 'float32', 'cpu')\n"
        "print(type(model).__module__)\n"
        "heavy = ('transformers.models', 'transformers.generation.utils', 'torch._dynamo')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["pdserve.runner.decoder", "[]"]
