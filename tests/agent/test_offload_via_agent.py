"""The offload tier through the checkpoint agent: a REAL agent as root with REAL CRIU and
the REAL native CUDA helper, the TEST-ONLY fake driver libraries by root's setting
(`cuda_library`, as tests/agent/test_gpu_via_agent.py), cedana-test's kernel launched
through the agent: `offload` frees its GPU memory into its host memory and keeps the
process, `reload` puts it back."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest_gpu import FakeGpu, fake_gpu, gpu_build

from .checkpoint_fixtures import configured_agent, loose_kernels
from .conftest import Agent
from .servers_on_agent import at_agent
from .test_gpu_via_agent import (
    GPU_ID,
    KERNEL_GPU_MEM,
    TOTAL,
    USER,
    gpu_agent,
    gpu_free,
    gpu_kernel,
    images,
    reconnect,
    with_frames,
)
from .test_launch import Kernel

__all__ = ["configured_agent", "fake_gpu", "gpu_agent", "gpu_build", "loose_kernels"]

pytestmark = pytest.mark.criu


def poll(agent: Agent, kid: str) -> dict[str, object]:
    reply = agent.run_as(USER, "poll", {"kernel_id": kid})
    assert reply["ok"], reply
    result: dict[str, object] = reply["result"]
    return result


def test_offload_frees_the_gpu_the_process_runs_on_and_reload_puts_it_back(
    gpu_agent: Agent, loose_kernels: list[Kernel], fake_gpu: FakeGpu
) -> None:
    agent = gpu_agent
    kernel, pid = gpu_kernel(agent, loose_kernels, fake_gpu)
    kernel.run("x = 41")

    reply = with_frames(agent, "offload", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    assert reply["result"]["gpu_memory_freed"] == KERNEL_GPU_MEM
    assert reply["result"]["gpu"]["memory_bytes"] == KERNEL_GPU_MEM
    assert reply["frames"][:2] == ["gpu-lock", "gpu-checkpoint"], reply["frames"]
    assert gpu_free() == TOTAL
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"
    assert fake_gpu.timeline() == ["lock", "checkpoint"]
    # The same process, still there: no image, nothing dumped.
    assert int(fake_gpu.proc_by_id(GPU_ID)["pid"]) == pid
    assert Path(f"/proc/{pid}").exists()
    assert images(agent) == []
    status = poll(agent, kernel.id)
    assert status["state"] == "running" and status["offloaded"] is True, status
    assert at_agent(agent, USER, kernel.id)["offloaded"] is True

    # Another user's requests find nothing; twice is a conflict; its signals wait.
    for op in ("offload", "reload"):
        other = agent.run_as("cedana-test2", op, {"kernel_id": kernel.id})
        assert other["error"]["code"] == "not_found", (op, other)
    again = agent.run_as(USER, "offload", {"kernel_id": kernel.id})
    assert again["error"]["code"] == "conflict", again
    sig = agent.run_as(USER, "signal", {"kernel_id": kernel.id, "signum": int(signal.SIGINT)})
    assert sig["error"]["code"] == "conflict" and "offloaded" in sig["error"]["message"], sig
    assert fake_gpu.timeline() == ["lock", "checkpoint"]

    reply = with_frames(agent, "reload", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    assert reply["result"]["gpu_memory_restored"] == KERNEL_GPU_MEM
    assert reply["result"]["gpu"]["pids"] == [pid]
    assert "gpu-restore" in reply["frames"], reply["frames"]
    assert fake_gpu.timeline() == ["lock", "checkpoint", "restore", "unlock"]
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    assert "offloaded" not in poll(agent, kernel.id)
    assert kernel.run("print(x + 1)").strip() == "42"
    again = agent.run_as(USER, "reload", {"kernel_id": kernel.id})
    assert again["error"]["code"] == "conflict", again


def test_a_reload_with_no_gpu_room_fails_and_it_stays_offloaded(
    gpu_agent: Agent, loose_kernels: list[Kernel], fake_gpu: FakeGpu
) -> None:
    agent = gpu_agent
    kernel, pid = gpu_kernel(agent, loose_kernels, fake_gpu)
    kernel.run("x = 41")
    assert agent.run_as(USER, "offload", {"kernel_id": kernel.id})["ok"]
    fake_gpu.add("proc", pid=1, dev=0, mem=TOTAL - KERNEL_GPU_MEM // 2)
    fake_gpu.clear_log()

    reply = agent.run_as(USER, "reload", {"kernel_id": kernel.id})
    assert reply["error"]["code"] == "failed", reply
    assert "GPU" in reply["error"]["message"] and "stays offloaded" in reply["error"]["message"]
    assert fake_gpu.timeline() == []  # the driver was not asked to restore
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"
    assert poll(agent, kernel.id)["offloaded"] is True
    assert Path(f"/proc/{pid}").exists()

    fake_gpu.update("proc", {"pid": 1}, mem=0)
    assert agent.run_as(USER, "reload", {"kernel_id": kernel.id})["ok"]
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert kernel.run("print(x + 1)").strip() == "42"


def test_an_offloaded_kernel_is_dumped_without_a_second_lock(
    gpu_agent: Agent, loose_kernels: list[Kernel], fake_gpu: FakeGpu
) -> None:
    """Its GPU memory is in its host memory already: CRIU dumps it as it is, and the
    restore puts it back on the GPU."""
    agent = gpu_agent
    kernel, pid = gpu_kernel(agent, loose_kernels, fake_gpu)
    kernel.run("x = 41")
    assert agent.run_as(USER, "offload", {"kernel_id": kernel.id})["ok"]
    reply = with_frames(agent, "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    assert reply["result"]["gpu_memory_freed"] == KERNEL_GPU_MEM
    assert "gpu-lock" not in reply["frames"], reply["frames"]
    assert fake_gpu.timeline() == ["lock", "checkpoint"]
    assert not Path(f"/proc/{pid}").exists()
    assert poll(agent, kernel.id)["state"] == "dumped"

    reply = agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    assert "offloaded" not in poll(agent, kernel.id)
    reconnect(kernel)
    assert kernel.run("print(x + 1)").strip() == "42"


def test_a_cpu_only_kernel_has_nothing_to_offload(
    gpu_agent: Agent, loose_kernels: list[Kernel], fake_gpu: FakeGpu
) -> None:
    from .test_launch import launch

    kernel, _ = launch(gpu_agent, loose_kernels, USER)
    kernel.run("x = 1")
    reply = gpu_agent.run_as(USER, "offload", {"kernel_id": kernel.id})
    assert reply["error"]["code"] == "conflict", reply
    assert "no GPU memory" in reply["error"]["message"], reply
    assert "offloaded" not in poll(gpu_agent, kernel.id)
