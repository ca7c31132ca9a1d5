"""GPU check: pdserve on CUDA gives the right tokens, in a few minutes (docs/gpu.md).

    python scripts/gpu_check.py [--model small] [--out gpu_check.json]
    python scripts/gpu_check.py --device cpu --model tiny      # the same checks on the CPU: zmq and shm
    python scripts/gpu_check.py --faults [--device cpu --model tiny]   # the fault checks (f) alone

It starts four stacks in turn with `pdserve up` (prefill on cuda:0, decode on cuda:1 when there are
two GPUs, else both on cuda:0; on the CPU, `--device cpu` and shm where the GPU uses cuda_ipc):

| stack | dtype | mode | checks |
|---|---|---|---|
| fp32-colocated | float32 | colocated | (a), (c) |
| fp32-zmq | float32 | disagg, zmq | (a), (d) |
| fp32-cuda_ipc | float32 | disagg, cuda_ipc | (a), (c), (d) |
| bf16-cuda_ipc | bfloat16 | disagg, cuda_ipc | (b), (c) but seeds, (d) |

(a) Greedy, float32: every request's tokens equal transformers `generate` (greedy, one request at a
    time, float32, on the same device as the nodes). The requests are sent at once, so the engine
    batches them; prompts are 8 to 1024 tokens, so long ones are chunked. A mismatch is reported with
    its position and HF's logit gap there (a near-tie shows as a small gap).
(b) Greedy, bf16: replaying each served sequence through transformers in bf16, every served token's
    logit is within `--logit-tol` of the best logit at its position (bf16 rounding may flip near-ties).
(c) Sampling: `--sampled` requests (temperature 0.5/1/1.5, top-k off/1/20/100, top-p 1/0.9/0.5, every
    other one with a seed), sent at once: each completes with its `max_tokens` tokens and no error,
    every node is still up after them, each sampled token lies within its request's top-k and top-p
    set (checked on transformers' logits of the served sequence, a tolerance for the dtype), top-k 1
    gives the greedy tokens, and the seeded requests, sent again in reverse order with other
    neighbours, give the same tokens. That last part is judged in float32 only: bf16 logits move with
    the batch's shape (the GEMMs tile differently), so a seeded draw near a boundary may flip there
    (seen on the CPU, on a top-k 1 request); the bf16 stack reports its differing seeds.
(d) KV transfer: the prefill node's transfers (bytes over pull-to-ack time) beside a device-to-device
    copy between the same devices; every request's KV was transferred. Reported, not judged.
(e) A clean stop, every stack: once the stack is stopped (SIGTERM), the pools its nodes mapped are released (on a
    GPU, the device's memory that other processes hold is back to what it was before the stack started, within
    `RELEASE_SLACK_MB`; on the CPU, every pdserve shared-memory segment its processes had mapped is gone), and its
    log holds no traceback and not torch's cuda_ipc warning "Producer process has been terminated" (a pool freed
    while another process still mapped it).

(f) Faults (`--faults`, instead of the stacks above): a float32 stack over the shared pool (cuda_ipc; shm on the
    CPU) started node by node, not by `pdserve up` (which stops its stack when a child exits): two prefill nodes,
    one decode node, the router (`--local-prefill-max-tokens 0`: every request through a prefill node), the nodes
    at `--max-num-batched-tokens 32` so that a prompt takes several steps. 8 greedy requests of 128 to 256 tokens.
    (f1) prefill0 is SIGKILLed while the router counts at least 2 requests on it (stopped first, so that however fast
    the device they are still there): the router's `pdserve:requests_redispatched_total` must grow, and every
    request's tokens equal transformers'. (f2) the decode node is stopped (SIGTERM) and started again on its
    addresses: the pool it mapped is released (on the CPU, each shm segment it mapped is gone or still mapped by
    a live node, its owner; on a GPU, the device's free memory grows by its KV pool at least, less
    `RELEASE_SLACK_MB`, and after the restart is no lower than before the stop, less that slack), and the
    restarted node serves the requests exactly (on the CPU, both must have mapped the pool: proof it was used).
    (f3) the stack's clean stop, judged as (e), with every process of the stack (the nodes' own children
    included) gone and exiting 0.

`--url` checks a stack already running (the GPU kit starts one and shares it between its stages) instead of
starting one. Exit code 0 only if every check passes; the JSON report (`--out`) is rewritten after each stack, and
each stack's log is kept in `--log-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: bench/ and pdserve/ import from the checkout

from bench.gpu import copy_gbps  # noqa: E402
from bench.systems import Stack, free_port, node_counters  # noqa: E402
from pdserve.flags import engine_flags  # noqa: E402
from pdserve.process import unwind_once  # noqa: E402

TEMPERATURES = (0.5, 1.0, 1.5)
TOP_KS = (-1, 1, 20, 100)
TOP_PS = (1.0, 0.9, 0.5)
STACK_READY_S = 300.0
REQUEST_TIMEOUT_S = 300.0
SAMPLED_MAX_TOKENS = 16
FP32_LOGIT_EPS = 1e-3  # fp32: the engine's and HF's logits differ by rounding only
PROB_EPS = {"float32": 1e-4, "bfloat16": 0.05}  # slack on top-p's cumulative mass
SETTLE_S = 1.2  # nodes report counters to the router every 0.5 s
RELEASE_SLACK_MB = 64  # (e): the device's free memory after a stack stops may differ this much from before it
STOP_WARNINGS = ("Producer process has been terminated", "Traceback (most recent call last)")


@dataclass(frozen=True)
class StackPlan:
    name: str
    dtype: str
    mode: str
    transport: str  # zmq | shm | cuda_ipc (disagg only)
    greedy_exact: bool  # (a), else (b)
    sampling: bool  # (c)

    @property
    def seeds_judged(self) -> bool:
        return self.dtype == "float32"


def plans(device: str) -> list[StackPlan]:
    ipc = "cuda_ipc" if device.startswith("cuda") else "shm"
    return [
        StackPlan("fp32-colocated", "float32", "colocated", "zmq", True, True),
        StackPlan("fp32-zmq", "float32", "disagg", "zmq", True, False),
        StackPlan(f"fp32-{ipc}", "float32", "disagg", ipc, True, True),
        StackPlan(f"bf16-{ipc}", "bfloat16", "disagg", ipc, False, True),
    ]


def decode_device(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.device_count() > 1:
        return "cuda:1"
    return device


# ---- the stack -------------------------------------------------------------------------------------


def stack_argv(a: argparse.Namespace, plan: StackPlan, port: int) -> list[str]:
    disagg = plan.mode == "disagg"
    engine = engine_flags(
        model=a.model, dtype=plan.dtype, kv_cache_gb=a.kv_cache_gb, kv_transport=plan.transport if disagg else None
    )
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--mode",
        plan.mode,
        "--port",
        str(port),
        "--device",
        a.device,
        *engine,
    ]
    if disagg:
        argv += ["--prefill-device", a.device, "--decode-device", decode_device(a.device)]
    return argv


def start(a: argparse.Namespace, plan: StackPlan) -> tuple[Stack, str]:
    port = free_port()
    stack = Stack(stack_argv(a, plan, port), a.log_dir / f"gpu_check.{plan.name}.log")
    try:
        stack.wait_ready(STACK_READY_S)
    except BaseException:
        stack.stop()
        raise
    return stack, f"http://127.0.0.1:{port}"


async def complete_all(url: str, bodies: list[dict]) -> list[dict]:
    """POST every body at once to /v1/completions; each answer: its token ids, or the error."""
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        name = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(body: dict) -> dict:
            try:
                r = await client.post(
                    "/v1/completions", json={"model": name, "ignore_eos": True, "return_token_ids": True, **body}
                )
            except httpx.HTTPError as e:
                return {"error": f"{type(e).__name__}: {e}"}
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
            return {"tokens": r.json()["choices"][0]["token_ids"]}

        return await asyncio.gather(*(one(b) for b in bodies))


def serve(url: str, bodies: list[dict]) -> list[dict]:
    return asyncio.run(complete_all(url, bodies))


# ---- references (transformers, on the nodes' device) -----------------------------------------------


class Reference:
    """transformers' model of the checkpoint, per dtype, loaded once, on the prefill device."""

    def __init__(self, path: Path, device: str) -> None:
        self.path, self.device = path, device
        self.models: dict[str, object] = {}

    def model(self, dtype: str):
        if dtype not in self.models:
            import transformers

            self.models.clear()  # one at a time on the device
            m = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, dtype))
            self.models[dtype] = m.to(self.device).eval()
        return self.models[dtype]

    @torch.inference_mode()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        model = self.model("float32")
        x = torch.tensor([prompt], device=self.device)
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return y[0, len(prompt) :].tolist()

    @torch.inference_mode()
    def logits(self, dtype: str, prompt: list[int], out: list[int]) -> torch.Tensor:
        """[len(out), V] float32: the logits that chose each served token."""
        x = torch.tensor([prompt + out], device=self.device)
        return self.model(dtype)(x).logits[0, len(prompt) - 1 : -1].float()


