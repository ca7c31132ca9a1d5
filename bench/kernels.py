"""Kernels a step launches on the GPU code path, counted on the CPU (Triton under its interpreter).

    TRITON_INTERPRET=1 python -m bench.kernels                 # 28 layers, qwen3-0.6b's layout, narrow
    TRITON_INTERPRET=1 python -m bench.kernels --json out.json

One decode step (`--decodes` requests, one token each) and one mixed step (the same decodes and a prompt
chunk after a cached past) run through the Triton backend's eager forward on a random model with
`qwen3-0.6b`'s layout (its layers, heads, KV heads and tied head) made narrow: how many kernels a layer
launches does not depend on its width. Counted, as a GPU would launch them:
- the ATen ops torch dispatches (seen by a `TorchDispatchMode`, so below the composite ops: transformers'
  RMSNorm is its ~8 casts, pow, mean, rsqrt and muls, `F.linear` a `mm`), except those that launch no
  work: views and other aliases, and allocations (`empty*`);
- each Triton kernel launch (the ATen ops the interpreter itself runs inside one are not counted);
- the sampler's ops for greedy rows, and the inputs' one host-to-device copy (on the CPU it is no op).
Per layer is the difference between the model and the same model with one layer, over the layers
removed; the rest is the step's fixed part (embedding, rotary tables, final norm, LM head, sampling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_WORK = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "detach",
    "alias",
    "set_",
    "resize_",
    "_reshape_alias",
}
INPUT_COPIES = 1  # the packed inputs' one host-to-device copy (a no-op on the CPU, where this counts)
BLOCK_SIZE = 16


def launches_work(func) -> bool:
    """An ATen op that launches a kernel on CUDA: not a view or alias of its input, not an allocation."""
    if func.__name__.split(".")[0] in NO_WORK:
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@contextmanager
def on_triton_launch(around):
    """While open, every Triton kernel launch runs inside `around(kernel, args, kwargs)` (a context manager)."""
    from pdserve.runner import triton_layers

    kernel_class = type(triton_layers._add_rms_norm_kernel)  # JITFunction, or InterpretedFunction on the CPU
    run = kernel_class.run

    def wrapped(fn, *args, **kwargs):
        if kwargs.get("warmup"):
            return run(fn, *args, **kwargs)
        with around(fn, args, kwargs):
            return run(fn, *args, **kwargs)

    kernel_class.run = wrapped
    try:
        yield
    finally:
        kernel_class.run = run


LAUNCH_OPTIONS = {"grid", "warmup", "num_warps", "num_stages", "num_ctas", "maxnreg"}


class TritonVariants:
    """The compiled variants Triton launches need, keyed as its JIT keys them: per argument, a tensor's dtype and
    whether its pointer is 16-byte aligned, an integer's width and whether it is 1 or a multiple of 16 (not for
    the arguments a kernel names in `do_not_specialize`), and the constexpr values. On a GPU each new key is a
    compilation; under the interpreter nothing compiles, and the keys say what would."""

    def __init__(self) -> None:
        self.keys: set[tuple] = set()

    @contextmanager
    def recording(self):
        def launch(fn, args, kwargs):
            self.keys.add(variant_key(fn, args, kwargs))
            yield

        with on_triton_launch(contextmanager(launch)):
            yield self


def variant_key(fn, args: tuple, kwargs: dict) -> tuple:
    names = fn.arg_names
    listed = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    opted_out = {names[i] if isinstance(i, int) else i for i in listed}
    spec = tuple(_arg_key(a, names[i] in opted_out) for i, a in enumerate(args))
    consts = tuple(sorted((k, str(v)) for k, v in kwargs.items() if k not in LAUNCH_OPTIONS))
    return fn.__name__, spec, consts


def _arg_key(a, opted_out: bool):
    if isinstance(a, torch.Tensor):
        return str(a.dtype), opted_out or a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        width = "i32" if -(2**31) <= a < 2**31 else "i64"
        return (width,) if opted_out else (width, a == 1, a % 16 == 0)
    return type(a).__name__


def _composite(func) -> bool:
    """An op defined by the ops it calls (CompositeImplicitAutograd), such as `linear` or `to`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


class KernelCounter(TorchDispatchMode):
    """Counts the work-launching ATen ops by name, and (with `triton_launches`) Triton kernel launches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _composite(func):  # under inference mode composite ops arrive whole: count what they expand to
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if not self.inside_triton and launches_work(func):
            self.ops[f"aten::{func.__name__.split('.')[0]}"] += 1
        return out

    @contextmanager
    def triton_launches(self):
        """Count each Triton launch (by kernel name) and nothing it dispatches meanwhile (the interpreter's copies)."""

        def launch(fn, args, kwargs):
            self.ops[f"triton::{fn.__name__}"] += 1
            self.inside_triton += 1
            try:
                yield
            finally:
                self.inside_triton -= 1

        with on_triton_launch(contextmanager(launch)):
            yield self

    def total(self) -> int:
        return sum(self.ops.values())


@dataclass(frozen=True)
class StepShape:
    decodes: int = 8  # requests decoding one token
    decode_past: int = 40  # tokens each already has
    chunk: int = 24  # the mixed step's prompt chunk
    chunk_past: int = 16  # tokens of that prompt already computed


def narrow_spec(layers: int):
    """qwen3-0.6b's layout (heads, KV heads, tied head, bf16) at a width the interpreter runs quickly."""
    from pdserve.checkpoint import BUILTIN_MODELS

    return dataclasses.replace(
        BUILTIN_MODELS["qwen3-0.6b"],
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        head_dim=16,
        num_layers=layers,
    )


def build_runner(layers: int, num_blocks: int = 64, device: str = "cpu"):
    """A ModelRunner on the Triton backend over a random narrow model (in memory, no checkpoint)."""
    import transformers

    from pdserve.checkpoint import hf_config
    from pdserve.kv.pool import KVPool
    from pdserve.runner.model import ModelRunner, kv_layout

    spec = narrow_spec(layers)
    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.bfloat16, attn_implementation="sdpa")
        .to(device)
        .eval()
    )
    pool = KVPool(kv_layout(model, BLOCK_SIZE, spec.dtype), num_blocks, device)
    return ModelRunner(model, pool, attention_backend="triton")


