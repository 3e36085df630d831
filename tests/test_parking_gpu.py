"""Parking a GPU-offloaded kernel: it goes to disk (GPU state in the image) and comes
back on a new server. Real servers, kernels and CRIU; the TEST-ONLY fake libcuda and
NVML (tests/fakes) stand in for the driver, as in tests/test_gpu_integration.py."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.test_cli import Server, _proc_table
from tests.test_parking import execute, records, servers, start_server, stop_with

from .conftest_gpu import FAKE_LIBCUDA, HELPER, FakeGpu, GiB, fake_gpu, gpu_build, nspid, wait_for

__all__ = ["fake_gpu", "gpu_build", "servers"]  # fixtures used by name

pytestmark = pytest.mark.criu

GPU_ID = "parked-kernel"
GPU_ARGS = (
    f"--CudaCheckpointer.helper_path={HELPER}",
    f"--CudaCheckpointer.libcuda_path={FAKE_LIBCUDA}",
)


def python_of(kid: str) -> int:
    """Host pid of the kernel's python process (the child of cedana-init)."""

    def find() -> list[int]:
        return [
            pid
            for pid, row in _proc_table().items()
            if kid in row[3] and "ipykernel" in row[3] and "cedana-init" not in row[3]
        ]

    pids = wait_for(find, timeout=30)
    assert len(pids) == 1, pids
    return pids[0]


def gpu_server(base: Path, root: Path) -> Server:
    return start_server(
        base, *GPU_ARGS, checkpoint_root=root, extra_env={"CEDANA_FAKE_GPU_ID": GPU_ID}
    )


def test_offloaded_kernel_is_parked_to_disk_and_adopted(
    tmp_path: Path, fake_gpu: FakeGpu, servers: list[Server]
) -> None:
    root = tmp_path / "checkpoints"
    a = gpu_server(tmp_path / "a", root)
    servers.append(a)
    kid = a.start_kernel()
    assert execute(a, kid, "g = 'on the gpu'")["reply"]["status"] == "ok"
    pid = python_of(kid)
    fake_gpu.add("proc", pid=pid, dev=0, mem=2 * GiB, id=GPU_ID, nspid=nspid(pid))

    status, view = a.api("POST", f"api/cedana/kernels/{kid}/suspend?tier=offload")
    assert status == 200 and view["state"] == "suspended" and view["tier"] == "offload", view
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"
    fake_gpu.clear_log()

    log = stop_with(a, signal.SIGTERM)
    assert "parked 1 of 1 kernel(s)" in log, log[-4000:]
    # To disk without touching the GPU state again: it was already in host memory.
    assert fake_gpu.timeline() == []
    manifest: dict[str, Any] = json.loads((root / kid / "manifest.json").read_text())
    assert manifest["gpu"] and manifest["gpu"]["bytes_freed"] == 2 * GiB
    assert records(root)[kid]["provisioner"]["cedana_tier"] == "disk"

    b = gpu_server(tmp_path / "b", root)
    servers.append(b)
    assert b.kernel(kid)["state"] == "suspended"
    out = execute(b, kid, "print(g)")
    assert out["stdout"].strip() == "on the gpu", out
    assert fake_gpu.timeline()[-2:] == ["restore", "unlock"]
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