# ---- checks ----------------------------------------------------------------------------------------


def greedy_bodies(prompts: list[list[int]], max_tokens: int) -> list[dict]:
    return [{"prompt": p, "max_tokens": max_tokens, "temperature": 0} for p in prompts]


def check_exact(ref: Reference, prompts: list[list[int]], answers: list[dict], expected: list[list[int]]) -> dict:
    """(a): served greedy tokens equal HF's; each mismatch with HF's logit gap at its first position."""
    errors = [a["error"] for a in answers if "error" in a]
    mismatches = []
    for i, (p, a, want) in enumerate(zip(prompts, answers, expected, strict=True)):
        got = a.get("tokens")
        if got is not None and got != want:
            j = next((k for k, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), min(len(got), len(want)))
            gap = None
            if j < min(len(got), len(want)):
                row = ref.logits("float32", p, want)[j]
                gap = float(row[want[j]] - row[got[j]])
            mismatches.append(
                {"request": i, "position": j, "served": got[j : j + 4], "hf": want[j : j + 4], "hf_logit_gap": gap}
            )
    exact = len(prompts) - len(errors) - len(mismatches)
    return {
        "requests": len(prompts),
        "exact": exact,
        "errors": errors[:5],
        "mismatches": mismatches[:10],
        "pass": exact == len(prompts),
    }


