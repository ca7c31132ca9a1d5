"""bench.graph_share: on bench.gpu's workload (the scheduler replayed, no model) every step is one the step graphs'
buckets hold, so at least 95% of all tokens and of decode tokens are computed in replayed graphs."""

from __future__ import annotations

from bench.graph_share import meets_target, replay


def test_the_gpu_benchmark_computes_its_tokens_in_replayed_graphs():
    res = replay()  # bench.gpu's run: 256 requests, 128 in flight, 2,048 tokens a step
    assert res["all"]["steps"] > 800 and res["all"]["decode_tokens"] > 20_000, res["all"]
    assert res["replayed"]["tokens"] >= 0.95 and res["replayed"]["decode_tokens"] >= 0.95, res["replayed"]
    assert meets_target(res)
    # the replay tells steps apart: graphs of decode-only steps computed barely half the decode tokens
    before = res["decode_only_before"]
    assert before["decode_tokens"] < 0.7 and before["tokens"] < 0.2 and not meets_target({"replayed": before}), before
