# The fixtures of conftest_gpu.py and test_server.py are imported, and tests name them.
# ruff: noqa: F811
"""The checkpoint budget counts a GPU kernel's whole image: its device memory is copied
into host memory before CRIU dumps it. A real server, real kernel and real CRIU, with the
TEST-ONLY fake driver (tests/fakes) standing in for the GPU."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.engine import CheckpointEngine
from jupyter_cedana.limits import estimate_image_bytes
from jupyter_cedana.proctree import process_tree
from tests.conftest_gpu import FAKE_LIBCUDA, HELPER, FakeGpu, GiB, fake_gpu, gpu_build, nspid  # noqa: F401
from tests.test_server import api, manager, new_kernel  # noqa: F401

pytestmark = pytest.mark.criu

GPU_ID = "budget-kernel"
KERNEL_GPU_MEM = 2 * GiB


@pytest.fixture
def jp_server_config(
    checkpoint_root: Path, fake_gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    monkeypatch.setenv("CEDANA_FAKE_GPU_ID", GPU_ID)  # kernels inherit it
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_cedana": True}},
        "CedanaApp": {"checkpoint_root": str(checkpoint_root)},
        "CudaCheckpointer": {
            "helper_path": str(HELPER),
            "libcuda_path": str(FAKE_LIBCUDA),
            "lock_timeout_ms": 500,
        },
        "SuspendPolicy": {"idle_timeout": 0, "check_interval": 3600},
    }


@pytest.fixture(autouse=True)
async def started(jp_serverapp: Any) -> Any:
    await jp_serverapp.extension_manager.start_extension("jupyter_cedana")
    yield jp_serverapp
    if CheckpointEngine.initialized():
        await CheckpointEngine.instance().close()


async def test_budget_counts_gpu_memory(api, new_kernel, fake_gpu, jp_serverapp):
    mgr = manager(jp_serverapp)
    kid = await new_kernel()
    init = mgr.kernel_manager.get_kernel(kid).provisioner.pid
    kids: set[int] = set()
    for _ in range(500):  # the python kernel under cedana-init (a guard, not a timing)
        kids = process_tree(init) - {init}
        if kids:
            break
        await asyncio.sleep(0.02)
    python = min(kids)
    fake_gpu.add("proc", pid=python, dev=0, mem=KERNEL_GPU_MEM, id=GPU_ID, nspid=nspid(python))

    host = estimate_image_bytes(init)
    # Room for the kernel's host memory, not for its GPU memory too.
    mgr.policy.max_checkpoint_bytes = host + KERNEL_GPU_MEM // 2
    status, err = await api("POST", "kernels", kid, "suspend")
    assert status == 507 and "Checkpoint budget exceeded" in err["message"], err
    assert "(memory and GPU memory)" in err["message"]
    assert fake_gpu.ops() == []  # refused before the GPU was touched
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "running"

    mgr.policy.max_checkpoint_bytes = host + 2 * KERNEL_GPU_MEM
    status, k = await api("POST", "kernels", kid, "suspend")
    assert status == 200 and k["state"] == "suspended", k
    assert fake_gpu.ops()[:2] == ["lock", "checkpoint"]
    _, st = await api("GET", "status")
    assert st["budget"]["reserved"] == 0 and st["budget"]["used"] == k["checkpoint_bytes"]
