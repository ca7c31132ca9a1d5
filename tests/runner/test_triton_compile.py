"""The Triton kernels compile for the GPU, not only run under the interpreter: each kernel variant a step launches,
recorded under the interpreter as a GPU would launch it, is compiled by Triton's CUDA backend for Hopper (sm_90, the
H200 the GPU kit runs on), here on the CPU: compiling needs no GPU, only the ptxas Triton ships.

The interpreter runs a kernel as NumPy and accepts what the compiler may refuse (a type it cannot lower, a shape it
cannot lay out). On a GPU the bfloat16 attention also takes a path no CPU test runs: its `tl.dot` on bfloat16 operands
(the interpreter's is wrong, so there bfloat16 takes the float32 products, `triton_attention._interpreted`). The
steps recorded: a decode step and a step with a prompt chunk, at `qwen3-0.6b`'s widths in bfloat16 (the kit's
measurements) and `small`'s in float32 (gpu_check's exact checks), one layer each."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.helpers import optional

optional("triton")

from bench.kernels import BLOCK_SIZE, LAUNCH_OPTIONS, StepShape, flat_inputs, on_triton_launch, step_chunks  # noqa: E402

ROOT = Path(__file__).parents[2]
TARGET = ("cuda", 90, 32)  # backend, compute capability (Hopper), warp size
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}
MODELS = (("qwen3-0.6b", torch.bfloat16), ("small", torch.float32))

COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if triton.backends.backends.get("nvidia") is None:
    sys.exit(3)
failed = []
for module, name, signature, constexprs, options in json.load(sys.stdin):
    fn = getattr(importlib.import_module(module), name)
    try:
        triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(*TARGET), options=options)
    except Exception as e:
        failed.append(f"{name} {constexprs}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def launch_key(fn, args: tuple, kwargs: dict) -> tuple:
    """(module, kernel, {argument: Triton type or "constexpr"}, {constexpr: value}, compile options) of a launch."""
    given = dict(zip(fn.arg_names, args, strict=False)) | {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature, constexprs = {}, {}
    for p in inspect.signature(fn.fn).parameters.values():
        value = given.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[p.name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return fn.fn.__module__, fn.__name__, json.dumps(signature), json.dumps(constexprs), json.dumps(options)


def one_layer_runner(name: str, dtype: torch.dtype):
    """A ModelRunner on the Triton backend over one random layer of the built-in model `name`'s widths."""
    import transformers

    from pdserve.checkpoint import BUILTIN_MODELS, hf_config
    from pdserve.kv.pool import KVPool
    from pdserve.runner.model import ModelRunner, kv_layout

    spec = dataclasses.replace(BUILTIN_MODELS[name], num_layers=1, vocab_size=512, dtype=str(dtype).split(".")[1])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(spec), dtype=dtype).eval()
    return ModelRunner(model, KVPool(kv_layout(model, BLOCK_SIZE, spec.dtype), 64), attention_backend="triton")


def test_every_kernel_variant_of_a_step_compiles_for_sm90(monkeypatch):
    from pdserve.runner import triton_attention

    monkeypatch.setattr(triton_attention, "_interpreted", lambda: False)  # the kernels' arguments as on a GPU
    keys = set()

    @contextmanager
    def record(fn, args, kwargs):
        keys.add(launch_key(fn, args, kwargs))
        yield

    with on_triton_launch(record), torch.inference_mode():
        for name, dtype in MODELS:
            runner = one_layer_runner(name, dtype)  # (its backend compiles the split-K combine at start)
            for mixed in (False, True):
                runner.forward(runner.backend.inputs(*flat_inputs(step_chunks(StepShape(), mixed))))
    bf16_dot = [k for k in keys if k[1] == "_paged_attention_kernel" and json.loads(k[3])["IEEE"] is False]
    assert bf16_dot, "the bfloat16 attention's GPU path was not recorded"
    launches = [[m, n, json.loads(s), json.loads(c), json.loads(o)] for m, n, s, c, o in sorted(keys)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernels as @triton.jit builds them
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = COMPILE.replace("TARGET", repr(TARGET))
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(launches),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == 3:
        pytest.skip("this triton has no CUDA backend")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
