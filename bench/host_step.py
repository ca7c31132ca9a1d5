"""Host time per engine step with the model forward stubbed, and the time a device would wait for the host.

    python -m bench.host_step                        # 128 and 256 running requests, this tree beside the one before
    python -m bench.host_step --record               # and write bench/results/<day>-<commit>-host-step.{json,md}
    python -m bench.host_step --device-ms 16 --record --label host-step-16ms   # a device step longer than the host's

The real engine (scheduler, block allocator with prefix caching, `ModelRunner.flatten`, the Triton backend's
packing of the inputs into one host buffer, the engine's update) runs decode steps of `--requests` running
requests of `--prompt` tokens (half of them greedy, the other half sampling with `--temperature` and top-p 0.95,
every other one seeded); the forward is stubbed, and so is the sampling's device work (the host side of the tree's
own sampler runs: the sampling parameters' building): a stub device runs each step for `--device-ms`, in launch
order, one after the other, and hands back made-up tokens (never a stop). Measured over
`--steps` steps, once every request decodes:
- host_ms: the host's wall time per step (launch and finish, the wait for the device taken out), and host_cpu_ms
  the CPU time the process spent per step (on a shared host the wall time also counts time others held the core);
- device_wait_ms: per step, how long the stub device sat idle between two steps, waiting for the host.
Variants, each in its own process, interleaved over `--repeats` rounds (the best round of each is reported; a
shared host is noisy): `before` and `before-async` (the engine of `--before`, by default the commit before the
persistent batch, checked out into a temporary folder), `sync` (this tree, one step at a time) and `async` (this
tree, `--async-scheduling`: step N+1 is scheduled and packed while step N runs). Each tree's own `ModelRunner.run`
prepares the inputs (its real input preparation, as on a GPU without graphs); only the forward is a stub.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("before", "before-async", "sync", "async")  # the tree before, then this tree; each sync and async


# ---- the worker: one variant, one process -----------------------------------------------------------------------
class StubDraw:
    """A step on the stub device: it ends `device_s` after the device is free and the step was submitted."""

    def __init__(self, device: StubDevice, drawn, ids) -> None:
        self.device = device
        self.done_at = device.submit()
        self.drawn = drawn
        self.ids = ids  # [S]: "on the device", for the next step's inputs

    def wait(self):
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.device.slept += left
        return self.drawn


class StubDevice:
    """Runs submitted steps one after the other, `device_s` each; counts its idle time between steps."""

    def __init__(self, device_s: float) -> None:
        self.device_s, self.free_at, self.idle, self.slept = device_s, 0.0, 0.0, 0.0

    def submit(self) -> float:
        now = time.perf_counter()
        if self.free_at:
            self.idle += max(0.0, now - self.free_at)
        self.free_at = max(now, self.free_at) + self.device_s
        return self.free_at


def stub_runner(backend, pool):
    """The tree's own `ModelRunner` with no model: its `run` prepares the step's inputs as it does on a GPU without
    graphs (the tree's input preparation, whatever it is: flatten and pack, or the persistent rows' gathers), then
    the stub forward returns at once; the packed inputs are copied to the "device" (a host tensor) as on a GPU."""
    from pdserve.runner.model import ModelRunner

    class StubRunner(ModelRunner):
        graph_captures = 0

        def __init__(self) -> None:
            self.backend, self.pool, self.graphs = backend, pool, None

        def forward(self, inp, out=None):
            return None

    return StubRunner()


class StubSampler:
    """The host side of the tree's own sampler (`sampler_host`: which rows are greedy, processed or guided, and the
    sampling rows' parameters, packed and made a tensor), then made-up tokens (never a stop), made once per step
    size and turn parity. The draw's device work, a few kernel launches on a GPU, is left out."""

    def __init__(self, device: StubDevice) -> None:
        from pdserve.runner.sampling import Sampler

        self.device, self.turn, self.made, self.sampler = device, 0, {}, Sampler()

    def launch(self, _logits, requests, _prompt_rows=(), rows=None):
        sampler_host(self.sampler, requests, rows)
        self.turn += 1
        key = (len(requests), self.turn % 2)
        if key not in self.made:
            import torch

            from pdserve.engine.draws import Drawn

            tokens = [1000 + (self.turn + i) % 1000 for i in range(len(requests))]
            self.made[key] = (Drawn(tokens, [None] * len(tokens), []), torch.tensor(tokens))
        return StubDraw(self.device, *self.made[key])


