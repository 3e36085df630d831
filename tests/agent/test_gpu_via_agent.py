"""GPU memory through the checkpoint agent: a REAL agent as root, with REAL CRIU and the
REAL native CUDA helper, the TEST-ONLY fake driver libraries chosen by root's setting
(`cuda_library` in the agent's checkpoint.json, tests/fakes/build) and nothing else:
the agent is started without LD_LIBRARY_PATH. The kernel is cedana-test's, launched
through the agent; its python process is the fake's CUDA process, named by
CEDANA_FAKE_GPU_ID and its namespace pid, which CRIU restores (as in
tests/test_gpu_integration.py; see tests/fakes/fakegpu_state.h)."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from tests.conftest_gpu import (
    BUILD,
    CUDA_ERROR_UNKNOWN,
    FakeGpu,
    GiB,
    fake_gpu,
    gpu_build,
    nspid,
    wait_for,
)
from tests.userserver import WAIT

from .checkpoint_fixtures import configured_agent, loose_kernels
from .conftest import USER_PYTHON, Agent
from .servers_on_agent import UserServer, agent_images, kernel_tasks
from .test_launch import Kernel, kernel_pid_of, launch

__all__ = ["configured_agent", "fake_gpu", "gpu_build", "loose_kernels"]  # fixtures

pytestmark = pytest.mark.criu

USER = "cedana-test"
GPU_ID = "agent-kernel-under-test"
KERNEL_GPU_MEM = GiB
TOTAL = 80 * GiB  # the fake's one H100

# What the CUDA driver starts in every CUDA process: a thread named cuda<hex> through
# which it restores the process's GPU memory (see tests/fakes/fakegpu_state.h).
RESTORE_THREAD = (
    "import ctypes, threading\n"
    "def _cuda_restore_thread():\n"
    "    ctypes.CDLL(None).prctl(15, b'cuda00001f00')\n"
    "    threading.Event().wait()\n"
    "threading.Thread(target=_cuda_restore_thread, daemon=True).start()\n"
)

# Run as the user: one request through the agent's client, with its progress frames.
WITH_FRAMES = """
import asyncio, json, sys
from jupyter_cedana.agent.client import AgentClient
from jupyter_cedana.agent.protocol import AgentError
async def main():
    frames = []
    async with await AgentClient.connect(sys.argv[1]) as agent:
        try:
            result = await agent.request(sys.argv[2], json.loads(sys.argv[3]), frames.append)
            out = {"ok": True, "result": result}
        except AgentError as e:
            out = {"ok": False, "error": e.to_json()}
    out["frames"] = [f.get("phase") for f in frames]
    print(json.dumps(out))