def check_logit_tol(ref: Reference, prompts: list[list[int]], answers: list[dict], tol: float) -> dict:
    """(b): every served token's logit within `tol` of the best at its position (HF bf16 replay)."""
    errors = [a["error"] for a in answers if "error" in a]
    gaps: list[float] = []
    for p, a in zip(prompts, answers, strict=True):
        if a.get("tokens"):
            logits = ref.logits("bfloat16", p, a["tokens"])
            served = logits.gather(1, torch.tensor(a["tokens"], device=logits.device)[:, None])[:, 0]
            gaps += (logits.max(-1).values - served).tolist()
    within = sum(g <= tol for g in gaps) / len(gaps) if gaps else 0.0
    return {
        "requests": len(prompts),
        "errors": errors[:5],
        "max_logit_gap": max(gaps, default=None),
        "tokens_within_tol": within,
        "pass": not errors and within == 1.0,
    }


def sampled_bodies(prompts: list[list[int]], n: int) -> list[dict]:
    """n requests cycling over temperature x top-k x top-p, each setting twice in a row: seeded, then not."""
    bodies = []
    for i in range(n):
        c = i // 2
        setting = {"temperature": TEMPERATURES[c % 3], "top_k": TOP_KS[(c // 3) % 4], "top_p": TOP_PS[(c // 12) % 3]}
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": SAMPLED_MAX_TOKENS, **setting}
        if i % 2 == 0:
            body["seed"] = 1000 + i
        bodies.append(body)
    return bodies


def allowed_rank(logits: torch.Tensor, body: dict, dtype: str) -> torch.Tensor:
    """[L] how many top tokens each position may sample from: min(top-k, top-p nucleus of logits / T),
    which holds whether the engine applies top-k before top-p or after."""
    probs = torch.softmax(logits / body["temperature"], -1).sort(-1, descending=True).values  # [L, V]
    before = probs.cumsum(-1) - probs  # [L, V]: mass of the tokens ranked above
    nucleus = (before < body["top_p"] + PROB_EPS[dtype]).sum(-1)  # [L]
    k = body["top_k"] if body["top_k"] > 0 else logits.shape[-1]
    return nucleus.clamp(max=k)


def out_of_set(ref: Reference, dtype: str, body: dict, tokens: list[int], eps: float) -> int:
    """How many of a request's sampled tokens rank outside its allowed set (ties within `eps` count in)."""
    logits = ref.logits(dtype, body["prompt"], tokens)  # [L, V]
    served = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])  # [L, 1]
    rank = (logits > served + eps).sum(-1)  # [L]: tokens clearly above the served one
    return int((rank >= allowed_rank(logits, body, dtype)).sum())


def check_sampling(ref: Reference, url: str, plan: StackPlan, bodies: list[dict], tol: float) -> dict:
    """(c): completes, nodes stay up, tokens in their top-k/top-p sets, top-k 1 greedy, seeds reproduce."""
    answers = serve(url, bodies)
    errors = [a["error"] for a in answers if "error" in a]
    short = sum(len(a.get("tokens", ())) != SAMPLED_MAX_TOKENS for a in answers if "tokens" in a)
    eps = FP32_LOGIT_EPS if plan.dtype == "float32" else tol
    pairs = [(b, a["tokens"]) for b, a in zip(bodies, answers, strict=True) if "tokens" in a]
    outside = sum(out_of_set(ref, plan.dtype, b, tokens, eps) for b, tokens in pairs)
    seeded = [i for i, b in enumerate(bodies) if "seed" in b][::-1]
    again = serve(url, [bodies[i] for i in seeded])
    differ = [i for i, a in zip(seeded, again, strict=True) if a.get("tokens") != answers[i].get("tokens")]
    health = httpx.get(url + "/health", timeout=10)
    r = {
        "requests": len(bodies),
        "errors": errors[:5],
        "num_errors": len(errors),
        "wrong_length": short,
        "tokens_outside_topk_topp": outside,
        "seeded": len(seeded),
        "seeded_differ": differ[:10],
        "healthy_after": health.status_code == 200,
        "sent": len(bodies) + len(seeded),
    }
    r["seeds_judged"] = plan.seeds_judged
    r["pass"] = not errors and not short and not outside and r["healthy_after"] and not (differ and plan.seeds_judged)
    return r


def check_top_k1_greedy(url: str, prompts: list[list[int]], expected: list[list[int]], n: int) -> dict:
    """top_k 1 at temperature 1 must give the greedy tokens."""
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 1.0, "top_k": 1} for p in prompts]
    answers = serve(url, bodies)
    same = sum(a.get("tokens") == e for a, e in zip(answers, expected, strict=True))
    return {"requests": len(bodies), "greedy": same, "pass": same == len(bodies)}


