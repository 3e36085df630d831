"""bench/gpu_check.py, the check meant for a real GPU, run against the TEST-ONLY fakes
(--fake): its steps, through the real provisioner, helper and CRIU, must work before
the one chance on a GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest_gpu import ROOT

pytestmark = pytest.mark.criu


def test_gpu_check_against_the_fakes(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--fake",
            "--steps",
            "criu,env,driver,small",
            "--small-gb",
            "0.02",
            # Inside pytest's timeout: a step that hangs is then reported, by name.
            "--timeout",
            "240",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]
    failed = {n: s.get("error") for n, s in steps.items() if not s.get("ok")}
    assert r.returncode == 0 and not failed, (failed, r.stdout[-3000:], r.stderr[-3000:])
    assert steps["criu"]["result"]["check"]["rc"] == 0
    no_cuda = steps["driver"]["result"]["no_cuda_process"]
    assert no_cuda["get_state"] == [None, "CUDA_ERROR_NOT_SUPPORTED"]
    assert steps["small.attribution"]["result"]["attributed_to_kernel"] is True
    for tier in ("offload", "disk"):
        t = steps[f"small.{tier}"]["result"]
        assert t["verify"] == {"tensors": True, "host": True, "new_cuda_work": True}
        assert t["nvml_freed"] == t["gpu_bytes"] == t["nvml_taken_back"] > 0
    two = steps["small.two_processes"]["result"]
    assert two["refused"] is True and "several processes" in two["message"]
    adm = steps["small.admission"]["result"]
    assert adm["refused"] is True and adm["state"] == "suspended" and adm["image_kept"] is True
    assert all(adm["verify_after"].values())
    assert report["targets"]["all_verified"] is True
    assert any(p.name.startswith("small-") for p in (tmp_path / "logs").iterdir())
