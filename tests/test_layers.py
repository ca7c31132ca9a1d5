"""The layering rules that the code cannot state itself: what each package may import, and the router runs without
torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.checkpoint import resolve_model


def test_the_router_loads_its_model_facts_without_torch():
    resolve_model("tiny")  # written (with torch) by this process first, as `pdserve up` does before its router
    code = (
        "import sys; import pdserve.router.api, pdserve.router.core; from pdserve.router.text import "
        "load_model_info; info = load_model_info('tiny'); assert info.vocab_size == 512, info; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(), timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", "the router imported torch"


PACKAGE = Path(__file__).resolve().parents[1] / "pdserve"
ALLOWED = {  # package -> the pdserve modules (or packages) its modules may import, beside its own
    "router": (
        "pdserve.wire.protocol",
        "pdserve.wire.transport",
        "pdserve.config",
        "pdserve.checkpoint",
        "pdserve.cbuild",
        "pdserve.process",
    ),
    "engine": ("pdserve.runner", "pdserve.kv", "pdserve.wire.protocol", "pdserve.config", "pdserve.checkpoint"),
    "runner": (
        "pdserve.engine.scheduler",
        "pdserve.engine.request",
        "pdserve.engine.draws",
        "pdserve.kv",
        "pdserve.wire.protocol",
        "pdserve.config",
        "pdserve.checkpoint",
        "pdserve.cbuild",
    ),
    "kv": ("pdserve.wire.protocol",),
    "wire": (),
    "plan": ("pdserve.config",),
    "nodes": (
        "pdserve.engine.engine",
        "pdserve.engine.request",
        "pdserve.engine.draws",
        "pdserve.kv",
        "pdserve.wire",
        "pdserve.config",
        "pdserve.cli",
    ),
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


# what runs without torch: the router (above), the wire, and what the engine and a mock node take from kv/
TORCH_FREE = (
    "wire/*.py",
    "kv/__init__.py",
    "kv/backend.py",
    "kv/block_allocator.py",
    "kv/layout.py",
    "kv/peers.py",
    "kv/faults.py",
    "kv/mock.py",
    "plan/*.py",
)


def _third_party(path: Path) -> set[str]:
    """The top-level names of the modules a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_the_wire_and_the_torch_free_kv_modules_import_no_torch():
    paths = [p for pattern in TORCH_FREE for p in PACKAGE.glob(pattern)]
    assert len(paths) >= len(TORCH_FREE) + 1, paths  # the wire has more than one module
    assert not [str(p) for p in paths if "torch" in _third_party(p)]


def test_the_node_loop_reaches_the_engine_only_through_its_methods():
    """The nodes never import the scheduler, the block manager or the pool."""
    internals = ("pdserve.engine.scheduler", "pdserve.kv.block_allocator", "pdserve.kv.pool")
    paths = sorted((PACKAGE / "nodes").glob("*.py"))
    assert len(paths) == 5, paths
    assert not {str(p): _imports(p) & set(internals) for p in paths if _imports(p) & set(internals)}
    assert not [str(p) for p in paths if "engine.pool" in p.read_text()]  # nor reach into the engine's pool
