"""The README and the docs are written for a reader who has only the repository: they
name no file outside it, no issue or pull-request number of ours, and no result file
that git does not hold; and docs/benchmarks.md opens with today's numbers, each
section saying when and how they were measured."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.test_docs_links import ROOT, documents, prose_lines

# Paths that exist only on the machines the project was developed on.
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])shared/DESIGN|/work/|/tmp/bash_jobs")
# "#26", "issue 26", "PR #3": numbers that mean something only to us. Another
# project's issue, written owner/repo#N, is a citation a reader can follow.
ISSUE = re.compile(r"(?<![\w/.&-])#\d+\b|\b(?:issues?|PR|pull request)\s*#?\d+\b", re.I)
# A result file the text cites: bench/results/NAME.EXT.
RESULT_FILE = re.compile(r"\bbench/results/[\w.-]+\.\w+")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def outside_references(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE.finditer(text)]


def issue_numbers(text: str) -> list[str]:
    return [m.group(0) for m in ISSUE.finditer(text)]


def test_no_reference_outside_the_repository_or_to_our_issues() -> None:
    found: list[str] = []
    for path in documents():
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT)
        found += [f"{name}: {ref}" for ref in outside_references(text)]
        found += [f"{name}: {ref}" for ref in issue_numbers(text)]
    assert found == []


def test_the_patterns_catch_what_they_are_for() -> None:
    text = (
        "see ../shared/DESIGN.md and /work/main/x, as in #26 (issue 25, PR #3); "
        "NVIDIA/cuda-checkpoint#44 is upstream; `c.x = 1  # 30 minutes`; GPU-0"
    )
    assert outside_references(text) == ["../shared", "/work/"]
    assert issue_numbers(text) == ["#26", "issue 25", "PR #3"]


def tracked(paths: list[str]) -> set[str]:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--", *paths],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_cited_result_files_are_committed() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    cited: dict[str, str] = {}
    for path in documents():
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            for m in RESULT_FILE.finditer(line):
                cited.setdefault(m.group(0), str(path.relative_to(ROOT)))
    # bench/README.md shows where a run writes its report; that is not a citation.
    cited = {f: doc for f, doc in cited.items() if doc != "bench/README.md"}
    missing = sorted(f"{doc}: {f}" for f, doc in cited.items() if f not in tracked(list(cited)))
    assert missing == []


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each `## ` section; the text before the first one is ''."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    out = [("", parts[0])]
    out += [(parts[i], parts[i + 1]) for i in range(1, len(parts), 2)]
    return out


def has_numbers_table(body: str) -> bool:
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return any(re.search(r"\|\s*\**[\d.]+", row) for row in rows)


def test_benchmarks_page_opens_with_todays_numbers() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    intro, *rest = sections(text)
    # Before any method: a table of every target, where it stands today and when.
    table = [line for line in intro[1].splitlines() if line.startswith("|")]
    assert table, "docs/benchmarks.md does not open with a table"
    assert re.match(r"\|\s*target\s*\|\s*today\s*\|\s*measured\s*\|", table[0]), table[0]
    rows = table[2:]
    assert len(rows) >= 5
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert DATE.search(cells[2]) or "not measured" in cells[1], row
        assert re.search(r"\]\(#[\w-]+\)", cells[3]), row
    # Every later section with a table of numbers says when it was measured and the
    # command that reproduces it, or that it comes from a run given above.
    for heading, body in rest:
        if heading == "How to read these numbers" or not has_numbers_table(body):
            continue
        from_above = re.search(r"same run as", body, re.I)
        assert DATE.search(body) or from_above, f"## {heading}: no date"
        assert "```sh" in body or from_above, f"## {heading}: no command"