def kv_report(url: str, requests: int, device: str) -> dict:
    time.sleep(SETTLE_S)  # the prefill node's counters reach the router with its next stats message
    """Every request either had its KV shipped by a prefill node or, its prompt already cached on the decode node
    (a request sent again), was prefilled there (conditional disaggregation)."""
    roles = node_counters(httpx.get(url + "/metrics", timeout=10).text)
    c, local = roles.get("prefill", {}), int(roles.get("decode", {}).get("local_prefill_requests", 0))
    secs = c.get("kv_transfer_time_s", 0.0)
    gbps = c.get("kv_transfer_bytes", 0.0) / secs / 1e9 if secs else None
    copy = copy_gbps(device, decode_device(device), 64 * 2**20, 10)
    transfers = int(c.get("kv_transfers", 0))
    share = gbps / copy if gbps else None
    return {
        "transfers": transfers,
        "local_prefills": local,
        "requests": requests,
        "GBps": gbps,
        "copy_GBps": copy,
        "share_of_copy": share,
        "pass": transfers > 0 and transfers + local >= requests,
    }


# ---- main ------------------------------------------------------------------------------------------


def run_stack(a, plan: StackPlan, ref: Reference, prompts, expected, sampled: list[dict]) -> dict:
    t0, free_before = time.perf_counter(), free_device_mb(a.device)
    stack, url = (None, a.url) if a.url else start(a, plan)  # a stack of this run, or one the kit shares
    try:
        r: dict = {
            "dtype": plan.dtype,
            "mode": plan.mode,
            "transport": plan.transport,
            "start_s": time.perf_counter() - t0,
        }
        answers = serve(url, greedy_bodies(prompts, a.max_tokens))
        if plan.greedy_exact:
            r["greedy_exact"] = check_exact(ref, prompts, answers, expected)
        else:
            r["greedy_logit_tol"] = check_logit_tol(ref, prompts, answers, a.logit_tol)
        sent = len(prompts)
        if plan.sampling:
            r["sampling"] = check_sampling(ref, url, plan, sampled, a.logit_tol)
            sent += r["sampling"]["sent"]
            if plan.dtype == "float32":
                r["top_k1_greedy"] = check_top_k1_greedy(url, prompts, expected, a.max_tokens)
                sent += len(prompts)
        if plan.mode == "disagg":
            r["kv_transfer"] = kv_report(url, sent, a.device)
        segments = mapped_segments(descendants(stack.proc.pid)) if stack is not None else set()
    finally:
        if stack is not None:
            stack.stop()
    if stack is not None:  # a shared stack is judged by whoever stops it
        r["clean_stop"] = check_clean_stop(stack.log_path, segments, a.device, free_before)
    r["seconds"] = time.perf_counter() - t0
    r["pass"] = all(v["pass"] for v in r.values() if isinstance(v, dict))
    return r