asyncio.run(main())
"""


def with_frames(agent: Agent, op: str, args: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [
            *("runuser", "-u", USER, "--", USER_PYTHON, "-c", WITH_FRAMES),
            *(str(agent.socket_path), op, json.dumps(args)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert out.stdout.strip(), out.stderr
    reply: dict[str, Any] = json.loads(out.stdout)
    return reply


def gpu_free() -> int:
    """Free memory of GPU 0 as NVML reports it (pynvml and the fake NVML)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def gpu_agent(
    fake_gpu: FakeGpu, configured_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> Agent:
    """An agent whose driver libraries are the fakes by root's setting alone; its log
    read as it comes (a full stderr pipe would stall it)."""
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    agent = configured_agent(
        {
            "cuda_library": str(BUILD),
            "cuda_lock_timeout_ms": 500,
            # the fake GPU memory must fit in this machine's host memory, without more
            "cuda_host_headroom_bytes": 0,
        }
    )
    stream = agent.proc.stderr
    assert stream is not None
    threading.Thread(target=lambda: deque(stream, maxlen=0), daemon=True).start()
    return agent


def fake_driver_log(fake: FakeGpu) -> list[str]:
    """Every call the fake libcuda logged, its loading (cuInit) included."""
    return fake.log_path.read_text().splitlines() if fake.log_path.exists() else []


def gpu_kernel(agent: Agent, kernels: list[Kernel], fake: FakeGpu) -> tuple[Kernel, int]:
    """cedana-test's kernel, holding KERNEL_GPU_MEM on the fake's GPU 0; its host pid."""
    kernel, init_pid = launch(agent, kernels, USER, env={"CEDANA_FAKE_GPU_ID": GPU_ID})
    kernel.run(RESTORE_THREAD)
    pid = kernel_pid_of(init_pid)
    assert wait_for(
        lambda: any(
            (t / "comm").read_text().strip() == "cuda00001f00"
            for t in Path(f"/proc/{pid}/task").iterdir()
        )
    )
    fake.add("proc", pid=pid, dev=0, mem=KERNEL_GPU_MEM, id=GPU_ID, nspid=nspid(pid))
    fake.clear_log()
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    return kernel, pid


def reconnect(kernel: Kernel) -> None:
    if kernel.client is not None:
        kernel.client.stop_channels()
        kernel.client = None


def images(agent: Agent) -> list[str]:
    return [i["kernel_id"] for i in agent.run_as(USER, "images")["result"]["images"]]


def test_dump_frees_the_gpu_and_restore_puts_it_back(
    gpu_agent: Agent, loose_kernels: list[Kernel], fake_gpu: FakeGpu
) -> None:
    agent = gpu_agent
    kernel, pid = gpu_kernel(agent, loose_kernels, fake_gpu)
    kernel.run("x = 41")

    reply = with_frames(agent, "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    result = reply["result"]
    assert result["gpu_memory_freed"] == KERNEL_GPU_MEM
    assert result["gpu"]["memory_bytes"] == KERNEL_GPU_MEM
    # The GPU phases come first, the image's after them (frames coalesce: CRIU's
    # "dumping" may be passed over by the next one when the dump is quick).
    frames = reply["frames"]
    assert frames[:2] == ["gpu-lock", "gpu-checkpoint"], frames
    assert frames[-1] == "committing", frames
    # Freed as NVML sees it; the driver holds the process checkpointed, and it is gone.
    assert gpu_free() == TOTAL
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"
    assert fake_gpu.timeline() == ["lock", "checkpoint"]
    assert not Path(f"/proc/{pid}").exists()
    # What the restore needs is in root's manifest of the image.
    manifest = json.loads(
        (agent.state_dir / "images" / "1001" / kernel.id / "manifest.json").read_text()
    )
    assert manifest["gpu"]["pids"] == [pid]
    assert manifest["gpu"]["memory_bytes"] == KERNEL_GPU_MEM

    # Another user can neither restore, discard nor see it.
    for op in ("restore", "discard", "dump"):
        other = agent.run_as("cedana-test2", op, {"kernel_id": kernel.id})
        assert other["error"]["code"] == "not_found", (op, other)
    assert agent.run_as("cedana-test2", "images")["result"]["images"] == []
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"

    fake_gpu.clear_log()
    reply = with_frames(agent, "restore", {"kernel_id": kernel.id, "lazy": True})
    assert reply["ok"], reply
    result = reply["result"]
    assert result["lazy"] is False  # a GPU kernel is restored whole
    assert result["gpu_memory_restored"] == KERNEL_GPU_MEM
    assert "gpu-restore" in reply["frames"]
    new_pid = kernel_pid_of(result["pid"])
    assert result["gpu"]["pids"] == [new_pid]
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert int(fake_gpu.proc_by_id(GPU_ID)["pid"]) == new_pid
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    assert fake_gpu.timeline() == ["restore", "unlock"]
    # Restored while the rest of the kernel was still stopped, as CRIU's cuda plugin does.
    assert any(c.startswith("restore ") and "frozen=1" in c for c in fake_gpu.calls())
    reconnect(kernel)
    assert kernel.run("print(x + 1)").strip() == "42"
    assert images(agent) == []


def test_cuda_checkpoint_failure_fails_the_dump_and_the_kernel_runs_on(
    gpu_agent: Agent, loose_kernels: list[Kernel], fake_gpu: FakeGpu
) -> None:
    agent = gpu_agent
    kernel, pid = gpu_kernel(agent, loose_kernels, fake_gpu)
    kernel.run("x = 41")
    fake_gpu.add("error", op="checkpoint", pid=0, code=CUDA_ERROR_UNKNOWN, times=1)

    reply = agent.run_as(USER, "dump", {"kernel_id": kernel.id})
    assert not reply.get("ok"), reply
    assert reply["error"]["code"] == "failed"
    assert "CUDA_ERROR_UNKNOWN" in reply["error"]["message"]
    # Rolled back: unlocked, its GPU memory where it was, no image, the same process.
    assert fake_gpu.timeline() == ["lock", "checkpoint!", "unlock"]
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    assert images(agent) == []
    assert Path(f"/proc/{pid}").exists()
    assert kernel.run("print(x + 1)").strip() == "42"
    # And it can still be suspended once the driver lets it.
    fake_gpu.clear_log()
    assert agent.run_as(USER, "dump", {"kernel_id": kernel.id})["ok"]
    assert fake_gpu.timeline() == ["lock", "checkpoint"]


def test_cuda_restore_failure_fails_the_restore_and_keeps_the_image(
    gpu_agent: Agent, loose_kernels: list[Kernel], fake_gpu: FakeGpu
) -> None:
    agent = gpu_agent
    kernel, _ = gpu_kernel(agent, loose_kernels, fake_gpu)
    kernel.run("x = 41")
    assert agent.run_as(USER, "dump", {"kernel_id": kernel.id})["ok"]
    fake_gpu.add("error", op="restore", pid=0, code=CUDA_ERROR_UNKNOWN, times=1)

    reply = agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert not reply.get("ok"), reply
    assert reply["error"]["code"] == "failed"
    assert "CUDA_ERROR_UNKNOWN" in reply["error"]["message"]
    # The image stays, the GPU stays free, and the restored tree is gone.
    assert images(agent) == [kernel.id]
    assert gpu_free() == TOTAL
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"
    # A retry restores it whole, with its GPU memory.
    reply = agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    reconnect(kernel)
    assert kernel.run("print(x + 1)").strip() == "42"


def test_no_gpu_room_refuses_the_restore_before_criu(
    gpu_agent: Agent, loose_kernels: list[Kernel], fake_gpu: FakeGpu
) -> None:
    """Admission: another process took the GPU meanwhile; nothing is restored, the image
    stays, and the restore works once there is room."""
    agent = gpu_agent
    kernel, _ = gpu_kernel(agent, loose_kernels, fake_gpu)
    assert agent.run_as(USER, "dump", {"kernel_id": kernel.id})["ok"]
    fake_gpu.add("proc", pid=1, dev=0, mem=TOTAL - KERNEL_GPU_MEM // 2)
    fake_gpu.clear_log()
    reply = agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert not reply.get("ok"), reply
    assert "GPU" in reply["error"]["message"], reply
    assert fake_gpu.timeline() == []  # the driver was not asked to restore
    assert images(agent) == [kernel.id]
    fake_gpu.update("proc", {"pid": 1}, mem=0)
    assert agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})["ok"]
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"


# A process of the kernel's that is the fake's CUDA process (a DataLoader worker, a
# `!python train.py`): started from a cell with its own CEDANA_FAKE_GPU_ID, as the
# server gives the kernel no environment of the test's.
CUDA_CHILD = (
    "import os, subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', CODE],\n"
    "                         env={**os.environ, 'CEDANA_FAKE_GPU_ID': GPU_ID})\n"
    "print(child.pid)\n"
)
CHILD_CODE = RESTORE_THREAD + "threading.Event().wait()\n"


async def suspended_event(server: UserServer, kid: str) -> dict[str, Any]:
    """Suspend through REST, listening to the server's events meanwhile: the kernel's
    `suspended` event."""
    url = server.url.replace("http://", "ws://") + "api/events/subscribe"
    headers = {"Authorization": f"token {server.token}"}
    ws = await websocket_connect(HTTPRequest(url, headers=headers, connect_timeout=WAIT))
    try:
        path = f"api/cedana/kernels/{kid}/suspend"
        status, body = await asyncio.to_thread(server.api, "POST", path)
        assert status == 200, (status, body, server.log_tail())
        while True:
            raw = await asyncio.wait_for(ws.read_message(), WAIT)
            assert raw is not None, "the events websocket closed"
            event: dict[str, Any] = json.loads(raw)
            if event.get("kernel_id") == kid and event.get("action") == "suspended":
                return event
    finally:
        ws.close()


def test_a_users_server_suspends_and_resumes_a_gpu_kernel_through_the_agent(
    gpu_agent: Agent, user_servers: Callable[..., UserServer], fake_gpu: FakeGpu
) -> None:
    """cedana-test's own server, no capability, no CRIU: its kernel's GPU memory is freed
    by a suspend and back after the cell that resumes it, and REST says so as for a root
    server (gpu_memory_freed)."""
    agent = gpu_agent
    server = user_servers(USER)
    kid = server.start_kernel()
    setup = f"CODE = {CHILD_CODE!r}\nGPU_ID = {GPU_ID!r}\nx = 41\n" + CUDA_CHILD
    inner = int(server.output(kid, setup).strip())
    _, tasks = kernel_tasks(agent, USER, kid)
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
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM

    event = asyncio.run(suspended_event(server, kid))
    # What the server tells of the suspend (its event, as for a root server's kernel).
    assert event["gpu_memory_freed_bytes"] == KERNEL_GPU_MEM, event
    assert event["tier"] == "disk", event
    assert server.kernel(kid)["state"] == "suspended"
    assert gpu_free() == TOTAL
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"
    assert [i["kernel_id"] for i in agent_images(agent, USER)] == [kid]

    # No resume asked: the cell resumes it, its GPU memory back before it runs.
    assert server.output(kid, "print(x + 1, child.poll())").split() == ["42", "None"]
    assert server.kernel(kid)["state"] == "running"
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    assert fake_gpu.timeline() == ["lock", "checkpoint", "restore", "unlock"]
    assert agent_images(agent, USER) == []
    assert server.criu_runs() == [], server.log_errors()


def test_driver_libraries_are_roots_choice_not_the_callers(
    fake_gpu: FakeGpu,
    configured_agent: Callable[..., Agent],
    loose_kernels: list[Kernel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without `cuda_library` the agent loads the system's driver (none here): a caller
    naming the fakes in its kernel's environment does not make the agent load them."""
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    agent = configured_agent({"cuda_host_headroom_bytes": 0})
    env = {"CEDANA_LIBCUDA": str(BUILD / "libcuda.so.1"), "LD_LIBRARY_PATH": str(BUILD)}
    kernel, _ = launch(agent, loose_kernels, USER, env=env)
    kernel.run("x = 1")
    reply = agent.run_as(USER, "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    assert "gpu" not in reply["result"]
    assert fake_driver_log(fake_gpu) == []  # the fake libcuda was never even loaded


def test_a_driver_directory_others_can_change_is_refused(
    fake_gpu: FakeGpu,
    configured_agent: Callable[..., Agent],
    loose_kernels: list[Kernel],
    monkeypatch: pytest.MonkeyPatch,
    agent_base: Path,
) -> None:
    """The agent loads the driver libraries as root: a directory a user could change is
    refused (the dump too), and the kernel runs on untouched."""
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    theirs = agent_base / "users-driver"
    theirs.mkdir()
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        shutil.copy2(BUILD / name, theirs / name)
    entry = pwd.getpwnam(USER)
    os.chown(theirs, entry.pw_uid, entry.pw_gid)
    agent = configured_agent({"cuda_library": str(theirs), "cuda_host_headroom_bytes": 0})
    kernel, pid = gpu_kernel(agent, loose_kernels, fake_gpu)
    kernel.run("x = 41")
    reply = agent.run_as(USER, "dump", {"kernel_id": kernel.id})
    assert reply["error"]["code"] == "refused", reply
    assert "CUDA driver library directory" in reply["error"]["message"], reply
    assert fake_driver_log(fake_gpu) == []
    assert fake_gpu.proc_by_id(GPU_ID).get("state", "running") == "running"  # untouched
    assert images(agent) == []
    assert Path(f"/proc/{pid}").exists()
    assert kernel.run("print(x + 1)").strip() == "42"


def quota_agent(configured_agent: Callable[..., Agent]) -> Agent:
    """The GPU agent with a quota no image fits: the dump fails after CRIU ran."""
    return configured_agent(
        {"cuda_library": str(BUILD), "cuda_host_headroom_bytes": 0, "quota_bytes": 1}
    )


def test_a_failed_criu_dump_puts_the_gpu_memory_back(
    fake_gpu: FakeGpu,
    configured_agent: Callable[..., Agent],
    loose_kernels: list[Kernel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    agent = quota_agent(configured_agent)
    kernel, pid = gpu_kernel(agent, loose_kernels, fake_gpu)
    kernel.run("x = 41")
    reply = agent.run_as(USER, "dump", {"kernel_id": kernel.id})
    assert reply["error"]["code"] == "refused" and "quota" in reply["error"]["message"], reply
    # Checkpointed for CRIU, then restored and unlocked into the continued kernel.
    assert fake_gpu.timeline() == ["lock", "checkpoint", "restore", "unlock"]
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "running"
    assert int(fake_gpu.proc_by_id(GPU_ID)["pid"]) == pid
    assert gpu_free() == TOTAL - KERNEL_GPU_MEM
    assert images(agent) == []
    assert kernel.run("print(x + 1)").strip() == "42"
    assert "note" not in agent.run_as(USER, "poll", {"kernel_id": kernel.id})["result"]


def test_gpu_memory_not_put_back_is_said(
    fake_gpu: FakeGpu,
    configured_agent: Callable[..., Agent],
    loose_kernels: list[Kernel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dump failed and so did the restore that puts the GPU memory back: the kernel
    runs, its GPU memory safe in host memory, and the reply and `poll` say so."""
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    agent = quota_agent(configured_agent)
    kernel, pid = gpu_kernel(agent, loose_kernels, fake_gpu)
    fake_gpu.add("error", op="restore", pid=0, code=CUDA_ERROR_UNKNOWN, times=1)
    reply = agent.run_as(USER, "dump", {"kernel_id": kernel.id})
    assert "quota" in reply["error"]["message"], reply
    assert "stays in host memory" in reply["error"]["message"], reply
    assert fake_gpu.timeline() == ["lock", "checkpoint", "restore!"]
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "checkpointed"
    assert gpu_free() == TOTAL
    status = agent.run_as(USER, "poll", {"kernel_id": kernel.id})["result"]
    assert status["state"] == "running", status
    assert "GPU memory was not put back" in status["note"], status
    assert Path(f"/proc/{pid}").exists()
