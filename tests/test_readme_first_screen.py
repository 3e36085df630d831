"""The README answers, on its own, what jupyter-cedana does, whether a deployment can use
it and how to turn it on, in under about 100 lines; the settings it shows exist, and what
it says about privilege and GPUs stays as plain as the code is."""

from __future__ import annotations

import re

from tests.test_docs_links import ROOT

README = ROOT / "README.md"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section ## {heading}"
    return m.group(1)


def test_readme_is_a_first_screen() -> None:
    text = readme()
    # The first screen, not a manual: the rest lives in docs/.
    assert len(text.splitlines()) <= 100
    headings = re.findall(r"^## (.+)$", text, re.M)
    for wanted in ("Requirements", "Install", "Turning it on", "Using it", "How fast"):
        assert wanted in headings, headings
    # What and why come before anything else.
    first = text.split("\n## ", 1)[0]
    assert "suspend" in first.lower() and "resume" in first.lower()
    assert "![" in first and "docs/images/" in first


def test_requirements_say_what_needs_privilege_and_the_gpu_status() -> None:
    req = section(readme(), "Requirements")
    for fact in ("CRIU 4.2", "root", "CheckpointAgent.socket", "r570", "docs/agent.md"):
        assert fact in req, fact
    # Where privilege lives, and what it means that the agent is root: said, not softened.
    assert re.search(r"the agent is root, so a flaw in it\s+is a flaw in root", req)
    assert re.search(r"no agent: kernels run as usual, never suspended", req)
    assert "grant-criu-caps" not in readme()
    assert re.search(r"never on a real GPU", req)


def test_the_settings_shown_first_exist_with_their_names() -> None:
    block = re.search(r"```python\n(.*?)```", section(readme(), "Turning it on"), re.S)
    assert block
    names = re.findall(r"^c\.(\w+\.\w+)\s*=", block.group(1), re.M)
    assert len(names) == 3, names
    reference = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    for name in names:
        assert f"### `{name}`" in reference, name


def test_the_install_uses_the_wheel_for_both_kinds_of_deployment() -> None:
    install = section(readme(), "Install")
    assert "bash scripts/build-wheel.sh" in install
    assert "pip install dist/jupyter_cedana-" in install
    assert "JupyterHub image" in install and "docs/jupyterhub.md" in install
    assert (ROOT / "scripts" / "build-wheel.sh").is_file()
    assert (ROOT / "scripts" / "check-wheel.sh").is_file()
    # The test command installs the wheel into a fresh virtualenv and serves from it.
    test_sh = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    assert "bash scripts/build-wheel.sh" in test_sh and "bash scripts/check-wheel.sh" in test_sh


def test_the_headline_table_says_where_and_when() -> None:
    fast = section(readme(), "How fast")
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", fast)
    assert re.search(r"\d+-vCPU|\bCPU\b", fast) and "CRIU" in fast
    assert "docs/benchmarks.md" in fast
    assert sum(line.startswith("| ") for line in fast.splitlines()) >= 3
