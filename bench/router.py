"""The router's CPU per streamed token, driven by mock nodes fast enough to saturate it.

    python -m bench.router --prefill 1 --decode 4 --concurrency 8 16 32 64 128 --out bench/results

For each number of router workers (1, and 2 where `pdserve up` takes --router-workers), `pdserve up --engine mock`
starts the stack (mock nodes: no model, a modelled step, see pdserve/engine/mock.py) and this process, the load
generator, runs a closed load at each concurrency C: C streamed completions in flight (token-id prompts, a fixed
number of output tokens, ignore_eos) until --requests are done. For each run it records, from /proc, the CPU seconds
of every router process (the `pdserve router` child of the launcher and its own children) and of this process, each
per streamed token; the streamed tokens a second; and TPOT p50/p99. The capacity of a configuration is the highest
streamed rate of a run whose TPOT p99 is at most twice that of the lightest run (the nodes' own step time): past it,
the router (or the shared cores) is what the streams wait for.

vLLM's API server cannot be put in front of mock nodes; where vLLM is installed, `--vllm-url` and `--vllm-pid`
name a running vLLM server (started by the user) whose API process's CPU per token (that process alone, not its
EngineCore child) is measured under the same client and load. Since vLLM streams a real model's tokens, at that
model's rate, `--pdserve-model` (e.g. `small`) adds the like-for-like row: pdserve's router in front of one colocated
node running that model (with vLLM's engine budget, --real-max-num-seqs and --real-max-num-batched-tokens), same
client and load. Without them those rows are left out, saying why.

Results go to <out>/router-<date>-<commit>.json, .md and .png; the Markdown names the machine (lscpu's model name).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.http_client import HttpTarget, run_http
from bench.metrics import SLO, cpu_per_token_us, summarize
from bench.systems import Stack, StackOptions, child_pids, cpu_seconds, free_port, settled_counters
from bench.systems import stack_argv as systems_stack_argv
from bench.workloads import BenchRequest, Workload
from pdserve.plan.costs import least_squares
from pdserve.startup import READY_TIMEOUT_S

RESULTS_DIR = Path(__file__).parent / "results"
MOCK_STEP_S = "0.002,2e-6,2e-5"  # a GPU-like node: 64 streams decode in 3.4 ms (19k tokens/s)
NO_SLO = SLO(ttft_s=float("inf"), tpot_s=float("inf"))
REAL_KV_CACHE_GB = 0.25  # the real node's KV pool: vLLM's --kv-cache-memory-bytes 268435456
TPOT_GROWTH = 2.0  # capacity: the highest rate before TPOT p99 grows past this many times the lightest run's
WARM_UP_STREAMS, WARM_UP_TOKENS = 4, 8
IDLE_S = 10.0  # how long a front's CPU is sampled with no request in flight (its timers, heartbeats, metrics)


@dataclasses.dataclass(frozen=True)
class RouterBench:
    prefill: int
    decode: int
    concurrency: tuple[int, ...]
    requests_per_stream: int  # requests a run sends per stream in flight (at least one run's worth of each)
    prompt_tokens: int
    max_tokens: int
    mock_step_s: str
    workers: tuple[int, ...]
    out: Path
    vllm_url: str = ""
    vllm_pid: int = 0
    pdserve_model: str = ""  # a real model behind pdserve's router, for the comparison with vLLM
    real_max_num_seqs: int = 16
    real_max_num_batched_tokens: int = 512
    real_concurrency: tuple[int, ...] = ()  # the runs of the real-model fronts (none: the same as the mock's)
    real_requests_per_stream: int = 0  # 0: the same as the mock's
    stack_args: tuple[str, ...] = ()  # more flags for the mock stack's `pdserve up`
    keep_alive: bool = False  # the client reuses its connections (default: one per request)

    def for_real_model(self) -> RouterBench:
        """The load of the fronts that serve a real model (pdserve before a node of it, vLLM): the same client,
        prompts and output length, at the concurrencies and request counts a real model's speed allows."""
        per_stream = self.real_requests_per_stream or self.requests_per_stream
        return dataclasses.replace(
            self, concurrency=self.real_concurrency or self.concurrency, requests_per_stream=per_stream
        )


