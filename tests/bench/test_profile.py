"""bench.profile: the weights a step reads, by which its GEMMs' GB/s and FLOP/s and its steps' floors are set."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch.autograd import DeviceType

from bench.profile import build, kernel_rows, kind, main, model_bytes, unmatched
from pdserve.checkpoint import ModelSpec, write_random_checkpoint


@pytest.mark.parametrize("dtype, tied", [("float32", False), ("float32", True), ("bfloat16", True)])
def test_a_steps_gemm_weights_are_the_layers_and_the_lm_heads(tmp_path, dtype, tied):
    """The runner takes the layers' projections (and an untied LM head) over from the model's modules: they count;
    the embedding table does not (a step looks rows up), the LM head does, once, apart from the layers' weights.
    float32 on the CPU: oneDNN's packed copies (a tied head's too); bfloat16: plain tensors, as on a GPU."""
    spec = ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024, tie_embeddings=tied)
    write_random_checkpoint(tmp_path / "m", spec)
    weights, _ = model_bytes(build(str(tmp_path / "m"), "cpu", dtype, 4, 64))
    config = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    with torch.device("meta"):
        params = dict(transformers.AutoModelForCausalLM.from_config(config).named_parameters())
    layers = sum(p.numel() for n, p in params.items() if "embed_tokens" not in n and "lm_head" not in n)
    assert (weights.body, weights.head) == (layers, 512 * 64)
    assert weights.nbytes == (layers + 512 * 64) * getattr(torch, dtype).itemsize


def test_on_a_gpu_only_device_kernels_count_each_once():
    """The profiler's averages hold an operator (its device time: its kernels'), each kernel, and ranges on the
    device timeline: a GPU step's table is the kernels alone, or the GEMMs would count twice; split-K attention's
    combine is attention's."""
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA

    def event(key, us, device, annotation=False):
        return SimpleNamespace(
            key=key, count=2, self_device_time_total=us, device_type=device, is_user_annotation=annotation
        )

    events = [
        event("aten::mm", 300, cpu),  # the operator: its kernel's time again
        event("sm90_xmma_gemm_bf16", 300, cuda),
        event("_paged_attention_kernel", 150, cuda),
        event("_combine_kernel", 50, cuda),
        event("engine step", 1000, cuda, annotation=True),
    ]
    rows = kernel_rows(events, True, 1e-3)
    assert [r["kernel"] for r in rows] == ["sm90_xmma_gemm_bf16", "_paged_attention_kernel", "_combine_kernel"]
    assert rows[0]["share"] == pytest.approx(0.3)
    assert [kind(r["kernel"]) for r in rows] == ["gemm", "attention", "attention"]
    result = {"steps": {"decode-128": {"attention": {"seconds": 2e-4}, "gemm": {"seconds": 0.0}}}}
    assert unmatched(result) == [("decode-128", "gemm")]


def test_every_profiled_step_runs_its_gemms_and_attention_on_the_cpu(tmp_path):
    """CPU mode's sizes (tiny: a 512-token vocabulary) run every step the GPU's do: the prompt chunk's ids start at
    503, so they must wrap below the vocabulary, or that step fails in the embedding and profiles nothing. Decode
    attention on the CPU is a C kernel, which the profiler sees only through the range bench.profile names it by."""
    from pdserve.runner import kernels

    out = tmp_path / "profile.json"
    assert main(["--device", "cpu", "--model", "tiny", "--out", str(out)]) == 0
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == ["decode-4", "decode-8", "chunk-64"]
    assert all(s["gemm"]["seconds"] > 0 for s in steps.values()), {n: s["gemm"] for n, s in steps.items()}
    assert unmatched({"steps": steps}) == []  # every step's attention has a time too
    if kernels.load() is not None:  # the C kernels run (a C compiler was found)
        for name in ("decode-4", "decode-8"):
            names = [k["kernel"] for k in steps[name]["kernels"]]
            assert "pdserve::decode_attention" in names and "pdserve::rms_norm" in names, names