def sampler_host(sampler, requests, rows, V: int = 32000) -> None:
    """What the tree's `Sampler.draw` does on the host for a step: from the persistent rows (a tree whose sampler
    gathers) or request by request (the tree before: its `draw` and `sample`'s host lines, as they are there)."""
    import numpy as np
    import torch

    mod = sys.modules[type(sampler).__module__]
    if hasattr(sampler, "host_params"):  # its draw's host side in one method
        sampler.asked(requests, rows)
        greedy, processed, guided = sampler.flags(requests, rows)
        pick = np.flatnonzero(~greedy)
        torch.as_tensor(sampler.host_params(requests, rows, pick, V)[0])
        return
    if hasattr(sampler, "gather"):
        sampler.asked(requests, rows)
        greedy, processed, guided = sampler.flags(requests, rows)
        pick = np.flatnonzero(~greedy)
        params = sampler.gather(requests, rows, pick) if rows is not None else sampler.params(requests, pick)
        host = mod._packed(params, pick, V)
        mod._masks(host, V)
        torch.as_tensor(host)
        return
    [i for i, req in enumerate(requests) if req.params.logprobs is not None]  # launch
    [i for i, req in enumerate(requests) if req.params.processed]  # process_rows
    [i for i, req in enumerate(requests) if req.guide is not None]  # mask_rows
    picked = [i for i, req in enumerate(requests) if not req.params.greedy]
    torch.as_tensor(picked, dtype=torch.long)
    params = [(*row, 0.0)[:5] for row in [sampler.row_params(requests[i]) for i in picked]]
    f32 = mod._f32_bits
    torch.as_tensor([[f32(t), k if k > 0 else V, f32(p), key, f32(m)] for t, k, p, key, m in params], dtype=torch.int64)
    any(m > 0 for *_, m in params)
    any(0 < k < V or p < 1.0 for _, k, p, _, _ in params)


def triton_backend(pool):
    """The Triton backend's host side (packing); its kernel modules are not needed, nor imported."""
    for name in ("triton_attention", "triton_layers"):
        stub = types.ModuleType(name)
        stub.build_combine = lambda *a, **k: None  # split-K's kernel, built ahead on a GPU
        stub.num_splits = lambda *a: 1  # split-K's slice count (a few integer operations on the host)
        sys.modules.setdefault(f"pdserve.runner.{name}", stub)
    import torch

    from pdserve.runner.backends import TritonBackend

    return TritonBackend(pool, 1.0, None, torch.device("cpu"), num_heads=16, silu_gated=True)


def stub_engine(n: int, prompt: int, steps: int, device: StubDevice, ahead: bool):
    """An engine of the tree on sys.path, with the stubs for a model."""
    import dataclasses

    from pdserve.config import EngineConfig
    from pdserve.engine import engine as engine_mod
    from pdserve.engine.parts import EngineParts
    from pdserve.kv.pool import KVLayout, KVPool

    bs = 16
    layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=1, block_size=bs, dtype="float32", model_fingerprint="0")
    pool = KVPool(layout, n * (prompt + steps * 3 + 64) // bs, "cpu")
    fields = {f.name for f in dataclasses.fields(EngineParts)}
    extra = {"feeds": True} if "feeds" in fields else {}
    parts = EngineParts(
        types.SimpleNamespace(attach=lambda req: None),
        layout,
        pool,
        stub_runner(triton_backend(pool), pool),
        StubSampler(device),
        1 << 20,
        True,
        **extra,
    )
    cfg = {"max_num_seqs": n, "max_num_batched_tokens": 8192, "model": "tiny"}
    if ahead:
        cfg["async_scheduling"] = True
    if "parts" in inspect.signature(engine_mod.Engine).parameters:
        return engine_mod.Engine(EngineConfig(**cfg), parts)
    engine_mod.build_parts = lambda *a, **k: parts  # a tree whose engine built its own parts
    return engine_mod.Engine(EngineConfig(**cfg))


def measure(n: int, prompt: int, steps: int, device_ms: float, ahead: bool, temperature: float) -> dict:
    import random

    from pdserve.engine.request import Request

    try:
        from pdserve.wire.params import SamplingParams
    except ImportError:  # a tree from before the parameters had their own module
        from pdserve.wire.protocol import SamplingParams

    device = StubDevice(device_ms / 1000)
    engine = stub_engine(n, prompt, steps, device, ahead)
    rng = random.Random(0)
    for i in range(n):
        sampling = {"temperature": temperature, "top_p": 0.95, "seed": i if i % 4 == 1 else None} if i % 2 else {}
        params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, **{"temperature": 0, **sampling})
        engine.add(Request(str(i), [rng.randrange(1000) for _ in range(prompt)], params))
    iterate = (lambda: engine.finish(engine.due(engine.launch()))) if ahead else engine.step
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        iterate()  # the prompts
    for _ in range(3):
        iterate()  # every request decodes
    device.idle = device.slept = 0.0
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        iterate()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {
        "host_ms": (wall - device.slept) / steps * 1000,
        "host_cpu_ms": cpu / steps * 1000,
        "device_wait_ms": device.idle / steps * 1000,
    }


