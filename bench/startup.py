"""Launch to first completion: `pdserve up` of this tree against another tree, interleaved, best of --runs.

    python -m bench.startup --baseline-tree DIR --record     # DIR: a checkout of the tree to compare against

Each run starts `python -m pdserve up --model M --mode MODE` from one tree (its own folder first on PYTHONPATH) and
posts one greedy completion until it is answered; the time from the start of the process to that answer is the
run's. The launcher's own "serving" line is timed too. The built-in checkpoint is written before the first run, and
each tree runs once untimed first (its compiled kernels cached), so that no run pays for either. The trees take turns,
run by run; the best of each is kept (a shared host's noise only adds time). Writes bench/results/<date>-<commit>-
startup.json and .md with --record.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(tree: Path, model: str, mode: str) -> dict:
    """Seconds from starting `pdserve up` in `tree` to its "serving" line and to its first completion."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", "up", "--model", model, "--mode", mode]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    started = time.monotonic()
    up = subprocess.Popen([*argv, "--port", str(port)], cwd=tree, env=env, stdout=subprocess.PIPE, text=True)
    try:
        serving = _serving_line(up, started)
        while time.monotonic() - started < TIMEOUT_S:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
                if r.status_code == 200:
                    return {"serving_s": serving, "first_completion_s": time.monotonic() - started}
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


def _serving_line(up: subprocess.Popen, started: float) -> float:
    line = up.stdout.readline()
    if "is serving" not in line:
        raise RuntimeError(f"pdserve up did not start (code {up.wait()})")
    return time.monotonic() - started


def compare(trees: dict[str, Path], model: str, mode: str, runs: int) -> dict:
    """Every tree's runs, interleaved, with their best."""
    from pdserve.checkpoint import resolve_model

    resolve_model(model)
    for tree in trees.values():
        one_start(tree, model, mode)  # untimed: kernels compiled and cached
    times: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(runs):
        for name, tree in trees.items():
            times[name].append(one_start(tree, model, mode))
    best = {name: min(t["first_completion_s"] for t in ts) for name, ts in times.items()}
    return {"model": model, "mode": mode, "runs": times, "best_first_completion_s": best}


def report(result: dict, commit: str, baseline: str) -> str:
    best = result["best_first_completion_s"]
    serving = {name: min(t["serving_s"] for t in ts) for name, ts in result["runs"].items()}
    lines = [
        f"# `pdserve up --model {result['model']} --mode {result['mode']}`: launch to first completion",
        "",
        f"Best of {len(result['runs']['this'])} interleaved runs each; load average before {result['load']}, "
        f"after {result['load_after']}.",
        "",
        "| tree | serving line (s) | first completion (s) | every run (s) |",
        "|---|---|---|---|",
    ]
    for name, label in (("baseline", baseline), ("this", commit)):
        runs = ", ".join(f"{t['first_completion_s']:.2f}" for t in result["runs"][name])
        lines.append(f"| {label} | {serving[name]:.2f} | {best[name]:.2f} | {runs} |")
    lines += ["", f"Ratio, this / {baseline}: {result['ratio']:.2f}x."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-tree", required=True, type=Path, help="a checkout of the tree to compare against")
    p.add_argument("--baseline-label", default="baseline", help="its name in the report (e.g. its commit)")
    p.add_argument("--model", default="small")
    p.add_argument("--mode", default="disagg", choices=["disagg", "colocated"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--record", action="store_true", help="write bench/results/<date>-<commit>-startup.{json,md}")
    a = p.parse_args()
    load = os.getloadavg()[0]
    result = compare({"baseline": a.baseline_tree.resolve(), "this": ROOT}, a.model, a.mode, a.runs)
    best = result["best_first_completion_s"]
    result.update(
        load=round(load, 2),
        load_after=round(os.getloadavg()[0], 2),
        ratio=best["this"] / best["baseline"],
        baseline=a.baseline_label,
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit = commit.stdout.strip() or "this"
    text = report(result, commit, a.baseline_label)
    print(text)
    if a.record:
        stem = ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-{commit}-startup"
        stem.with_suffix(".json").write_text(json.dumps({**result, "commit": commit}, indent=1) + "\n")
        stem.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