def parse_args(argv: list[str] | None = None) -> RouterBench:
    p = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=int, default=1, help="mock prefill nodes")
    p.add_argument("--decode", type=int, default=4, help="mock decode nodes")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--requests-per-stream", type=int, default=3, help="a run sends this many requests per stream")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens of each request")
    p.add_argument("--mock-step-s", default=MOCK_STEP_S, help="the mock nodes' step time A,B,C (see --engine mock)")
    p.add_argument(
        "--workers",
        type=int,
        nargs="*",
        default=[1, 2],
        help="router workers to measure on mock nodes (more than 1 only where pdserve up takes "
        "--router-workers; none: only the real-model fronts)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--vllm-url", default="", help="a running vLLM server (CPU build) to measure beside")
    p.add_argument("--vllm-pid", type=int, default=0, help="the PID of that server's API process")
    p.add_argument(
        "--pdserve-model",
        default="",
        help="also measure pdserve's router before a colocated node of this model (the like-for-like row beside vLLM)",
    )
    p.add_argument("--real-max-num-seqs", type=int, default=16, help="that node's batch (give vLLM's)")
    p.add_argument("--real-max-num-batched-tokens", type=int, default=512, help="that node's token budget (vLLM's)")
    p.add_argument(
        "--real-concurrency",
        type=int,
        nargs="*",
        default=[],
        help="the runs before a real model (pdserve's node, vLLM); default: --concurrency",
    )
    p.add_argument("--real-requests-per-stream", type=int, default=0, help="default: --requests-per-stream")
    p.add_argument(
        "--stack-arg",
        action="append",
        default=[],
        help="a flag for the mock stack's `pdserve up` (repeat; as --stack-arg=--flag=value)",
    )
    p.add_argument(
        "--keep-alive",
        action="store_true",
        help="the client keeps its connections open between requests, as the OpenAI SDK does (default: a "
        "connection per request)",
    )
    a = p.parse_args(argv)
    if min(a.concurrency) < 1 or a.prefill < 1 or a.decode < 1 or a.max_tokens < 2:
        p.error("concurrency, node counts must be at least 1 and --max-tokens at least 2")
    return RouterBench(
        a.prefill,
        a.decode,
        tuple(sorted(a.concurrency)),
        a.requests_per_stream,
        a.prompt_tokens,
        a.max_tokens,
        a.mock_step_s,
        tuple(a.workers),
        a.out,
        a.vllm_url,
        a.vllm_pid,
        a.pdserve_model,
        a.real_max_num_seqs,
        a.real_max_num_batched_tokens,
        tuple(sorted(a.real_concurrency)),
        a.real_requests_per_stream,
        tuple(a.stack_arg),
        a.keep_alive,
    )


# ---- the stack and its router processes -------------------------------------------------------------


def takes_router_workers() -> bool:
    """Whether this pdserve's `up` has --router-workers."""
    out = subprocess.run([sys.executable, "-m", "pdserve", "up", "--help"], capture_output=True, text=True, check=False)
    return "--router-workers" in out.stdout


def stack_argv(cfg: RouterBench, workers: int, port: int) -> list[str]:
    biggest = max(cfg.concurrency)
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--mode",
        "disagg",
        "--engine",
        "mock",
        "--model",
        "tiny",
        "--num-prefill",
        str(cfg.prefill),
        "--num-decode",
        str(cfg.decode),
        "--port",
        str(port),
        "--no-pin",
        "--mock-step-s",
        cfg.mock_step_s,
        "--max-num-seqs",
        str(biggest),
        "--max-queued-requests",
        str(biggest * 4),
    ]
    return argv + (["--router-workers", str(workers)] if workers > 1 else []) + list(cfg.stack_args)


