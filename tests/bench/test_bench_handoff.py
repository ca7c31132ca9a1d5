"""bench.handoff's arithmetic from /metrics text, and bench.kv_bandwidth's shared-copy mode proved on the CPU (shm,
tiny sizes): the GPU kit runs the same code with cuda_ipc and the real model's layout."""

from __future__ import annotations

import pytest

from bench import handoff
from bench.kv_bandwidth import LAYOUTS, measure_shared_copy, shared_copy_markdown

BEFORE = """pdserve:request_handoff_time_seconds_sum 1.0
pdserve:request_handoff_time_seconds_count 10
pdserve:request_time_per_output_token_seconds_sum{x="a"} 0.5
pdserve:request_time_per_output_token_seconds_count{x="a"} 10
pdserve:node_handoff_copy_seconds_sum{role="decode"} 0.01
pdserve:node_handoff_copy_seconds_count{role="decode"} 2
"""
AFTER = """pdserve:request_handoff_time_seconds_sum 3.0
pdserve:request_handoff_time_seconds_count 30
pdserve:request_time_per_output_token_seconds_sum{x="a"} 1.5
pdserve:request_time_per_output_token_seconds_count{x="a"} 30
pdserve:node_handoff_copy_seconds_sum{role="decode"} 0.02
pdserve:node_handoff_copy_seconds_count{role="decode"} 6
"""


def test_the_handoff_and_its_parts_are_read_against_the_tpot():
    r = handoff.summarize(AFTER, BEFORE)
    assert r["handoff_mean_s"] == pytest.approx(0.1) and r["tpot_mean_s"] == pytest.approx(0.05)
    assert r["handoff_over_tpot"] == pytest.approx(2.0)
    assert r["handoff_copy_mean_s"] == pytest.approx(0.0025) and r["handoff_copy_over_tpot"] == pytest.approx(0.05)
    assert r["handoff_copies"] == 4 and r["handoff_wait_mean_s"] is None
    assert "| the copy (decode node) | 2.5 | 0.05x |" in handoff.table(r)
    assert len(handoff.workload(handoff.HandoffConfig(streams=2, per_stream=3, prompt_len=5)).requests) == 6


def test_the_shared_copy_mode_runs_the_copier_between_two_processes():
    r = measure_shared_copy("cpu", "tiny", 40, 2)
    assert r["transport"] == "shm" and r["bytes"] == 40 * LAYOUTS["tiny"].bytes_per_token()
    assert r["copy_s"] > 0 and r["device_copy_s"] > 0 and r["copy_vs_device_copy"] > 0
    assert "shm on cpu" in shared_copy_markdown(r)
    assert LAYOUTS["qwen3-0.6b"].bytes_per_token() == 112 * 1024
