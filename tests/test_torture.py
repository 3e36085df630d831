"""A short torture run (bench/torture.py) as part of the suite: random operations on a
few kernels through a real jupyter server; nothing may be lost, leaked or fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.criu

BENCH = Path(__file__).parents[1] / "bench" / "torture.py"


def test_short_torture_run_loses_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "torture.json"
    # Operations stop being started after --seconds, so a loaded machine does fewer of
    # them rather than running over; every one started is checked.
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--kernels",
            "4",
            "--ops",
            "400",
            "--seconds",
            "75",
            "--seed",
            "11",
            "--workdir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.exists(), (
        f"no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    report = json.loads(out.read_text())
    assert report["operations"] >= 25, proc.stdout[-3000:]
    assert report["failures"] == {}, report["failure_examples"]
    assert report["states_lost"] == 0
    assert report["reconnect_wakeups"] == 0
    assert report["bad_shutdowns"] == 0
    assert report["leaked"] == {"processes": [], "ports": [], "images": [], "kernels_listed": []}
    assert report["leaked_after_stop"] == []
    # The run exercised what it is for: kernels were suspended and woken along the way.
    assert report["suspends"] > 0
    assert proc.returncode == 0, proc.stdout[-3000:]
