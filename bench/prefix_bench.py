"""Prefix caching benchmark: two workloads of shared prefixes, on pdserve stacks with caching on and off.

- `shared_prefix`: requests behind one long common prefix with short distinct suffixes, sent one after another
  (each when the previous one has completed): TTFT is the time to compute what the cache does not hold.
- `multi_turn`: conversations of several turns behind a shared system prompt; each turn's prompt is the whole
  history (system prompt, every earlier message and answer, the new message); a conversation sends its next
  turn when the previous one completes; the conversations run side by side. Reported: TTFT, output tokens a
  second, and (disaggregated) the KV bytes shipped per turn against the KV of the tokens added since the
  previous turn's prompt (the previous answer and the new message).

Every request is greedy with `ignore_eos` and a fixed output length, over HTTP with streaming, from a fixed seed
(the same token ids for every system). Results go to bench/runs/prefix-caching.{json,md}, or with --record to
bench/results/<date>-<commit>-prefix-caching.{json,md}.

    python -m bench.prefix_bench --model small --record
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import systems
from bench.http_client import send
from bench.metrics import RequestRecord
from bench.run_bench import RESULTS_DIR, RUNS_DIR, environment, model_config, recorded_name
from bench.workloads import NUM_SPECIAL_TOKENS, BenchRequest

CONFIGS = [("colocated", True), ("colocated", False), ("disagg", True), ("disagg", False)]


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


QUICK = Sizes(prefix=100, suffix=(4, 8), requests=4, output=4, system=64, message=(4, 12), answer=4,
              conversations=2, turns=2)  # fmt: skip


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab - NUM_SPECIAL_TOKENS, n).tolist()


def shared_prefix(sizes: Sizes, vocab: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, sizes.prefix, vocab)
    return [BenchRequest(tuple(prefix + _tokens(rng, int(rng.integers(*sizes.suffix, endpoint=True)), vocab)),
                         sizes.output) for _ in range(sizes.requests)]  # fmt: skip


def multi_turn_messages(sizes: Sizes, vocab: int, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt, and each conversation's user messages."""
    rng = np.random.default_rng(seed + 1)
    system = _tokens(rng, sizes.system, vocab)
    msgs = [[_tokens(rng, int(rng.integers(*sizes.message, endpoint=True)), vocab) for _ in range(sizes.turns)]
            for _ in range(sizes.conversations)]  # fmt: skip
    return system, msgs


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
    ttfts = sorted(r.ttft for r in ok)
    return {"requests": len(records), "ok": len(ok), "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "errors": sorted({r.error for r in records if r.error})[:3]}  # fmt: skip


def run_config(args, mode: str, caching: bool, sizes: Sizes, vocab: int) -> dict:
    extra = () if caching else ("--no-prefix-caching",)
    opts = systems.StackOptions(args.model, 16, 512, args.kv_cache_gb, args.kv_transport,
                                RUNS_DIR / f"prefix-{mode}-{'on' if caching else 'off'}", extra)  # fmt: skip
    with systems.pdserve_stack(opts, mode, progress=False) as run:
        url, target = f"{run.target.base_url}/v1/completions", run.target
        model = asyncio.run(_served(run.target.base_url))
        asyncio.run(_sequential(url, model, target, [BenchRequest(tuple(range(10, 42)), 4)]))  # warm-up
        before = systems.settled_counters(run)
        shared = asyncio.run(_sequential(url, model, target, shared_prefix(sizes, vocab, args.seed)))
        mid = systems.settled_counters(run)
        system, convs = multi_turn_messages(sizes, vocab, args.seed)
        wall, turns = asyncio.run(_multi_turn(url, model, target, system, convs, sizes.answer))
        after = systems.settled_counters(run)
    records = [rec for rec, _ in turns]
    result = {"mode": mode, "prefix_caching": caching,
              "shared_prefix": {**_summary(shared), "counters": systems.counters_diff(mid, before)},
              "multi_turn": {**_summary(records), "wall_s": wall, "counters": systems.counters_diff(after, mid),
                             "output_tok_s": sum(len(r.output_token_ids) for r in records) / wall,
                             "tokens_added": sum(a for _, a in turns),
                             "tokens_added_after_first_turn": sum(a for i, (_, a) in enumerate(turns)
                                                                  if i % sizes.turns)}}  # fmt: skip
    result["token_ids"] = {"shared_prefix": [r.output_token_ids for r in shared],
                           "multi_turn": [r.output_token_ids for r in records]}  # fmt: skip
    return result


async def _served(base_url: str) -> str:
    import httpx

    from bench.http_client import served_model

    async with httpx.AsyncClient(timeout=30) as client:
        return await served_model(client, base_url)


# ---- report ----------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def kv_per_turn(result: dict, bytes_per_token: float | None) -> str:
    """KV bytes shipped per turn over the KV of the tokens added since the previous turn's prompt (disagg)."""
    mt = result["multi_turn"]
    shipped = mt["counters"].get("prefill", {}).get("kv_transfer_bytes")
    if shipped is None or not bytes_per_token:
        return "-"
    return f"{shipped / (mt['tokens_added'] * bytes_per_token):.2f}"


def report(results: list[dict], env: dict, sizes: Sizes) -> str:
    bpt = next((r["bytes_per_token"] for r in results if r.get("bytes_per_token")), None)
    lines = [f"# Prefix caching ({env['model']}, {env['started']}, commit {env['git_commit']})", "",
             f"CPU: {env['cpu_count']} cores, load average at start {env['loadavg_at_start'][0]:.1f} "
             "(shared with other work: timings are noisy; one run).", "",
             f"shared_prefix: {sizes.requests} requests, a {sizes.prefix}-token prefix, suffixes of "
             f"{sizes.suffix[0]}-{sizes.suffix[1]} tokens, {sizes.output} output tokens, one after another.",
             f"multi_turn: {sizes.conversations} conversations x {sizes.turns} turns, a {sizes.system}-token "
             f"system prompt, messages of {sizes.message[0]}-{sizes.message[1]} tokens, {sizes.answer}-token "
             "answers; conversations side by side, turns one after another.", "",
             "| system | caching | shared_prefix TTFT p50 ms | hits / queries | multi_turn TTFT p50 ms | "
             "multi_turn out tok/s | KV shipped / KV added | ok |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        sp, mt = r["shared_prefix"], r["multi_turn"]
        c = {k: sum(v.get(k, 0) for v in sp["counters"].values())
             for k in ("prefix_cache_hits", "prefix_cache_queries")}
        hits = f"{c['prefix_cache_hits']:.0f} / {c['prefix_cache_queries']:.0f}"
        ok = f"{sp['ok'] + mt['ok']}/{sp['requests'] + mt['requests']}"
        lines.append(f"| {r['mode']} | {'on' if r['prefix_caching'] else 'off'} | {_ms(sp['ttft_p50_s'])} | {hits} "
                     f"| {_ms(mt['ttft_p50_s'])} | {mt['output_tok_s']:.1f} | {kv_per_turn(r, bpt)} | {ok} |")
    return "\n".join([*lines, "", agreement(results)]) + "\n"


def agreement(results: list[dict]) -> str:
    """How many answers of each system equal the first system's, token for token (greedy: all should)."""
    ref = results[0]["token_ids"]
    parts = []
    for r in results[1:]:
        pairs = [(a, b) for w in ref for a, b in zip(ref[w], r["token_ids"][w], strict=True)]
        parts.append(f"{_name(r)} {sum(a == b for a, b in pairs)}/{len(pairs)}")
    return f"Answers equal to {_name(results[0])}'s, token for token: " + ", ".join(parts) + "."


def _name(result: dict) -> str:
    return f"{result['mode']} caching {'on' if result['prefix_caching'] else 'off'}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--kv-transport", default="zmq", choices=["zmq", "shm"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not a measurement")
    p.add_argument("--record", action="store_true", help="write to bench/results, named by date and commit")
    p.add_argument("--out-dir", type=Path, default=None, help="default: bench/runs (bench/results with --record)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    config = model_config(args.model)
    env = {**environment(), "model": args.model}
    args.out_dir = args.out_dir or (RESULTS_DIR if args.record else RUNS_DIR)
    for folder in {args.out_dir, RUNS_DIR}:
        folder.mkdir(parents=True, exist_ok=True)
    stem, results = output_stem(args, env["git_commit"]), []
    for mode, caching in CONFIGS:
        print(f"{mode}, prefix caching {'on' if caching else 'off'}", file=sys.stderr)
        try:
            results.append({**run_config(args, mode, caching, sizes, config.vocab_size),
                            "bytes_per_token": _bytes_per_token(config)})  # fmt: skip
        except systems.SystemFailed as e:
            print(f"  failed: {e}", file=sys.stderr)
            return 1
        write(args.out_dir / stem, env, sizes, results)  # after each system: a cut-short run keeps what it has
    print((args.out_dir / f"{stem}.md").read_text())
    return 0


def write(path: Path, env: dict, sizes: Sizes, results: list[dict]) -> None:
    path.with_suffix(".json").write_text(json.dumps({"env": env, "sizes": sizes.__dict__, "results": results}))
    path.with_suffix(".md").write_text(report(results, env, sizes))


def output_stem(args: argparse.Namespace, commit: str) -> str:
    label = "prefix-caching" + ("-quick" if args.quick else "")
    return recorded_name(label, commit, time.strftime("%Y-%m-%d", time.gmtime())) if args.record else label


def _bytes_per_token(config) -> int:
    """KV bytes per token of a float32 pool of this model."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4


if __name__ == "__main__":
    sys.exit(main())