# ---- (e) a clean stop -----------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def mapped_segments(pids: list[int]) -> set[str]:
    """The pdserve shared-memory segments (/dev/shm/pdserve-*) these processes map."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names |= {line.split()[-1] for line in maps.splitlines() if "/dev/shm/pdserve-" in line}
    return names


def free_device_mb(device: str) -> float | None:
    """The device's memory in MiB that no other process holds: its free memory plus what this process's allocator
    has reserved (the reference model's logits grow it while a stack runs). None on the CPU."""
    if not device.startswith("cuda"):
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return (free + torch.cuda.memory_reserved(device)) / 2**20


def device_total_gb(device: str) -> float | None:
    """The device's memory in GiB; None on the CPU."""
    if not device.startswith("cuda"):
        return None
    return torch.cuda.mem_get_info(torch.device(device))[1] / 2**30


def check_clean_stop(log: Path, segments: set[str], device: str, free_before: float | None) -> dict:
    """(e), after the stack stopped: its pools released, its log free of STOP_WARNINGS."""
    text = log.read_text(errors="replace") if log.exists() else ""
    warnings = {w: text.count(w) for w in STOP_WARNINGS if w in text}
    left = sorted(s for s in segments if Path(s).exists())
    free_after = free_device_mb(device)
    moved = None if free_before is None or free_after is None else free_before - free_after
    released = not left and (moved is None or moved <= RELEASE_SLACK_MB)
    return {
        "pass": released and not warnings,
        "segments_mapped": len(segments),
        "segments_left": left,
        "device_free_mb_before": free_before,
        "device_free_mb_after": free_after,
        "warnings": warnings,
    }


def make_prompts(n: int, vocab: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 3) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a smoke test of the checks")
    ap.add_argument("--requests", type=int, default=16, help="greedy requests per stack")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sampled", type=int, default=200, help="sampled requests per sampling stack")
    ap.add_argument("--logit-tol", type=float, default=0.5)
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="per node; default 1 on CUDA, 0.25 on the CPU")
    ap.add_argument("--stacks", nargs="*", default=None, help="run only these stacks (by name)")
    ap.add_argument("--url", default=None, help="check this running stack (one of --stacks) instead of starting it")
    ap.add_argument(
        "--faults",
        action="store_true",
        help="run the fault checks (f) instead, on nodes of their own (not --url's stack): float32 over a shared pool",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    unwind_once(signal.SIGTERM, exit_code=True)  # SIGTERM stops the started stacks by PID
    if a.url and (a.stacks is None or len(a.stacks) != 1):
        print("gpu_check: --url checks one stack: name it with --stacks")
        return 2
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check (try --device cpu)")
        return 2
    a.kv_cache_gb = a.kv_cache_gb or (1.0 if a.device.startswith("cuda") else 0.25)
    a.log_dir.mkdir(parents=True, exist_ok=True)
    import transformers

    from pdserve.checkpoint import resolve_model

    t0 = time.perf_counter()
    path = resolve_model(a.model)
    vocab = transformers.AutoConfig.from_pretrained(path, local_files_only=True).vocab_size
    if a.faults:  # (f) alone, on stacks of its own
        report = faults_main(a, path, vocab, t0)
        print(json.dumps(report, indent=2))
        return 0 if report["pass"] else 1
    prompts = make_prompts(a.requests, vocab, 0, 8, 1024)
    sampled = sampled_bodies(make_prompts(a.sampled, vocab, 1, 4, 256), a.sampled)
    ref = Reference(path, a.device)
    expected = [ref.greedy(p, a.max_tokens) for p in prompts]
    report = {
        "device": torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu",
        "gpus": torch.cuda.device_count(),
        "model": a.model,
        "stacks": {},
    }
    for plan in plans(a.device):
        if a.stacks is None or plan.name in a.stacks:
            report["stacks"][plan.name] = run_one(a, plan, ref, prompts, expected, sampled)
            finish(report, a, t0)
    report = finish(report, a, t0)
    print(json.dumps(report, indent=2))
    return 0 if report["pass"] else 1


def run_one(a, plan: StackPlan, ref: Reference, prompts, expected, sampled) -> dict:
    try:
        r = run_stack(a, plan, ref, prompts, expected, sampled)
    except Exception as e:  # a stack that cannot start or be driven fails its checks; the others still run
        r = {"error": f"{type(e).__name__}: {e}", "pass": False}
    print(plan.name, json.dumps(r), flush=True)
    return r


def finish(report: dict, a: argparse.Namespace, t0: float) -> dict:
    report["pass"] = bool(report["stacks"]) and all(s["pass"] for s in report["stacks"].values())
    report["elapsed_s"] = time.perf_counter() - t0
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2))
    return report


