"""The native CUDA checkpoint helper and CudaCheckpointer, through the TEST-ONLY fake
libcuda (dlopen()ed by the helper via CEDANA_LIBCUDA) and the fake NVML."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.errors import (
    GpuError,
    InsufficientGpuMemory,
    InsufficientHostMemory,
    NotCheckpointable,
)
from jupyter_cedana.gpu.cuda import CudaCheckpointer, CudaStateLeft, OffloadResult
from jupyter_cedana.gpu.monitor import GpuMonitor

from .conftest_gpu import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_INITIALIZED,
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
    spawn,
    wait_tree,
)

__all__ = ["fake_gpu", "gpu_build", "spawn"]  # fixtures used by name


def cli(*args: str, lib: Path = FAKE_LIBCUDA) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CEDANA_LIBCUDA": str(lib)}
    return subprocess.run([str(HELPER), *args], env=env, capture_output=True, text=True)


# ---- command line (cuda-checkpoint compatible) ----


def test_cli_state_machine(fake_gpu: FakeGpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=10 * GiB)
    pid = str(p.pid)
    assert cli("--get-state", "--pid", pid).stdout == "running\n"
    assert cli("--action", "lock", "--pid", pid, "--timeout", "1234").returncode == 0
    assert cli("--get-state", "--pid", pid).stdout == "locked\n"
    assert cli("--action", "checkpoint", "--pid", pid).returncode == 0
    assert cli("--get-state", "--pid", pid).stdout == "checkpointed\n"
    assert GpuMonitor().free_memory(0) == 80 * GiB  # the fake NVML sees the GPU freed
    bad = cli("--action", "unlock", "--pid", pid)  # not allowed from CHECKPOINTED
    assert bad.returncode == 1 and "CUDA_ERROR_ILLEGAL_STATE" in bad.stderr
    assert cli("--action", "restore", "--pid", pid).returncode == 0
    assert cli("--action", "unlock", "--pid", pid).returncode == 0
    assert cli("--get-state", "--pid", pid).stdout == "running\n"
    assert fake_gpu.ops(p.pid) == ["lock", "checkpoint", "unlock!", "restore", "unlock"]
    assert "timeout_ms=1234" in fake_gpu.calls()[1]


def test_cli_toggle_and_device_map(fake_gpu: FakeGpu, spawn):
    fake_gpu.setup(
        [
            {"uuid": UUID0, "total": 80 * GiB, "name": H100},
            {"uuid": UUID1, "total": 80 * GiB, "name": H100},
        ]
    )
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    assert cli("--toggle", "--pid", str(p.pid)).returncode == 0
    assert fake_gpu.proc(p.pid)["state"] == "checkpointed"
    r = cli("--toggle", "--pid", str(p.pid), "--device-map", f"{UUID0}={UUID1}")
    assert r.returncode == 0, r.stderr
    assert fake_gpu.proc(p.pid)["state"] == "running"
    assert fake_gpu.proc(p.pid)["dev"] == "1"
    assert any(f"pairs={UUID0}>{UUID1}" in c for c in fake_gpu.calls())
    bad = cli("--action", "restore", "--pid", str(p.pid), "--device-map", "GPU-xyz=1")
    assert bad.returncode == 2 and "device-map" in bad.stderr


def test_cli_errors(fake_gpu: FakeGpu, spawn):
    p = spawn()  # not a CUDA process: the fake answers CUDA_ERROR_NOT_SUPPORTED by default
    r = cli("--get-state", "--pid", str(p.pid))
    assert r.returncode == 1 and "CUDA_ERROR_NOT_SUPPORTED" in r.stderr
    r = cli("--get-state", "--pid", str(2**22 + 3))  # no such process
    assert r.returncode == 1 and "CUDA_ERROR_INVALID_VALUE" in r.stderr
    r = cli("--get-state", "--pid", str(p.pid), lib=Path("/nonexistent/libcuda.so.1"))
    assert r.returncode == 1 and "LIBCUDA_NOT_FOUND" in r.stderr
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    r = cli("--get-state", "--pid", str(p.pid), lib=FAKE_OLD_LIBCUDA)
    assert r.returncode == 1 and "CHECKPOINT_API_MISSING" in r.stderr and "r570" in r.stderr
    assert cli("--pid", str(p.pid)).returncode == 2  # no action
    assert cli("--help").returncode == 0


# ---- --serve protocol ----


def test_serve_protocol(fake_gpu: FakeGpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    reqs = [
        {"id": 1, "op": "info"},
        {"id": 2, "op": "get_state", "pid": p.pid},
        {"id": 3, "op": "lock", "pid": p.pid, "timeout_ms": 5000},
        {"id": 4, "op": "lock", "pid": p.pid},
        {"id": 5, "op": "frobnicate", "pid": p.pid},
        {"id": 6, "op": "lock"},
        {"id": 7, "op": "restore", "pid": p.pid, "device_map": "nonsense"},
    ]
    out = subprocess.run(
        [str(HELPER), "--serve"],
        input="".join(json.dumps(r) + "\n" for r in reqs),
        env={**os.environ, "CEDANA_LIBCUDA": str(FAKE_LIBCUDA)},
        capture_output=True,
        text=True,
        check=True,
    )
    resp = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["id"] for r in resp] == [1, 2, 3, 4, 5, 6, 7]
    info = resp[0]
    assert info["ok"] and info["loaded"] and info["checkpoint_api"]
    assert info["driver_version"] == 12080 and info["init_result"] == 0
    assert resp[1] == {"id": 2, "ok": True, "state": "running"}
    assert resp[2]["ok"] and resp[2]["elapsed_s"] >= 0
    assert resp[3]["ok"] is False and resp[3]["error"] == "CUDA_ERROR_ILLEGAL_STATE"
    assert resp[3]["code"] == 401 and "lock pid" in resp[3]["message"]
    assert [r["error"] for r in resp[4:]] == ["BAD_REQUEST"] * 3
    # cuInit was called once for all requests
    log = fake_gpu.log_path.read_text().splitlines()
    assert sum(line.startswith("cuda init") for line in log) == 1


# ---- CudaCheckpointer ----


def roomy_host(tmp_path: Path) -> dict[str, str]:
    """Host memory sources with room for the fake GPUs' gigabytes (this machine's real
    MemAvailable is smaller than an H100): a meminfo and a cgroup tree without limits."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {2 << 30} kB\nMemAvailable: {2 << 30} kB\n")
    (tmp_path / "cgroup").mkdir()
    return {"meminfo_path": str(meminfo), "cgroup_root": str(tmp_path / "cgroup")}


