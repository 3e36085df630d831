"""Nothing the project installs or sets up carries privilege of its own: no file under
jupyter_cedana/ (the native helpers included, as built here and shipped in the wheel) is
setuid or setgid or has file capabilities, and neither the build nor any script of the
project (set-up, CI, packaging) grants any. Privilege lives in one root service, the
checkpoint agent (docs/agent.md); a server that is not root runs no CRIU."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jupyter_cedana"
BUILD_FILES = [ROOT / "native" / "Makefile", ROOT / "native" / "hatch_build.py"]
# Everything that installs or sets up something: set-up, test and release scripts, CI,
# the systemd unit.
SCRIPT_DIRS = [ROOT / "scripts", ROOT / ".ci", ROOT / "packaging"]
GRANTING = re.compile(r"\bsetcap\b|chmod\s+[ug]*\+s|chmod\s+[2467][0-7]{3}\b|cap_set_file")


def privileged(path: Path) -> str | None:
    """Why `path` carries privilege, or None."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        return None
    if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
        return f"mode {stat.S_IMODE(st.st_mode):o}"
    try:
        os.getxattr(path, "security.capability", follow_symlinks=False)
    except OSError:
        return None
    return "file capabilities"


def privileged_files(top: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d not in ("node_modules", "__pycache__")]
        for name in filenames:
            why = privileged(Path(dirpath) / name)
            if why:
                found.append(f"{Path(dirpath, name).relative_to(top)}: {why}")
    return found


def test_no_file_of_the_package_is_setuid_or_has_capabilities() -> None:
    helpers = sorted(p.name for p in (PACKAGE / "bin").iterdir())
    assert "cedana-init" in helpers, "the native helpers are not built: make -C native"
    assert privileged_files(PACKAGE) == []


def test_the_build_grants_nothing() -> None:
    for path in BUILD_FILES:
        assert not GRANTING.search(path.read_text()), path


def test_no_script_grants_capabilities_or_setuid() -> None:
    # The capability-carrying copy of CRIU it made gave every notebook of its users
    # CAP_SYS_PTRACE, that is root; the checkpoint agent replaced it.
    assert not (ROOT / "scripts" / "grant-criu-caps.sh").exists()
    scripts = [p for d in SCRIPT_DIRS for p in sorted(d.rglob("*")) if p.is_file()]
    assert len(scripts) > 5, scripts
    granting = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in scripts
        for m in [GRANTING.search(p.read_text(errors="replace"))]
        if m
    ]
    assert granting == []


def test_the_checker_sees_setuid_and_capabilities(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"\x7fELF")
    assert privileged_files(tmp_path) == []
    plain.chmod(0o4755)
    assert privileged_files(tmp_path) == ["plain: mode 4755"]
    plain.chmod(0o755)
    if os.geteuid() != 0:
        pytest.skip("setting file capabilities needs root")
    subprocess.run(["setcap", "cap_sys_ptrace+ep", str(plain)], check=True)
    assert privileged_files(tmp_path) == ["plain: file capabilities"]
    assert GRANTING.search("\tsetcap cap_sys_ptrace+ep $(BIN)/cedana-init")
    assert GRANTING.search("chmod u+s cedana-init") and GRANTING.search("chmod 4755 x")
