"""The documentation stays navigable: every relative link in README.md and docs/ reaches a file (and a heading) of
the repository, every repository path a page names in code quotes exists, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").rglob("*.md")])
README_MAX_LINES = 200

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
UNCLOSED = re.compile(r"\]\((?![^)\s]+\))")  # a `](` whose target does not close on its line
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
QUOTED_PATH = re.compile(r"`((?:bench|docs|pdserve|scripts|tests|\.ci)/[\w./-]*)`")


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (a link or path inside them is an example, not a reference)."""
    return FENCE.sub("", page.read_text())


def _ignored(path: str) -> bool:
    """A path under a folder .gitignore names (a command's output folder, made when it runs)."""
    folders = [e.strip("/") for e in (ROOT / ".gitignore").read_text().split() if e.endswith("/") and "*" not in e]
    return any(path.startswith(f + "/") or path == f for f in folders)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (a repeated heading gets -1, -2, ... as on GitHub)."""
    counts: dict[str, int] = {}
    found = set()
    for line in _prose(page).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            base = slug(m.group(1))
            found.add(f"{base}-{counts[base]}" if base in counts else base)
            counts[base] = counts.get(base, 0) + 1
    return found


def link_problem(page: Path, target: str) -> str | None:
    """Why a link of `page` does not resolve inside the repository, or None when it does."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: outside the repository by design
        return None
    path_part, _, anchor = target.partition("#")
    dest = (page.parent / path_part).resolve() if path_part else page
    if not dest.is_relative_to(ROOT):
        return "leaves the repository"
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading #{anchor} in {dest.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    targets = LINK.findall(_prose(page))
    broken = {t: why for t in targets if (why := link_problem(page, t))}
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_target_closes_on_its_line(page):
    """A target wrapped across lines (or holding a space) renders broken and would escape the check above."""
    assert not [line for line in _prose(page).splitlines() if UNCLOSED.search(line)]


def test_the_unclosed_link_check_catches_a_wrapped_target():
    assert UNCLOSED.search("see [a page](router-") and UNCLOSED.search("[a](b c)")
    assert not UNCLOSED.search("see [a page](router-scaling.md#x) and [b](https://x.org/y)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page):
    named = set(QUOTED_PATH.findall(_prose(page)))
    assert not {p for p in named if not (ROOT / p).exists() and not _ignored(p)}


def test_the_docs_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")} - {"README.md"}
    assert not {p for p in pages if f"]({p})" not in index}


def test_every_docs_page_starts_with_a_title_and_a_one_line_purpose():
    for page in (ROOT / "docs").rglob("*.md"):
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and lines[1] == "" and lines[2] and lines[3] == "", page


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_the_link_checker_finds_a_broken_link_and_a_missing_anchor():
    """The checks above can fail: a missing file, a missing heading and a path outside the repository."""
    page = ROOT / "docs" / "README.md"
    assert link_problem(page, "architecture.md") is None
    assert link_problem(page, "architecture.md#the-files") is None
    assert link_problem(page, "no-such-page.md") == "no such file"
    assert link_problem(page, "architecture.md#no-such-heading").startswith("no heading")
    assert link_problem(page, "../../outside.md") == "leaves the repository"
    assert slug("Latest run (2026-12-01, AVX-512 host)") == "latest-run-2026-12-01-avx-512-host"


def test_ci_runs_the_readmes_test_command_verbatim():
    """The README's install-and-test command is what .ci/run runs, character for character."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(python3 -m venv [^\n]+)\n```", readme)
    assert len(commands) == 2 and commands[0].endswith("pdserve up --model tiny"), commands
    assert commands[1].endswith("python -m pytest -q")
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()