# ---- the driver ---------------------------------------------------------------------------------------------------
def before_commit() -> str:
    """The commit before the persistent batch came in (the parent of the commit that added engine/rows.py)."""
    cmd = ["git", "log", "--format=%H", "--reverse", "--diff-filter=A", "--", "pdserve/engine/rows.py"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not out:
        raise SystemExit("no commit adds pdserve/engine/rows.py in this checkout's history: give --before")
    return out[0] + "^"


def checkout(rev: str, into: Path) -> None:
    archive = subprocess.run(["git", "archive", rev, "pdserve"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def run_worker(tree: Path, variant: str, a: argparse.Namespace, n: int) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        variant,
        "--requests",
        str(n),
        "--prompt",
        str(a.prompt),
        "--steps",
        str(a.steps),
        "--device-ms",
        str(a.device_ms),
        "--temperature",
        str(a.temperature),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"the {variant} worker failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(a: argparse.Namespace) -> dict:
    rev = a.before or before_commit()
    results: dict[int, dict[str, list[dict]]] = {n: {v: [] for v in VARIANTS} for n in a.sizes}
    with tempfile.TemporaryDirectory() as tmp:
        checkout(rev, Path(tmp))
        trees = {"before": Path(tmp), "before-async": Path(tmp), "sync": ROOT, "async": ROOT}
        for r in range(a.repeats):
            for n in a.sizes:
                for v in VARIANTS:
                    results[n][v].append(run_worker(trees[v], v, a, n))
                    print(f"round {r + 1}, {n} requests, {v}: {results[n][v][-1]}", file=sys.stderr)
    before = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True)
    best = {
        n: {v: {k: min(x[k] for x in runs) for k in runs[0]} for v, runs in by.items()} for n, by in results.items()
    }
    return {
        "before": before.stdout.strip(),
        "device_ms": a.device_ms,
        "steps": a.steps,
        "prompt": a.prompt,
        "temperature": a.temperature,
        "repeats": a.repeats,
        "best": best,
        "runs": results,
    }


def markdown(res: dict, commit: str) -> str:
    lines = [
        f"# Host time per decode step, forward stubbed ({commit}, before: {res['before']})",
        "",
        f"Stub device step {res['device_ms']} ms; {res['steps']} decode steps of requests with "
        f"{res['prompt']}-token prompts, half greedy, half sampling at temperature {res.get('temperature', 0)} "
        f"(top-p 0.95, every other one seeded); best of {res['repeats']} interleaved rounds.",
        "",
        "Ratios are against the tree before in the same mode (sync against `before`, async against `before-async`).",
        "",
        "| requests | variant | host ms/step | host CPU ms/step | device waits ms/step | host CPU × before | "
        "wait × before host |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, by in res["best"].items():
        for v, m in by.items():
            ref = by["before-async" if v.endswith("async") else "before"]
            base, cpu = ref["host_ms"], ref["host_cpu_ms"]
            lines.append(
                f"| {n} | {v} | {m['host_ms']:.3f} | {m['host_cpu_ms']:.3f} | {m['device_wait_ms']:.3f} | "
                f"{m['host_cpu_ms'] / cpu:.2f} | {m['device_wait_ms'] / base:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 256], help="running requests")
    p.add_argument("--prompt", type=int, default=700, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=100, help="decode steps measured")
    p.add_argument("--device-ms", type=float, default=3.0, help="the stub device's time per step")
    p.add_argument("--temperature", type=float, default=0.8, help="the sampling half's temperature")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the best is reported")
    p.add_argument(
        "--before", default="", help="the commit compared with (default: the one before the persistent batch)"
    )
    p.add_argument("--record", action="store_true", help="write the result under bench/results")
    p.add_argument("--label", default="host-step", help="the recorded file's label (after the day and commit)")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(
            json.dumps(measure(a.requests, a.prompt, a.steps, a.device_ms, a.worker.endswith("async"), a.temperature))
        )
        return
    res = compare(a)
    from bench.run_bench import git_commit, recorded_name

    commit = git_commit()
    md = markdown(res, commit)
    print(md)
    if a.record:
        stem = ROOT / "bench" / "results" / recorded_name(a.label, commit, time.strftime("%Y-%m-%d", time.gmtime()))
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        stem.with_suffix(".md").write_text(md)


if __name__ == "__main__":
    main()
