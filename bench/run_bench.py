"""Every system on every workload, side by side in one run (bench/README.md, docs/benchmarks.md).

    python -m bench.run_bench --model small --workloads equal_size short_long_mix \\
        --systems colocated static hf_cb [--quick]

Each system is opened once (a `pdserve up` child, or a model in this process), warmed up with two
short requests, then run on each workload in turn; a system that fails is reported as failed and the
run goes on. Every system gets the same max batch (`--max-batch`), token budget and KV budget; the
in-process baselines run on `--threads` torch threads, the cores a colocated pdserve node is pinned to.
Then the engine-overhead floor (bench/floors.py, in this process) and, when `disagg` ran,
bench/kv_bandwidth.py (a child process). "ratio vs static" is output tok/s over static batching's.

Writes bench/runs/<name>.json (config, environment, per-request records, summaries), <name>.md (the
table) and <name>.png (the plot); bench/runs/ is git-ignored. `--record` writes into bench/results/
instead, named by the date and the commit (2026-12-01-61c17bb[-NAME]). Timings are only comparable
within one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from bench import report, systems
from bench.baselines import load_hf_model
from bench.floors import engine_overhead
from bench.metrics import SLO, RequestRecord, cpu_per_token_us, max_rate_within_slo, summarize
from bench.workloads import WORKLOADS, BenchRequest, Workload, make_workload

SYSTEMS = ("colocated", "disagg", "static", "hf_cb")
RESULTS_DIR = Path(__file__).parent / "results"  # recorded results, kept in git (--record)
RUNS_DIR = Path(__file__).parent / "runs"  # every other run (git-ignored)
# two requests of different lengths in one batch: padding, prefill chunks and decode all run once
WARMUP = Workload("warmup", (BenchRequest(tuple(range(1, 9)), 4), BenchRequest(tuple(range(1, 65)), 4)))
KV_BANDWIDTH_TIMEOUT_S = 300.0
TOKEN_REFERENCES = ("static", "hf_cb", "colocated")  # whose greedy tokens the others are compared to
BENCH_EXTRA = ("httpx", "matplotlib", "tqdm")  # what `pip install -e '.[bench]'` adds that a run needs


@dataclass(frozen=True)
class BenchConfig:
    model: str
    workloads: tuple[str, ...]
    systems: tuple[str, ...]
    external: tuple[tuple[str, str], ...] = ()  # (name, base URL) of OpenAI-compatible servers
    quick: bool = False
    max_batch: int = 16
    max_num_batched_tokens: int = 512
    kv_cache_gb: float = 0.25
    rates: tuple[float, ...] = ()  # () = closed arrival
    seed: int = 0
    num_requests: int | None = None
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    kv_transport: str = "zmq"
    engine_args: tuple[str, ...] = ()  # extra `pdserve up` flags, e.g. --num-prefill 2
    threads: int = 2
    overhead: bool = True
    kv_bandwidth: bool = True  # after a disagg run: bench/kv_bandwidth.py
    name: str = "bench"
    out_dir: Path = field(default=RUNS_DIR)
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
        if any(r <= 0 for r in self.rates):
            raise ValueError("--rates must be positive (requests/s)")
        if self.max_batch < 1 or self.threads < 1:
            raise ValueError("--max-batch and --threads must be at least 1")

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_s, self.slo_tpot_s)


# ---- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="built-in (tiny, small) or a checkpoint folder")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--systems", nargs="*", default=["colocated", "static", "hf_cb"], choices=SYSTEMS)
    p.add_argument(
        "--external",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="also drive an OpenAI-compatible server, e.g. vllm=http://127.0.0.1:8001",
    )
    p.add_argument("--quick", action="store_true", help="4 requests, lengths / 8: a smoke test")
    p.add_argument("--max-batch", type=int, default=16, help="max requests per batch, every system")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per iteration")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV budget of pdserve and HF CB")
    p.add_argument("--rates", type=float, nargs="*", default=[], help="Poisson rates (req/s); none: closed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=None, help="override every workload's request count")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.2)
    p.add_argument("--kv-transport", default="zmq", choices=["zmq", "shm", "cuda_ipc"], help="for disagg")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        dest="engine_args",
        metavar="FLAG",
        help="an extra `pdserve up` flag, e.g. --engine-arg=--num-prefill --engine-arg=2",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-process systems")
    p.add_argument("--no-overhead", action="store_true", help="skip the engine-overhead floor")
    p.add_argument("--no-kv-bandwidth", action="store_true", help="skip the KV bandwidth run after disagg")
    p.add_argument("--name", default=None, help="file stem (<model>[-quick]; --record: <date>-<commit>[-NAME])")
    p.add_argument("--record", action="store_true", help="keep it: into bench/results/, named by date and commit")
    p.add_argument("--out-dir", type=Path, default=None, help="bench/runs/ (git-ignored); --record: bench/results/")
    p.add_argument("--no-progress", action="store_true")
    return p


def _external(specs: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith("http"):
            raise ValueError(f"--external {spec!r}: write NAME=http://host:port")
        pairs.append((name, url))
    return tuple(pairs)


def recorded_name(label: str | None, commit: str, day: str) -> str:
    """A recorded result's file stem: the day (UTC), the commit, then the label if one was given."""
    if not commit:
        raise ValueError("--record names a result by its git commit: run it from a git checkout")
    return "-".join(part for part in (day, commit, label) if part)


