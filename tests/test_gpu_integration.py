"""The GPU path end to end: REAL ipykernel kernels under the REAL CedanaProvisioner, dumped
and restored by REAL CRIU, with the TEST-ONLY fake libcuda (loaded by the real native
helper) and fake NVML (loaded by pynvml) standing in for the driver.

The kernel process (the python child of cedana-init) is the fake's CUDA process. It is
started with CEDANA_FAKE_GPU_ID in its environment, and its fake record names it by that
id and its pid inside its PID namespace, both of which CRIU restores: so after a disk
restore, which gives the kernel a new host pid, the fake still knows the restored process
is the checkpointed one, as the real driver does (it keeps that state in the process's
memory). See tests/fakes/fakegpu_state.h, "Process identity across a CRIU restore".
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.checkpoint.proctree import process_tree
from jupyter_cedana.errors import (
    Conflict,
    GpuError,
    InsufficientGpuMemory,
    InsufficientHostMemory,
    NotCheckpointable,
    SuspendFailed,
)
from jupyter_cedana.server.kernel.provisioner import KernelState
from jupyter_cedana.server.manager import SuspendManager
from jupyter_cedana.server.policy import SuspendPolicy
from tests.conftest import exited, run, wait_iopub

from .conftest_gpu import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OPERATING_SYSTEM,
    CUDA_ERROR_UNKNOWN,
    FAKE_LIBCUDA,
    FAKE_OLD_LIBCUDA,
    H100,
    HELPER,
    UUID0,
    UUID1,
    UUID2,
    FakeGpu,
    GiB,
    fake_gpu,
    gpu_build,
    nspid,
    wait_for,
)

__all__ = ["fake_gpu", "gpu_build"]  # fixtures used by name

pytestmark = pytest.mark.criu

GPU_ID = "kernel-under-test"
KERNEL_GPU_MEM = 2 * GiB
A100 = "NVIDIA A100-SXM4-80GB"


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def libcuda() -> Path:
    """The driver library the helper loads (parametrize to use the old-driver fake)."""
    return FAKE_LIBCUDA


@pytest.fixture
def engine_config(
    checkpoint_root: Path, fake_gpu: FakeGpu, libcuda: Path, monkeypatch: pytest.MonkeyPatch
) -> Config:
    """Overrides conftest's: the engine with GPU checkpointing through the fakes. The
    kernel fixture starts the kernel with os.environ, hence with CEDANA_FAKE_GPU_ID."""
    monkeypatch.setenv("CEDANA_FAKE_GPU_ID", GPU_ID)
    c = Config()
    c.CheckpointEngine.checkpoint_root = str(checkpoint_root)
    c.CudaCheckpointer.helper_path = str(HELPER)
    c.CudaCheckpointer.libcuda_path = str(libcuda)
    c.CudaCheckpointer.lock_timeout_ms = 500
    # the fake GPU memory must fit in this machine's host memory, without more headroom
    c.CudaCheckpointer.host_memory_headroom_bytes = 0
    return c


@pytest.fixture(autouse=True)
async def _stop_gpu_helper() -> AsyncIterator[None]:
    """Stop the engine's CUDA helper after the kernel is gone (autouse: torn down last)."""
    yield
    if CheckpointEngine.initialized():
        await CheckpointEngine.instance().close()


