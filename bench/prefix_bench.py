"""Prefix caching benchmark: two workloads of shared prefixes, on pdserve stacks with caching on and off.

- `shared_prefix`: requests behind one long common prefix with short distinct suffixes, sent one after another
  (each when the previous one has completed): TTFT is the time to compute what the cache does not hold.
- `multi_turn`: conversations of several turns behind a shared system prompt; each turn's prompt is the whole
  history (system prompt, every earlier message and answer, the new message); a conversation sends its next
  turn when the previous one completes; the conversations run side by side. Reported: TTFT, output tokens a
  second, and (disaggregated) the KV bytes shipped per turn against the KV of the tokens added since the
  previous turn's prompt (the previous answer and the new message).

Every request is greedy with `ignore_eos` and a fixed output length, over HTTP with streaming, from a fixed seed
(the same token ids for every system). `--external NAME=URL` adds a server someone else started (e.g. vLLM's CPU
build) on the same workloads: its prefix cache is emptied first where it serves `POST /reset_prefix_cache`, and its
`vllm:prefix_cache_*` counters stand for the nodes'. `--rounds N` runs every system N times in turn and reports
each figure's best. Results go to bench/runs/prefix-caching.{json,md,png}, or with --record to
bench/results/<date>-<commit>-prefix-caching.{json,md,png}.

    python -m bench.prefix_bench --model small --external vllm=http://127.0.0.1:8001 --rounds 2 --record
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import systems
from bench.http_client import HttpTarget, send
from bench.metrics import RequestRecord
from bench.run_bench import RESULTS_DIR, RUNS_DIR, _external, environment, model_config, recorded_name
from bench.workloads import NUM_SPECIAL_TOKENS, BenchRequest

CONFIGS = [("colocated", True), ("colocated", False), ("disagg", True), ("disagg", False)]
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 16, 512  # pdserve's engine budget (an external server brings its own)
EXTERNAL_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}


@dataclass(frozen=True)
class Sizes:
    prefix: int = 800  # shared_prefix: the common prefix
    suffix: tuple[int, int] = (16, 48)  # its distinct suffixes (min, max)
    requests: int = 12
    output: int = 16
    system: int = 400  # multi_turn: the shared system prompt
    message: tuple[int, int] = (32, 96)  # each user message
    answer: int = 32  # each answer
    conversations: int = 3
    turns: int = 3


QUICK = Sizes(
    prefix=100, suffix=(4, 8), requests=4, output=4, system=64, message=(4, 12), answer=4, conversations=2, turns=2
)


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab - NUM_SPECIAL_TOKENS, n).tolist()


def shared_prefix(sizes: Sizes, vocab: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, sizes.prefix, vocab)
    return [
        BenchRequest(tuple(prefix + _tokens(rng, int(rng.integers(*sizes.suffix, endpoint=True)), vocab)), sizes.output)
        for _ in range(sizes.requests)
    ]


def multi_turn_messages(sizes: Sizes, vocab: int, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt, and each conversation's user messages."""
    rng = np.random.default_rng(seed + 1)
    system = _tokens(rng, sizes.system, vocab)
    msgs = [
        [_tokens(rng, int(rng.integers(*sizes.message, endpoint=True)), vocab) for _ in range(sizes.turns)]
        for _ in range(sizes.conversations)
    ]
    return system, msgs


# ---- the systems -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class System:
    """A pdserve stack (`colocated` or `disagg`, caching on or off), or an external OpenAI-compatible server."""

    name: str
    caching: bool | None = None  # pdserve: whether its nodes cache prefixes; external: None (the server's own)
    url: str = ""  # external servers only

    @property
    def label(self) -> str:
        if self.url:
            return self.name
        return f"{self.name} caching {'on' if self.caching else 'off'}"


