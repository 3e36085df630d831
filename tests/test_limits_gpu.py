# The fixtures of conftest_gpu.py and test_server.py are imported, and tests name them.
# ruff: noqa: F811
"""The checkpoint budget counts a GPU kernel's whole image: its device memory is copied
into host memory before CRIU dumps it. A real server, real kernel and real CRIU, with the
TEST-ONLY fake driver (tests/fakes) standing in for the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.checkpoint.proctree import process_tree
from jupyter_cedana.server.limits import estimate_image_bytes
from tests.conftest_gpu import (  # noqa: F401
    FAKE_LIBCUDA,
    FAKE_OLD_LIBCUDA,
    HELPER,
    FakeGpu,
    GiB,
    fake_gpu,
    gpu_build,
    nspid,
)
from tests.test_limits_server import (  # noqa: F401
    actions,
    due,
    events,
    idle_kernel,
    saw,
    settled,
    until,
)
from tests.test_server import api, connect, manager, new_kernel  # noqa: F401

pytestmark = pytest.mark.criu

GPU_ID = "budget-kernel"
KERNEL_GPU_MEM = 2 * GiB


@pytest.fixture
def libcuda() -> Path:
    """The driver library the helper loads (parametrize for the old-driver fake)."""
    return FAKE_LIBCUDA


@pytest.fixture
def jp_server_config(
    checkpoint_root: Path, fake_gpu: FakeGpu, libcuda: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    monkeypatch.setenv("CEDANA_FAKE_GPU_ID", GPU_ID)  # kernels inherit it
    if libcuda == FAKE_OLD_LIBCUDA:
        fake_gpu.update("driver", {}, version="550.54.15", cuda=12040)
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_cedana": True}},
        "CedanaApp": {"checkpoint_root": str(checkpoint_root)},
        "CudaCheckpointer": {
            "helper_path": str(HELPER),
            "libcuda_path": str(libcuda),
            "lock_timeout_ms": 500,
        },
        # GPU-idle as soon as sampled; the tests run each policy check themselves.
        "SuspendPolicy": {
            "idle_timeout": 0,
            "check_interval": 3600,
            "gpu_utilization_window": 0,
        },
    }


@pytest.fixture(autouse=True)
async def started(jp_serverapp: Any) -> Any:
    await jp_serverapp.extension_manager.start_extension("jupyter_cedana")
    yield jp_serverapp
    if CheckpointEngine.initialized():
        await CheckpointEngine.instance().close()


async def gpu_kernel(mgr: Any, new_kernel: Any, connect: Any, fake_gpu: FakeGpu) -> tuple[str, int]:
    """An idle kernel whose python process holds KERNEL_GPU_MEM on the fake GPU; its id
    and the pid of its cedana-init."""
    kid = await idle_kernel(new_kernel, connect)
    init = mgr.kernel_manager.get_kernel(kid).provisioner.pid

    async def started() -> bool:
        return bool(process_tree(init) - {init})

    await until(started, "the python kernel under cedana-init")
    python = min(process_tree(init) - {init})
    fake_gpu.add("proc", pid=python, dev=0, mem=KERNEL_GPU_MEM, id=GPU_ID, nspid=nspid(python))
    return kid, init


async def test_budget_counts_gpu_memory(api, new_kernel, connect, fake_gpu, jp_serverapp):
    mgr = manager(jp_serverapp)
    kid, init = await gpu_kernel(mgr, new_kernel, connect, fake_gpu)
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


@pytest.mark.parametrize("libcuda", [FAKE_OLD_LIBCUDA])
async def test_a_gpu_kernel_the_driver_cannot_checkpoint_is_not_retried(
    api, new_kernel, connect, fake_gpu, events, jp_serverapp
):
    """Preflight refusal (a driver older than r570 holds GPU memory the image would lack):
    the policy marks the kernel not checkpointable instead of trying at every check."""
    mgr = manager(jp_serverapp)
    kid, _ = await gpu_kernel(mgr, new_kernel, connect, fake_gpu)
    mgr.policy.idle_timeout = 0.01
    await until(due(mgr, kid), "the policy to want a suspend")
    await mgr.check()
    await until(settled(mgr, kid), "the automatic suspend")
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "running" and k["gpus"], k
    assert k["backoff"]["not_checkpointable"] is True
    assert k["reason"].startswith("Not checkpointable") and "r570" in k["reason"]
    for _ in range(3):
        await mgr.check()
    await saw(events, kid, ["suspending", "failed"])  # tried once, not at every check
    status, err = await api("POST", "kernels", kid, "suspend")  # a person still may
    assert status == 409 and err["code"] == "not_checkpointable"
