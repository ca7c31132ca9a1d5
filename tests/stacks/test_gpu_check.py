"""The GPU check (scripts/gpu_check.py): its logic on the CPU, and the whole script where CUDA is present. Its flow
on the CPU (a float32 disaggregated stack over shm) is checked in the GPU kit's CPU mode (tests/stacks/test_gpu_kit.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.kit import load_script as load

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_check.py"


def load_script():
    return load(SCRIPT)


class FixedLogits:
    """Stands in for the transformers reference: the same logits row at every position."""

    def __init__(self, row: list[float]) -> None:
        self.row = torch.tensor(row)

    def logits(self, dtype: str, prompt: list[int], out: list[int]) -> torch.Tensor:
        return self.row.expand(len(out), -1)


def test_sampled_tokens_outside_top_k_or_top_p_are_counted():
    gc = load_script()
    ref = FixedLogits([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])  # ranks 0..5
    body = {"prompt": [1], "temperature": 1.0, "top_k": 2, "top_p": 1.0}
    assert gc.out_of_set(ref, "float32", body, [0, 1, 0], 1e-3) == 0
    assert gc.out_of_set(ref, "float32", body, [0, 2, 5], 1e-3) == 2  # ranks 2 and 5 are outside top-2
    # top-p 0.5 at temperature 1: softmax of the row puts ~0.64 on rank 0, so only rank 0 is allowed
    nucleus = {"prompt": [1], "temperature": 1.0, "top_k": -1, "top_p": 0.5}
    assert gc.out_of_set(ref, "float32", nucleus, [0, 0], 1e-3) == 0
    assert gc.out_of_set(ref, "float32", nucleus, [1], 1e-3) == 1
    # a high temperature flattens the distribution: rank 1 joins the nucleus
    hot = {**nucleus, "temperature": 4.0}
    assert gc.out_of_set(ref, "float32", hot, [1], 1e-3) == 0


def test_ties_within_eps_count_as_in_the_set():
    gc = load_script()
    ref = FixedLogits([1.0, 1.0 - 1e-5, 0.0])
    body = {"prompt": [1], "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    assert gc.out_of_set(ref, "float32", body, [1], 1e-3) == 0  # a near-tie: either may be the argmax
    assert gc.out_of_set(ref, "float32", body, [2], 1e-3) == 1


def test_logit_tolerance_judges_each_served_token():
    gc = load_script()
    ref = FixedLogits([2.0, 1.8, 0.0])
    prompts = [[1], [2]]
    near = gc.check_logit_tol(ref, prompts, [{"tokens": [0, 1]}, {"tokens": [1]}], 0.5)
    assert near["pass"] and near["max_logit_gap"] == pytest.approx(0.2)
    far = gc.check_logit_tol(ref, prompts, [{"tokens": [0, 2]}, {"error": "HTTP 503"}], 0.5)
    assert not far["pass"] and far["tokens_within_tol"] == 0.5 and far["errors"] == ["HTTP 503"]


def test_exact_check_reports_the_first_mismatch_and_its_logit_gap():
    gc = load_script()
    ref = FixedLogits([2.0, 1.5, 0.0])
    answers = [{"tokens": [0, 0, 0]}, {"tokens": [0, 1, 0]}, {"error": "HTTP 503"}]
    r = gc.check_exact(ref, [[1], [2], [3]], answers, [[0, 0, 0]] * 3)
    assert not r["pass"] and r["exact"] == 1 and r["errors"] == ["HTTP 503"]
    assert r["mismatches"] == [{"request": 1, "position": 1, "served": [1, 0], "hf": [0, 0], "hf_logit_gap": 0.5}]


def test_sampled_bodies_give_each_setting_seeded_and_unseeded():
    gc = load_script()
    bodies = gc.sampled_bodies([[1, 2]], 200)
    settings = {(b["temperature"], b["top_k"], b["top_p"], "seed" in b) for b in bodies}
    assert len(settings) == len(gc.TEMPERATURES) * len(gc.TOP_KS) * len(gc.TOP_PS) * 2
    assert len({b["seed"] for b in bodies if "seed" in b}) == 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_script_passes(tmp_path):
    out = tmp_path / "gpu.json"
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            "tiny",
            "--requests",
            "8",
            "--out",
            str(out),
            "--log-dir",
            str(tmp_path),
        ],
        timeout=900,
    )
    assert r.returncode == 0, out.read_text() if out.exists() else "no report"


def test_a_clean_stop_is_judged_by_the_segments_left_and_the_log(tmp_path):
    gc = load_script()
    log, segment = tmp_path / "stack.log", tmp_path / "pdserve-segment"
    log.write_text("INFO started\nINFO stopped\n")
    assert gc.check_clean_stop(log, {str(segment)}, "cpu", None)["pass"]
    segment.write_bytes(b"")
    assert gc.check_clean_stop(log, {str(segment)}, "cpu", None)["segments_left"] == [str(segment)]
    segment.unlink()
    log.write_text("UserWarning: Producer process has been terminated before all shared CUDA tensors released\n")
    r = gc.check_clean_stop(log, set(), "cpu", None)
    assert not r["pass"] and r["warnings"] == {"Producer process has been terminated": 1}
    assert gc.descendants(os.getpid())[0] == os.getpid()


def test_the_fault_checks_run_float32_over_the_shared_pool_on_nodes_of_their_own(tmp_path):
    gc = load_script()
    a = gc.build_parser().parse_args(["--device", "cpu", "--model", "tiny", "--faults", "--kv-cache-gb", "0.25"])
    assert [p.name for p in gc.fault_plans(a)] == ["fp32-shm"]  # bf16 is not exact, zmq has no shared pool
    a.stacks = ["fp32-zmq"]
    assert gc.fault_plans(a) == []
    stack = gc.NodeStack(a, gc.plans("cpu")[2], tmp_path / "faults.log")
    try:
        argvs = {name: stack.node_argv(name) for name in stack.infos}
    finally:
        gc.shutil.rmtree(stack.dir)
    assert list(argvs) == ["prefill0", "prefill1", "decode0"]
    addresses = [info["listen"] for info in stack.infos.values()] + [stack.infos["decode0"]["kv_listen"]]
    assert len(set(addresses)) == 4
    for name, argv in argvs.items():
        assert argv[argv.index("--kv-transport") + 1] == "shm" and argv[argv.index("--dtype") + 1] == "float32"
        assert argv[argv.index("--max-num-batched-tokens") + 1] == str(gc.FAULT_CHUNK_TOKENS)
        assert ("--kv-listen" in argv) == (name == "decode0")
