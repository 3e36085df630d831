"""docs/architecture.md stays true to the code: every module, native helper and
frontend file it names, in its prose or in its diagrams, exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# Where the files it names by their bare name (in the diagrams) live.
HOMES = [
    ROOT / "jupyter_cedana",
    *sorted(p.parent for p in (ROOT / "jupyter_cedana").glob("*/**/__init__.py")),
    ROOT / "native",
    ROOT / "labextension" / "src",
]

# A path into the package, the native helpers or the frontend: jupyter_cedana/server/gate.py,
# native/cedana-pages.c, labextension/src/panel.tsx, jupyter_cedana/events/kernel_state.yaml
PATH = re.compile(r"\b((?:jupyter_cedana|native|labextension/src)/[\w./-]*\w)")
# A bare file name of those kinds, as the diagrams write them: manager.py, panel.tsx
BARE = re.compile(r"(?<![\w./-])([\w-]+\.(?:py|c|ts|tsx))\b")


def named_paths(text: str) -> set[str]:
    return set(PATH.findall(text))


def named_files(text: str) -> set[str]:
    without_paths = PATH.sub(" ", text)
    return set(BARE.findall(without_paths))


def missing(text: str) -> list[str]:
    gone = [p for p in sorted(named_paths(text)) if not (ROOT / p).exists()]
    gone += [
        name
        for name in sorted(named_files(text))
        if not any((home / name).exists() for home in HOMES)
    ]
    return gone


def test_every_named_file_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert missing(text) == []
    # Named enough to be a map of the code, so that the check is not vacuous.
    paths = named_paths(text)
    assert len(paths) >= 10, paths
    assert {p.split("/")[0] for p in paths} >= {"jupyter_cedana", "native", "labextension"}
    assert len(named_files(text)) >= 30


def test_both_flows_are_drawn() -> None:
    text = DOC.read_text(encoding="utf-8")
    for heading in ("## The parts", "## A suspend", "## A resume", "## Where it is going"):
        assert heading in text
    # The diagrams are code blocks; at least the parts, the suspend and the resume.
    assert text.count("```text") >= 3


def test_the_check_catches_a_stale_name() -> None:
    stale = "`jupyter_cedana/gone.py` and, in a diagram, manager.py ─▶ nosuch.py"
    assert missing(stale) == ["jupyter_cedana/gone.py", "nosuch.py"]
    assert missing("`native/cedana-pages.c`, labextension/src/panel.tsx, gate.py") == []