@pytest.fixture
def spy(fake_gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    """Mark CRIU's dump and restore in the fake's call log, with the fake CUDA state of
    the kernel at that moment, so tests can check the order of GPU and CRIU steps."""
    dump, start, wait = (
        CheckpointEngine.dump,
        CheckpointEngine.start_restore,
        CheckpointEngine.wait_restored,
    )

    def gpu_state() -> str:
        try:
            return fake_gpu.proc_by_id(GPU_ID)["state"]
        except KeyError:
            return "none"

    async def spy_dump(self: Any, *a: Any, **kw: Any) -> float:
        fake_gpu.mark(f"criu-dump gpu={gpu_state()}")
        return await dump(self, *a, **kw)

    def spy_start(self: Any, *a: Any, **kw: Any) -> Any:
        fake_gpu.mark(f"criu-restore gpu={gpu_state()}")
        return start(self, *a, **kw)

    async def spy_wait(self: Any, *a: Any, **kw: Any) -> int:
        pid = await wait(self, *a, **kw)
        fake_gpu.mark(f"criu-restored gpu={gpu_state()}")
        return pid

    monkeypatch.setattr(CheckpointEngine, "dump", spy_dump)
    monkeypatch.setattr(CheckpointEngine, "start_restore", spy_start)
    monkeypatch.setattr(CheckpointEngine, "wait_restored", spy_wait)
    return fake_gpu


def kernel_process(km: Any) -> int:
    """Host pid of the python kernel: the child of cedana-init."""
    init = km.provisioner.pid
    kids = wait_for(lambda: sorted(process_tree(init) - {init}), timeout=10)
    assert kids, "the kernel process is missing"
    return kids[0]


# What the CUDA driver starts in every CUDA process: a thread named cuda<hex> through
# which it restores the process's GPU memory (see tests/fakes/fakegpu_state.h).
RESTORE_THREAD = (
    "import ctypes, threading\n"
    "def _cuda_restore_thread():\n"
    "    ctypes.CDLL(None).prctl(15, b'cuda00001f00')\n"
    "    threading.Event().wait()\n"
    "threading.Thread(target=_cuda_restore_thread, daemon=True).start()\n"
)


@pytest.fixture
async def gpu_kernel(kernel: Any, fake_gpu: FakeGpu) -> Any:
    """A kernel whose python process holds 2 GiB on GPU 0 of the fake."""
    reply, out = await run(kernel.test_client, RESTORE_THREAD)
    assert reply["status"] == "ok", out
    pid = kernel_process(kernel)
    assert wait_for(
        lambda: any(
            (t / "comm").read_text().strip() == "cuda00001f00"
            for t in Path(f"/proc/{pid}/task").iterdir()
        )
    )
    assert f"CEDANA_FAKE_GPU_ID={GPU_ID}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    fake_gpu.add("proc", pid=pid, dev=0, mem=KERNEL_GPU_MEM, id=GPU_ID, nspid=nspid(pid))
    fake_gpu.clear_log()
    kernel.gpu_pid = pid
    return kernel


def gpu_free(fake_gpu: FakeGpu, index: int = 0) -> int:
    """Free memory of a GPU as NVML reports it (through pynvml and the fake NVML)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
    finally:
        pynvml.nvmlShutdown()


def kernel_gpu_use(km: Any) -> list[dict[str, Any]]:
    """What the engine's GPU monitor attributes to the kernel's process tree now."""
    monitor = km.provisioner.engine.gpu_monitor()
    return [u.to_json() for u in monitor.usage(process_tree(km.provisioner.pid))]


def images(checkpoint_root: Path) -> list[Path]:
    if not checkpoint_root.exists():
        return []
    return [p for p in checkpoint_root.iterdir() if not p.name.startswith(".")]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X", "T")
    except FileNotFoundError:
        return False


async def assert_kernel_answers(km: Any, code: str, expect: str) -> None:
    await wait_iopub(km.test_client)
    reply, out = await run(km.test_client, code)
    assert reply["status"] == "ok", out
    assert out.strip() == expect


# ---- offload tier -----------------------------------------------------------------------


async def test_offload_tier(gpu_kernel: Any, fake_gpu: FakeGpu, checkpoint_root: Path) -> None:
    km, pid = gpu_kernel, gpu_kernel.gpu_pid
    prov = km.provisioner
    reply, _ = await run(km.test_client, "x = 41")
    assert reply["status"] == "ok"
    assert gpu_free(fake_gpu) == 80 * GiB - KERNEL_GPU_MEM
    assert [u["memory_bytes"] for u in kernel_gpu_use(km)] == [KERNEL_GPU_MEM]

    result = await prov.suspend(tier="offload")
    assert result["state"] == "suspended" and result["tier"] == "offload"
    assert result["gpu_memory_freed"] == KERNEL_GPU_MEM
    assert result["checkpoint_bytes"] == 0
    # the GPU is free as NVML sees it; the process stays, with the same pid
    assert gpu_free(fake_gpu) == 80 * GiB
    assert kernel_gpu_use(km) == []
    assert alive(pid) and prov.pid and alive(prov.pid)
    assert fake_gpu.proc(pid)["state"] == "checkpointed"
    assert images(checkpoint_root) == []  # nothing on disk
    assert await prov.poll() is None and await km.is_alive()
    assert fake_gpu.timeline() == ["lock", "checkpoint"]
    with pytest.raises(Conflict, match="already suspended"):
        await prov.suspend(tier="offload")

    result = await prov.resume()
    assert result["state"] == "running" and result["tier"] is None
    assert fake_gpu.timeline() == ["lock", "checkpoint", "restore", "unlock"]
    assert fake_gpu.proc(pid)["state"] == "running"
    assert gpu_free(fake_gpu) == 80 * GiB - KERNEL_GPU_MEM
    assert kernel_process(km) == pid  # the same process throughout
    await assert_kernel_answers(km, "print(x + 1)", "42")


# ---- disk tier --------------------------------------------------------------------------


async def test_disk_tier_with_gpu(gpu_kernel: Any, spy: FakeGpu, checkpoint_root: Path) -> None:
    km, old_pid = gpu_kernel, gpu_kernel.gpu_pid
    prov = km.provisioner
    reply, _ = await run(km.test_client, "import numpy as np; a = np.arange(10); x = 41")
    assert reply["status"] == "ok"

    result = await prov.suspend(tier="disk")
    assert result["state"] == "suspended" and result["tier"] == "disk"
    assert result["gpu_memory_freed"] == KERNEL_GPU_MEM
    # lock -> checkpoint (GPU freed) -> CRIU dump, then the process is gone
    assert spy.timeline() == ["lock", "checkpoint", "criu-dump gpu=checkpointed"]
    assert not alive(old_pid)
    assert gpu_free(spy) == 80 * GiB
    manifest = json.loads((checkpoint_root / km.kernel_id / "manifest.json").read_text())
    gpu = manifest["gpu"]
    assert gpu["pids"] == [old_pid]
    assert gpu["memory_bytes"] == KERNEL_GPU_MEM == gpu["bytes_freed"]
    assert [(d["uuid"], d["name"], d["memory_bytes"]) for d in gpu["devices"]] == [
        (UUID0, H100, KERNEL_GPU_MEM)
    ]
    assert gpu["driver_version"] == 12080

    spy.clear_log()
    result = await prov.resume()
    assert result["state"] == "running"
    # CRIU restore -> CUDA restore -> unlock, into the restored process's new host pid
    assert spy.timeline() == [
        "criu-restore gpu=checkpointed",
        "criu-restored gpu=checkpointed",
        "restore",
        "unlock",
    ]
    new_pid = kernel_process(km)
    assert new_pid != old_pid
    assert nspid(new_pid) == nspid(prov.pid) + 1 == 2  # same inner pid, new namespace
    rec = spy.proc_by_id(GPU_ID)
    assert (rec["pid"], rec["state"], rec["dev"]) == (str(new_pid), "running", "0")
    # the GPU memory went back while the restored kernel was still stopped (all its
    # threads but the driver's restore thread), as CRIU's cuda plugin does it: nothing
    # of the kernel ran before its device memory was back
    (restore,) = [c for c in spy.calls() if c.startswith("restore ")]
    assert restore.startswith(f"restore pid={new_pid} rc=0 by=cedana-cuda frozen=1")
    # the GPU memory is back, attributed to the restored kernel
    assert gpu_free(spy) == 80 * GiB - KERNEL_GPU_MEM
    use = kernel_gpu_use(km)
    assert [(u["uuid"], u["memory_bytes"], u["pids"]) for u in use] == [
        (UUID0, KERNEL_GPU_MEM, [new_pid])
    ]
    await assert_kernel_answers(km, "print(x + 1, a.sum())", "42 45")


async def test_offload_then_disk(gpu_kernel: Any, spy: FakeGpu, checkpoint_root: Path) -> None:
    """An offloaded kernel goes to disk (the policy's second timeout) and comes back."""
    km, old_pid = gpu_kernel, gpu_kernel.gpu_pid
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    states: list[tuple[str, str | None]] = []

    def on_change(p: Any, what: str) -> None:
        if what == "state":
            states.append((p.state.value, p.tier))

    prov.add_listener(on_change)

    await prov.suspend(tier="offload")
    assert prov.tier == "offload" and alive(old_pid)
    result = await prov.suspend(tier="disk")
    assert result["state"] == "suspended" and result["tier"] == "disk"
    assert result["gpu_memory_freed"] == KERNEL_GPU_MEM
    assert states == [
        ("suspending", None),
        ("suspended", "offload"),
        ("suspending", "offload"),
        ("suspended", "disk"),
    ]
    # not locked or checkpointed twice: the dump took the offloaded process as it was
    assert spy.timeline() == ["lock", "checkpoint", "criu-dump gpu=checkpointed"]
    assert not alive(old_pid)
    manifest = json.loads((checkpoint_root / km.kernel_id / "manifest.json").read_text())
    assert manifest["gpu"]["pids"] == [old_pid]
    assert manifest["gpu"]["memory_bytes"] == KERNEL_GPU_MEM

    await prov.resume()
    assert spy.timeline()[3:] == [
        "criu-restore gpu=checkpointed",
        "criu-restored gpu=checkpointed",
        "restore",
        "unlock",
    ]
    assert spy.proc_by_id(GPU_ID)["state"] == "running"
    assert gpu_free(spy) == 80 * GiB - KERNEL_GPU_MEM
    await assert_kernel_answers(km, "print(x + 1)", "42")


# ---- restore admission ------------------------------------------------------------------


async def test_admission_keeps_kernel_suspended(
    gpu_kernel: Any, spy: FakeGpu, checkpoint_root: Path
) -> None:
    km = gpu_kernel
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    await prov.suspend(tier="disk")
    spy.clear_log()
    # another tenant took the GPU meanwhile: 1 GiB free, the kernel needs 2
    spy.update("device", {"index": 0}, reserved=79 * GiB)

    with pytest.raises(InsufficientGpuMemory, match="stays suspended"):
        await prov.resume()
    assert prov.state == KernelState.suspended and prov.tier == "disk"
    assert "Not enough free GPU memory" in (prov.reason or "")
    assert (checkpoint_root / km.kernel_id / "manifest.json").exists()
    assert spy.timeline() == []  # no CRIU restore, no CUDA restore
    assert spy.proc_by_id(GPU_ID)["state"] == "checkpointed"
    assert await prov.poll() is None and await km.is_alive()

    spy.update("device", {"index": 0}, reserved=0)
    await prov.resume()
    assert prov.state == KernelState.running and prov.reason is None
    assert spy.timeline()[-2:] == ["restore", "unlock"]
    assert gpu_free(spy) == 80 * GiB - KERNEL_GPU_MEM
    await assert_kernel_answers(km, "print(x + 1)", "42")


async def test_admission_after_offload(gpu_kernel: Any, fake_gpu: FakeGpu) -> None:
    """The offload tier's resume checks too: the process stays offloaded and usable."""
    km = gpu_kernel
    prov = km.provisioner
    await prov.suspend(tier="offload")
    fake_gpu.update("device", {"index": 0}, reserved=79 * GiB)
    with pytest.raises(InsufficientGpuMemory):
        await prov.resume()
    assert prov.state == KernelState.suspended and prov.tier == "offload"
    assert fake_gpu.proc(km.gpu_pid)["state"] == "checkpointed"
    assert fake_gpu.timeline() == ["lock", "checkpoint"]
    fake_gpu.update("device", {"index": 0}, reserved=0)
    await prov.resume()
    assert fake_gpu.proc(km.gpu_pid)["state"] == "running"
    await assert_kernel_answers(km, "print('back')", "back")


async def test_restore_remaps_to_same_model(
    gpu_kernel: Any, fake_gpu: FakeGpu, checkpoint_root: Path
) -> None:
    km = gpu_kernel
    prov = km.provisioner
    fake_gpu.add("device", index=1, uuid=UUID1, total=80 * GiB, reserved=0, name=H100)
    # more room, but another model: never a target
    fake_gpu.add("device", index=2, uuid=UUID2, total=160 * GiB, reserved=0, name=A100)
    await run(km.test_client, "x = 41")
    await prov.suspend(tier="disk")
    fake_gpu.update("device", {"index": 0}, reserved=79 * GiB)
    fake_gpu.clear_log()

    await prov.resume()
    calls = [c for c in fake_gpu.calls() if c.startswith("restore ")]
    assert len(calls) == 1 and f"pairs={UUID0}>{UUID1}" in calls[0] and " rc=0" in calls[0]
    assert fake_gpu.proc_by_id(GPU_ID)["dev"] == "1"
    assert gpu_free(fake_gpu, 1) == 80 * GiB - KERNEL_GPU_MEM
    assert [(u["uuid"], u["memory_bytes"]) for u in kernel_gpu_use(km)] == [(UUID1, KERNEL_GPU_MEM)]
    await assert_kernel_answers(km, "print(x + 1)", "42")


async def test_no_gpu_of_the_same_model(gpu_kernel: Any, fake_gpu: FakeGpu) -> None:
    km = gpu_kernel
    fake_gpu.add("device", index=1, uuid=UUID2, total=160 * GiB, reserved=0, name=A100)
    await km.provisioner.suspend(tier="disk")
    fake_gpu.update("device", {"index": 0}, reserved=79 * GiB)
    with pytest.raises(InsufficientGpuMemory, match=f"no other {H100} has room"):
        await km.provisioner.resume()
    assert km.provisioner.state == KernelState.suspended


# ---- preflight refusals -----------------------------------------------------------------


async def assert_refused_and_running(
    km: Any, fake_gpu: FakeGpu, checkpoint_root: Path, pids: set[int]
) -> None:
    prov = km.provisioner
    assert prov.state == KernelState.running and prov.tier is None
    assert process_tree(prov.pid) == pids and all(alive(p) for p in pids)
    assert images(checkpoint_root) == []
    assert fake_gpu.proc_by_id(GPU_ID).get("state", "running") == "running"
    assert await prov.poll() is None
    await assert_kernel_answers(km, "print(x + 1)", "42")


async def test_preflight_several_cuda_processes(
    gpu_kernel: Any, fake_gpu: FakeGpu, checkpoint_root: Path
) -> None:
    km = gpu_kernel
    prov = km.provisioner
    reply, _ = await run(
        km.test_client, "import subprocess; child = subprocess.Popen(['sleep', '600']); x = 41"
    )
    assert reply["status"] == "ok"
    pids = wait_for(lambda: len(t := process_tree(prov.pid)) == 3 and t, timeout=10)
    (child,) = pids - {prov.pid, km.gpu_pid}
    fake_gpu.add("proc", pid=child, dev=0, mem=GiB)  # e.g. a DataLoader worker on the GPU

    for tier in ("disk", "offload"):
        with pytest.raises(NotCheckpointable, match="several processes") as info:
            await prov.suspend(tier=tier)
        assert str(child) in info.value.message
        assert "several processes" in (prov.reason or "")
        assert fake_gpu.timeline() == []  # refused before anything was locked
        await assert_refused_and_running(km, fake_gpu, checkpoint_root, pids)
    await run(km.test_client, "child.kill(); child.wait()")


@pytest.mark.parametrize("libcuda", [FAKE_OLD_LIBCUDA])
async def test_preflight_driver_without_checkpoint_api(
    gpu_kernel: Any, fake_gpu: FakeGpu, checkpoint_root: Path
) -> None:
    """A pre-r570 driver has no checkpoint API: a kernel holding GPU memory must not be
    dumped without it (its GPU memory would be lost)."""
    km = gpu_kernel
    prov = km.provisioner
    fake_gpu.update("driver", {}, version="550.54.15", cuda=12040)
    await run(km.test_client, "x = 41")
    pids = process_tree(prov.pid)
    with pytest.raises(NotCheckpointable, match=r"CUDA 12\.4.*r570"):
        await prov.suspend(tier="disk")
    assert "r570" in (prov.reason or "")
    with pytest.raises(Conflict, match="r570"):
        await prov.suspend(tier="offload")
    await assert_refused_and_running(km, fake_gpu, checkpoint_root, pids)
    manager = SuspendManager(engine=prov.engine, policy=SuspendPolicy())
    manager.gpu_monitor = prov.engine.gpu_monitor()
    gpu = manager.status()["gpu"]
    assert gpu["available"] is True and gpu["checkpoint"] is False
    assert "cannot be checkpointed" in gpu["reason"] and "r570" in gpu["reason"]


async def test_preflight_driver_api_too_old(
    gpu_kernel: Any, fake_gpu: FakeGpu, checkpoint_root: Path
) -> None:
    km = gpu_kernel
    await run(km.test_client, "x = 41")
    fake_gpu.update("driver", {}, version="560.35.03", cuda=12060)
    pids = process_tree(km.provisioner.pid)
    with pytest.raises(NotCheckpointable, match=r"12\.6 is older than 12\.8"):
        await km.provisioner.suspend(tier="disk")
    assert fake_gpu.timeline() == []
    await assert_refused_and_running(km, fake_gpu, checkpoint_root, pids)


# ---- failures after lock ----------------------------------------------------------------


@pytest.mark.parametrize("tier", ["disk", "offload"])
async def test_lock_timeout_keeps_kernel_running(
    gpu_kernel: Any, fake_gpu: FakeGpu, checkpoint_root: Path, tier: str
) -> None:
    km = gpu_kernel
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    pids = process_tree(prov.pid)
    fake_gpu.add("error", op="lock", pid=0, code=CUDA_ERROR_NOT_READY, times=1)
    with pytest.raises(GpuError, match="timed out after 500 ms") as info:
        await prov.suspend(tier=tier)
    assert "keeps running" in info.value.message
    assert "timed out" in (prov.reason or "")
    assert fake_gpu.timeline() == ["lock!"]
    await assert_refused_and_running(km, fake_gpu, checkpoint_root, pids)
    # the next try, with the GPU work done, goes through
    await prov.suspend(tier=tier)
    assert any(c.startswith("lock ") and "timeout_ms=500" in c for c in fake_gpu.calls())
    await prov.resume()
    await assert_kernel_answers(km, "print(x)", "41")


async def test_checkpoint_error_after_lock_unlocks(
    gpu_kernel: Any, spy: FakeGpu, checkpoint_root: Path
) -> None:
    km = gpu_kernel
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    pids = process_tree(prov.pid)
    spy.add("error", op="checkpoint", pid=0, code=CUDA_ERROR_UNKNOWN, times=1)
    with pytest.raises(GpuError, match="put back to running"):
        await prov.suspend(tier="disk")
    assert spy.timeline() == ["lock", "checkpoint!", "unlock"]  # no CRIU dump
    assert gpu_free(spy) == 80 * GiB - KERNEL_GPU_MEM
    await assert_refused_and_running(km, spy, checkpoint_root, pids)


async def make_criu_refuse(km: Any) -> None:
    """The kernel holds a deleted file bigger than the ghost limit: CRIU refuses to dump it
    (and x = 41)."""
    km.provisioner.engine.ghost_limit = 1 << 20
    reply, out = await run(
        km.test_client,
        "import os, tempfile; g = tempfile.NamedTemporaryFile(dir='.', delete=False); "
        "g.write(b'x' * (2 << 20)); g.flush(); os.unlink(g.name); x = 41",
    )
    assert reply["status"] == "ok", out


async def test_dump_failure_after_gpu_checkpoint_restores_gpu(
    gpu_kernel: Any, spy: FakeGpu, checkpoint_root: Path
) -> None:
    """CRIU fails after the GPU memory was checkpointed: the GPU memory goes back and the
    kernel runs on (a deleted open file over the ghost limit makes CRIU refuse)."""
    km = gpu_kernel
    prov = km.provisioner
    await make_criu_refuse(km)
    pids = process_tree(prov.pid)
    with pytest.raises(SuspendFailed, match="CRIU dump failed"):
        await prov.suspend(tier="disk")
    assert spy.timeline() == [
        "lock",
        "checkpoint",
        "criu-dump gpu=checkpointed",
        "restore",
        "unlock",
    ]
    assert gpu_free(spy) == 80 * GiB - KERNEL_GPU_MEM
    await assert_refused_and_running(km, spy, checkpoint_root, pids)


async def test_gpu_restore_failure_keeps_image_and_retry_works(
    gpu_kernel: Any, spy: FakeGpu, checkpoint_root: Path
) -> None:
    """CRIU restored the process but the driver failed to restore its GPU memory: the
    restored process is killed (it must not run without its GPU memory), the image is
    kept, and a retry restores into yet another host pid."""
    km = gpu_kernel
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    await prov.suspend(tier="disk")
    spy.clear_log()
    spy.add("error", op="restore", pid=0, code=CUDA_ERROR_UNKNOWN, times=1)
    with pytest.raises(GpuError, match="CUDA_ERROR_UNKNOWN"):
        await prov.resume()
    assert prov.state == KernelState.failed
    assert (checkpoint_root / km.kernel_id / "manifest.json").exists()
    first = int(spy.proc_by_id(GPU_ID)["pid"])
    assert not alive(first)
    assert spy.proc_by_id(GPU_ID)["state"] == "checkpointed"
    assert await prov.poll() is None

    await prov.resume()
    assert prov.state == KernelState.running
    second = kernel_process(km)
    assert second != first and spy.proc_by_id(GPU_ID)["pid"] == str(second)
    assert spy.timeline()[-2:] == ["restore", "unlock"]
    await assert_kernel_answers(km, "print(x + 1)", "42")


# ---- CPU kernels, no GPU ----------------------------------------------------------------


@pytest.mark.parametrize(
    "answer", [CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OPERATING_SYSTEM]
)
async def test_cpu_kernel_next_to_a_gpu(
    kernel: Any, spy: FakeGpu, checkpoint_root: Path, answer: int
) -> None:
    """A kernel that holds no GPU memory on a machine with a (fake) GPU, whichever error
    the driver gives for processes without CUDA (the header leaves it open)."""
    spy.update("driver", {}, noncuda=answer)
    prov = kernel.provisioner
    await run(kernel.test_client, "x = 41")
    pids = process_tree(prov.pid)
    with pytest.raises(Conflict, match="holds no GPU memory"):
        await prov.suspend(tier="offload")
    assert prov.state == KernelState.running and "no GPU memory" in (prov.reason or "")
    assert process_tree(prov.pid) == pids

    result = await prov.suspend(tier="disk")
    assert result["tier"] == "disk" and result["gpu_memory_freed"] == 0
    manifest = json.loads((checkpoint_root / kernel.kernel_id / "manifest.json").read_text())
    assert manifest["gpu"] is None
    await prov.resume()
    assert [t for t in spy.timeline() if not t.startswith("criu")] == []
    assert any(f"rc={answer} " in c for c in spy.calls())  # the driver was asked
    await assert_kernel_answers(kernel, "print(x + 1)", "42")


async def test_status_without_any_gpu(
    gpu_build: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No driver at all (no fake state, no libcuda): GPU features are off, and the status
    says why; the engine still checkpoints CPU kernels."""
    monkeypatch.delenv("CEDANA_FAKE_GPU_STATE", raising=False)
    c = Config()
    c.CheckpointEngine.checkpoint_root = str(tmp_path / "ckpt")
    c.CudaCheckpointer.helper_path = str(HELPER)
    c.CudaCheckpointer.libcuda_path = str(tmp_path / "no-driver" / "libcuda.so.1")
    engine = CheckpointEngine.instance(config=c)
    monitor = engine.gpu_monitor()
    assert await engine.cuda_checkpointer() is None
    available, why = engine.cuda_status()
    assert available is False and "no NVIDIA driver" in (why or "")

    manager = SuspendManager(engine=engine, policy=SuspendPolicy(), gpu_monitor=monitor)
    status = manager.status()
    assert status["available"] is True  # CRIU is fine
    gpu = status["gpu"]
    assert gpu["available"] is False and gpu["checkpoint"] is False and gpu["devices"] == []
    # pynvml finds no libnvidia-ml.so.1, or (when an earlier test of this process loaded
    # the fake NVML) one with no driver behind it
    assert gpu["reason"] in (
        "no NVIDIA driver (libnvidia-ml.so.1 not found)",
        "NVIDIA driver not loaded",
    )

    off = CheckpointEngine(config=c, gpu=False)
    assert off.gpu_monitor() is None and await off.cuda_checkpointer() is None
    status = SuspendManager(engine=off, policy=SuspendPolicy()).status()
    assert status["gpu"]["available"] is False and status["gpu"]["reason"]


def test_fake_identity_is_not_a_stale_pid(fake_gpu: FakeGpu) -> None:
    """A record with an id never matches the recycled pid of another process."""
    import subprocess

    from .conftest_gpu import FAKE_LIBCUDA as lib

    other = subprocess.Popen(["sleep", "30"])
    try:
        fake_gpu.add("proc", pid=other.pid, dev=0, mem=GiB, id="someone-else", nspid=1)
        env = {**os.environ, "CEDANA_LIBCUDA": str(lib)}
        r = subprocess.run(
            [str(HELPER), "--get-state", "--pid", str(other.pid)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert r.returncode != 0 and "CUDA_ERROR_NOT_SUPPORTED" in r.stderr  # no CUDA here
    finally:
        os.kill(other.pid, signal.SIGKILL)
        other.wait()


async def test_offload_restore_error_keeps_kernel_offloaded(
    gpu_kernel: Any, fake_gpu: FakeGpu
) -> None:
    km = gpu_kernel
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    await prov.suspend(tier="offload")
    fake_gpu.add("error", op="restore", pid=0, code=CUDA_ERROR_UNKNOWN, times=1)
    with pytest.raises(GpuError, match="CUDA_ERROR_UNKNOWN"):
        await prov.resume()
    assert prov.state == KernelState.suspended and prov.tier == "offload"
    assert "CUDA_ERROR_UNKNOWN" in (prov.reason or "")
    assert alive(km.gpu_pid) and fake_gpu.proc(km.gpu_pid)["state"] == "checkpointed"
    await prov.resume()
    assert fake_gpu.timeline() == ["lock", "checkpoint", "restore!", "restore", "unlock"]
    await assert_kernel_answers(km, "print(x + 1)", "42")


@pytest.mark.parametrize("tier", ["offload", "disk"])
async def test_shutdown_of_suspended_gpu_kernel(
    gpu_kernel: Any, checkpoint_root: Path, tier: str
) -> None:
    """Shutting down a suspended kernel leaves no process and no image behind; an
    offloaded kernel still has its process, which must go too."""
    km = gpu_kernel
    pids = process_tree(km.provisioner.pid)
    await km.provisioner.suspend(tier=tier)
    await km.shutdown_kernel(now=True)
    assert wait_for(lambda: not any(alive(p) for p in pids), timeout=10)
    assert await exited(pids) == []
    assert images(checkpoint_root) == []


async def test_offloaded_kernel_that_dies_is_reported_dead(gpu_kernel: Any) -> None:
    """poll() of an offloaded kernel follows its process, so the restarter can act."""
    prov = gpu_kernel.provisioner
    await prov.suspend(tier="offload")
    assert await prov.poll() is None
    os.kill(gpu_kernel.gpu_pid, signal.SIGKILL)  # e.g. the OOM killer
    assert wait_for(lambda: prov.process.poll() is not None, timeout=10)
    assert await prov.poll() is not None
    assert prov.state == KernelState.running and prov.tier is None
    assert "exited" in (prov.reason or "")


# ---- failures the rollback cannot undo --------------------------------------------------


@pytest.fixture
def full_disk(tmp_path: Path):
    """A checkpoint disk with no room for one more file (a tmpfs out of inodes)."""
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    opts = "size=8m,nr_inodes=16"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "root").mkdir(mode=0o700)
        i = 0
        while True:
            try:
                (mnt / f"filler{i}").touch()
            except OSError:
                break
            i += 1
        yield mnt / "root"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_disk_full_before_the_dump_puts_the_gpu_back(
    gpu_kernel: Any, spy: FakeGpu, full_disk: Path
) -> None:
    """The GPU memory was offloaded, then the image cannot even be started on the disk:
    the offload is undone and the kernel runs on, its GPU memory back."""
    km = gpu_kernel
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    pids = process_tree(prov.pid)
    prov.engine.checkpoint_root = str(full_disk)
    with pytest.raises(SuspendFailed, match="No space left"):
        await prov.suspend(tier="disk")
    assert spy.timeline() == ["lock", "checkpoint", "restore", "unlock"]  # no CRIU dump
    assert prov.state == KernelState.running and "No space left" in (prov.reason or "")
    assert gpu_free(spy) == 80 * GiB - KERNEL_GPU_MEM
    assert process_tree(prov.pid) == pids
    assert spy.proc_by_id(GPU_ID)["state"] == "running"
    await assert_kernel_answers(km, "print(x + 1)", "42")


async def test_gpu_memory_taken_during_a_failed_dump(
    gpu_kernel: Any, spy: FakeGpu, checkpoint_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRIU refuses, and meanwhile another process took the freed GPU memory: the GPU
    memory cannot go back. The kernel is `failed`, never `running`, with its GPU memory
    kept in host memory; once the GPU has room a resume brings it back."""
    km = gpu_kernel
    prov = km.provisioner
    await make_criu_refuse(km)
    dump = CheckpointEngine.dump

    async def dump_while_the_gpu_fills(self: Any, *a: Any, **kw: Any) -> Any:
        spy.update("device", {"index": 0}, reserved=79 * GiB)  # another tenant
        return await dump(self, *a, **kw)

    monkeypatch.setattr(CheckpointEngine, "dump", dump_while_the_gpu_fills)
    with pytest.raises(SuspendFailed, match=r"CRIU dump failed.*stays in host memory"):
        await prov.suspend(tier="disk")
    assert prov.state == KernelState.failed and prov.tier == "offload"
    assert "Not enough free GPU memory" in (prov.reason or "")
    # no restore was tried: one that runs out of memory can wedge the process for good
    assert spy.timeline() == ["lock", "checkpoint", "criu-dump gpu=checkpointed"]
    assert spy.proc_by_id(GPU_ID)["state"] == "checkpointed"
    assert alive(km.gpu_pid) and await prov.poll() is None and await km.is_alive()
    assert images(checkpoint_root) == []
    with pytest.raises(Conflict, match="resume it first"):
        await prov.suspend(tier="disk")

    spy.update("device", {"index": 0}, reserved=0)
    result = await prov.resume()
    assert result["state"] == "running" and prov.reason is None and prov.tier is None
    assert spy.proc_by_id(GPU_ID)["state"] == "running"
    assert gpu_free(spy) == 80 * GiB - KERNEL_GPU_MEM
    await assert_kernel_answers(km, "print(x + 1)", "42")


@pytest.mark.parametrize("tier", ["offload", "disk"])
async def test_cuda_state_lost_is_failed_not_running(
    gpu_kernel: Any, fake_gpu: FakeGpu, checkpoint_root: Path, tier: str
) -> None:
    """The driver ends in its FAILED state: the kernel's CUDA state is lost and the
    rollback cannot help. The kernel is `failed` with the reason (never `running`),
    cannot be resumed, and goes away cleanly when shut down."""
    km = gpu_kernel
    prov = km.provisioner
    pids = process_tree(prov.pid)
    fake_gpu.add("error", op="checkpoint", pid=0, code=CUDA_ERROR_UNKNOWN, fail_state="failed")
    with pytest.raises(GpuError, match="CUDA state is lost"):
        await prov.suspend(tier=tier)
    assert prov.state == KernelState.failed and prov.tier is None
    assert "CUDA state is lost" in (prov.reason or "") and "is failed" in (prov.reason or "")
    assert fake_gpu.proc_by_id(GPU_ID)["state"] == "failed"
    assert images(checkpoint_root) == []
    assert await prov.poll() is None and all(alive(p) for p in pids)  # the process lives
    with pytest.raises(Conflict, match="restart it"):
        await prov.resume()
    assert prov.state == KernelState.failed
    await km.shutdown_kernel(now=True)
    assert wait_for(lambda: not any(alive(p) for p in pids), timeout=10)


async def test_offload_refused_without_host_memory(
    gpu_kernel: Any, fake_gpu: FakeGpu, tmp_path: Path
) -> None:
    """The kernel's cgroup has no room for its GPU memory in host memory: refused with
    the reason before anything is touched, instead of inviting the OOM killer."""
    km = gpu_kernel
    prov = km.provisioner
    pid = km.gpu_pid
    rel = Path(f"/proc/{pid}/cgroup").read_text().split("0::", 1)[1].splitlines()[0].strip("/")
    cg = tmp_path / "cgroup" / rel
    cg.mkdir(parents=True, exist_ok=True)
    (cg / "memory.max").write_text(f"{3 * GiB}\n")
    (cg / "memory.current").write_text(f"{2 * GiB}\n")
    gpu = await prov.engine.cuda_checkpointer()
    gpu.cgroup_root = str(tmp_path / "cgroup")
    for tier in ("offload", "disk"):
        with pytest.raises(InsufficientHostMemory, match=r"needs 2\.00 GiB.*only 1\.00 GiB"):
            await prov.suspend(tier=tier)
        assert prov.state == KernelState.running and "host memory" in (prov.reason or "")
    assert fake_gpu.timeline() == []
    (cg / "memory.max").write_text(f"{8 * GiB}\n")
    await prov.suspend(tier="offload")
    await prov.resume()
    await assert_kernel_answers(km, "print('fits')", "fits")


async def test_gpu_restore_after_continue_when_configured(
    gpu_kernel: Any, spy: FakeGpu, checkpoint_root: Path
) -> None:
    """CudaCheckpointer.restore_frozen off (for a driver on which the thaw fails): the GPU
    memory goes back right after the restored kernel was continued."""
    km = gpu_kernel
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    await prov.suspend(tier="disk")
    gpu = await prov.engine.cuda_checkpointer()
    gpu.restore_frozen = False
    spy.clear_log()
    await prov.resume()
    (restore,) = [c for c in spy.calls() if c.startswith("restore ")]
    assert " rc=0 by=cedana-cuda frozen=0" in restore
    assert spy.proc_by_id(GPU_ID)["state"] == "running"
    await assert_kernel_answers(km, "print(x + 1)", "42")
