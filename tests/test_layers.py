"""The layering rules that the code cannot state itself: what each package may import, and the router runs without
torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.checkpoint import resolve_model


def test_the_router_loads_its_model_facts_without_torch():
    resolve_model("tiny")  # written (with torch) by this process first, as `pdserve up` does before its router
    code = ("import sys; import pdserve.router.api, pdserve.router.core; from pdserve.router.text import "
            "load_model_info; info = load_model_info('tiny'); assert info.vocab_size == 512, info; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(),
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", "the router imported torch"


PACKAGE = Path(__file__).resolve().parents[1] / "pdserve"
ROLE_ALLOWED = ("pdserve.node", "pdserve.engine.engine", "pdserve.engine.request", "pdserve.wire", "pdserve.config",
                "pdserve.cli")  # fmt: skip
ALLOWED = {  # package -> the pdserve modules (or packages) its modules may import, beside its own
    "router": ("pdserve.wire.protocol", "pdserve.wire.transport", "pdserve.config", "pdserve.engine.checkpoint",
               "pdserve.process"),
    "engine": ("pdserve.wire.protocol", "pdserve.config"),
    # kv_layout: what a mock node's KV transfer (wire/kv_mock.py) checks, without the torch pool of kv_cache
    "wire": ("pdserve.engine.kv_cache", "pdserve.engine.kv_layout", "pdserve.engine.block_allocator"),
    "prefill_node": ROLE_ALLOWED,
    "decode_node": ROLE_ALLOWED,
    "colocated_node": ROLE_ALLOWED,
}


def _imports(path: Path) -> set[str]:
    """The pdserve modules a file imports (`from pdserve.wire import protocol` counts as pdserve.wire.protocol)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            is_package = (PACKAGE.parent / node.module.replace(".", "/")).is_dir()
            found |= {f"{node.module}.{a.name}" for a in node.names} if is_package else {node.module}
    return {m for m in found if m.startswith("pdserve.")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_what_its_layer_allows(package):
    own = f"pdserve.{package}"
    allowed = (own, *ALLOWED[package])
    wrong = {
        f"{path.relative_to(PACKAGE.parent)}: {module}"
        for path in (PACKAGE / package).rglob("*.py")
        for module in _imports(path)
        if not any(module == a or module.startswith(a + ".") for a in allowed)
    }
    assert not wrong, sorted(wrong)


def test_the_node_loop_reaches_the_engine_only_through_its_methods():
    """node.py and the role nodes never import the scheduler, the allocator or the pool."""
    internals = ("pdserve.engine.scheduler", "pdserve.engine.block_allocator", "pdserve.engine.kv_cache")
    paths = [PACKAGE / "node.py", *(PACKAGE / f"{r}_node" / "node.py" for r in ("prefill", "decode", "colocated"))]
    assert not {str(p): _imports(p) & set(internals) for p in paths if _imports(p) & set(internals)}
