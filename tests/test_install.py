"""The install the README promises: `pip install -e .` brings every module pdserve imports (guided decoding's
llguidance included), the `bench` extra every module the benchmarks import, and every extra the pages name exists."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra brings tomli where the standard library has no TOML parser yet
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# modules imported only for a feature of an extra or of a GPU host, never on the default path
OPTIONAL_MODULES = {"ray": "the ray extra (pdserve up --ray)", "triton": "GPU hosts (CUDA torch brings it)"}


def imported_modules(package: str) -> set[str]:
    """The third-party top-level modules a package of the repository imports, anywhere in its files."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in ("pdserve", "bench")}


def installed_closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, with what they require in turn (no extras of theirs)."""
    todo, seen = [Requirement(r) for r in requirements], set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in md.requires(req.name) or ()]
        except md.PackageNotFoundError:
            pass
    return seen


def missing_from(modules: set[str], requirements: list[str]) -> set[str]:
    dists = installed_closure(requirements)
    provider = md.packages_distributions()  # a module not installed here: its distribution's name is its own
    return {m for m in modules if not any(canonicalize_name(d) in dists for d in provider.get(m, [m]))}


def test_the_default_install_brings_every_module_pdserve_imports():
    modules = imported_modules("pdserve") - set(OPTIONAL_MODULES)
    assert "llguidance" in modules  # response_format works after `pip install -e .`
    assert not missing_from(modules, PROJECT["dependencies"])


def test_the_bench_extra_brings_every_module_the_benchmarks_import():
    requirements = PROJECT["dependencies"] + PROJECT["optional-dependencies"]["bench"]
    assert not missing_from(imported_modules("bench"), requirements)


def test_the_checker_notices_a_module_no_requirement_brings():
    assert missing_from({"llguidance"}, ["msgpack>=1.0"]) == {"llguidance"}
    assert not missing_from({"llguidance"}, ["llguidance>=1.0"])


def test_every_extra_the_pages_name_exists():
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").rglob("*.md")]
    named = {m for p in pages for m in re.findall(r"(?:pdserve|\.)\[(\w+)\]", p.read_text())}
    assert "bench" in named and "test" in named
    assert named <= set(PROJECT["optional-dependencies"])