def git_commit() -> str:
    """The checkout's short commit, `-dirty` appended when tracked files differ from it; "" outside git."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, check=False)
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + "-dirty" if commit and git("status", "--porcelain", "--untracked-files=no") else commit
    except OSError:
        return ""


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    a = build_parser().parse_args(argv)
    derived = {
        "workloads": tuple(a.workloads),
        "systems": tuple(a.systems),
        "external": _external(a.external),
        "rates": tuple(a.rates),
        "engine_args": tuple(a.engine_args),
        "overhead": not a.no_overhead,
        "kv_bandwidth": not a.no_kv_bandwidth,
        "name": recorded_name(a.name, git_commit(), time.strftime("%Y-%m-%d", time.gmtime()))
        if a.record
        else a.name or (f"{a.model}-quick" if a.quick else a.model),
        "out_dir": a.out_dir or (RESULTS_DIR if a.record else RUNS_DIR),
        "progress": not a.no_progress,
    }
    same = {f.name for f in fields(BenchConfig)} & set(vars(a)) - set(derived)  # flags named like their field
    return BenchConfig(**{k: getattr(a, k) for k in same}, **derived)


# ---- workloads -------------------------------------------------------------------------------------


def model_config(model: str):
    import transformers

    from pdserve.checkpoint import resolve_model

    return transformers.AutoConfig.from_pretrained(resolve_model(model), local_files_only=True)


def build_workloads(cfg: BenchConfig, config) -> list[Workload]:
    from pdserve.runner.model import max_model_len

    rates = cfg.rates or (None,)
    return [
        make_workload(name, config.vocab_size, max_model_len(config), cfg.seed, rate, cfg.num_requests, cfg.quick)
        for name in cfg.workloads
        for rate in rates
    ]


# ---- systems ---------------------------------------------------------------------------------------


class LazyModel:
    """The HF model of the in-process baselines, loaded once, on first use."""

    def __init__(self, model: str) -> None:
        self.name = model
        self._model = None

    def get(self):
        if self._model is None:
            from pdserve.checkpoint import resolve_model

            self._model = load_hf_model(resolve_model(self.name))
        return self._model


def open_system(cfg: BenchConfig, system: str, hf: LazyModel) -> AbstractContextManager:
    if system in ("colocated", "disagg"):
        opts = systems.StackOptions(
            cfg.model,
            cfg.max_batch,
            cfg.max_num_batched_tokens,
            cfg.kv_cache_gb,
            cfg.kv_transport,
            cfg.out_dir / cfg.name,
            cfg.engine_args,
        )
        return systems.pdserve_stack(opts, system, cfg.progress)
    if system == "static":
        return systems.static_batching(hf.get(), cfg.max_batch, cfg.progress)
    if system == "hf_cb":
        opts = systems.CbOptions(cfg.max_batch, cfg.max_num_batched_tokens, cfg.kv_cache_gb)
        return systems.hf_continuous_batching(hf.get(), opts, cfg.progress)
    return systems.external_server(dict(cfg.external)[system], cfg.progress)


def _failed(system: str, w: Workload, error: str) -> dict:
    return {"system": system, "workload": w.name, "label": w.label, "rate": w.rate, "ok": False, "error": error}


def _records_json(t0: float, records: list[RequestRecord]) -> list[dict]:
    return [
        {
            "send_s": round(r.send_time - t0, 6),
            "token_s": [round(t - t0, 6) for t in r.token_times],
            "expected_output_len": r.expected_output_len,
            "prompt_len": r.num_prompt_tokens,
            "streamed": r.streamed,
            "error": r.error,
        }
        for r in records
    ]


def run_workload(slo: SLO, system: str, run: systems.Runner, w: Workload) -> dict:
    try:
        before = _node_counters(run)
        cpu0 = time.process_time()
        t0, records = run(w, f"{system}/{w.label}")
        client_cpu_s = time.process_time() - cpu0  # this process during the run: for a stack, the load generator
        counters = None if before is None else systems.counters_diff(systems.settled_counters(run), before)
    except Exception as e:  # one workload failing must not end the run
        return _failed(system, w, f"{type(e).__name__}: {e}")
    summary = summarize(records, t0, slo)
    ok = summary["num_failed"] < len(records)
    error = "" if ok else "every request failed: " + "; ".join(summary["errors"])
    router_cpu_s = getattr(run, "router_cpu_s", None)  # pdserve stacks: the router's CPU during the run
    return {
        "system": system,
        "workload": w.name,
        "label": w.label,
        "rate": w.rate,
        "ok": ok,
        "error": error,
        "summary": summary,
        "router_cpu_s": router_cpu_s,
        "router_cpu_us_per_token": cpu_per_token_us(router_cpu_s, records),
        "client_cpu_s": client_cpu_s,
        "client_cpu_us_per_token": cpu_per_token_us(client_cpu_s, records),
        "node_counters": counters,  # pdserve stacks: per role, the nodes' steps and step time during the run
        "records": _records_json(t0, records),
        "tokens": [r.output_token_ids for r in records],
    }


def _node_counters(run: systems.Runner) -> dict | None:
    """A pdserve stack's node counters per role (from its router's /metrics); None for other systems."""
    return systems.settled_counters(run) if isinstance(run, systems.StackRunner) else None


def warm_up(run: systems.Runner, system: str) -> None:
    _, records = run(WARMUP, f"{system}/warmup")
    bad = [r.error for r in records if not r.ok]
    if bad:
        raise systems.SystemFailed(f"the warm-up request failed: {bad[0]}")


def run_system(cfg: BenchConfig, system: str, workloads: list[Workload], hf: LazyModel) -> list[dict]:
    done: list[dict] = []
    try:
        with open_system(cfg, system, hf) as run:
            warm_up(run, system)
            for w in workloads:
                done.append(run_workload(cfg.slo, system, run, w))
    except Exception as e:  # a system that cannot start is reported, not fatal
        msg = f"{type(e).__name__}: {e}"
        print(f"bench: {system} failed: {msg}", file=sys.stderr)
        done += [_failed(system, w, msg) for w in workloads[len(done) :]]
    return done


# ---- cross-checks and floors -----------------------------------------------------------------------


def add_token_agreement(results: list[dict]) -> None:
    """Share of requests whose greedy tokens equal those of the first reference system that ran."""
    for label in dict.fromkeys(r["label"] for r in results):
        rows = [r for r in results if r["label"] == label and r["ok"]]
        refs = [r for name in TOKEN_REFERENCES for r in rows if r["system"] == name]
        if not refs:
            continue
        ref = refs[0]
        for r in rows:
            if r is not ref and all(r["tokens"]):
                same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"], strict=True))
                r["token_agreement"], r["token_reference"] = same / len(ref["tokens"]), ref["system"]
    for r in results:
        r.pop("tokens", None)


def goodput(results: list[dict]) -> dict[str, float | None]:
    """Per (workload, system) swept over rates: the highest rate with >= 90% SLO attainment."""
    by_key: dict[str, dict[float, float]] = {}
    for r in results:
        if r["rate"] is not None:
            attainment = r["summary"]["slo_attainment"] if r["ok"] else 0.0
            by_key.setdefault(f"{r['workload']}|{r['system']}", {})[r["rate"]] = attainment
    return {k: max_rate_within_slo(v) for k, v in by_key.items() if len(v) > 1}


def run_overhead(cfg: BenchConfig, config) -> dict:
    from pdserve.config import EngineConfig
    from pdserve.runner.model import max_model_len

    w = make_workload(
        "short_long_mix",
        config.vocab_size,
        max_model_len(config),
        cfg.seed,
        quick=cfg.quick,
        num_requests=cfg.num_requests,
    )
    engine_cfg = EngineConfig(
        model=cfg.model,
        max_num_seqs=cfg.max_batch,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        kv_cache_gb=cfg.kv_cache_gb,
    )
    try:
        return engine_overhead(engine_cfg, w, cfg.progress)
    except Exception as e:  # the floor is a side measurement: report, go on
        return {"error": f"{type(e).__name__}: {e}"}


def run_kv_bandwidth(cfg: BenchConfig) -> dict:
    """bench/kv_bandwidth.py (the backends beside their floors) for one 2048-token prompt's KV, as a child
    process with a deadline: it spawns processes of its own, and a hang there must not hang this run."""
    prefix = cfg.out_dir / f"{cfg.name}.kv_bandwidth"
    tokens, repeats = (64, 3) if cfg.quick else (2048, 10)
    argv = [sys.executable, "-m", "bench.kv_bandwidth", "--tokens", str(tokens), "--repeats", str(repeats)]
    root = Path(__file__).parent.parent
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen([*argv, "--out", str(prefix)], cwd=root, start_new_session=True, **pipe)
    try:
        out, _ = proc.communicate(timeout=KV_BANDWIDTH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the child and what it spawned
        proc.wait()
        return {"error": f"bench.kv_bandwidth did not finish within {KV_BANDWIDTH_TIMEOUT_S:.0f} s"}
    if proc.returncode != 0:
        return {"error": (out.strip().splitlines() or ["no output"])[-1]}
    written = Path(f"{prefix}.json")  # kv_bandwidth writes <out>.json and <out>.md
    result = json.loads(written.read_text()) if written.exists() else {}
    return {**result, "markdown": out.strip()}


def environment() -> dict:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "git_commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_at_start": os.getloadavg(),
    }


def shown_path(path: Path) -> str:
    """A path as a result records it: relative to the repository when inside it (no one's home folder)."""
    root = Path(__file__).resolve().parents[1]
    return str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path)


