"""bench.costs: the cost measurement's whole path (prefill and decode steps, the hand-off, the fit, the JSON) with
tiny sizes on the CPU, as the GPU kit runs it with --device cuda."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import costs as bench_costs
from pdserve.plan.costs import Costs


def test_the_costs_run_end_to_end_with_tiny_sizes(tmp_path) -> None:
    out = tmp_path / "costs.json"
    argv = ["--model", "tiny", "--device", "cpu", "--sizes", "tiny", "--kv-bandwidth", str(tmp_path / "none.json")]
    run = subprocess.run(  # a process of its own: bench.costs pins itself to a core
        [sys.executable, "-m", "bench.costs", *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [s["tokens"] for s in result["handoff_samples"]] == [16, 64, 256]
    assert len(result["prefill_samples"]) == 4 and len(result["decode_samples"]) == 4
    assert result["link_source"] == "hand-off measured on the device" and result["sizes"] == "tiny"
    costs = Costs.load(out)
    assert costs.link_bytes_per_s == result["handoff_fit"]["link_bytes_per_s"] > 0
    assert costs.kv_bytes_per_token > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kv_bytes_of_a_token_are_the_pools_without_building_one(dtype) -> None:
    target = bench_costs.Target("tiny", dtype=dtype)
    engine = bench_costs._engine(target, prefill_only=True, max_tokens_budget=16)
    assert bench_costs.kv_bytes_per_token(target) == engine.layout.bytes_per_token()
