"""pdserve's dependencies, as pyproject.toml lists them: check them, and install them on a host without a package index.

    python scripts/deps.py check --extras gpu bench       # import each one, check its version; exit 1 naming any
    # on a machine with PyPI: the wheels for the target host's Python and platform, into .whl/
    python scripts/deps.py fetch --python-version 3.12 --platform manylinux_2_28_x86_64 --have ... (default: HOST_HAS)
    # on the target host (no index): install from .whl/ the distributions it lacks, into a folder for PYTHONPATH
    python3 scripts/deps.py install --wheels .whl --target /tmp/site

`fetch` resolves the requirements (runtime, plus `--extras`, less the `--have` ones the host already holds)
with `pip download --only-binary=:all:` for that Python and platform, so their own dependencies come too; it
writes the list it resolved to <dest>/requirements.txt and prints the wheels' size (what must travel to the host).
By default the host holds torch, transformers and triton, and so the tokenizers and safetensors transformers
requires: 47 MiB of wheels for Python 3.12, matplotlib and numpy the most of it; `--have` naming those too: 8 MiB.
`install` installs, with no index and no dependency resolution, each wheel in the folder whose distribution the
host does not already have: nothing the host holds (say the tokenizers its transformers was built with) is
shadowed, and what an earlier install put in the target at the same version is kept. Only the standard library and
`packaging` (a dependency of transformers) are needed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPORT_NAMES = {"pyzmq": "zmq"}  # distributions imported under another name
# what a GPU host holds: torch, transformers (with the tokenizers and safetensors it requires) and triton
HOST_HAS = ("torch", "transformers", "tokenizers", "safetensors", "triton")
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def load_pyproject(path: Path = ROOT / "pyproject.toml") -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(path.read_text())


def requirements(extras: list[str], pyproject: dict | None = None) -> list[str]:
    """The runtime requirements, then those of each extra named, as pyproject.toml spells them."""
    project = (pyproject or load_pyproject())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ValueError(f"no extra {', '.join(unknown)} in pyproject.toml (it has {', '.join(optional)})")
    out = list(project["dependencies"])
    for extra in extras:
        out += [r for r in optional[extra] if r not in out]
    return out


def split(req: str) -> tuple[str, str]:
    """'transformers>=4.56' -> ('transformers', '>=4.56')."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", req)
    if m is None:
        raise ValueError(f"cannot read the requirement {req!r}")
    return m.group(1), m.group(3).split(";")[0].strip()


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def problem(req: str) -> str:
    """Why the requirement is not met here ('' when it is): not installed, too old, or failing to import."""
    name, spec = split(req)
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        return f"{name} is not installed (pyproject.toml needs {req})"
    if spec and not _satisfies(version, spec):
        return f"{name} {version} is installed, pyproject.toml needs {req}"
    module = IMPORT_NAMES.get(normalize(name), normalize(name).replace("-", "_"))
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return f"{name} {version} does not import ({module}): {type(e).__name__}: {e}"
    return ""


def _satisfies(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


def check(extras: list[str]) -> int:
    problems = [p for p in map(problem, requirements(extras)) if p]
    for p in problems:
        print(f"missing dependency: {p}", file=sys.stderr)
    if not problems:
        print(f"dependencies: {len(requirements(extras))} import (extras: {' '.join(extras) or 'none'})")
    return 1 if problems else 0


def fetch(dest: Path, python_version: str, platforms: list[str], extras: list[str], have: list[str]) -> int:
    """Download the wheels of the requirements less `have` (and what they need) for the target into dest."""
    skip = {normalize(h) for h in have}
    wanted = [r for r in requirements(extras) if normalize(split(r)[0]) not in skip]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "requirements.txt").write_text("".join(f"{r}\n" for r in wanted))
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "-d",
        str(dest),
        "-r",
        str(dest / "requirements.txt"),
    ]
    for p in platforms:
        argv += ["--platform", p]
    rc = subprocess.run(argv).returncode
    if rc == 0:
        files = list(dest.glob("*.whl"))
        mib = sum(f.stat().st_size for f in files) / 2**20
        print(f"{len(files)} wheels, {mib:.1f} MiB, in {dest}; on the target host:")
        print(f"    python3 scripts/deps.py install --wheels {dest} --target /tmp/site && export PYTHONPATH=/tmp/site")
    return rc


def wheel_name(path: Path) -> str:
    """The distribution a wheel file holds (its file name's first field)."""
    return normalize(path.name.split("-")[0])


def install(wheels: Path, target: Path) -> int:
    """Install each wheel whose distribution is not installed here, nor at its version in `target` (an earlier
    install: a second run unpacks only what changed), without an index or dependency resolution."""
    files = sorted(wheels.glob("*.whl"))
    if not files:
        print(
            f"deps install: no wheels in {wheels} (run `python scripts/deps.py fetch` where PyPI is reachable)",
            file=sys.stderr,
        )
        return 3
    lacking = [f for f in files if not _installed(wheel_name(f)) and not _in_target(f, target)]
    print(f"deps install: {len(lacking)} of {len(files)} wheels needed here")
    if not lacking:
        return 0
    argv = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(target),
        *map(str, lacking),
    ]
    return subprocess.run(argv).returncode


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
        return True
    except md.PackageNotFoundError:
        return False


def _in_target(wheel: Path, target: Path) -> bool:
    """The wheel's distribution is in `target` at the wheel's version (its file name's second field)."""
    version = wheel.name.split("-")[1]
    return any(d.version == version for d in md.distributions(name=wheel_name(wheel), path=[str(target)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="import every dependency; exit 1 naming those missing")
    c.add_argument("--extras", nargs="*", default=[])
    f = sub.add_parser("fetch", help="download the wheels for another host (needs PyPI)")
    f.add_argument("--dest", type=Path, default=ROOT / ".whl")
    f.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    f.add_argument("--platform", nargs="*", default=list(DEFAULT_PLATFORMS))
    f.add_argument("--extras", nargs="*", default=["bench"])
    f.add_argument(
        "--have",
        nargs="*",
        default=list(HOST_HAS),
        help="distributions the target host already holds (not fetched; default: %(default)s)",
    )
    i = sub.add_parser("install", help="install the wheels this host lacks (no index)")
    i.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    i.add_argument("--target", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "check":
        return check(a.extras)
    if a.cmd == "fetch":
        return fetch(a.dest, a.python_version, a.platform, a.extras, a.have)
    return install(a.wheels, a.target)


if __name__ == "__main__":
    sys.exit(main())