def step_chunks(shape: StepShape, mixed: bool) -> list[tuple[int, int]]:
    """(past, new tokens) per request of the step."""
    chunks = [(shape.decode_past, 1)] * shape.decodes
    return chunks + [(shape.chunk_past, shape.chunk)] if mixed else chunks


def flat_inputs(chunks: list[tuple[int, int]]):
    """The flat inputs of a step (ids, positions, slots, sampled rows, Chunks), blocks handed out in order."""
    from pdserve.kv.block_allocator import blocks_for
    from pdserve.runner.backends import Chunk

    ids, positions, slots, sample, out, next_block = [], [], [], [], [], 0
    for past, n in chunks:
        blocks = list(range(next_block, next_block + blocks_for(past + n, BLOCK_SIZE)))
        next_block += len(blocks)
        out.append(Chunk(len(ids), n, past, blocks))
        ids += [7] * n
        positions += range(past, past + n)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(past, past + n)]
        sample.append(len(ids) - 1)
    return ids, positions, slots, sample, out


def count_step(runner, chunks: list[tuple[int, int]]) -> Counter[str]:
    """Kernels of one eager step: inputs, forward, greedy sampling."""
    from pdserve.engine.request import Request
    from pdserve.runner.sampling import Sampler
    from pdserve.wire.params import SamplingParams

    flat = flat_inputs(chunks)
    requests = [Request(str(i), [7], SamplingParams(temperature=0.0)) for i in range(len(chunks))]
    sampler = Sampler()
    counter = KernelCounter()
    with torch.inference_mode(), counter, counter.triton_launches():
        logits = runner.forward(runner.backend.inputs(*flat))
        sampler.launch(logits, requests).wait()
    counter.ops["copy::inputs (host to device)"] += INPUT_COPIES
    return counter.ops


@dataclass
class StepCount:
    kind: str
    total: int  # kernels of the whole step at `layers`
    per_layer: float
    fixed: int  # the step's kernels outside the layers
    ops: dict[str, int]  # by name, at `layers`


def can_count(device: str) -> bool:
    """Triton runs on a CUDA device, or on the CPU under its interpreter."""
    return device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"


def count(layers: int = 28, shape: StepShape = StepShape(), device: str = "cpu") -> list[StepCount]:
    """The decode step and the mixed step, at `layers` and at one layer (for the per-layer difference)."""
    if not can_count(device):
        raise RuntimeError("run with TRITON_INTERPRET=1: the Triton kernels run on the CPU by the interpreter")
    full, one = build_runner(layers, device=device), build_runner(1, device=device)
    out = []
    for kind, mixed in (("decode", False), ("mixed", True)):
        chunks = step_chunks(shape, mixed)
        ops, base = count_step(full, chunks), count_step(one, chunks)
        total, single = sum(ops.values()), sum(base.values())
        per_layer = (total - single) / (layers - 1) if layers > 1 else float(single)
        out.append(StepCount(kind, total, per_layer, round(single - per_layer), dict(sorted(ops.items()))))
    return out


def limit(layers: int) -> int:
    """The most kernels a decode step may launch: 10 a layer and 20 besides."""
    return 10 * layers + 20


def markdown(counts: list[StepCount], layers: int) -> str:
    lines = [
        f"Kernels per step, {layers} layers (qwen3-0.6b's layout), Triton path traced on the CPU; "
        f"limit for a decode step: {limit(layers)}",
        "",
        "| step | kernels | per layer | outside the layers |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c.kind} | {c.total} | {c.per_layer:.1f} | {c.fixed} |" for c in counts]
    for c in counts:
        lines += ["", f"{c.kind} step, by op:", ""] + [f"    {n:>5}  {name}" for name, n in c.ops.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--decodes", type=int, default=StepShape.decodes, help="requests in the decode step")
    p.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda:N")
    p.add_argument("--json", default="", help="also write the counts to this JSON file")
    args = p.parse_args(argv)
    if args.layers < 1 or args.decodes < 1:
        p.error("--layers and --decodes must be at least 1")
    if not can_count(args.device):
        p.error("on the CPU, run with TRITON_INTERPRET=1 (Triton's interpreter runs the kernels)")
    counts = count(args.layers, StepShape(decodes=args.decodes), args.device)
    print(markdown(counts, args.layers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"layers": args.layers, "limit": limit(args.layers), "steps": [dataclasses.asdict(c) for c in counts]},
                f,
                indent=1,
            )
    return 0 if counts[0].total <= limit(args.layers) else 1


if __name__ == "__main__":
    sys.exit(main())
