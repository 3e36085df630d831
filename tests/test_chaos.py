"""A short chaos run (bench/chaos.py) as part of the suite: a real jupyter server killed
with SIGKILL about ten times, mid-dump, mid-commit, mid-lazy-load, mid-park, mid-adopt,
mid-gc and at random, and started again on the same checkpoint root each time. No
suspended kernel may be lost, nothing may leak, and the disk budget must add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.criu

BENCH = Path(__file__).parents[1] / "bench" / "chaos.py"
NAMED = {"dump", "commit", "lazy-load", "park", "adopt", "gc"}


def test_short_chaos_run_loses_no_suspended_kernel(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    # Kills stop being aimed after --seconds, so a loaded machine makes fewer of them
    # rather than running over; every restart is checked in full.
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--kills",
            "10",
            "--kernels",
            "2",
            "--big",
            "1",
            "--big-gb",
            "0.3",
            "--ops",
            "3",
            "--phases",
            "dump,commit,lazy-load,park,adopt,gc,random",
            "--seconds",
            "130",
            "--seed",
            "7",
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
    assert report["kills"] >= 4, proc.stdout[-3000:]
    # The kills landed where they were aimed, not just anywhere: named phases were hit.
    assert len(NAMED & set(report["hit"])) >= 3, report["kill_log"]
    assert report["lost_suspended"] == [], report["lost_suspended"]
    # Kernels were suspended at the kills and came back, with their state.
    assert report["recovered_suspended"] > 0
    assert report["leaks"] == []
    assert report["budget_mismatches"] == []
    assert report["failures"] == []
    final = report["final_leaks"]
    assert (final["processes"], final["ports"], final["store"], final["kernels_listed"]) == (
        [],
        [],
        [],
        [],
    ), final
    assert report["leaked_after_stop"] == []
    assert proc.returncode == 0, proc.stdout[-3000:]
