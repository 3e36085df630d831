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

from jupyter_cedana.cuda import CudaCheckpointer, OffloadResult
from jupyter_cedana.errors import GpuError, InsufficientGpuMemory, NotCheckpointable
from jupyter_cedana.gpu import GpuMonitor

from .conftest_gpu import (
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_NOT_SUPPORTED,
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
    p = spawn()  # not a CUDA process
    r = cli("--get-state", "--pid", str(p.pid))
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


@pytest.fixture
async def ckpt(fake_gpu: FakeGpu) -> AsyncIterator[CudaCheckpointer]:
    c = CudaCheckpointer(
        helper_path=str(HELPER), libcuda_path=str(FAKE_LIBCUDA), monitor=GpuMonitor()
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
        await nolib.lock(1)
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