def cpu_model() -> str:
    """The CPU's model name and its wide vector extensions (avx2, avx512f, amx_tile), from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    first = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.split("\n\n")[0].splitlines())}
    flags = set(first.get("flags", "").split())
    name = first.get("model name") or platform.processor()
    wide = [f for f in ("avx2", "avx512f", "amx_tile") if f in flags]
    return f"{name} ({', '.join(wide) or 'no avx2'})"


def warn_if_busy(cores: int) -> None:
    """Timings on a shared machine are only worth something while nobody else computes."""
    load = os.getloadavg()[0]
    if load > 0.5 * cores:
        print(
            f"bench: warning: 1-min load average is {load:.2f} on {cores} cores before the run; "
            "other work will distort the timings",
            file=sys.stderr,
        )


def missing_bench_extra() -> list[str]:
    """The modules of the bench extra that are not installed."""
    return [m for m in BENCH_EXTRA if importlib.util.find_spec(m) is None]


def main(argv: list[str] | None = None) -> int:
    if missing := missing_bench_extra():
        print(
            f"bench: error: the benchmarks need the bench extra, pip install -e '.[bench]' (missing: "
            f"{', '.join(missing)})",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = parse_args(argv)
        config = model_config(cfg.model)
    except ValueError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.threads)
    warn_if_busy(os.cpu_count() or 1)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    workloads = build_workloads(cfg, config)
    hf = LazyModel(cfg.model)
    config_record = {**asdict(cfg), "out_dir": shown_path(cfg.out_dir)}
    run: dict = {"config": config_record, "environment": environment(), "results": []}
    for system in [*cfg.systems, *(name for name, _ in cfg.external)]:
        run["results"] += run_system(cfg, system, workloads, hf)
    add_token_agreement(run["results"])
    run["goodput"] = goodput(run["results"])
    if cfg.overhead:
        run["engine_overhead"] = run_overhead(cfg, config)
    run["environment"]["loadavg_at_end"] = os.getloadavg()
    if "disagg" in cfg.systems and cfg.kv_bandwidth:
        run["kv_bandwidth"] = run_kv_bandwidth(cfg)
    paths = report.write_all(run, cfg.out_dir, cfg.name)
    print(report.markdown(run))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r["ok"] for r in run["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
