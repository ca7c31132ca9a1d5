"""Building pdserve's C sources with the system's C compiler, on first use, into the pdserve cache folder: the engine's
CPU kernels (runner/kernels.py). No torch here."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TIMEOUT_S = 120  # one compiler call; a build takes about a second


def compiler() -> str | None:
    """The system's C compiler, or None."""
    return shutil.which("cc") or shutil.which("gcc")


def run(argv: list[str]) -> None:
    """One compiler call; CalledProcessError (its stderr kept) where it fails."""
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=TIMEOUT_S)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to build into, named for this process and call (several router workers, or hosts
    sharing the cache folder, may build the same file at once); moved onto `path` in one step when the block ends,
    so a reader finds the whole file or none; removed where the block raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