# ---- (f) faults (--faults): nodes killed, stopped and started again -------------------------------

FAULT_PREFILL_NODES = 2  # prefill0 is killed; prefill1 takes its requests
FAULT_REQUESTS = 8
FAULT_MAX_TOKENS = 8
FAULT_PROMPT_TOKENS = (128, 256)
FAULT_CHUNK_TOKENS = 32  # --max-num-batched-tokens: a prompt takes several steps, so the prefill nodes hold a queue
FAULT_HELD = 2  # requests the router counts on prefill0 when it is killed
FAULT_WAIT_S = 60.0  # a hang guard on each wait below, not a latency target
FAULT_ROUTER_FLAGS = ("--local-prefill-max-tokens", "0")  # every request goes through a prefill node and the pool
REDISPATCHED = "pdserve:requests_redispatched_total"


class NodeStack:
    """A disaggregated stack started node by node (`pdserve up` stops its whole stack when one child exits): the
    prefill nodes, one decode node and the router, each a child of this process; all their output in one log."""

    def __init__(self, a: argparse.Namespace, plan: StackPlan, log: Path) -> None:
        from pdserve.launcher import node_ports

        self.a, self.plan, self.log = a, plan, log
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-faults-"))
        self.procs: dict[str, subprocess.Popen] = {}
        ports = iter(node_ports(FAULT_PREFILL_NODES + 2))
        self.infos = {f"prefill{i}": {"role": "prefill"} for i in range(FAULT_PREFILL_NODES)}
        self.infos["decode0"] = {"role": "decode", "kv_listen": f"tcp://127.0.0.1:{next(ports)}"}
        for info in self.infos.values():
            info["listen"] = f"tcp://127.0.0.1:{next(ports)}"
        self.url, self.instance = "", uuid.uuid4().hex

    def spawn_all(self) -> None:
        """Start every node and, beside them, the router (it waits for them, as `pdserve up`'s does)."""
        from pdserve.flags import router_command

        for name in self.infos:
            self.spawn(name)
        port = free_port()
        options = ["--port", str(port), "--instance-id", self.instance, "--connect-timeout-s", str(STACK_READY_S)]
        argv = router_command(self.a.model, self.infos.values(), [*options, *FAULT_ROUTER_FLAGS])
        self.procs["router"] = self.child(argv)
        self.url = f"http://127.0.0.1:{port}"

    def wait(self) -> None:
        """Until the router answers /health as this stack's (it does once every node has answered it)."""
        from pdserve.launcher import wait_stack

        files = [self.dir / f"{name}.json" for name in self.infos]
        wait_stack(self.url, list(self.procs.values()), files, self.instance, time.monotonic())

    def node_argv(self, name: str) -> list[str]:
        info, a, plan = self.infos[name], self.a, self.plan
        device = decode_device(a.device) if info["role"] == "decode" else a.device
        engine = engine_flags(
            model=a.model,
            dtype=plan.dtype,
            kv_cache_gb=a.kv_cache_gb,
            kv_transport=plan.transport,
            max_num_batched_tokens=FAULT_CHUNK_TOKENS,
        )
        where = ["--listen", info["listen"], *(["--kv-listen", info["kv_listen"]] if "kv_listen" in info else [])]
        ready = ["--ready-file", str(self.dir / f"{name}.json")]
        return [sys.executable, "-m", "pdserve", info["role"], *engine, "--device", device, *where, *ready]

    def spawn(self, name: str) -> None:
        (self.dir / f"{name}.json").unlink(missing_ok=True)
        self.procs[name] = self.child(self.node_argv(name))

    def child(self, argv: list[str]) -> subprocess.Popen:
        """As the launcher's children: a session of its own, SIGTERM if this process dies; its output to the log."""
        from pdserve.process import die_with_parent

        with self.log.open("a") as out:
            return subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
            )

    def wait_ready(self, name: str) -> None:
        ready, proc = self.dir / f"{name}.json", self.procs[name]
        deadline = time.monotonic() + STACK_READY_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (exit code {proc.returncode}); log {self.log}")
            time.sleep(0.05)

    def health(self) -> dict[str, dict]:
        """{node name: the router's view of it (up, in_flight)}."""
        by_addr = {n["addr"]: n for n in httpx.get(self.url + "/health", timeout=10).json()["nodes"]}
        return {name: by_addr[info["listen"]] for name, info in self.infos.items()}

    def pids(self) -> list[int]:
        """Every live process of the stack, the nodes' own children included."""
        return [p for proc in self.procs.values() if proc.poll() is None for p in descendants(proc.pid)]

    def close(self) -> dict[str, int | None]:
        """A clean stop: SIGTERM to the router, then to the nodes (the launcher's order); {name: exit code}."""
        from pdserve.launcher import stop_all

        names = [n for n in self.procs if n != "router"] + ["router"]
        procs = {n: self.procs[n] for n in names if n in self.procs}
        owners = [p for n, p in procs.items() if self.infos.get(n, {}).get("role") == "prefill"]
        stop_all(list(procs.values()), owners=owners)
        shutil.rmtree(self.dir, ignore_errors=True)
        return {n: p.returncode for n, p in self.procs.items()}


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + FAULT_WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting until {what}")
        time.sleep(0.01)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def stop_holding(stack: NodeStack, name: str, held: int) -> int:
    """SIGSTOP node `name` once the router counts `held` requests on it, as it still does with the node stopped:
    however fast the device, they are held there at the kill. Returns the count."""
    proc = stack.procs[name]
    while True:
        wait_for(lambda: stack.health()[name]["in_flight"] >= held, f"{name} holds {held} requests")
        proc.send_signal(signal.SIGSTOP)
        count = stack.health()[name]["in_flight"]
        if count >= held:
            return count
        proc.send_signal(signal.SIGCONT)