@pytest.fixture
async def ckpt(fake_gpu: FakeGpu, tmp_path: Path) -> AsyncIterator[CudaCheckpointer]:
    c = CudaCheckpointer(
        helper_path=str(HELPER),
        libcuda_path=str(FAKE_LIBCUDA),
        monitor=GpuMonitor(),
        **roomy_host(tmp_path),
    )
    await c.start()
    yield c
    await c.stop()


async def test_start_reports_capabilities(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, tmp_path):
    assert ckpt.available and ckpt.reason is None and ckpt.driver_version == 12080
    missing = CudaCheckpointer(helper_path=str(tmp_path / "nope"))
    await missing.start()
    assert not missing.available and "not found" in (missing.reason or "")
    nolib = CudaCheckpointer(helper_path=str(HELPER), libcuda_path="/nonexistent/libcuda.so.1")
    await nolib.start()
    assert not nolib.available and (nolib.reason or "").startswith("no NVIDIA driver")
    with pytest.raises(GpuError):
        await nolib.lock(1, 100)
    await nolib.stop()
    old = CudaCheckpointer(helper_path=str(HELPER), libcuda_path=str(FAKE_OLD_LIBCUDA))
    await old.start()
    assert not old.available and "r570" in (old.reason or "")
    await old.stop()


