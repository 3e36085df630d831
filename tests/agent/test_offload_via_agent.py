"""The offload tier through the checkpoint agent: a REAL agent as root with REAL CRIU and
the REAL native CUDA helper, the TEST-ONLY fake driver libraries by root's setting
(`cuda_library`, as tests/agent/test_gpu_via_agent.py), cedana-test's kernel launched
through the agent: `offload` frees its GPU memory into its host memory and keeps the
process, `reload` puts it back."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest_gpu import FakeGpu, fake_gpu, gpu_build, nspid, wait_for

from .checkpoint_fixtures import configured_agent, loose_kernels
from .conftest import Agent
from .servers_on_agent import (
    UserServer,
    agent_images,
    alive,
    at_agent,
    eventually,
    kernel_tasks,
)
from .test_gpu_via_agent import (
    CHILD_CODE,
    CUDA_CHILD,
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


def test_a_users_server_offloads_through_the_agent_and_a_cell_reloads_it(
    gpu_agent: Agent, user_servers: Callable[..., UserServer], fake_gpu: FakeGpu
) -> None:
    """cedana-test's own server, no capability: REST `suspend?tier=offload` frees its
    kernel's GPU memory at the agent, the process kept; the next cell reloads it first."""
    agent = gpu_agent
    server = user_servers(USER)
    kid = server.start_kernel()
    setup = f"CODE = {CHILD_CODE!r}\nGPU_ID = {GPU_ID!r}\nx = 41\n" + CUDA_CHILD
    inner = int(server.output(kid, setup).strip())
    init, tasks = kernel_tasks(agent, USER, kid)
    host = [p for p in tasks if nspid(p) == inner]
    assert len(host) == 1, (inner, tasks)
    child = host[0]
    assert wait_for(
        lambda: any(
            (t / "comm").read_text().strip() == "cuda00001f00"
            for t in Path(f"/proc/{child}/task").iterdir()
        )
    )
    fake_gpu.add("proc", pid=child, dev=0, mem=KERNEL_GPU_MEM, id=GPU_ID, nspid=inner)
    fake_gpu.clear_log()

    path = f"api/cedana/kernels/{kid}/suspend?tier=offload"
    status, body = server.api("POST", path)
    assert status == 200, (status, body, server.log_tail())
    view = server.kernel(kid)
    assert view["state"] == "suspended" and view["tier"] == "offload", view
    assert gpu_free() == TOTAL
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"
    entry = at_agent(agent, USER, kid)
    assert entry["offloaded"] is True and entry["pid"] == init, entry
    assert Path(f"/proc/{child}").exists()
    assert agent_images(agent, USER) == []

    # No resume asked: the cell reloads it, its GPU memory back before it runs.
    assert server.output(kid, "print(x + 1, child.poll())").split() == ["42", "None"]
    assert server.kernel(kid)["state"] == "running"
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert int(fake_gpu.proc_by_id(GPU_ID)["pid"]) == child
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    assert fake_gpu.timeline() == ["lock", "checkpoint", "restore", "unlock"]
    assert "offloaded" not in at_agent(agent, USER, kid)
    assert server.criu_runs() == [], server.log_errors()

    # Shut down while offloaded: it has no image, its process is ended, as in-process.
    status, body = server.api("POST", path)
    assert status == 200, (status, body)
    status, body = server.api("DELETE", f"api/kernels/{kid}")
    assert status == 204, (status, body, server.log_errors())
    assert eventually(lambda: not alive(init)), at_agent(agent, USER, kid)
    assert not alive(child)
    assert agent_images(agent, USER) == []


def test_an_offloaded_kernel_that_dies_at_the_agent_is_seen_dead_by_its_server(
    gpu_agent: Agent, user_servers: Callable[..., UserServer], fake_gpu: FakeGpu
) -> None:
    """The process of an offloaded kernel is kept at the agent, as in-process: when it
    dies (killed here by root), the server's poll sees it, as for a running kernel, and
    the kernel is no longer said to be offloaded (jupyter_client's restarter then starts
    it again, as it does for any kernel that died)."""
    agent = gpu_agent
    server = user_servers(USER)
    kid = server.start_kernel()
    setup = f"CODE = {CHILD_CODE!r}\nGPU_ID = {GPU_ID!r}\nx = 41\n" + CUDA_CHILD
    inner = int(server.output(kid, setup).strip())
    init, tasks = kernel_tasks(agent, USER, kid)
    [child] = [p for p in tasks if nspid(p) == inner]
    fake_gpu.add("proc", pid=child, dev=0, mem=KERNEL_GPU_MEM, id=GPU_ID, nspid=inner)
    status, body = server.api("POST", f"api/cedana/kernels/{kid}/suspend?tier=offload")
    assert status == 200, (status, body, server.log_tail())
    assert server.kernel(kid)["tier"] == "offload"

    os.kill(init, signal.SIGKILL)
    assert eventually(lambda: server.kernel(kid).get("tier") != "offload"), server.kernel(kid)
    assert f"Offloaded kernel {kid} exited" in server.log_tail(), server.log_tail()