async def kill_mid_burst(stack: NodeStack, bodies: list[dict]) -> tuple[int, list[dict]]:
    """Send `bodies` at once; SIGKILL prefill0 while it holds some of them. (its count then, the answers)"""
    answers = asyncio.create_task(complete_all(stack.url, bodies))
    held = await asyncio.to_thread(stop_holding, stack, "prefill0", FAULT_HELD)
    stack.procs["prefill0"].kill()
    stack.procs["prefill0"].wait()
    return held, await answers


def check_prefill_kill(stack: NodeStack, ref: Reference, prompts, expected) -> dict:
    """(f1): prefill0 SIGKILLed mid-burst; the router dispatches its requests again (its counter grows), every
    request's greedy tokens still equal HF's."""
    before = metric(stack.url, REDISPATCHED)
    held, answers = asyncio.run(kill_mid_burst(stack, greedy_bodies(prompts, FAULT_MAX_TOKENS)))
    r = check_exact(ref, prompts, answers, expected)
    r["held_at_kill"] = held
    r["killed_exit_code"] = stack.procs["prefill0"].returncode
    r["redispatched"] = metric(stack.url, REDISPATCHED) - before
    r["pass"] = r["pass"] and r["redispatched"] >= 1 and r["killed_exit_code"] == -signal.SIGKILL
    return r


def segment_mappers(segments: set[str], pids: list[int]) -> dict[str, int]:
    """{segment: how many of these processes map it}."""
    return {s: sum(s in mapped_segments([p]) for p in pids) for s in segments}


def check_decode_restart(stack: NodeStack, ref: Reference, prompts, expected) -> dict:
    """(f2): decode0 stopped (SIGTERM) and started again: the pool it mapped is released (CPU: each shared segment
    it mapped is gone, or mapped still by its owner alone; GPU: the device's memory it held is free again, and
    after the restart no more is held than before the stop) and the restarted node serves exact tokens."""
    device = decode_device(stack.a.device)
    old = stack.procs["decode0"]
    pids, free_before = descendants(old.pid), free_device_mb(device)
    segments = mapped_segments(pids)
    old.send_signal(signal.SIGTERM)
    old.wait(timeout=FAULT_WAIT_S)
    wait_until(lambda: not alive(pids))
    gone = alive(pids)
    mappers = segment_mappers({s for s in segments if Path(s).exists()}, stack.pids())
    orphaned = sorted(s for s, n in mappers.items() if n == 0)  # exists, yet nobody maps it: leaked
    released = free_before is None or wait_until(lambda: freed_mb(device, free_before) >= pool_mb(stack.a))
    free_stopped = free_device_mb(device)
    stack.spawn("decode0")
    stack.wait_ready("decode0")
    wait_for(lambda: stack.health()["decode0"]["up"], "the router has the restarted decode node up")
    r = check_exact(ref, prompts, serve(stack.url, greedy_bodies(prompts, FAULT_MAX_TOKENS)), expected)
    free_after = free_device_mb(device)
    back = free_before is None or free_after >= free_before - RELEASE_SLACK_MB
    r |= {
        "stopped_exit_code": old.returncode,
        "processes_left": gone,
        "segments_mapped": len(segments),
        "segments_orphaned": orphaned,
        "segments_mapped_by_restarted": len(mapped_segments(descendants(stack.procs["decode0"].pid))),
        "device_free_mb_before_stop": free_before,
        "device_free_mb_stopped": free_stopped,
        "device_free_mb_restarted": free_after,
    }
    mapped = free_before is not None or bool(segments and r["segments_mapped_by_restarted"])  # CPU: the pool was used
    r["pass"] = r["pass"] and not gone and not orphaned and released and back and mapped
    return r


