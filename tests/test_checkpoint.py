"""Built-in checkpoints: a tied, bf16-saved model (the shape of `qwen3-0.6b`, made tiny) loads and serves."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open

from pdserve.checkpoint import BUILTIN_MODELS, ModelSpec, hf_config, write_random_checkpoint
from pdserve.config import EngineConfig
from pdserve.nodes.parts import build_engine
from tests.engine.test_engine import greedy_requests, run_engine
from tests.helpers import hf_greedy, mixed_workload

TIED_BF16 = ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024, seed=4, tie_embeddings=True, dtype="bfloat16")


def test_qwen3_06b_spec_builds_a_model_of_qwen3_06bs_size():
    """What the spec turns into (the transformers model of its config, on the meta device: no weights) has the
    published size of Qwen3-0.6B: 596,049,920 parameters, 440,467,456 without the embedding its head is tied to."""
    config = hf_config(BUILTIN_MODELS["qwen3-0.6b"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.lm_head.weight is model.model.embed_tokens.weight
    assert (total, total - model.model.embed_tokens.weight.numel()) == (596_049_920, 440_467_456)
    assert config.to_dict().get("dtype", config.to_dict().get("torch_dtype")) in ("bfloat16", torch.bfloat16)


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
    got = run_engine(build_engine(EngineConfig(model=str(path), dtype="float32")), greedy_requests(prompts, outs))
    assert [got[str(i)] for i in range(len(prompts))] == ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_loads_straight_into_its_tensors_without_transformers_loader(tmp_path, monkeypatch, dtype):
    """The weights go from the safetensors file into the model's own tensors (built on the meta device): the same
    values, dtype, tied head and rotary buffers as `from_pretrained`, which is not called."""
    from pdserve.runner.model import load_model

    path = tmp_path / "tied"
    write_random_checkpoint(path, TIED_BF16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))

    def refused(*_, **__):
        raise AssertionError("from_pretrained was called")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refused)
    model = load_model(path, dtype, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ours, theirs = model.state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)
    for name, buf in hf.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name


def test_a_checkpoint_whose_names_differ_goes_through_transformers(tmp_path, monkeypatch):
    from pdserve.runner import model as runner_model

    path = tmp_path / "tied"
    write_random_checkpoint(path, TIED_BF16)
    calls = []
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    weights["model.extra.weight"] = torch.zeros(2)  # a name the model has no parameter for
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert runner_model._load_direct(path, hf_config(TIED_BF16), torch.float32, torch.device("cpu")) is None
    model = runner_model.load_model(path, "float32", "cpu")
    assert len(calls) == 1 and model.lm_head.weight is model.model.embed_tokens.weight


def test_processes_resolving_one_built_in_at_once_take_turns_and_only_one_writes_it(tmp_path):
    """While this process holds the built-in's lock, another that resolves it blocks on the lock (seen in
    /proc/locks); once this one has written it and let go, the other finds it written and writes nothing."""
    import fcntl
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from pdserve import checkpoint

    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path)}
    folder = tmp_path / "models" / f"tiny-v{checkpoint.FORMAT_VERSION}"
    folder.parent.mkdir(parents=True)
    code = (
        "import pdserve.checkpoint as c; n = []; w = c.write_random_checkpoint\n"
        "c.write_random_checkpoint = lambda f, s: (n.append(f), w(f, s))\n"
        "c.resolve_model('tiny'); print(len(n))"
    )
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        inode = os.fstat(lock.fileno()).st_ino
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        try:
            while not any(
                f":{inode} " in line and "->" in line for line in Path("/proc/locks").read_text().splitlines()
            ):
                assert proc.poll() is None, "it finished without waiting for the lock"
                time.sleep(0.05)
            write_random_checkpoint(folder, BUILTIN_MODELS["tiny"])
        except BaseException:
            proc.kill()
            raise
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.split() == ["0"]  # it waited, then found the checkpoint written
