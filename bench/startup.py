"""Launch to first completion: `pdserve up` of this tree against another tree, interleaved, best of --runs.

    python -m bench.startup --baseline-tree DIR --record     # DIR: a checkout of the tree to compare against
    python -m bench.startup --model qwen3-0.6b --device cuda:0 --runs 1 --json OUT.json   # this tree alone (GPU kit)

Each run starts `python -m pdserve up --model M --mode MODE` from one tree (its own folder first on PYTHONPATH, then
the caller's entries: where the dependencies are installed) and
posts one greedy completion until it is answered; the time from the start of the process to that answer is the
run's. The launcher's own "serving" line is timed too, and each run's start stages are read from the stack's log
(`start_stages`: per process, imports, weights, kernels and graphs, ready; the router's join of each node). The
built-in checkpoint is written before the first run, and each tree runs once untimed first (its compiled kernels
cached), so that no run pays for either. The trees take turns, run by run; the best of each is kept (a shared host's
noise only adds time). Writes bench/results/<date>-<commit>-startup.json and .md with --record, the result as JSON
with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(tree: Path, model: str, mode: str, up_args: tuple[str, ...] = ()) -> dict:
    """Seconds from starting `pdserve up` in `tree` to its "serving" line and to its first completion, and its start
    stages (`start_stages`, from its log)."""
    port = free_port()
    path = [str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]  # the tree's own first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    argv = [sys.executable, "-m", "pdserve", "--log-level", "INFO", "up", "--model", model, "--mode", mode, *up_args]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        argv += ["--port", str(port)]
        up = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            serving = _serving_line(up, started)
            while time.monotonic() - started < TIMEOUT_S:
                try:
                    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
                    if r.status_code == 200:
                        done = time.monotonic() - started
                        log.seek(0)
                        return {"serving_s": serving, "first_completion_s": done, "stages": start_stages(log.read())}
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
            raise RuntimeError(f"no completion from {tree} within {TIMEOUT_S} s")
        finally:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()


STAGE_LINES = (  # (pattern of a start log line, the stage it times); a node's lines carry its role and pid
    (re.compile(r"INFO (\w+ \d+): imported .* in ([\d.]+) s"), "imported_s"),
    (re.compile(r"INFO (\w+ \d+): loaded the weights .* in ([\d.]+) s"), "weights_s"),
    (re.compile(r"INFO (\w+ \d+): built the kernels.* in ([\d.]+) s"), "kernels_and_graphs_s"),
    (re.compile(r"INFO (\w+ \d+): \w+ node ready in ([\d.]+) s"), "ready_s"),
    (re.compile(r"INFO (router): imported the router in ([\d.]+) s"), "imported_s"),
    (re.compile(r"INFO router: (\w+)@\S+ is up \(joined ([\d.]+) s after the router started\)"), "joined_s"),
    (re.compile(r"INFO up: the (\w+) node is ready, ([\d.]+) s after launch"), "ready_after_launch_s"),
    (re.compile(r"INFO (up): ready ([\d.]+) s after launch"), "ready_after_launch_s"),
)


def start_stages(log: str) -> dict[str, dict[str, float]]:
    """{process ("prefill 1234", "router", a node's role, "up"): {stage: seconds}} from a stack's log: each node's
    imports, weights, kernels and graphs (each its own time), and ready (from the end of its imports); the router's
    imports; when the router joined each role's node (from the router's start); when the launcher saw each role's
    node, and the whole stack, ready (from the launch)."""
    out: dict[str, dict[str, float]] = {}
    for line in log.splitlines():
        for pattern, stage in STAGE_LINES:
            m = pattern.search(line)
            if m:
                out.setdefault(m.group(1), {})[stage] = float(m.group(2))
    return out


def _serving_line(up: subprocess.Popen, started: float) -> float:
    line = up.stdout.readline()
    if "is serving" not in line:
        raise RuntimeError(f"pdserve up did not start (code {up.wait()})")
    return time.monotonic() - started


def compare(
    trees: dict[str, Path], model: str, mode: str, runs: int, up_args: tuple[str, ...] = (), warm_up: bool = True
) -> dict:
    """Every tree's runs, interleaved, with their best."""
    from pdserve.checkpoint import resolve_model

    resolve_model(model)
    for tree in trees.values() if warm_up else ():
        one_start(tree, model, mode, up_args)  # untimed: kernels compiled and cached
    times: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(runs):
        for name, tree in trees.items():
            times[name].append(one_start(tree, model, mode, up_args))
    best = {name: min(t["first_completion_s"] for t in ts) for name, ts in times.items()}
    return {
        "model": model,
        "mode": mode,
        "up_args": list(up_args),
        "warm_up": warm_up,
        "runs": times,
        "best_first_completion_s": best,
    }


def report(result: dict, commit: str, baseline: str | None) -> str:
    best = result["best_first_completion_s"]
    serving = {name: min(t["serving_s"] for t in ts) for name, ts in result["runs"].items()}
    extra = f" {' '.join(result['up_args'])}" if result["up_args"] else ""
    each = "interleaved runs each" if baseline else "runs"
    lines = [
        f"# `pdserve up --model {result['model']} --mode {result['mode']}{extra}`: launch to first completion",
        "",
        f"Best of {len(result['runs']['this'])} {each}, after "
        + ("one untimed start" if result["warm_up"] else f"no untimed start (Triton cache: {result['triton_cache']})")
        + f"; load average before {result['load']}, after {result['load_after']}.",
        "",
        "| tree | serving line (s) | first completion (s) | every run (s) |",
        "|---|---|---|---|",
    ]
    trees = (("baseline", baseline), ("this", commit)) if baseline else (("this", commit),)
    for name, label in trees:
        runs = ", ".join(f"{t['first_completion_s']:.2f}" for t in result["runs"][name])
        lines.append(f"| {label} | {serving[name]:.2f} | {best[name]:.2f} | {runs} |")
    if baseline:
        lines += ["", f"Ratio, this / {baseline}: {result['ratio']:.2f}x."]
    fastest = min(result["runs"]["this"], key=lambda t: t["first_completion_s"])
    lines += [
        "",
        "Start stages of this tree's fastest run, in seconds: each stage's own time, but a node's `ready` (from the "
        "end of its imports), `joined` (from the router's start) and `after launch`:",
        "",
        "| process | stage | s |",
        "|---|---|---|",
    ]
    for process, stages in fastest.get("stages", {}).items():
        lines += [
            f"| {process} | {stage.removesuffix('_s').replace('_', ' ')} | {v:.1f} |" for stage, v in stages.items()
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-tree", type=Path, help="a checkout of the tree to compare against (else: this alone)")
    p.add_argument("--baseline-label", default="baseline", help="its name in the report (e.g. its commit)")
    p.add_argument("--model", default="small")
    p.add_argument("--mode", default="disagg", choices=["disagg", "colocated"])
    p.add_argument("--device", default=None, help="`pdserve up --device` (default: its own, the CPU)")
    p.add_argument("--dtype", default=None, help="`pdserve up --dtype`")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="`pdserve up --kv-cache-gb`")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--triton-cache-from",
        type=Path,
        default=None,
        help="start from a copy of this Triton cache folder, compiled by a stack of the same model, and time every "
        "start (no untimed one first); ignored when the folder does not exist",
    )
    p.add_argument("--record", action="store_true", help="write bench/results/<date>-<commit>-startup.{json,md}")
    p.add_argument("--json", type=Path, default=None, help="write the result here too")
    a = p.parse_args()
    up_args = []
    for flag, value in (("--device", a.device), ("--dtype", a.dtype), ("--kv-cache-gb", a.kv_cache_gb)):
        up_args += [flag, str(value)] if value is not None else []
    load = os.getloadavg()[0]
    trees = {"this": ROOT} if a.baseline_tree is None else {"baseline": a.baseline_tree.resolve(), "this": ROOT}
    warm = a.triton_cache_from is not None and a.triton_cache_from.is_dir()
    with tempfile.TemporaryDirectory() as copy:
        if warm:
            shutil.copytree(a.triton_cache_from, copy, dirs_exist_ok=True)
            os.environ["TRITON_CACHE_DIR"] = copy  # the stacks' nodes compile, or find, their kernels here
        result = compare(trees, a.model, a.mode, a.runs, tuple(up_args), warm_up=not warm)
    result["triton_cache"] = f"a copy of {a.triton_cache_from}" if warm else "the default"
    best = result["best_first_completion_s"]
    result.update(load=round(load, 2), load_after=round(os.getloadavg()[0], 2))
    result["serving_s"] = min(t["serving_s"] for t in result["runs"]["this"])  # the ready line, best run
    result["first_completion_s"] = best["this"]
    if a.baseline_tree is not None:
        result.update(ratio=best["this"] / best["baseline"], baseline=a.baseline_label)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit = commit.stdout.strip() or "this"
    text = report(result, commit, a.baseline_label if a.baseline_tree is not None else None)
    print(text)
    stem = ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-{commit}-startup"
    if a.record:
        stem.with_suffix(".md").write_text(text)
    for path in filter(None, [a.json, a.record and stem.with_suffix(".json")]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**result, "commit": commit}, indent=1) + "\n")


if __name__ == "__main__":
    main()
