"""Every results file opens with its one current table, and every row of it says how to get it again.

A file in ``benchmarks/results/`` is read by someone who wants a figure and a reason to trust it, so it
opens (after its title and at most a short paragraph) with this table:

    | figure | setting | command | commit | machine | load | date |
    | --- | --- | --- | --- | --- | --- | --- |
    | **1.16** DP / non-private step | cnn-small, micro-batch 256, K = 1 | `python -m ...` | `21123ae` | 2 CPU cores | 0.8-3.5 | 2026-11-28 |

- ``command``: the command in backticks, or a link to the section or block that holds it;
- ``commit``: the code measured, as a short hash in backticks (``recorded in `abc1234` `` where the file
  recorded only the commit that added the figure);
- ``machine``: CPU cores or the GPU; ``load``: the 1-minute load average, or why it does not matter;
- ``date``: YYYY-MM-DD.

A value nobody recorded says ``not recorded``: a gap is visible, never filled in by a guess. Below the
table come only what a reader needs to trust it (method, caveats); dated re-runs, attempts not kept and
plans live in git history (``git log -- benchmarks/results/FILE``), not in the file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FILES = sorted(RESULTS.rglob("*.md"))
COLUMNS = ["figure", "setting", "command", "commit", "machine", "load", "date"]
MAX_PARAGRAPH_LINES = 4
NOT_RECORDED = "not recorded"
CODE = re.compile(r"`[^`]+`")
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# A diary, not a result: a heading with a date or a plan in it, or a correction struck through.
DIARY = re.compile(
    r"^#+ .*(\b20\d\d-[01]\d-[0-3]\d\b|re-run|rerun|second lease|next lease|not kept|not done|earlier measurements"
    r"|round \d)",
    re.IGNORECASE | re.MULTILINE,
)


def _cells(line: str) -> list[str]:
    """A table row's cells; ``\\|`` is a pipe inside a cell, as GitHub reads it."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().removeprefix("|").removesuffix("|"))]


def _opening_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the table a file opens with; fails the test where it opens with anything else."""
    lines = text.splitlines()
    assert lines and lines[0].startswith("# "), "the first line is the title (`# ...`)"
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    if rest and not rest[0].startswith("|"):  # at most one short paragraph before the table
        paragraph = []
        while rest and rest[0].strip():
            paragraph.append(rest.pop(0))
        assert len(paragraph) <= MAX_PARAGRAPH_LINES, f"more than a short paragraph before the table: {paragraph}"
        assert not any(line.lstrip().startswith(("#", "```", "    ")) for line in paragraph), paragraph
        while rest and not rest[0].strip():
            rest = rest[1:]
    table = []
    while rest and rest[0].startswith("|"):
        table.append(rest.pop(0))
    assert len(table) >= 3, "the file does not open with its table (after its title and a short paragraph)"
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", table[1].replace(" ", "")), table[1]
    return _cells(table[0]), [_cells(line) for line in table[2:]]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_there_are_results_files():
    assert len(FILES) >= 10


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_a_results_file_opens_with_its_table_and_each_row_names_its_command_and_commit(path):
    text = path.read_text()
    header, rows = _opening_table(text)
    assert [cell.lower() for cell in header] == COLUMNS, f"columns are {COLUMNS}, in that order: {header}"
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    for row in rows:
        assert len(row) == len(COLUMNS), f"{len(row)} cells, not {len(COLUMNS)}: {row}"
        cell = dict(zip(COLUMNS, row))
        assert cell["figure"] and cell["setting"], row
        command = cell["command"]
        assert CODE.search(command) or LINK.search(command) or NOT_RECORDED in command, f"no command: {row}"
        for target in LINK.findall(command):
            if target.startswith("#"):
                assert target[1:] in anchors, f"the command's link {target} names no heading of {path.name}"
            elif "://" not in target:
                assert (path.parent / target.split("#")[0]).exists(), f"the command's link {target} is broken"
        assert COMMIT.search(cell["commit"]) or NOT_RECORDED in cell["commit"], f"no commit: {row}"
        assert re.search(r"CPU|GPU|H100|H200|" + NOT_RECORDED, cell["machine"]), f"no machine: {row}"
        assert cell["load"], f"no load (or why it does not matter): {row}"
        assert DATE.search(cell["date"]) or NOT_RECORDED in cell["date"], f"no date: {row}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_a_results_file_holds_no_diary(path):
    text = path.read_text()
    assert not DIARY.findall(text), f"dated or planned sections belong to git history: {DIARY.findall(text)}"
    assert "~~" not in text, "a correction replaces the figure; the old one stays in git history"


def _full_history() -> bool:
    try:
        shallow = subprocess.run(
            ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return False
    return shallow.stdout.strip() == "false"


@pytest.mark.skipif(not _full_history(), reason="needs the repository's full git history")
def test_every_commit_a_results_table_names_exists():
    named = set()
    for path in FILES:
        _, rows = _opening_table(path.read_text())
        named |= {sha for row in rows for sha in COMMIT.findall(row[COLUMNS.index("commit")])}
    checked = subprocess.run(
        ["git", "cat-file", "--batch-check"],
        cwd=ROOT,
        input="".join(f"{sha}^{{commit}}\n" for sha in sorted(named)),
        capture_output=True,
        text=True,
        check=True,
    )
    missing = [line.split()[0] for line in checked.stdout.splitlines() if line.endswith("missing")]
    assert not missing, f"commits named in results tables that git does not know: {missing}"
