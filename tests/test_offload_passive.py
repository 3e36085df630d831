# The fixtures of conftest_gpu.py and test_gate.py are imported, and tests name them.
"""A passive message held for an offloaded kernel (JupyterLab's debugger probe, sent when
a notebook gets focus) waits for the kernel's next run: it must not keep the kernel from
moving to disk, where its host memory is given back. A real server, real kernel and real
CRIU, with the TEST-ONLY fake driver (tests/fakes) standing in for the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.checkpoint.proctree import process_tree
from tests.conftest import alive
from tests.conftest_gpu import FAKE_LIBCUDA, HELPER, FakeGpu, GiB, fake_gpu, gpu_build, nspid
from tests.test_gate import api, connect, gate, idle_for_hours, manager, new_kernel, until

__all__ = ["api", "connect", "fake_gpu", "gpu_build", "new_kernel"]  # fixtures used by name

pytestmark = pytest.mark.criu

GPU_ID = "offloaded-kernel"
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
        # The test runs each policy check itself.
        "SuspendPolicy": {"idle_timeout": 0, "check_interval": 3600, "gpu_utilization_window": 0},
    }


@pytest.fixture(autouse=True)
async def started(jp_serverapp: Any) -> Any:
    await jp_serverapp.extension_manager.start_extension("jupyter_cedana")
    yield jp_serverapp
    if CheckpointEngine.initialized():
        await CheckpointEngine.instance().close()


def debug_info(client: Any) -> str:
    return str(
        client.send(
            "debug_request", {"seq": 1, "type": "request", "command": "debugInfo"}, "control"
        )
    )


async def test_a_held_debugger_probe_does_not_keep_an_offloaded_kernel_in_memory(
    api, new_kernel, connect, fake_gpu, jp_serverapp
):
    kid = await new_kernel()
    client = await connect(kid)
    assert await client.run("x = 21") == ""
    init = jp_serverapp.kernel_manager.get_kernel(kid).provisioner.pid
    await until(lambda: process_tree(init) - {init}, "the python kernel under cedana-init")
    python = min(process_tree(init) - {init})
    fake_gpu.add("proc", pid=python, dev=0, mem=KERNEL_GPU_MEM, id=GPU_ID, nspid=nspid(python))
    status, k = await api("POST", "kernels", kid, "suspend", tier="offload")
    assert status == 200 and (k["state"], k["tier"]) == ("suspended", "offload"), k
    assert alive(python)  # offloaded: its process, and the GPU memory copied into it, stay

    probe = debug_info(client)
    g = gate(jp_serverapp)
    await until(lambda: g._held.get(kid), "the probe to be held")
    assert not g.busy(kid)  # it waits for the next run; it is not a reason to stay

    mgr = manager(jp_serverapp)
    idle_for_hours(jp_serverapp, kid)
    await mgr.check()
    await until(lambda: not mgr.transition_pending(kid), "the move to disk")
    _, k = await api("GET", "kernels", kid)
    assert (k["state"], k["tier"]) == ("suspended", "disk"), k
    await until(lambda: not alive(python), "the offloaded process to be gone")
    assert [m.msg_id for _, m in g._held.get(kid, [])] == [probe]  # still waiting

    # A cell resumes the kernel from disk; the probe is delivered with it and answered.
    assert await client.run("print(x * 2)") == "42\n"
    got = await client.answer(probe)
    assert got["reply"]["msg_type"] == "debug_reply", got["reply"]
    assert "could not be resumed" not in str(got["reply"]["content"])
