"""The share of tokens an engine computes in replayed CUDA graphs on bench.gpu's workload: the scheduler replayed,
no model.

    python -m bench.graph_share                      # bench.gpu's run: 256 requests, 128 in flight, 2,048 tokens a step
    python -m bench.graph_share --requests 1024 --concurrency 256 --json out.json

The engine runs with `--engine mock` (the real scheduler and KV accounting, no model, no step time) on
bench.gpu's `sharegpt_like` workload (its request count, seed and ShareGPT shape, `qwen3-0.6b`'s vocabulary),
at most `--concurrency` requests in flight as bench.gpu's load generator keeps them (a request comes in as
one ends), with `--max-num-seqs` the concurrency and bench.gpu's `--max-num-batched-tokens` and KV pool. Each
step's flat inputs (`ModelRunner.flatten`, as the GPU runner builds them) go to the step graphs' own choice
of bucket (`cuda_graphs.pick` over `cuda_graphs.plan`): a step that a bucket holds would replay a graph. It
reports the share of steps, of all tokens and of decode tokens (one token after a computed prompt) computed
in such steps, beside the decode-only graphs of before (a step replayed only when every request decodes one
token and samples it). Exit status 1 when either token share is below 95%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

TARGET = 0.95  # of all tokens and of decode tokens, computed in replayed steps


@dataclass
class Tally:
    steps: int = 0
    tokens: int = 0
    decode_tokens: int = 0

    def add(self, tokens: int, decode_tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.decode_tokens += decode_tokens

    def share_of(self, whole: Tally) -> dict[str, float]:
        return {
            k: getattr(self, k) / getattr(whole, k) if getattr(whole, k) else 1.0
            for k in ("steps", "tokens", "decode_tokens")
        }


class StepRecorder:
    """Stands in for the mock engine's runner: tallies each step, and those a bucket holds (or the decode-only
    graphs of before would have), then runs the mock's step."""

    def __init__(self, inner, buckets, block_size: int) -> None:
        self.inner, self.buckets, self.block_size = inner, buckets, block_size
        self.graph_captures = inner.graph_captures
        self.all, self.replayed, self.decode_only = Tally(), Tally(), Tally()

    def run(self, batch, *feed):
        from pdserve.runner.cuda_graphs import pick
        from pdserve.runner.model import ModelRunner

        ids, _, _, sample, chunks = ModelRunner.flatten(batch, self.block_size)
        counts = (len(ids), batch.num_decode_tokens)
        self.all.add(*counts)
        if pick(self.buckets, len(ids), len(chunks), len(sample)) is not None:
            self.replayed.add(*counts)
        if decode_only(batch, len(sample)):
            self.decode_only.add(*counts)
        return self.inner.run(batch, *feed)


def decode_only(batch, samples: int) -> bool:
    """A step the decode-only graphs of before replayed: every request one token after a past, every row sampled."""
    return samples == len(batch.scheduled) and all(s.num_new_tokens == 1 and s.past > 0 for s in batch.scheduled)


def gpu_workload(requests: int, concurrency: int, seed: int = 0):
    """bench.gpu's workload of `requests` (sharegpt_like, its shape, qwen3-0.6b's vocabulary)."""
    from bench.gpu import GpuBenchConfig, sharegpt
    from pdserve.engine.mock import model_facts

    cfg = GpuBenchConfig(device="cpu", requests=requests, concurrency=concurrency, seed=seed)
    return sharegpt(model_facts(cfg.model), cfg)


def replay(
    requests: int = 256, concurrency: int = 128, max_num_batched_tokens: int | None = None, seed: int = 0
) -> dict:
    """Run bench.gpu's workload through the mock engine closed at `concurrency`; the tallies and shares."""
    from bench.gpu import GpuBenchConfig
    from pdserve.config import EngineConfig
    from pdserve.engine.request import Request
    from pdserve.nodes.parts import build_engine
    from pdserve.runner.cuda_graphs import plan
    from pdserve.wire.params import SamplingParams

    gpu = GpuBenchConfig(device="cpu")
    budget = max_num_batched_tokens or gpu.max_num_batched_tokens
    cfg = EngineConfig(
        model=gpu.model,
        dtype=gpu.dtype,
        engine="mock",
        mock_step_s=(0.0, 0.0, 0.0),
        max_num_seqs=concurrency,
        max_num_batched_tokens=budget,
        kv_cache_gb=gpu.kv_cache_gb,
    )
    engine = build_engine(cfg)
    recorder = engine.runner = StepRecorder(engine.runner, plan(budget, concurrency), cfg.block_size)
    queue = [
        Request(
            str(i), list(r.prompt_token_ids), SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
        )
        for i, r in enumerate(gpu_workload(requests, concurrency, seed).requests)
    ]
    queue.reverse()
    for _ in range(min(concurrency, len(queue))):
        engine.add(queue.pop())
    while engine.has_work():
        ended = sum(o.finish_reason is not None for o in engine.step())
        for _ in range(min(ended, len(queue))):  # the load generator sends one for each that ends
            engine.add(queue.pop())
    return {
        "requests": requests,
        "concurrency": concurrency,
        "max_num_batched_tokens": budget,
        "target": TARGET,
        "all": dataclasses.asdict(recorder.all),
        "replayed": recorder.replayed.share_of(recorder.all),
        "decode_only_before": recorder.decode_only.share_of(recorder.all),
    }


def meets_target(res: dict) -> bool:
    return min(res["replayed"]["tokens"], res["replayed"]["decode_tokens"]) >= TARGET


def markdown(res: dict) -> str:
    a = res["all"]
    lines = [
        f"Share computed in replayed CUDA graphs, bench.gpu's workload ({res['requests']} requests, at most "
        f"{res['concurrency']} in flight, --max-num-batched-tokens {res['max_num_batched_tokens']}; the scheduler "
        f"replayed: {a['steps']} steps, {a['tokens']} tokens, {a['decode_tokens']} decode tokens)",
        "",
        "| graphs | steps | tokens | decode tokens |",
        "|---|---|---|---|",
    ]
    for name, key in (("every step by token-count bucket", "replayed"), ("decode-only (before)", "decode_only_before")):
        s = res[key]
        lines.append(f"| {name} | {s['steps']:.1%} | {s['tokens']:.1%} | {s['decode_tokens']:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=128, help="requests in flight; also --max-num-seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: bench.gpu's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the result to this JSON file")
    a = p.parse_args(argv)
    if min(a.requests, a.concurrency, a.max_num_batched_tokens or 1) < 1:
        p.error("--requests, --concurrency and --max-num-batched-tokens must be at least 1")
    res = replay(a.requests, a.concurrency, a.max_num_batched_tokens, a.seed)
    print(markdown(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if meets_target(res) else 1


if __name__ == "__main__":
    sys.exit(main())
