"""GPU checks (CUDA IPC between two processes, bf16 within a logit tolerance of HF): skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_script_passes(tmp_path):
    script = Path(__file__).parents[1] / "scripts" / "gpu_check.py"
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, str(script), "--model", "tiny", "--requests", "8", "--out", str(out)],
                       timeout=900)  # fmt: skip
    assert r.returncode == 0, out.read_text() if out.exists() else "no report"
