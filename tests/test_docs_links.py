"""Every relative link in the README and the docs resolves: to a file that exists and,
for `#anchor` links into Markdown, to a heading of that file as GitHub names it.
External http(s) links are not fetched (the tests run without a network)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def documents() -> list[Path]:
    top = [ROOT / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")]
    return top + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "bench" / "README.md"]


FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets
# (an image inside a link).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their line numbers."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            marker = m.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, with everything but
    letters, digits, spaces, hyphens and underscores dropped, and spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        bare = CODE_SPAN.sub("", line)
        ref = REFERENCE.match(bare)
        if ref:
            found.append((number, ref.group(1)))
            continue
        found.extend((number, m.group(1)) for m in INLINE_LINK.finditer(bare))
    return found


def broken_links(path: Path, root: Path = ROOT) -> tuple[list[str], int]:
    """The broken relative links of a Markdown file, and how many relative links it has.
    A link out of the repository (`root`) is broken too: a reader of the repository does
    not have what lies beside it."""
    errors: list[str] = []
    checked = 0
    for number, target in links(path):
        if EXTERNAL.match(target):
            continue
        checked += 1
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root) if path.is_relative_to(root) else path.name}:{number}"
        if not dest.is_relative_to(root.resolve()):
            errors.append(f"{where}: {target}: outside the repository")
            continue
        if not dest.exists():
            errors.append(f"{where}: {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{where}: {target}: no heading #{anchor} in {dest.name}")
    return errors, checked


def test_every_relative_link_resolves() -> None:
    docs = documents()
    missing = [p for p in docs if not p.is_file()]
    assert missing == []
    assert {p.name for p in docs} >= {"README.md", "index.md", "architecture.md"}
    errors: list[str] = []
    checked = 0
    for path in docs:
        file_errors, n = broken_links(path)
        errors += file_errors
        checked += n
    assert errors == []
    # Enough links are looked at that the check cannot pass by finding none.
    assert checked >= 50


def test_the_checker_catches_broken_links(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "beside.md").write_text("# Beside the repository\n")
    (repo / "other.md").write_text("# A `code` heading: yes\n\n## Twice\n\n## Twice\n")
    doc = repo / "doc.md"
    doc.write_text(
        "# Title\n\n"
        "[fine](other.md#a-code-heading-yes) [second](other.md#twice-1) [self](#title)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) ![img](images/none.png)\n"
        "[web](https://example.org/404) `[in code](nowhere.md)`\n\n"
        "```\n[in a block](nowhere.md)\n# not a heading\n```\n"
        "[ref]: also-missing.md\n"
        "[self-bad](#not-a-heading) [out](../beside.md)\n"
    )
    errors, checked = broken_links(doc, root=repo)
    assert checked == 9
    assert len(errors) == 6, errors
    for target in ("missing.md", "other.md#nope", "images/none.png", "also-missing.md"):
        assert any(f": {target}:" in e for e in errors), (target, errors)
    assert any("#not-a-heading" in e for e in errors)
    assert any(": ../beside.md: outside the repository" in e for e in errors), errors


def test_slugs_follow_github() -> None:
    assert slug("CRIU's probe of the Linux kernel: `/run` on a tmpfs") == (
        "crius-probe-of-the-linux-kernel-run-on-a-tmpfs"
    )
    assert slug("The `jupyter cedana` command") == "the-jupyter-cedana-command"
    assert slug("Culling: jupyter_server and JupyterHub") == "culling-jupyter_server-and-jupyterhub"
    assert slug("Small kernels (0.1 GB)") == "small-kernels-01-gb"
    assert slug("`SuspendPolicy.idle_timeout`") == "suspendpolicyidle_timeout"
    assert slug("Resume: all memory in") == "resume-all-memory-in"


def test_readme_keeps_the_quick_start() -> None:
    """A newcomer starts with these two commands, and CI runs the README's test command
    (.ci/run): they stay in the README, and the scripts they name exist."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = {line.split(" #")[0].strip() for block in blocks for line in block.splitlines()}
    assert "bash scripts/lab.sh" in commands
    assert "bash scripts/test.sh" in commands
    assert (ROOT / "scripts" / "lab.sh").is_file()
    assert (ROOT / "scripts" / "test.sh").is_file()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