def pool_mb(a: argparse.Namespace) -> float:
    """The decode node's KV pool in MiB, less the slack: at least what its stop must free on the device."""
    return a.kv_cache_gb * 1024 - RELEASE_SLACK_MB


def freed_mb(device: str, before: float) -> float:
    return free_device_mb(device) - before


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists()]


def wait_until(cond, timeout: float = 10.0) -> bool:
    """cond() within `timeout` seconds (the driver frees a dead process's memory shortly after it exits)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def run_faults(a: argparse.Namespace, plan: StackPlan, ref: Reference, prompts) -> dict:
    """(f) on a stack of its own: (f1), (f2), then (f3) a clean stop judged as (e), every process gone and exiting
    0. HF's tokens are computed while the nodes start, its model loaded and run once before: its first run's CUDA
    modules and handles lower the device's free memory outside the allocator, so they are in the count before."""
    ref.greedy(prompts[0], 1)
    t0, free_before = time.perf_counter(), free_device_mb(a.device)
    log = a.log_dir / f"gpu_check.faults.{plan.name}.log"
    stack = NodeStack(a, plan, log)
    r: dict = {"dtype": plan.dtype, "transport": plan.transport, "prefill_nodes": FAULT_PREFILL_NODES}
    try:
        stack.spawn_all()
        expected = [ref.greedy(p, FAULT_MAX_TOKENS) for p in prompts]
        stack.wait()
        r["start_s"] = time.perf_counter() - t0
        r["prefill_kill"] = timed(check_prefill_kill, stack, ref, prompts, expected)
        r["decode_restart"] = timed(check_decode_restart, stack, ref, prompts, expected)
        pids = stack.pids()
        segments = mapped_segments(pids)
    finally:
        codes = stack.close()
    r["clean_stop"] = check_clean_stop(log, segments, a.device, free_before)
    wait_until(lambda: not alive(pids))  # a prefill node's resource tracker exits just after it
    left = alive(pids)
    exits = {n: c for n, c in codes.items() if n != "prefill0"}  # prefill0 was killed in (f1)
    r["clean_stop"] |= {"processes": len(pids), "processes_left": left, "exit_codes": exits}
    r["clean_stop"]["pass"] = r["clean_stop"]["pass"] and not left and not any(exits.values())
    r["seconds"] = time.perf_counter() - t0
    r["pass"] = all(v["pass"] for v in r.values() if isinstance(v, dict))
    return r


def timed(check, *args) -> dict:
    t0 = time.perf_counter()
    return {**check(*args), "seconds": time.perf_counter() - t0}


def fault_plans(a: argparse.Namespace) -> list[StackPlan]:
    """The float32 stacks over a shared pool (cuda_ipc, or shm on the CPU) that --stacks names: exact greedy output
    is judged there."""
    shared = [p for p in plans(a.device) if p.dtype == "float32" and p.transport in ("shm", "cuda_ipc")]
    return [p for p in shared if a.stacks is None or p.name in a.stacks]


def faults_main(a: argparse.Namespace, path: Path, vocab: int, t0: float) -> dict:
    prompts = make_prompts(FAULT_REQUESTS, vocab, 2, *FAULT_PROMPT_TOKENS)
    ref = Reference(path, a.device)
    report = {"device": a.device, "model": a.model, "faults": True, "stacks": {}}
    for plan in fault_plans(a):
        try:
            r = run_faults(a, plan, ref, prompts)
        except Exception as e:  # a stack that cannot start or be driven fails its checks
            r = {"error": f"{type(e).__name__}: {e}", "pass": False}
        print(plan.name, "faults", json.dumps(r), flush=True)
        report["stacks"][plan.name] = r
        finish(report, a, t0)
    return finish(report, a, t0)


if __name__ == "__main__":
    sys.exit(main())
