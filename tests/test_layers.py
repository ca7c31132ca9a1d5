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


def _torch_modules(code: str) -> str:
    """The torch modules a fresh interpreter holds after running `code`, as the sorted list prints."""
    code += "; import sys; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(), timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_router_loads_its_model_facts_without_torch():
    import transformers

    fast_tokenizer = "import transformers.tokenization_utils_tokenizers"  # 5.17's imports torch; 5.25's does not
    if _torch_modules(fast_tokenizer) != "[]":
        pytest.skip(f"transformers {transformers.__version__}'s fast tokenizer imports torch itself")
    resolve_model("tiny")  # written (with torch) by this process first, as `pdserve up` does before its router
    code = (
        "import pdserve.router.api, pdserve.router.core; from pdserve.router.text import load_model_info; "
        "info = load_model_info('tiny'); assert info.vocab_size == 512, info"
    )
    assert _torch_modules(code) == "[]", "the router imported torch"


PACKAGE = Path(__file__).resolve().parents[1] / "pdserve"
ALLOWED = {  # package or module -> the pdserve modules (or packages) it may import, beside its own
    "wire": (),
    "checkpoint": (),
    "plan": ("pdserve.config",),
    "config": ("pdserve.checkpoint", "pdserve.wire"),
    "kv": ("pdserve.wire",),
    "engine": ("pdserve.kv", "pdserve.wire", "pdserve.config", "pdserve.checkpoint"),
    "runner": (
        "pdserve.engine.scheduler",  # what a step runs: the scheduler's Batch, the requests in it, the draws' types
        "pdserve.engine.request",
        "pdserve.engine.draws",
        "pdserve.engine.rows",  # the persistent rows a step's inputs and sampling parameters are gathered from
        "pdserve.kv",
        "pdserve.wire",
        "pdserve.config",
        "pdserve.checkpoint",
        "pdserve.cbuild",
    ),
    "nodes": ("pdserve.engine", "pdserve.runner", "pdserve.kv", "pdserve.wire", "pdserve.config", "pdserve.checkpoint"),
    "router": ("pdserve.wire", "pdserve.config", "pdserve.checkpoint", "pdserve.process"),
}


def _imports(path: Path) -> set[str]:
    """The pdserve modules a file imports, at its top or inside a function (`from pdserve.wire import messages` counts
    as pdserve.wire.messages)."""
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
    paths = list((PACKAGE / package).rglob("*.py")) or [PACKAGE / f"{package}.py"]
    wrong = {
        f"{path.relative_to(PACKAGE.parent)}: {module}"
        for path in paths
        for module in _imports(path)
        if not any(module == a or module.startswith(a + ".") for a in allowed)
    }
    assert not wrong, sorted(wrong)


# what runs without torch: the router (above), the wire, and what the engine and a mock node take from kv/
TORCH_FREE = (
    "wire/*.py",
    "plan/*.py",
    "kv/__init__.py",
    "kv/backend.py",
    "kv/block_allocator.py",
    "kv/layout.py",
    "kv/peers.py",
    "kv/faults.py",
    "kv/mock.py",
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
    """The node loop and the roles never import the scheduler, the block manager or the pool (parts.py builds the
    engine's parts, the pool among them)."""
    internals = ("pdserve.engine.scheduler", "pdserve.kv.block_allocator", "pdserve.kv.pool")
    paths = sorted(p for p in (PACKAGE / "nodes").glob("*.py") if p.name != "parts.py")
    assert len(paths) == 5, paths
    assert not {str(p): _imports(p) & set(internals) for p in paths if _imports(p) & set(internals)}
    assert not [str(p) for p in paths if "engine.pool" in p.read_text()]  # nor reach into the engine's pool


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def test_the_import_graph_has_no_circle():
    """No module reaches itself through what it imports, lazy imports inside functions included."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(" -> ".join([*path[path.index(module) :], module]))
            return
        if module in done:
            return
        for nxt in sorted(graph[module]):
            visit(nxt, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, circles


def _closure(module: str) -> set[str]:
    """`module` and every pdserve module it reaches through its imports."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen or m not in modules:
            continue
        seen.add(m)
        todo += _imports(modules[m])
    return {m for m in seen if m in modules}


def test_the_routing_policy_reaches_no_socket():
    """routing.py is pure functions over node views: neither it nor anything it imports imports zmq."""
    reached = _closure("pdserve.router.routing")
    assert "pdserve.wire.params" in reached  # the walk follows imports
    path = {_module(p): p for p in PACKAGE.rglob("*.py")}
    assert not [m for m in sorted(reached) if "zmq" in _third_party(path[m]) or m == "pdserve.wire.transport"]


def test_the_router_core_creates_no_socket():
    """The node sockets are nodes.py's: the core imports neither zmq nor the transport, and opens no socket."""
    path = PACKAGE / "router" / "core.py"
    assert "zmq" not in _third_party(path)
    assert not {m for m in _imports(path) if m.startswith("pdserve.wire.transport")}
    assert "pdserve.router.nodes" in _imports(path)
    source = path.read_text()
    assert ".socket(" not in source and "Context(" not in source
