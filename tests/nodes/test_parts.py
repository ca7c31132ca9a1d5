"""pdserve.nodes.parts: the node's device is its current one before anything runs on it."""

from __future__ import annotations

import pytest
import torch

from pdserve.nodes import parts


@pytest.mark.parametrize("device, current", [("cuda:1", [torch.device("cuda:1")]), ("cuda", []), ("cpu", [])])
def test_a_node_on_a_gpu_makes_it_the_current_device(monkeypatch, device, current):
    """Triton and CUDA graph capture use the current device's stream: a node on cuda:1 sets it (cuda alone is the
    current device already; the CPU has none)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    parts.use_device(device)
    assert calls == current