def chosen_systems(args: argparse.Namespace) -> list[System]:
    pdserve = [
        System(mode, caching)
        for mode, caching in CONFIGS
        if mode in args.modes and ("on" if caching else "off") in args.caching
    ]
    return pdserve + [System(name, url=url) for name, url in _external(args.external)]


# ---- running ---------------------------------------------------------------------------------------
async def _sequential(url: str, model: str, target, requests: list[BenchRequest]) -> list[RequestRecord]:
    return [await send(url, model, r, target) for r in requests]


async def _conversation(url: str, model: str, target, system: list[int], msgs: list[list[int]], answer: int):
    """One conversation's turns, each sent when the previous completes: (record, tokens added) per turn."""
    history, out = list(system), []
    for msg in msgs:
        added = len(msg) + (len(out[-1][0].output_token_ids) if out else len(system))
        history += msg
        rec = await send(url, model, BenchRequest(tuple(history), answer), target)
        out.append((rec, added))
        history += rec.output_token_ids
    return out


async def _multi_turn(url: str, model: str, target, system, convs, answer: int):
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(_conversation(url, model, target, system, m, answer) for m in convs))
    return time.perf_counter() - t0, [turn for conv in runs for turn in conv]


def _summary(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok]
    return {
        "requests": len(records),
        "ok": len(ok),
        "ttft_p50_s": _p50(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "errors": sorted({r.error for r in records if r.error})[:3],
    }


def _p50(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def run_workloads(target: HttpTarget, counters: Callable[[], dict], sizes: Sizes, vocab: int, seed: int) -> dict:
    """Both workloads against one server: their TTFTs, the multi-turn rate, the server's counters over each
    (`counters()`: {group: {counter: value}}) and every answer's token ids."""
    url = f"{target.base_url}/v1/completions"
    model = asyncio.run(_served(target.base_url))
    asyncio.run(_sequential(url, model, target, [BenchRequest(tuple(range(10, 42)), 4)]))  # warm-up
    before = counters()
    shared = asyncio.run(_sequential(url, model, target, shared_prefix(sizes, vocab, seed)))
    mid = counters()
    system, convs = multi_turn_messages(sizes, vocab, seed)
    wall, turns = asyncio.run(_multi_turn(url, model, target, system, convs, sizes.answer))
    after = counters()
    records = [rec for rec, _ in turns]
    return {
        "shared_prefix": {**_summary(shared), "counters": systems.counters_diff(mid, before)},
        "multi_turn": {
            **_summary(records),
            "wall_s": wall,
            "counters": systems.counters_diff(after, mid),
            "output_tok_s": sum(len(r.output_token_ids) for r in records) / wall,
            "first_turn_ttft_p50_s": _p50(r.ttft for i, r in enumerate(records) if r.ok and i % sizes.turns == 0),
            "later_turn_ttft_p50_s": _p50(r.ttft for i, r in enumerate(records) if r.ok and i % sizes.turns),
            "tokens_added": sum(a for _, a in turns),
            "tokens_added_after_first_turn": sum(a for i, (_, a) in enumerate(turns) if i % sizes.turns),
        },
        "token_ids": {
            "shared_prefix": [r.output_token_ids for r in shared],
            "multi_turn": [r.output_token_ids for r in records],
        },
    }


def run_pdserve(args, system: System, sizes: Sizes, vocab: int) -> dict:
    extra = (() if system.caching else ("--no-prefix-caching",)) + tuple(args.stack_arg)
    logs = RUNS_DIR / f"prefix-{system.name}-{'on' if system.caching else 'off'}"
    opts = systems.StackOptions(
        args.model, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, args.kv_cache_gb, args.kv_transport, logs, extra
    )
    with systems.pdserve_stack(opts, system.name, progress=False) as run:
        result = run_workloads(run.target, lambda: systems.settled_counters(run), sizes, vocab, args.seed)
    return {"mode": system.name, "prefix_caching": system.caching, **result}


def run_external(args, system: System, sizes: Sizes, vocab: int) -> dict:
    """The same workloads against a server someone else started. Its prefix cache is emptied first where it lets
    us (vLLM: `POST /reset_prefix_cache`, served when it runs with VLLM_SERVER_DEV_MODE=1), so that an earlier run
    leaves it no hits; its own counters (vLLM's `prefix_cache_queries`/`_hits`) stand for pdserve's."""
    target = HttpTarget(system.url.rstrip("/").removesuffix("/v1"))
    if not _server_up(target.base_url):
        raise systems.SystemFailed(f"{system.name}: nothing answers at {target.base_url}")
    emptied = reset_prefix_cache(target.base_url)
    result = run_workloads(target, lambda: external_counters(target.base_url), sizes, vocab, args.seed)
    return {
        "mode": system.name,
        "prefix_caching": external_caching(target.base_url),
        "external": target.base_url,
        "cache_emptied_first": emptied,
        **result,
    }


def _server_up(base_url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base_url}/v1/models", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def reset_prefix_cache(base_url: str) -> bool:
    import httpx

    try:
        return httpx.post(f"{base_url}/reset_prefix_cache", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def _metrics_text(base_url: str) -> str:
    import httpx

    try:
        return httpx.get(f"{base_url}/metrics", timeout=systems.METRICS_TIMEOUT_S).text
    except httpx.HTTPError:
        return ""


def external_counters(base_url: str) -> dict[str, dict[str, float]]:
    """An external server's prefix-cache counters, once two reads a moment apart agree: {"server": {...}}."""
    last = parse_external_counters(_metrics_text(base_url))
    for _ in range(systems.METRICS_TRIES):
        time.sleep(systems.METRICS_SETTLE_S)
        now = parse_external_counters(_metrics_text(base_url))
        if now == last:
            break
        last = now
    return last


def parse_external_counters(text: str) -> dict[str, dict[str, float]]:
    """vLLM's `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (summed over its engines), under
    pdserve's names: {"server": {"prefix_cache_queries": q, "prefix_cache_hits": h}}; {} when it has neither."""
    counts: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = EXTERNAL_COUNTERS.get(name)
        if key and not line.startswith("#"):
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return {"server": counts} if counts else {}


def external_caching(base_url: str) -> bool | None:
    """Whether an external server caches prefixes, from vLLM's `vllm:cache_config_info` labels; None if unknown."""
    for line in _metrics_text(base_url).splitlines():
        if line.startswith("vllm:cache_config_info{") and 'enable_prefix_caching="' in line:
            return line.split('enable_prefix_caching="', 1)[1].split('"', 1)[0] == "True"
    return None


async def _served(base_url: str) -> str:
    import httpx

    from bench.http_client import served_model

    async with httpx.AsyncClient(timeout=30) as client:
        return await served_model(client, base_url)


def run_system(args, system: System, sizes: Sizes, vocab: int, round_: int) -> dict:
    load0, t0 = os.getloadavg(), time.time()
    runner = run_external if system.url else run_pdserve
    result = runner(args, system, sizes, vocab)
    return {
        **result,
        "label": system.label,
        "round": round_,
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "seconds": time.time() - t0,
        "bytes_per_token": _bytes_per_token(model_config(args.model)),
    }


# ---- report ----------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def kv_ratio(result: dict) -> float | None:
    """KV bytes shipped in the multi-turn load over the KV of the tokens added since each previous turn's prompt
    (disagg; None elsewhere)."""
    mt, bpt = result["multi_turn"], result.get("bytes_per_token")
    shipped = mt["counters"].get("prefill", {}).get("kv_transfer_bytes")
    return None if shipped is None or not bpt else shipped / (mt["tokens_added"] * bpt)


def kv_per_turn(result: dict) -> str:
    ratio = kv_ratio(result)
    return "-" if ratio is None else f"{ratio:.2f}"


def kv_mb_per_turn(result: dict) -> float | None:
    """KV megabytes shipped per multi-turn request (disagg; None elsewhere)."""
    mt = result["multi_turn"]
    shipped = mt["counters"].get("prefill", {}).get("kv_transfer_bytes")
    return None if shipped is None or not mt["requests"] else shipped / mt["requests"] / 1e6


def local_prefills(result: dict) -> float | None:
    """Multi-turn requests a decode node prefilled itself (conditional disaggregation; None where not counted)."""
    return result["multi_turn"]["counters"].get("decode", {}).get("local_prefill_requests")


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _hits(result: dict) -> tuple[float, float]:
    counters = result["shared_prefix"]["counters"].values()
    return (
        sum(c.get("prefix_cache_hits", 0) for c in counters),
        sum(c.get("prefix_cache_queries", 0) for c in counters),
    )


def _caching(result: dict) -> str:
    on = result["prefix_caching"]
    text = "?" if on is None else ("on" if on else "off")
    return f"{text} (its own)" if result.get("external") else text


def best_of(runs: list[dict]) -> dict:
    """One system's runs, each figure the best of them: lowest TTFT, highest rate, fewest KV bytes."""

    def least(get):
        vals = [v for v in map(get, runs) if v is not None]
        return min(vals) if vals else None

    return {
        "label": runs[0]["label"],
        "mode": runs[0]["mode"],
        "caching": _caching(runs[0]),
        "runs": len(runs),
        "shared_ttft_p50_s": least(lambda r: r["shared_prefix"]["ttft_p50_s"]),
        "multi_ttft_p50_s": least(lambda r: r["multi_turn"]["ttft_p50_s"]),
        "multi_tok_s": max(r["multi_turn"]["output_tok_s"] for r in runs),
        "kv_ratio": least(kv_ratio),
        "kv_mb_per_turn": least(kv_mb_per_turn),
        "hits": _hits(runs[-1]),
        "local_prefills": local_prefills(runs[-1]),
        "ok": f"{sum(r['shared_prefix']['ok'] + r['multi_turn']['ok'] for r in runs)}/"
        f"{sum(r['shared_prefix']['requests'] + r['multi_turn']['requests'] for r in runs)}",
    }


def by_system(results: list[dict]) -> list[list[dict]]:
    """The results grouped per system, in the order the systems first ran."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["label"], []).append(r)
    return list(groups.values())


def report(results: list[dict], env: dict, sizes: Sizes) -> str:
    rounds = max(r["round"] for r in results) + 1
    lines = [
        f"# Prefix caching ({env['model']}, {env['started']}, commit {env['git_commit']})",
        "",
        f"Machine: {env['cpu']}, {env['cpu_count']} cores, shared with other work (1-minute load average "
        f"{env['loadavg_at_start'][0]:.1f} at the start; each run's below). {rounds} round(s), the systems run "
        "in turn within each; the first table gives each figure's best over the rounds.",
        "",
        f"shared_prefix: {sizes.requests} requests, a {sizes.prefix}-token prefix, suffixes of "
        f"{sizes.suffix[0]}-{sizes.suffix[1]} tokens, {sizes.output} output tokens, one after another.",
        f"multi_turn: {sizes.conversations} conversations x {sizes.turns} turns, a {sizes.system}-token "
        f"system prompt, messages of {sizes.message[0]}-{sizes.message[1]} tokens, {sizes.answer}-token "
        "answers; conversations side by side, turns one after another.",
        "",
        *(
            [f"pdserve's stacks started with `{' '.join(env['stack_args'])}` besides the benchmark's own flags.", ""]
            if env.get("stack_args")
            else []
        ),
        "| system | caching | shared_prefix TTFT p50 ms | hits / queries | multi_turn TTFT p50 ms | "
        "multi_turn out tok/s | KV MB shipped / turn | KV shipped / KV added | local prefills | ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in map(best_of, by_system(results)):
        kv = "-" if b["kv_ratio"] is None else f"{b['kv_ratio']:.2f}"
        lines.append(
            f"| {b['mode']} | {b['caching']} | {_ms(b['shared_ttft_p50_s'])} | {b['hits'][0]:.0f} / "
            f"{b['hits'][1]:.0f} | {_ms(b['multi_ttft_p50_s'])} | {b['multi_tok_s']:.1f} | "
            f"{_mb(b['kv_mb_per_turn'])} | {kv} | {_count(b['local_prefills'])} | {b['ok']} |"
        )
    return "\n".join([*lines, "", *each_run(results), "", agreement(results)]) + "\n"


def each_run(results: list[dict]) -> list[str]:
    lines = [
        "Each run, in the order run:",
        "",
        "| round | system | load avg before / after | shared_prefix TTFT p50 ms | multi_turn TTFT p50 ms | "
        "first / later turns' TTFT p50 ms | multi_turn out tok/s | KV MB shipped / turn | KV shipped / KV added |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mt = r["multi_turn"]
        lines.append(
            f"| {r['round'] + 1} | {r['label']} | {r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f} "
            f"| {_ms(r['shared_prefix']['ttft_p50_s'])} | {_ms(mt['ttft_p50_s'])} | "
            f"{_ms(mt.get('first_turn_ttft_p50_s'))} / {_ms(mt.get('later_turn_ttft_p50_s'))} | "
            f"{mt['output_tok_s']:.1f} | {_mb(kv_mb_per_turn(r))} | {kv_per_turn(r)} |"
        )
    notes = [
        f"{r['label']}'s prefix cache could not be emptied before round {r['round'] + 1} (no "
        "`/reset_prefix_cache`): it may hold that round's prefixes from an earlier one"
        for r in results
        if r.get("external") and not r["cache_emptied_first"] and r["round"]
    ]
    return lines + ([""] + [f"- {n}." for n in notes] if notes else [])


def agreement(results: list[dict]) -> str:
    """How many answers of each run equal the first run's, token for token (greedy: all should)."""
    ref = results[0]["token_ids"]
    parts = []
    for r in results[1:]:
        pairs = [(a, b) for w in ref for a, b in zip(ref[w], r["token_ids"][w], strict=True)]
        parts.append(f"{r['label']} (round {r['round'] + 1}) {sum(a == b for a, b in pairs)}/{len(pairs)}")
    return f"Answers equal to {results[0]['label']}'s (round 1), token for token: " + ", ".join(parts) + "."


def plot(results: list[dict], env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = [best_of(runs) for runs in by_system(results)]
    names = [b["label"].replace(" caching ", "\ncaching ") for b in best]
    disagg = [i for i, b in enumerate(best) if b["kv_mb_per_turn"] is not None]
    panels = [
        ("shared_prefix TTFT p50 (ms)", names, [1e3 * (b["shared_ttft_p50_s"] or 0) for b in best]),
        ("multi_turn TTFT p50 (ms)", names, [1e3 * (b["multi_ttft_p50_s"] or 0) for b in best]),
        ("multi_turn output tok/s", names, [b["multi_tok_s"] for b in best]),
        ("multi_turn KV MB shipped per turn", [names[i] for i in disagg], [best[i]["kv_mb_per_turn"] for i in disagg]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.9 * len(panels), 4.2))
    for ax, (title, labels, values) in zip(axes, panels, strict=True):
        bars = ax.bar(range(len(values)), values, color=[_color(n) for n in labels])
        ax.bar_label(bars, fmt=lambda v: f"{v:.0f}" if v >= 100 else f"{v:.3g}", fontsize=7)
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"Prefix caching, {env['model']}, commit {env['git_commit']}: {env['cpu']}, {env['cpu_count']} "
        "cores (best of each system's runs)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _color(label: str) -> str:
    """An external server orange, pdserve with caching blue, without grey."""
    return "tab:orange" if "caching" not in label else "tab:blue" if label.endswith("on") else "tab:gray"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--kv-transport", default="zmq", choices=["zmq", "shm"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--modes",
        nargs="*",
        default=["colocated", "disagg"],
        choices=["colocated", "disagg"],
        help="pdserve stacks to run, each with caching on and off (see --caching)",
    )
    p.add_argument(
        "--caching",
        nargs="+",
        default=["on", "off"],
        choices=["on", "off"],
        help="the pdserve stacks' prefix caching: on, off or both",
    )
    p.add_argument(
        "--external",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="also drive an OpenAI-compatible server someone started, e.g. vllm=http://127.0.0.1:8001",
    )
    p.add_argument("--rounds", type=int, default=1, help="run every system this many times, in turn; report the best")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not a measurement")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="RUN.json",
        help="only rewrite a run's .md and .png from its .json (same stem), running nothing",
    )
    p.add_argument(
        "--stack-arg",
        action="append",
        default=[],
        help="a flag for every pdserve stack's `pdserve up` (repeat; as --stack-arg=--flag=value)",
    )
    p.add_argument("--name", default="", help="a label added to the files' name (prefix-caching-NAME)")
    p.add_argument("--record", action="store_true", help="write to bench/results, named by date and commit")
    p.add_argument("--out-dir", type=Path, default=None, help="default: bench/runs (bench/results with --record)")
    args = p.parse_args(argv)
    try:
        _external(args.external)
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1 or not (args.modes or args.external):
        p.error("--rounds must be at least 1, and some system must run (--modes or --external)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return rewrite_report(args.report, plotted=not args.no_plot)
    sizes = QUICK if args.quick else Sizes()
    config = model_config(args.model)
    env = {**environment(), "model": args.model, "stack_args": args.stack_arg}
    args.out_dir = args.out_dir or (RESULTS_DIR if args.record else RUNS_DIR)
    for folder in {args.out_dir, RUNS_DIR}:
        folder.mkdir(parents=True, exist_ok=True)
    stem, results = output_stem(args, env["git_commit"]), []
    for round_ in range(args.rounds):
        for system in chosen_systems(args):
            print(f"round {round_ + 1}: {system.label}", file=sys.stderr)
            try:
                results.append(run_system(args, system, sizes, config.vocab_size, round_))
            except systems.SystemFailed as e:
                print(f"  failed: {e}", file=sys.stderr)
                return 1
            write(args.out_dir / stem, env, sizes, results)  # after each run: a cut-short run keeps what it has
    env["loadavg_at_end"] = os.getloadavg()
    write(args.out_dir / stem, env, sizes, results, plotted=not args.no_plot)
    print((args.out_dir / f"{stem}.md").read_text())
    return 0


def rewrite_report(path: Path, plotted: bool) -> int:
    run = json.loads(path.read_text())
    sizes = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in run["sizes"].items()})
    write(path.with_suffix(""), run["env"], sizes, run["results"], plotted)
    print(path.with_suffix(".md").read_text())
    return 0


def write(path: Path, env: dict, sizes: Sizes, results: list[dict], plotted: bool = False) -> None:
    path.with_suffix(".json").write_text(json.dumps({"env": env, "sizes": sizes.__dict__, "results": results}))
    path.with_suffix(".md").write_text(report(results, env, sizes))
    if plotted:
        plot(results, env, path.with_suffix(".png"))


def output_stem(args: argparse.Namespace, commit: str) -> str:
    label = "prefix-caching" + ("-quick" if args.quick else "") + (f"-{args.name}" if args.name else "")
    return recorded_name(label, commit, time.strftime("%Y-%m-%d", time.gmtime())) if args.record else label


def _bytes_per_token(config) -> int:
    """KV bytes per token of a float32 pool of this model."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4


if __name__ == "__main__":
    sys.exit(main())