async def test_offload_and_restore(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    k = spawn("bash", "-c", "sleep 600 & wait")
    tree = wait_tree(k.pid, 2)
    worker = max(tree - {k.pid})
    fake_gpu.add("proc", pid=worker, dev=0, mem=12 * GiB)
    monitor = ckpt.monitor
    assert monitor is not None
    assert monitor.free_memory(0) == 68 * GiB
    seen: list[tuple[str, int | None, int | None]] = []
    result = await ckpt.offload(tree, progress=lambda *a: seen.append(a))
    assert isinstance(result, OffloadResult) and result
    assert result.pids == [worker]
    assert fake_gpu.ops() == ["lock", "checkpoint"]
    assert fake_gpu.proc(worker)["state"] == "checkpointed"
    assert monitor.free_memory(0) == 80 * GiB
    assert result["bytes_freed"] == 12 * GiB and result["memory_bytes"] == 12 * GiB
    assert result["devices"] == [
        {"uuid": UUID0, "index": 0, "name": H100, "memory_bytes": 12 * GiB}
    ]
    assert result["lock_s"] >= 0 and result["checkpoint_s"] >= 0
    assert ("gpu-lock", 1, 1) in seen and ("gpu-checkpoint", 1, 1) in seen
    manifest = json.loads(json.dumps(result))  # it travels through the manifest
    fake_gpu.clear_log()
    out = await ckpt.restore(manifest, None)
    assert fake_gpu.ops() == ["restore", "unlock"]
    assert fake_gpu.proc(worker)["state"] == "running"
    assert monitor.free_memory(0) == 68 * GiB
    assert out["pids"] == [worker] and out["device_map"] == {UUID0: UUID0}
    # no remap: the restore was called without GPU pairs
    assert not any("pairs=" in c for c in fake_gpu.calls())


async def test_cpu_only_kernel_is_a_no_op(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    p = spawn()
    result = await ckpt.offload({p.pid})
    assert not result and result.bytes_freed == 0
    assert fake_gpu.ops() == []
    assert await ckpt.restore(result) == {"pids": [], "restore_s": 0.0, "unlock_s": 0.0}


async def test_restore_into_new_pid_after_criu(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    old, new = spawn(), spawn()
    fake_gpu.add("proc", pid=old.pid, dev=0, mem=GiB)
    result = await ckpt.offload({old.pid})
    # what a CRIU restore does: same process, new host pid, still checkpointed
    fake_gpu.update("proc", {"pid": old.pid}, pid=new.pid, nvml_pid=new.pid)
    out = await ckpt.restore(json.loads(json.dumps(result)), {new.pid})
    assert out["pids"] == [new.pid]
    assert fake_gpu.proc(new.pid)["state"] == "running"
    assert fake_gpu.ops(new.pid) == ["restore", "unlock"]


async def test_admission_refuses_without_touching(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    p, hog = spawn(), spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=40 * GiB)
    result = await ckpt.offload({p.pid})
    fake_gpu.add("proc", pid=hog.pid, dev=0, mem=60 * GiB)  # someone took the GPU meanwhile
    fake_gpu.clear_log()
    with pytest.raises(InsufficientGpuMemory, match="stays suspended"):
        await ckpt.restore(result)
    assert fake_gpu.ops() == []  # a restore that runs out of memory can wedge the process
    assert fake_gpu.proc(p.pid)["state"] == "checkpointed"
    # once there is room it goes back
    fake_gpu.update("proc", {"pid": hog.pid}, mem=10 * GiB)
    await ckpt.restore(result)
    assert fake_gpu.proc(p.pid)["state"] == "running"


async def test_restore_remaps_to_same_model(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    fake_gpu.setup(
        [
            {"uuid": UUID0, "total": 80 * GiB, "name": H100},
            {"uuid": UUID1, "total": 40 * GiB, "name": "NVIDIA A100-SXM4-40GB"},
            {"uuid": UUID2, "total": 80 * GiB, "name": H100},
        ]
    )
    p, hog = spawn(), spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=30 * GiB)
    result = await ckpt.offload({p.pid})
    fake_gpu.add("proc", pid=hog.pid, dev=0, mem=70 * GiB)
    plan = await ckpt.admit(result)
    assert plan == {UUID0: UUID2}  # not the A100: another chip type
    out = await ckpt.restore(result)
    assert out["device_map"] == {UUID0: UUID2}
    assert any(f"pairs={UUID0}>{UUID2}" in c for c in fake_gpu.calls())
    assert fake_gpu.proc(p.pid)["dev"] == "2"
    # and when no GPU of that model has room: refused
    result = await ckpt.offload({p.pid})
    fake_gpu.update("proc", {"pid": hog.pid}, dev=2)
    fake_gpu.add("proc", pid=hog.pid, dev=0, mem=70 * GiB)
    with pytest.raises(InsufficientGpuMemory):
        await ckpt.restore(result)


async def test_preflight_several_cuda_processes(ckpt: CudaCheckpointer, fake_gpu, spawn):
    a, b = spawn(), spawn()
    fake_gpu.add("proc", pid=a.pid, dev=0, mem=GiB)
    fake_gpu.add("proc", pid=b.pid, dev=0, mem=GiB)
    with pytest.raises(NotCheckpointable, match="several processes"):
        await ckpt.offload({a.pid, b.pid})
    assert fake_gpu.ops() == []


async def test_preflight_old_driver(fake_gpu: FakeGpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    old = CudaCheckpointer(
        helper_path=str(HELPER), libcuda_path=str(FAKE_OLD_LIBCUDA), monitor=GpuMonitor()
    )
    with pytest.raises(NotCheckpointable, match="r570"):
        await old.offload({p.pid})
    await old.stop()
    # the API present but an older driver API version than configured
    fake_gpu.update("driver", {}, cuda=12040)
    c = CudaCheckpointer(helper_path=str(HELPER), libcuda_path=str(FAKE_LIBCUDA), monitor=None)
    with pytest.raises(NotCheckpointable, match=r"12\.4 is older than 12\.8"):
        await c.offload({p.pid})
    await c.stop()
    assert fake_gpu.ops() == []


async def test_preflight_mig_and_mps(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB, mps=1)
    with pytest.raises(NotCheckpointable, match="MPS"):
        await ckpt.offload({p.pid})
    fake_gpu.update("proc", {"pid": p.pid}, mps=0)
    fake_gpu.update("device", {"index": 0}, mig=1)
    ckpt.monitor = GpuMonitor()  # MIG mode is read when NVML starts
    with pytest.raises(NotCheckpointable, match="MIG"):
        await ckpt.offload({p.pid})
    assert fake_gpu.ops() == []


async def test_lock_timeout_leaves_process_running(ckpt: CudaCheckpointer, fake_gpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    fake_gpu.add("error", op="lock", pid=p.pid, code=CUDA_ERROR_NOT_READY)
    ckpt.lock_timeout_ms = 250
    with pytest.raises(GpuError, match="timed out after 250 ms") as e:
        await ckpt.offload({p.pid})
    assert not isinstance(e.value, NotCheckpointable)
    assert fake_gpu.ops() == ["lock!"]
    assert fake_gpu.proc(p.pid)["state"] == "running"


async def test_checkpoint_error_unlocks(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    fake_gpu.add("error", op="checkpoint", pid=p.pid, code=CUDA_ERROR_UNKNOWN, times=1)
    with pytest.raises(GpuError, match=r"CUDA_ERROR_UNKNOWN.*put back to running"):
        await ckpt.offload({p.pid})
    assert fake_gpu.ops() == ["lock", "checkpoint!", "unlock"]
    assert fake_gpu.proc(p.pid)["state"] == "running"
    assert ckpt.monitor is not None and ckpt.monitor.free_memory(0) == 79 * GiB
    # the error was one-off: a second try works
    assert await ckpt.offload({p.pid})


async def test_driver_refusal_is_not_checkpointable(ckpt: CudaCheckpointer, fake_gpu, spawn):
    """e.g. managed (UVM) memory or CUDA IPC: the driver says NOT_SUPPORTED."""
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    fake_gpu.add("error", op="checkpoint", pid=p.pid, code=CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(NotCheckpointable, match="CUDA_ERROR_NOT_SUPPORTED"):
        await ckpt.offload({p.pid})
    assert fake_gpu.ops() == ["lock", "checkpoint!", "unlock"]
    assert fake_gpu.proc(p.pid)["state"] == "running"


async def test_partial_checkpoint_is_restored(ckpt: CudaCheckpointer, fake_gpu, spawn):
    """A checkpoint that fails after it released the GPU: restore + unlock."""
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    fake_gpu.add(
        "error", op="checkpoint", pid=p.pid, code=CUDA_ERROR_UNKNOWN, fail_state="checkpointed"
    )
    with pytest.raises(GpuError):
        await ckpt.offload({p.pid})
    assert fake_gpu.ops() == ["lock", "checkpoint!", "restore", "unlock"]
    assert fake_gpu.proc(p.pid)["state"] == "running"


async def test_restore_error_keeps_checkpoint(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    result = await ckpt.offload({p.pid})
    fake_gpu.add("error", op="restore", pid=p.pid, code=CUDA_ERROR_UNKNOWN, times=1)
    with pytest.raises(GpuError, match="restore"):
        await ckpt.restore(result)
    assert fake_gpu.proc(p.pid)["state"] == "checkpointed"
    assert fake_gpu.ops()[-1] == "restore!"
    await ckpt.restore(result)
    assert fake_gpu.proc(p.pid)["state"] == "running"


async def test_restore_without_checkpointed_process(ckpt: CudaCheckpointer, fake_gpu, spawn):
    p, other = spawn(), spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    result = await ckpt.offload({p.pid})
    with pytest.raises(GpuError, match="No checkpointed CUDA process"):
        await ckpt.restore(result, {other.pid})


async def test_helper_restarts_after_dying(ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    proc: Any = ckpt._proc
    proc.kill()
    await proc.wait()
    assert await ckpt.state(p.pid) == "running"  # a new helper was started
    assert ckpt._proc is not None and ckpt._proc.pid != proc.pid
    assert await ckpt.state(2**22 + 1) is None  # no such process: not a CUDA process


async def test_driver_out_of_memory_on_restore(ckpt: CudaCheckpointer, fake_gpu, spawn):
    """Admission skipped (or raced): the driver's OOM is reported as such."""
    p, hog = spawn(), spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=50 * GiB)
    result = await ckpt.offload({p.pid})
    fake_gpu.add("proc", pid=hog.pid, dev=0, mem=50 * GiB)
    with pytest.raises(InsufficientGpuMemory, match="during restore"):
        await ckpt.restore(result, admission=False)
    assert fake_gpu.proc(p.pid)["state"] == "checkpointed"


# ---- processes that never used CUDA ----


@pytest.mark.parametrize(
    "answer",
    [
        CUDA_ERROR_NOT_SUPPORTED,
        CUDA_ERROR_INVALID_VALUE,
        CUDA_ERROR_NOT_INITIALIZED,
        CUDA_ERROR_OPERATING_SYSTEM,
    ],
)
async def test_cpu_only_process_whatever_the_driver_answers(
    ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn, answer: int
):
    """The header leaves open which error a process without CUDA gets: none of the
    candidates may make the suspend of a CPU-only kernel fail."""
    fake_gpu.update("driver", {}, noncuda=answer)
    k = spawn("bash", "-c", "sleep 600 & wait")
    tree = wait_tree(k.pid, 2)
    result = await ckpt.offload(tree)
    assert not result
    assert [c.split()[0] for c in fake_gpu.calls()] == ["get_state", "get_state"]
    assert all(f" rc={answer} " in c for c in fake_gpu.calls())
    assert fake_gpu.ops() == []


async def test_unreadable_answer_for_a_process_holding_a_gpu(
    fake_gpu: FakeGpu, spawn, tmp_path: Path
):
    # (no host memory needed: nothing gets as far as the offload)
    """An error that does not say "no CUDA" is only ignored for a process that holds no
    NVIDIA device: one that does may be a CUDA process, and the suspend stops."""
    fake_gpu.update("driver", {}, noncuda=CUDA_ERROR_OPERATING_SYSTEM)
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_text("")
    with open(dev / "nvidia0") as gpu0:
        holder = spawn(stdin=gpu0)
    c = CudaCheckpointer(
        helper_path=str(HELPER),
        libcuda_path=str(FAKE_LIBCUDA),
        monitor=GpuMonitor(device_path_prefix=str(dev / "nvidia")),
    )
    try:
        with pytest.raises(GpuError, match=r"Cannot tell the CUDA state.*OPERATING_SYSTEM"):
            await c.offload({holder.pid})
    finally:
        await c.stop()


async def test_gpu_memory_without_cuda_state_is_refused(
    ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn
):
    """NVML sees the process holding GPU memory, the driver has no CUDA state for it:
    dumping it would lose that memory."""
    p = spawn()
    fake_gpu.add("proc", pid=2**22 + 5, nvml_pid=p.pid, dev=0, mem=GiB)
    with pytest.raises(NotCheckpointable, match=r"no checkpointable CUDA state.*NOT_SUPPORTED"):
        await ckpt.offload({p.pid})
    assert fake_gpu.ops() == []


# ---- failures that cannot be rolled back ----


async def test_driver_failed_state_is_reported_lost(
    ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn
):
    """The driver's FAILED state: the rollback cannot put the process back running."""
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    fake_gpu.add("error", op="checkpoint", pid=p.pid, code=CUDA_ERROR_UNKNOWN, fail_state="failed")
    with pytest.raises(CudaStateLeft, match=r"CUDA state is lost.*is failed") as info:
        await ckpt.offload({p.pid})
    assert info.value.kept is None
    assert "put back to running" not in info.value.message
    assert fake_gpu.proc(p.pid)["state"] == "failed"
    assert fake_gpu.ops() == ["lock", "checkpoint!"]  # nothing to restore from FAILED


async def test_rollback_refused_when_the_memory_went(
    ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn
):
    """The checkpoint failed after freeing the GPU and someone took the memory: no
    restore is tried (it would wedge the process); the GPU memory stays in host memory."""
    p, hog = spawn(), spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=30 * GiB)
    fake_gpu.add("proc", pid=hog.pid, dev=0, mem=50 * GiB)
    fake_gpu.add(
        "error", op="checkpoint", pid=p.pid, code=CUDA_ERROR_UNKNOWN, fail_state="checkpointed"
    )
    with pytest.raises(CudaStateLeft, match=r"stays in host memory.*Not enough free GPU") as info:
        await ckpt.offload({p.pid})
    assert info.value.kept is not None and info.value.kept["pids"] == [p.pid]
    assert fake_gpu.ops() == ["lock", "checkpoint!"]
    assert fake_gpu.proc(p.pid)["state"] == "checkpointed"
    fake_gpu.update("proc", {"pid": hog.pid}, mem=10 * GiB)
    await ckpt.restore(info.value.kept)
    assert fake_gpu.proc(p.pid)["state"] == "running"


async def test_restore_of_a_locked_process_unlocks_it(
    ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn
):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    result = await ckpt.offload({p.pid})
    fake_gpu.add("error", op="unlock", pid=p.pid, code=CUDA_ERROR_UNKNOWN, times=1)
    with pytest.raises(GpuError):
        await ckpt.restore(result)
    # restored, then put back into CHECKPOINTED, as before the call
    assert fake_gpu.ops() == ["lock", "checkpoint", "restore", "unlock!", "checkpoint"]
    fake_gpu.update("proc", {"pid": p.pid}, state="locked")  # e.g. an earlier half restore
    fake_gpu.clear_log()
    await ckpt.restore(result)
    assert fake_gpu.ops() == ["unlock"]
    assert fake_gpu.proc(p.pid)["state"] == "running"


# ---- host memory ----


def fake_cgroup(root: Path, limit: int, current: int) -> Path:
    """A directory laid out like a cgroup v2 hierarchy, for the root cgroup of this
    machine's processes (here their v2 path is "/")."""
    root.mkdir(exist_ok=True)
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    return root


async def test_offload_refused_when_host_memory_is_short(
    ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn, tmp_path: Path
):
    p = spawn()
    v2 = Path(f"/proc/{p.pid}/cgroup").read_text().split("0::", 1)[1].splitlines()[0]
    cg = fake_cgroup(tmp_path / "cg" / v2.strip("/"), 40 * GiB, 30 * GiB)
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=12 * GiB)
    ckpt.cgroup_root = str(tmp_path / "cg")
    with pytest.raises(InsufficientHostMemory) as info:
        await ckpt.offload({p.pid})
    assert "needs 13.00 GiB of host memory" in info.value.message
    assert "only 10.00 GiB is free (cgroup /" in info.value.message
    assert "memory.max 40.00 GiB, 30.00 GiB in use" in info.value.message
    assert fake_gpu.ops() == []  # nothing touched: the kernel keeps running
    assert fake_gpu.proc(p.pid)["state"] == "running"
    # the machine's MemAvailable counts too
    (cg / "memory.max").write_text("max\n")
    Path(ckpt.meminfo_path).write_text(f"MemAvailable: {12 << 20} kB\n")
    with pytest.raises(InsufficientHostMemory, match=r"12\.00 GiB is free \(MemAvailable"):
        await ckpt.offload({p.pid})
    ckpt.host_memory_headroom_bytes = 0
    assert await ckpt.offload({p.pid})


# ---- restore into a stopped process ----

RESTORE_THREAD = r"""
import ctypes, signal, threading, time
libc = ctypes.CDLL(None)
def restore_thread():
    libc.prctl(15, b"cuda00001f00")  # PR_SET_NAME: the driver names its thread cuda<hex>
    threading.Event().wait()
threading.Thread(target=restore_thread, daemon=True).start()
time.sleep(0.2)
print("ready", flush=True)
signal.pause()
"""


def thread_states(pid: int) -> dict[str, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        comm = (task / "comm").read_text().strip()
        out[comm] = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    return out


async def test_restore_frozen_runs_only_the_restore_thread(
    ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn
):
    import signal
    import sys

    p = spawn(sys.executable, "-c", RESTORE_THREAD, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    result = await ckpt.offload({p.pid})
    os.kill(p.pid, signal.SIGSTOP)  # as a CRIU restore with --leave-stopped leaves it
    assert wait_for_states(p.pid, "T")
    fake_gpu.clear_log()
    await ckpt.restore(result, {p.pid}, frozen=True)
    (restore,) = [c for c in fake_gpu.calls() if c.startswith("restore ")]
    assert " rc=0 " in restore and " frozen=1" in restore
    assert fake_gpu.proc(p.pid)["state"] == "running"
    # the whole process is stopped again, the restore thread too
    assert set(thread_states(p.pid).values()) == {"T"}
    os.kill(p.pid, signal.SIGCONT)


async def test_restore_of_a_stopped_process_needs_its_restore_thread(
    ckpt: CudaCheckpointer, fake_gpu: FakeGpu, spawn
):
    """Without the thaw, the driver cannot restore a stopped process (the fake gives up
    after 5 s where the real driver would wait)."""
    import signal
    import sys

    p = spawn(sys.executable, "-c", RESTORE_THREAD, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    result = await ckpt.offload({p.pid})
    os.kill(p.pid, signal.SIGSTOP)
    assert wait_for_states(p.pid, "T")
    with pytest.raises(GpuError, match="OPERATING_SYSTEM"):
        await ckpt.restore(result, {p.pid}, frozen=False)
    assert "restore_thread_stopped" in next(c for c in fake_gpu.calls() if c.startswith("restore"))
    assert fake_gpu.proc(p.pid)["state"] == "checkpointed"
    os.kill(p.pid, signal.SIGCONT)


def wait_for_states(pid: int, letter: str) -> bool:
    from .conftest_gpu import wait_for

    return bool(wait_for(lambda: set(thread_states(pid).values()) == {letter}))
