"""The documentation stays navigable: every relative link in README.md and docs/ reaches a file (and a heading) of
the repository, every repository path a page names in code quotes exists, the README stays short, the defaults the
pages name are the code's, the manual tells no build history, and its prose lines fit 120 characters."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.config import MOCK_STEP_S, EngineConfig, NodeConfig, RouterConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").rglob("*.md")])
MANUAL = [p for p in PAGES if ROOT / "docs" / "notes" not in p.parents]
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


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page):
    """The manual names files that exist; the notes (docs/notes/) keep the paths of their time."""
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


def _up_flags() -> dict[str, argparse.Action]:
    """`pdserve up`'s flags by option string (the parser takes each default from its config field)."""
    parser = build_parser()
    up = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["up"]
    return up._option_string_actions


def default_problems(table: str, flags: dict[str, argparse.Action]) -> list[str]:
    """The rows of a `| flag | meaning | default |` table whose default is not the parser's: a row's flags pair with
    its comma-separated defaults in order (a lone default is the first flag's); `none` stands for an empty default
    and any words, for a `--no-...` flag, for its feature being on."""
    problems = []
    for row in re.findall(r"^\| (`--.*?) \|.*\| (.*?) \|$", table, re.M):
        names = re.findall(r"--[\w-]+", row[0])
        for name, shown in zip(names, [s.strip("` ") for s in row[1].split(",")], strict=False):
            value = flags[name].default
            if name.startswith("--no-"):
                ok = value is True
            elif shown == "none":
                ok = value in (None, "", ())
            else:
                ok = shown == str(value) or (isinstance(value, float) and float(shown) == value)
            if not ok:
                problems.append(f"{name}: {shown!r}, but the default is {value!r}")
    return problems


def test_the_readme_flags_table_shows_the_real_defaults():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| flag | meaning | default |") :].split("\n\n")[0]
    assert len(re.findall(r"^\| `--", table, re.M)) >= 10
    assert not default_problems(table, _up_flags())


def test_the_defaults_check_notices_a_wrong_default():
    flags = _up_flags()
    assert default_problems("| `--max-num-seqs` | m | 17 |\n| `--api-key` | k | secret |", flags) == [
        "--max-num-seqs: '17', but the default is 16",
        "--api-key: 'secret', but the default is ''",
    ]
    assert not default_problems("| `--num-prefill N --num-decode M` | n | 1, 1 |", flags)


@pytest.mark.parametrize(
    ("page", "text"),
    [
        ("docs/mock-nodes.md", f"(default `{','.join(map(str, MOCK_STEP_S))}`)"),
        ("docs/prefix-caching.md", f"(default {RouterConfig.cache_balance_margin})"),
        ("docs/prefix-caching.md", f"a stats period ({NodeConfig.stats_interval_s} s)"),
        ("docs/prefix-caching.md", f"`--max-num-batched-tokens` ({EngineConfig.max_num_batched_tokens} by default)"),
    ],
)
def test_a_default_a_page_names_is_the_real_one(page, text):
    assert text in " ".join((ROOT / page).read_text().split())


# Build-history phrases and paths of one machine: a manual says what pdserve does, not how its pages came to be.
# Phrases, not single words, so that "issue a request", "an HTTP session" or "it issues a" pass.
DIARY = re.compile(
    r"|".join(
        [
            r"(?<!HTTP )(?<!login )(?<!own )(?<!new )\bsessions?\b(?! cookie)(?!-scoped)",
            r"\ba (?:later|previous|first|second|third|next) look\b",
            r"\bthis look\b",
            r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth) look\b",
            r"\bthe issue\b",
            r"\bissue's\b",
            r"\bissue \d+",
            r"(?<![\w&/])#\d+\b",
            r"\bwe (?:tried|measured|found)\b",
            r"\bwas tried\b",
            r"\b(?:previous|last|this|next|earlier) session\b",
            r"\bthe (?:throughput )?goals? (?:is|are|was|were) (?:still )?(?:not )?met\b",
            r"(?<![\w.~$])/(?:tmp|root|home|work)/",
            r"\bround \([a-z]\)",
            r"\bsince removed\b",
            r"\b(?:before|after) this change\b",
            r"\bre-run with\b",
            r"\bwe\b",
        ]
    ),
    re.I,
)


def diary_lines(page: Path) -> list[str]:
    """`file:line: text` for each line of `page` (code blocks included) with a build-history phrase or a machine's
    path."""
    name = page.relative_to(ROOT)
    lines = page.read_text().splitlines()
    return [f"{name}:{i}: {line.strip()}" for i, line in enumerate(lines, 1) if DIARY.search(line)]


def test_the_manual_speaks_of_pdserve_not_of_its_making():
    """README.md, bench/README.md and docs/ outside docs/notes/ use no build-history phrase and name no path of one
    machine; the records of how figures came to be belong under docs/notes/."""
    found = [hit for page in MANUAL for hit in diary_lines(page)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "As the session before showed",
        "the previous session measured 3 ms",
        "A later look found it",
        "see the issue's numbers",
        "as issue 12 asked",
        "fixed in #42",
        "what was tried and dropped",
        "we tried uvloop",
        "**The goals are still not met**",
        "the throughput goal is not met",
        "written to /tmp/out",
        "cd /root/pdserve",
        "under /home/me/ckpt",
        "in /work/main",
        "Validation on an idle host, round (e)",
        "the per-token path in C, since removed",
        "the step before this change",
        "re-run with the new flag",
        "We measured it twice",
    ],
)
def test_the_diary_check_catches_history_and_machine_paths(line):
    assert DIARY.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "issue a request to the router",
        "the router issues a Generate",
        "an HTTP session with keep-alive",
        "a session cookie",
        "the children run in their own session",
        "look at the logs",
        "`$PDSERVE_CACHE/models/tiny-v1`",
        "~/.cache/pdserve",
        "see [a page](router-scaling.md#several-router-workers)",
        "the goal of the scheduler is fairness",
        "one round of requests",
        "--router-us-per-token 9.2",
        "the welcome page",
    ],
)
def test_the_diary_check_lets_ordinary_words_pass(line):
    assert not DIARY.search(line)


PROSE_WIDTH = 120


def long_prose_lines(text: str) -> list[str]:
    """The lines of a page's prose longer than PROSE_WIDTH: code blocks (fenced) and table rows may be longer."""
    return [
        line
        for line in FENCE.sub("", text).splitlines()
        if len(line) > PROSE_WIDTH and not line.lstrip().startswith("|")
    ]


@pytest.mark.parametrize(
    "page",
    [p for p in MANUAL if p.parent != ROOT / "bench"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_prose_line_of_the_manual_is_longer_than_120_characters(page):
    assert not long_prose_lines(page.read_text())


def test_the_width_check_passes_code_and_tables_and_catches_prose():
    long = "x" * (PROSE_WIDTH + 1)
    assert long_prose_lines(f"ok\n{long}\n") == [long]
    assert not long_prose_lines(f"```bash\n{long}\n```\n| {long} |\n  | {long} |\n")