def real_stack_argv(cfg: RouterBench, port: int) -> list[str]:
    """One colocated node of a real model (`--pdserve-model`) behind one router, with vLLM's engine budget."""
    opts = StackOptions(
        cfg.pdserve_model,
        cfg.real_max_num_seqs,
        cfg.real_max_num_batched_tokens,
        REAL_KV_CACHE_GB,
        "zmq",
        Path("unused"),
    )
    return systems_stack_argv(opts, "colocated", port)


def descendants(pid: int) -> list[int]:
    out = []
    for child in child_pids(pid):
        out += [child, *descendants(child)]
    return out


def router_processes(launcher_pid: int) -> list[int]:
    """Every process of the router: the launcher's `pdserve router` child and all below it."""
    for pid in child_pids(launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"router" in argv:
            return [pid, *descendants(pid)]
    return []


def cpu_of(pids: list[int]) -> float:
    return sum(cpu_seconds(p) or 0.0 for p in pids)


# ---- one run ----------------------------------------------------------------------------------------


def workload(cfg: RouterBench, concurrency: int) -> Workload:
    n = concurrency * cfg.requests_per_stream
    prompts = [tuple((7 * i + j) % 500 for j in range(cfg.prompt_tokens)) for i in range(n)]
    return Workload(f"closed-{concurrency}", tuple(BenchRequest(p, cfg.max_tokens) for p in prompts))


class Metrics:
    """The router's /metrics, read the way bench.systems.settled_counters reads a stack's."""

    def __init__(self, url: str) -> None:
        self.url = url

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def node_steps(self) -> float:
        """Every node's steps so far (the messages the nodes have sent the router: one a step)."""
        return sum(c.get("steps", 0.0) for c in settled_counters(self).values())


def run_once(url: str, cfg: RouterBench, concurrency: int, pids: list[int], pdserve: bool = True) -> dict:
    """One closed run at `concurrency`: the front processes' (`pids`) and this process's CPU per streamed token,
    the streamed rate and TPOT, and (`pdserve`) the nodes' messages, from the router's /metrics."""
    w = workload(cfg, concurrency)
    target = HttpTarget(url, max_concurrency=concurrency, keep_alive=cfg.keep_alive)  # model: the first one listed
    metrics = Metrics(url) if pdserve else None
    steps0 = metrics.node_steps() if metrics else 0.0
    router0, client0 = cpu_of(pids), time.process_time()
    t0, records = run_http(target, w, f"c={concurrency}", progress=False)
    router_s, client_s = cpu_of(pids) - router0, time.process_time() - client0
    s = summarize(records, t0, NO_SLO)
    messages = metrics.node_steps() - steps0 if metrics else None
    return {
        "concurrency": concurrency,
        "node_messages": messages,
        "requests": len(records),
        "failed": s["num_failed"],
        "errors": s["errors"],
        "tokens": s["total_output_tokens"],
        "wall_s": s["wall_s"],
        "tok_per_s": s["output_throughput"],
        "tpot_p50_ms": _ms(s["tpot_s"], "p50"),
        "tpot_p99_ms": _ms(s["tpot_s"], "p99"),
        "router_cpu_s": router_s,
        "router_us_per_token": cpu_per_token_us(router_s, records),
        "client_cpu_s": client_s,
        "client_us_per_token": cpu_per_token_us(client_s, records),
    }


def _ms(dist: dict | None, key: str) -> float | None:
    return None if dist is None else dist[key] * 1e3


def capacity(runs: list[dict]) -> dict:
    """The highest streamed rate before TPOT p99 grows past TPOT_GROWTH times the lightest run's."""
    ok = [r for r in runs if not r["failed"] and r["tpot_p99_ms"]]
    if not ok:
        return {"tok_per_s": None, "concurrency": None, "base_tpot_p99_ms": None}
    base = ok[0]["tpot_p99_ms"]
    within = [r for r in ok if r["tpot_p99_ms"] <= TPOT_GROWTH * base]
    best = max(within, key=lambda r: r["tok_per_s"])
    return {"tok_per_s": best["tok_per_s"], "concurrency": best["concurrency"], "base_tpot_p99_ms": base}


def router_fit(runs: list[dict]) -> dict | None:
    """The router's CPU as µs per message from a node plus µs per token, least squares over the runs (as
    `bench.sim --fit-router` fits run_bench results), for bench.sim's Costs."""
    ok = [r for r in runs if r["node_messages"] and r["router_cpu_s"] and not r["failed"]]
    if len(ok) < 2:
        return None
    a, b = least_squares([[r["node_messages"], r["tokens"]] for r in ok], [r["router_cpu_s"] for r in ok])
    return {"us_per_message": a * 1e6, "us_per_token": b * 1e6, "runs": len(ok)}


def measure_workers(cfg: RouterBench, workers: int, log_dir: Path) -> dict:
    port = free_port()
    stack = Stack(stack_argv(cfg, workers, port), log_dir / f"router-bench-w{workers}.log")
    return {"workers": workers, **measure_stack(stack, port, cfg, f"{workers} worker(s)")}


def measure_real_pdserve(cfg: RouterBench, log_dir: Path) -> dict:
    """pdserve's router (one process) before a colocated node of a real model, or why not."""
    if not cfg.pdserve_model:
        return {"skipped": "give --pdserve-model to measure pdserve's router before a real model"}
    port = free_port()
    stack = Stack(real_stack_argv(cfg, port), log_dir / "router-bench-real.log")
    label = f"pdserve {cfg.pdserve_model}"
    return {"model": cfg.pdserve_model, **measure_stack(stack, port, cfg.for_real_model(), label)}


def measure_stack(stack: Stack, port: int, cfg: RouterBench, label: str) -> dict:
    """Every concurrency's run against a started stack, its router's CPU counted; the stack stopped after."""
    try:
        stack.wait_ready(READY_TIMEOUT_S)
        pids = router_processes(stack.proc.pid)
        url = f"http://127.0.0.1:{port}"
        warm_up(url, cfg, pids)
        idle = idle_cpu_per_s(pids)
        runs = []
        for c in cfg.concurrency:
            runs.append(net_of_idle(run_once(url, cfg, c, pids), idle))
            print(json.dumps({"system": label, **runs[-1]}), flush=True)
        return {
            "router_processes": len(pids),
            "idle_cpu_per_s": idle,
            "runs": runs,
            "capacity": capacity(runs),
            "fit": router_fit(runs),
        }
    finally:
        stack.stop()


def warm_up(url: str, cfg: RouterBench, pids: list[int], pdserve: bool = True) -> None:
    """A short run first, not counted: connections, the tokenizer's caches, a compiled graph's first shapes."""
    run_once(
        url, dataclasses.replace(cfg, max_tokens=WARM_UP_TOKENS, requests_per_stream=1), WARM_UP_STREAMS, pids, pdserve
    )


def measure_vllm(cfg: RouterBench) -> dict:
    """vLLM's API server under the same client and load, or why not."""
    if importlib.util.find_spec("vllm") is None and not cfg.vllm_url:
        return {"skipped": "vLLM is not installed here"}
    if not (cfg.vllm_url and cfg.vllm_pid):
        return {"skipped": "give --vllm-url and --vllm-pid of a running `vllm serve` to measure it"}
    url, cfg = cfg.vllm_url.rstrip("/").removesuffix("/v1"), cfg.for_real_model()
    warm_up(url, cfg, [cfg.vllm_pid], pdserve=False)
    idle = idle_cpu_per_s([cfg.vllm_pid])
    runs = []
    for c in cfg.concurrency:
        runs.append(net_of_idle(run_once(url, cfg, c, [cfg.vllm_pid], pdserve=False), idle))
        print(json.dumps({"system": "vllm", **runs[-1]}), flush=True)
    return {
        "model": httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"],
        "idle_cpu_per_s": idle,
        "runs": runs,
        "capacity": capacity(runs),
        "api_process": process_name(cfg.vllm_pid),
    }


def idle_cpu_per_s(pids: list[int]) -> float:
    """The front's CPU seconds a second with no request in flight, over IDLE_S."""
    cpu0, t0 = cpu_of(pids), time.monotonic()
    time.sleep(IDLE_S)  # a measurement window, not a wait for an event
    return (cpu_of(pids) - cpu0) / (time.monotonic() - t0)


def net_of_idle(run: dict, idle_per_s: float) -> dict:
    """A run with the front's CPU per token less what it spends idle over the run's wall time: the cost of the
    tokens themselves, which matters where a slow model streams few tokens a second."""
    net = run["router_cpu_s"] - idle_per_s * run["wall_s"]
    return {**run, "router_us_per_token_net": net / run["tokens"] * 1e6 if run["tokens"] else None}


def process_name(pid: int) -> str:
    """A process's command line, as /proc shows it, each absolute path cut to its last part (to record which
    process was measured without naming this machine's folders)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    return short_argv(argv)


def short_argv(argv: list[str]) -> str:
    return " ".join(Path(a).name if a.startswith("/") else a for a in argv if a)


# ---- the machine and the report ---------------------------------------------------------------------


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False, cwd=Path(__file__).parent
    )
    return out.stdout.strip() or "unknown"


def machine() -> dict:
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def fronts(result: dict) -> list[tuple[str, dict]]:
    """(label, measurement) of every front process measured: the router on mock nodes per worker count, then
    (where run) the router before a real model's node and vLLM's API server."""
    cfg = result["config"]
    out = [
        (f"router, {w['workers']} worker(s), mock {cfg['prefill']}P{cfg['decode']}D", w)
        for w in result.get("workers", [])
    ]
    real, vllm = result.get("pdserve_real", {}), result.get("vllm", {})
    out += [(f"router, colocated `{real['model']}` node", real)] if "runs" in real else []
    out += [(f"vLLM API server, `{vllm.get('model', '?')}`", vllm)] if "runs" in vllm else []
    return out


def markdown(result: dict) -> str:
    cfg, m = result["config"], result["machine"]
    lines = [
        f"# Router CPU per streamed token ({result['date']}, commit {result['commit']})",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores (load average {m['loadavg_at_start'][0]:.1f} at "
        f"start{_end_load(m)}). Mock stack: {cfg['prefill']}P{cfg['decode']}D mock nodes (step "
        f"{cfg['mock_step_s']} s). Load: {cfg['prompt_tokens']}-token prompts, {cfg['max_tokens']} output tokens "
        "a request, closed, the same client for every front"
        + (", connections kept open between requests" if cfg.get("keep_alive") else ", a connection a request")
        + "."
        + (f" Stack flags: `{' '.join(cfg['stack_args'])}`." if cfg.get("stack_args") else ""),
        "",
        "| front | streams | tok/s | TPOT p50 ms | TPOT p99 ms | front CPU µs/token | net of idle | client CPU "
        "µs/token | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, f in fronts(result):
        for r in f["runs"]:
            lines.append(
                f"| {label} | {r['concurrency']} | {r['tok_per_s']:,.0f} | {_f(r['tpot_p50_ms'])} | "
                f"{_f(r['tpot_p99_ms'])} | {_f(r['router_us_per_token'])} | "
                f"{_f(r.get('router_us_per_token_net'))} | {_f(r['client_us_per_token'])} | "
                f"{r['failed']} |"
            )
    lines += [
        "",
        *side_by_side(result),
        "",
        "Capacity (the highest streamed rate before TPOT p99 doubles over the lightest run's):",
        "",
    ]
    for label, f in fronts(result):
        c, fit = f["capacity"], f.get("fit")
        rate = "n/a" if c["tok_per_s"] is None else f"{c['tok_per_s']:,.0f} tok/s at {c['concurrency']} streams"
        fitted = (
            ""
            if not fit
            else (
                f"; router CPU fitted over the runs: {fit['us_per_message']:.0f} µs a node "
                f"message + {fit['us_per_token']:.1f} µs a token"
            )
        )
        idle = "" if f.get("idle_cpu_per_s") is None else f"; idle: {f['idle_cpu_per_s'] * 1e3:.1f} ms of CPU a second"
        lines.append(f"- {label}: {rate}{fitted}{idle}")
    skipped = [
        f"{name}: {result[key]['skipped']}."
        for key, name in (("pdserve_real", "Router before a real model"), ("vllm", "vLLM API server"))
        if result.get(key, {}).get("skipped")
    ]
    lines += ["", *skipped] if skipped else []
    lines += [f"Router workers: {result['workers_note']}"] if result.get("workers_note") else []
    return "\n".join(lines) + "\n"


def side_by_side(result: dict) -> list[str]:
    """Front CPU µs per streamed token, one column per front, one row per concurrency."""
    cols = fronts(result)
    if len(cols) < 2:
        return []
    header = "| streams | " + " | ".join(label for label, _ in cols) + " |"
    lines = [
        "Front CPU µs per streamed token (net of its idle CPU in brackets), side by side:",
        "",
        header,
        "|---" * (len(cols) + 1) + "|",
    ]
    for c in sorted({r["concurrency"] for _, f in cols for r in f["runs"]}):
        cells = [next((_cell(r) for r in f["runs"] if r["concurrency"] == c), "-") for _, f in cols]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def _cell(run: dict) -> str:
    net = run.get("router_us_per_token_net")
    return _f(run["router_us_per_token"]) + ("" if net is None else f" ({net:.1f})")


def _end_load(m: dict) -> str:
    return f", {m['loadavg_at_end'][0]:.1f} at the end" if m.get("loadavg_at_end") else ""


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, f in fronts(result):
        runs = [r for r in f["runs"] if r["router_us_per_token"] is not None]
        left.plot([r["tok_per_s"] for r in runs], [r["router_us_per_token"] for r in runs], "o-", label=label)
        right.plot([r["tok_per_s"] for r in runs], [r["tpot_p99_ms"] for r in runs], "o-", label=label)
    left.set(xlabel="streamed tokens/s", ylabel="front CPU µs per token", title="Front process CPU per token")
    right.set(xlabel="streamed tokens/s", ylabel="TPOT p99 (ms)", title="TPOT p99 against rate")
    for ax in (left, right):
        ax.set_xscale("log")  # a CPU model's few tokens a second beside mock nodes' thousands
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Router CPU per streamed token, {result['machine']['cpu_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped benchmark still stops its stack (finally)
    workers = [w for w in cfg.workers if w == 1 or takes_router_workers()]
    skipped = sorted(set(cfg.workers) - set(workers))
    note = f"{skipped} skipped: this pdserve has no --router-workers" if skipped else ""
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "machine": machine(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "workers_note": note,
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    stem = cfg.out / f"router-{result['date']}-{result['commit']}"
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        result["workers"] = []
        for w in workers:
            result["workers"].append(measure_workers(cfg, w, Path(tmp)))
            save(result, stem)  # after each front: a cut-short run keeps what it has
        result["pdserve_real"] = measure_real_pdserve(cfg, Path(tmp))
        save(result, stem)
    result["vllm"] = measure_vllm(cfg)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    save(result, stem)
    plot(result, stem.with_suffix(".png"))
    print(markdown(result))
    return 0


def save(result: dict, stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    sys.exit(main())
