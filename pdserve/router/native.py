"""The router's per-token path in C (csrc/tokenpath.c), where it can be built: a steady request's plain tokens, from a
node message's flat list to its stream's chunk, without the interpreter's frames in between.

Why: measured, a served router pays for a token's Python path several times what the same path costs in process,
because each node message finds the CPU's caches holding the nodes' and clients' data (docs/router-scaling.md);
compiled, the path runs far fewer instructions and touches far less memory. The Python it mirrors stays the
reference and the fallback: `RouterCore._deliver_tokens`'s loop and `SseStream._on_tokens` with `ByteText.add`
and `ChunkFormat.event`. `tests/router/test_native_path.py` runs both on the same events and compares what they leave:
stream bytes, outputs, clocks, metrics, faults.

Built like the engine's CPU kernels: with the system's C compiler on first use (well under a second), against this
Python's headers, cached per source, compiler flags and Python under the pdserve cache folder, loaded as an
extension module. Where it cannot be built (no compiler, no headers, not Linux), `load()` returns None, the router
logs why once, and the Python path runs.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from pdserve import cbuild
from pdserve.checkpoint import cache_dir

log = logging.getLogger("pdserve.router")
SOURCE = Path(__file__).with_name("csrc") / "tokenpath.c"
NAME = "pdserve_tokenpath"
CFLAGS = ["-O2", "-fPIC", "-shared", "-std=c11", "-fno-strict-aliasing"]

_loaded: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The compiled module, built on first use; None where it cannot be built here (logged once)."""
    key = _build_key()
    if key not in _loaded:
        _loaded[key] = _build_and_load(key)
    return _loaded[key]


def _build_key() -> str:
    """What the build depends on, hashed: the source, the flags, this Python; "" where the source cannot be read."""
    try:
        source = SOURCE.read_bytes()
    except OSError:
        return ""
    h = hashlib.sha256(source)
    h.update(" ".join(CFLAGS).encode())
    h.update(f"{sys.version} {sysconfig.get_config_var('EXT_SUFFIX')} {_includes()}".encode())
    return h.hexdigest()[:16]


def _includes() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys((paths["include"], paths.get("platinclude", paths["include"]))))


def _build_and_load(key: str) -> ModuleType | None:
    why = _cannot_build() or ("" if key else f"{SOURCE} cannot be read")
    if why:
        log.warning("the router's C token path is not built (%s); its Python path runs", why)
        return None
    path = cache_dir("native") / f"{NAME}-{key}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    try:
        return _built(path)
    except Exception as e:  # whatever fails here, the Python path serves: never a router that cannot start
        detail = getattr(e, "stderr", "") or str(e)
        detail = (detail.decode(errors="replace") if isinstance(detail, bytes) else detail).strip()
        log.warning("the router's C token path did not build (%s); its Python path runs", detail[:500])
        return None


def _built(path: Path) -> ModuleType:
    """The module at `path`, compiled first where it is not there; compiled again once where the cached one does
    not load (built by another machine that shares the cache folder, say)."""
    if path.exists():
        try:
            return _import(path)
        except ImportError:
            path.unlink(missing_ok=True)
    _compile(path)
    return _import(path)


def _cannot_build() -> str:
    """Why the module cannot be built here, or ""."""
    if not sys.platform.startswith("linux"):
        return f"not on {sys.platform}"
    if cbuild.compiler() is None:
        return "no C compiler found"
    if not any((Path(d) / "Python.h").exists() for d in _includes()):
        return f"no Python.h under {' or '.join(_includes())}"
    return ""


def _compile(path: Path) -> None:
    with cbuild.replacing(path) as tmp:
        cbuild.run([cbuild.compiler(), *CFLAGS, *(f"-I{d}" for d in _includes()), str(SOURCE), "-o", str(tmp)])


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
