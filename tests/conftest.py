"""Tiny random checkpoints for the tests, built once per session through the built-in writer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton kernels run on the CPU by Triton's interpreter (before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from pdserve.checkpoint import ModelSpec, write_random_checkpoint

TINY_SPECS = {
    "qwen3": ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 1024, seed=1),
    "llama": ModelSpec("llama", 512, 64, 128, 2, 4, 2, 16, 1024, seed=2),
    "qwen2": ModelSpec("qwen2", 512, 64, 128, 2, 4, 2, 16, 1024, seed=3),
}


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--soak-requests", type=int, default=300, help="length of the slow soak test (tests/stacks/test_soak.py)"
    )
    parser.addoption(
        "--router-workers",
        type=int,
        default=1,
        help="router processes of every test stack (tests/stack.py): 2 runs e.g. the API tests over two",
    )


def pytest_configure(config) -> None:
    from tests import stack

    stack.ROUTER_WORKERS = config.getoption("--router-workers")


STACKS = Path(__file__).parent / "stacks"


def pytest_collection_modifyitems(items) -> None:
    """Every test under tests/stacks/ starts processes and is marked `stack`: `-m "not stack"` is the quick loop."""
    for item in items:
        if STACKS in Path(item.path).parents:
            item.add_marker(pytest.mark.stack)


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory) -> Path:
    """Built-in models go to a per-session cache unless PDSERVE_CACHE is set already."""
    if "PDSERVE_CACHE" not in os.environ:
        os.environ["PDSERVE_CACHE"] = str(tmp_path_factory.mktemp("pdserve-cache"))
    return Path(os.environ["PDSERVE_CACHE"])


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    paths = {}
    for arch, spec in TINY_SPECS.items():
        write_random_checkpoint(root / arch, spec)
        paths[arch] = root / arch
    return paths
