"""The prefill → decode hand-off under load, against the time per output token.

A 1P1D stack (`pdserve up --mode disagg`, each node pinned to its own core as `pdserve up` pins them, KV over
--kv-transport, no local prefill on the decode node) gets --streams closed-loop streams, each sending
--per-stream requests one after another (--prompt-len random prompt tokens, --output-len tokens out). From the
router's /metrics, around the run: the mean hand-off (`pdserve:request_handoff_time_seconds`: the prefill node's
first token → the decode node's first token) and the mean time per output token
(`pdserve:request_time_per_output_token_seconds`), and their ratio; from the decode node's histograms
(`pdserve:node_handoff_{wait,copy,check,join}_seconds`), the hand-off in parts where the KV was copied out of a
shared pool (offer received → copy started, the copy, the checks of what landed, checked → the request's first
decode step), each as a mean and against the TPOT.

    python -m bench.handoff --record        # bench/results/<day>-<commit>-handoff.{json,md}
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench import systems
from bench.run_bench import git_commit, recorded_name
from bench.workloads import NUM_SPECIAL_TOKENS, BenchRequest, Workload

RESULTS = Path(__file__).parent / "results"
HANDOFF = "pdserve:request_handoff_time_seconds"
TPOT = "pdserve:request_time_per_output_token_seconds"
# the decode node's hand-off parts: (its histogram on the router's /metrics, what it measures)
PARTS = (
    ("pdserve:node_handoff_wait_seconds", "offer received → copy started"),
    ("pdserve:node_handoff_copy_seconds", "the copy"),
    ("pdserve:node_handoff_check_seconds", "checks of what landed"),
    ("pdserve:node_handoff_join_seconds", "copy done and checked → first decode step"),
    ("pdserve:node_handoff_admit_seconds", "  of which: checked → admitted (marked landed)"),
    ("pdserve:node_handoff_queue_seconds", "  of which: admitted → its first step launched"),
    ("pdserve:node_handoff_step_seconds", "  of which: that step's launch (its computation)"),
    ("pdserve:node_handoff_out_seconds", "  of which: launch end → its token out"),
)


def part_key(name: str) -> str:
    """A part's key in the result: pdserve:node_handoff_copy_seconds -> handoff_copy."""
    return name.removeprefix("pdserve:node_").removesuffix("_seconds")


@dataclass(frozen=True)
class HandoffConfig:
    model: str = "small"
    kv_transport: str = "shm"
    streams: int = 16
    per_stream: int = 4
    prompt_len: int = 400
    output_len: int = 32
    vocab_size: int = 8192
    seed: int = 0


def workload(cfg: HandoffConfig) -> Workload:
    """streams x per_stream requests; a closed loop of `streams` in flight sends them one after another."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.streams * cfg.per_stream
    prompts = rng.integers(0, cfg.vocab_size - NUM_SPECIAL_TOKENS, size=(n, cfg.prompt_len))
    return Workload("handoff", tuple(BenchRequest(tuple(int(t) for t in p), cfg.output_len) for p in prompts))


def histogram_sums(metrics_text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram in Prometheus text, over all its label sets."""
    total, count = 0.0, 0.0
    for line in metrics_text.splitlines():
        head, _, value = line.rpartition(" ")
        base = head.split("{", 1)[0]
        if base == f"{name}_sum":
            total += float(value)
        elif base == f"{name}_count":
            count += float(value)
    return total, count


def mean_between(after: str, before: str, name: str) -> float | None:
    (s1, c1), (s0, c0) = histogram_sums(after, name), histogram_sums(before, name)
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def summarize(after: str, before: str) -> dict:
    """The run's means (seconds) and ratios to the mean TPOT, from /metrics before and after it."""
    handoff, tpot = mean_between(after, before, HANDOFF), mean_between(after, before, TPOT)
    out = {"handoff_mean_s": handoff, "tpot_mean_s": tpot}
    out["handoff_over_tpot"] = handoff / tpot if handoff and tpot else None
    for name, _ in PARTS:
        mean = mean_between(after, before, name)
        out[f"{part_key(name)}_mean_s"] = mean
        out[f"{part_key(name)}_over_tpot"] = mean / tpot if mean is not None and tpot else None
    copies = PARTS[1][0]  # every part is observed once a copy's request has decoded
    out["handoff_copies"] = histogram_sums(after, copies)[1] - histogram_sums(before, copies)[1]
    return out


def run(cfg: HandoffConfig, log_prefix: Path, progress: bool) -> dict:
    opts = systems.StackOptions(
        model=cfg.model,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        kv_cache_gb=0.5,
        kv_transport=cfg.kv_transport,
        log_prefix=log_prefix,
        extra_args=("--local-prefill-max-tokens", "0"),
        max_concurrency=cfg.streams,
    )
    w = workload(cfg)
    with systems.pdserve_stack(opts, "disagg", progress) as runner:
        runner(Workload("warm-up", w.requests[:2]), "warm-up")
        systems.settled_counters(runner)  # the nodes' latest Stats (and histograms) reached the router
        before = runner.metrics()
        t0 = time.perf_counter()
        _, records = runner(w, "handoff")
        wall = time.perf_counter() - t0
        systems.settled_counters(runner)
        after = runner.metrics()
    failed = sum(1 for r in records if r.error)
    return {"config": asdict(cfg), "wall_s": wall, "failed": failed, **summarize(after, before)}


def table(result: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    rows = [
        "| part | mean (ms) | / mean TPOT |",
        "|---|---|---|",
        f"| hand-off (router: prefill first token → decode first token) | {ms(result['handoff_mean_s'])} | "
        f"{x(result['handoff_over_tpot'])} |",
    ]
    for name, words in PARTS:
        k = part_key(name)
        rows.append(f"| {words} (decode node) | {ms(result[f'{k}_mean_s'])} | {x(result[f'{k}_over_tpot'])} |")
    rows.append(f"| time per output token (router) | {ms(result['tpot_mean_s'])} | 1.00x |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=HandoffConfig.model)
    p.add_argument("--kv-transport", default=HandoffConfig.kv_transport)
    p.add_argument("--streams", type=int, default=HandoffConfig.streams)
    p.add_argument("--per-stream", type=int, default=HandoffConfig.per_stream)
    p.add_argument("--prompt-len", type=int, default=HandoffConfig.prompt_len)
    p.add_argument("--output-len", type=int, default=HandoffConfig.output_len)
    p.add_argument("--record", action="store_true", help="write bench/results/<day>-<commit>-handoff.{json,md}")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    cfg = HandoffConfig(a.model, a.kv_transport, a.streams, a.per_stream, a.prompt_len, a.output_len)
    commit = git_commit()
    stem = recorded_name("handoff", commit, time.strftime("%Y-%m-%d", time.gmtime())) if a.record else "handoff"
    RESULTS.mkdir(exist_ok=True)
    result = {"commit": commit, **run(cfg, Path(tempfile.mkdtemp()) / stem, not a.no_progress)}
    text = table(result)
    print(text)
    if a.record:
        (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        head = (
            f"# Hand-off at {commit}\n\n1P1D `{cfg.model}` over {cfg.kv_transport}, no local prefill, "
            f"{cfg.streams} closed-loop streams x {cfg.per_stream} requests ({cfg.prompt_len}-token prompts, "
            f"{cfg.output_len} tokens out); {result['failed']} failed, {result['wall_s']:.1f} s.\n\n"
        )
        (RESULTS / f"{stem}.md").write_text(head + text + "\n")


if __name__ == "__main__":
    main()
