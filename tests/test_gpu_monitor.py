"""GpuMonitor through the TEST-ONLY fake NVML, loaded by pynvml's own loader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint import proctree
from jupyter_cedana.checkpoint.proctree import nspids, process_tree
from jupyter_cedana.gpu.monitor import GpuMonitor

from .conftest_gpu import (
    H100,
    ROOT,
    UUID0,
    UUID1,
    FakeGpu,
    GiB,
    fake_gpu,
    gpu_build,
    spawn,
    wait_tree,
)

__all__ = ["fake_gpu", "gpu_build", "spawn"]  # fixtures used by name


def two_gpus(fake: FakeGpu) -> None:
    fake.setup(
        [
            {"uuid": UUID0, "total": 80 * GiB, "reserved": GiB, "name": H100},
            {"uuid": UUID1, "total": 80 * GiB, "name": H100},
        ]
    )


# ---- process trees ----


def test_process_tree_finds_descendants(spawn):
    p = spawn("bash", "-c", "sleep 600 & sleep 600 & wait")
    tree = wait_tree(p.pid, 3)
    assert tree and p.pid in tree and len(tree) == 3
    assert process_tree(2**22 + 7) == set()  # no such pid


def test_process_tree_without_children_files(spawn, monkeypatch):
    p = spawn("bash", "-c", "sleep 600 & wait")
    wait_tree(p.pid, 2)
    monkeypatch.setattr(proctree, "_children_from_task_files", lambda pid: None)
    assert len(process_tree(p.pid)) == 2  # /proc/*/stat scan


# ---- no driver ----


def test_no_library_reports_reason(gpu_build):
    """In a process where libnvidia-ml.so.1 cannot be found at all."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    code = (
        "import json; from jupyter_cedana.gpu.monitor import GpuMonitor; m = GpuMonitor(); "
        "print(json.dumps([m.available, m.reason, m.devices(), m.sample({'k': {1}})]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    available, reason, devices, sample = json.loads(out.stdout)
    assert available is False
    assert reason == "no NVIDIA driver (libnvidia-ml.so.1 not found)"
    assert devices == [] and sample == {"k": []}


def test_fake_nvml_via_ld_library_path(fake_gpu):
    """The subprocess route: pynvml finds the fake through LD_LIBRARY_PATH."""
    code = (
        "from jupyter_cedana.gpu.monitor import GpuMonitor; "
        "m = GpuMonitor(); print(m.devices()[0]['name'])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == H100, out.stderr


def test_driver_not_loaded(fake_gpu):
    fake_gpu.path.unlink()  # the fake answers NVML_ERROR_DRIVER_NOT_LOADED
    m = GpuMonitor()
    assert not m.available
    assert m.reason == "NVIDIA driver not loaded"
    assert m.is_gpu_idle("k", 5)


def test_disabled_by_config(fake_gpu):
    m = GpuMonitor(enabled=False)
    assert not m.available and "disabled" in (m.reason or "")


def test_no_gpu(fake_gpu):
    fake_gpu.setup(devices=[])
    m = GpuMonitor()
    assert not m.available and m.reason == "no NVIDIA GPU found"


# ---- devices and memory ----


def test_devices_and_memory(fake_gpu, spawn):
    two_gpus(fake_gpu)
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=1, mem=3 * GiB)
    m = GpuMonitor()
    assert m.available and m.reason is None
    assert m.driver_version == "570.86.10"
    devs = m.devices()
    assert [d["uuid"] for d in devs] == [UUID0, UUID1]
    assert devs[0]["memory_used"] == GiB and devs[0]["memory_free"] == 79 * GiB
    assert devs[1]["memory_used"] == 3 * GiB and devs[1]["memory_total"] == 80 * GiB
    assert m.free_memory(1) == 77 * GiB
    assert m.find_device(UUID1)["index"] == 1
    assert m.find_device("GPU-nope") is None
    m.close()


def test_sample_maps_memory_to_kernel_trees(fake_gpu, spawn):
    two_gpus(fake_gpu)
    k1 = spawn("bash", "-c", "sleep 600 & wait")
    tree1 = wait_tree(k1.pid, 2)
    child = max(tree1 - {k1.pid})
    k2 = spawn()
    k3 = spawn()  # a CPU-only kernel
    fake_gpu.add("proc", pid=k1.pid, dev=0, mem=2 * GiB)
    fake_gpu.add("proc", pid=child, dev=0, mem=1 * GiB)  # e.g. a DataLoader worker
    fake_gpu.add("proc", pid=child, dev=1, mem=5 * GiB)
    fake_gpu.add("proc", pid=k2.pid, dev=1, mem=7 * GiB)
    fake_gpu.add("proc", pid=424242, dev=1, mem=9 * GiB)  # someone else's process
    m = GpuMonitor()
    out = m.sample({"k1": tree1, "k2": {k2.pid}, "k3": {k3.pid}})
    assert [(u.index, u.memory_bytes) for u in out["k1"]] == [(0, 3 * GiB), (1, 5 * GiB)]
    assert sorted(out["k1"][0].pids) == sorted(tree1)
    assert out["k1"][1].pids == [child]
    assert [(u.uuid, u.memory_bytes) for u in out["k2"]] == [(UUID1, 7 * GiB)]
    assert out["k3"] == []
    j = out["k2"][0].to_json()
    assert j["matched_by"] == "pid" and j["name"] == H100 and json.dumps(j)
    assert [u.memory_bytes for u in m.usage({k2.pid})] == [7 * GiB]


def test_checkpointed_process_frees_memory_in_nvml(fake_gpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=10 * GiB)
    m = GpuMonitor()
    assert m.free_memory(0) == 70 * GiB
    fake_gpu.update("proc", {"pid": p.pid}, state="checkpointed")
    assert m.free_memory(0) == 80 * GiB
    assert m.sample({"k": {p.pid}}) == {"k": []}


# ---- utilisation window ----


def test_utilization_window_and_idle(fake_gpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    fake_gpu.add("util", pid=p.pid, dev=0, sm=60)
    m = GpuMonitor(utilization_window=10.0)
    tree = {"k": {p.pid}}
    assert m.sample(tree, now=100.0)["k"][0].utilization == 60
    assert not m.is_gpu_idle("k", 10, now=100.0)
    fake_gpu.update("util", {"pid": p.pid}, sm=0)
    assert m.sample(tree, now=105.0)["k"][0].utilization == 30  # mean of 60 and 0
    assert not m.is_gpu_idle("k", 10, now=105.0)  # the busy sample is still in the window
    m.sample(tree, now=111.0)
    # 100.0 fell out of the window; 105 and 111 were idle, and 11 s were observed
    assert m.sample(tree, now=112.0)["k"][0].utilization == 0
    assert m.is_gpu_idle("k", 10, now=112.0)
    assert not m.is_gpu_idle("k", 0, now=112.0)  # nothing is under 0 %
    fake_gpu.update("util", {"pid": p.pid}, sm=15)
    m.sample(tree, now=113.0)
    assert not m.is_gpu_idle("k", 10, now=113.0)
    assert m.is_gpu_idle("k", 20, now=113.0)


def test_idle_needs_a_full_window(fake_gpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    m = GpuMonitor(utilization_window=30.0)
    m.sample({"k": {p.pid}}, now=0.0)
    m.sample({"k": {p.pid}}, now=10.0)
    assert not m.is_gpu_idle("k", 5, now=10.0)
    m.sample({"k": {p.pid}}, now=31.0)
    assert m.is_gpu_idle("k", 5, now=31.0)


def test_kernel_without_gpu_is_idle_and_forgotten(fake_gpu, spawn):
    p = spawn()
    m = GpuMonitor(utilization_window=30.0)
    m.sample({"k": {p.pid}}, now=0.0)
    assert m.is_gpu_idle("k", 5, now=0.0)
    m.sample({"other": {p.pid}}, now=1.0)
    assert "k" not in m._windows  # kernels not sampled any more are dropped


def test_tree_utilization_sums_processes(fake_gpu, spawn):
    a, b = spawn(), spawn()
    for pid in (a.pid, b.pid):
        fake_gpu.add("proc", pid=pid, dev=0, mem=GiB)
        fake_gpu.add("util", pid=pid, dev=0, sm=70)
    m = GpuMonitor()
    assert m.sample({"k": {a.pid, b.pid}})["k"][0].utilization == 100  # capped


def test_device_utilization_when_process_samples_unsupported(fake_gpu, spawn):
    fake_gpu.setup([{"uuid": UUID0, "total": 80 * GiB, "gpu_util": 42, "name": H100}])
    fake_gpu.add("nvml_error", fn="nvmlDeviceGetProcessUtilization", code=3)
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    m = GpuMonitor()
    assert m.sample({"k": {p.pid}})["k"][0].utilization == 42


def test_nvml_failure_while_sampling(fake_gpu, spawn):
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB)
    m = GpuMonitor()
    assert m.available
    fake_gpu.add("nvml_error", fn="nvmlDeviceGetComputeRunningProcesses_v3", code=15)
    assert m.sample({"k": {p.pid}}) == {"k": []}
    assert m.is_gpu_idle("k", 5)


# ---- another PID namespace ----


def test_container_match_by_nspid(fake_gpu, spawn):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    outer = spawn("unshare", "--pid", "--fork", "sleep", "600")
    tree = wait_tree(outer.pid, 2)
    if not tree:
        pytest.skip("cannot create a PID namespace here")
    inner = max(tree - {outer.pid})
    assert nspids(inner)[1:] == [1]
    # NVML reports the PID as the container sees it
    fake_gpu.add("proc", pid=inner, nvml_pid=1, dev=0, mem=4 * GiB)
    m = GpuMonitor()
    (use,) = m.sample({"k": tree})["k"]
    assert use.matched_by == "nspid" and use.pids == [inner] and use.memory_bytes == 4 * GiB


def fake_dev(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_text("")
    return dev


def test_container_match_by_device_files(fake_gpu, spawn, tmp_path: Path):
    two_gpus(fake_gpu)
    dev = fake_dev(tmp_path)
    prefix = str(dev / "nvidia")
    with open(dev / "nvidia0") as gpu0, open(dev / "nvidiactl") as ctl:
        holder = spawn(stdin=gpu0, stdout=ctl)
    with open(dev / "nvidiactl") as ctl:
        ctl_only = spawn(stdin=ctl)  # nvidiactl alone does not tie a process to a GPU
    # NVML reports a PID that means nothing here (the host's)
    fake_gpu.add("proc", pid=999999, nvml_pid=999999, dev=0, mem=6 * GiB)
    m = GpuMonitor(device_path_prefix=prefix)
    out = m.sample({"k": {holder.pid}, "cpu": {ctl_only.pid}})
    (use,) = out["k"]
    # one NVML process of GPU 0 unexplained, one process of the kernels holding GPU 0
    assert use.matched_by == "learned" and use.memory_bytes == 6 * GiB and use.pids == [holder.pid]
    assert out["cpu"] == []
    # two NVML processes of a GPU that one kernel holds: both are that kernel's
    fake_gpu.add("proc", pid=999998, nvml_pid=999998, dev=1, mem=GiB)
    fake_gpu.add("proc", pid=999997, nvml_pid=999997, dev=1, mem=GiB)
    with open(dev / "nvidia1") as gpu1:
        two = spawn("bash", "-c", "sleep 600 & wait", stdin=gpu1)
    tree = wait_tree(two.pid, 2)
    (use,) = m.sample({"k2": tree})["k2"]
    assert use.matched_by == "devfile" and use.memory_bytes == 2 * GiB and use.index == 1


def test_foreign_pids_attributed_by_elimination(fake_gpu, spawn, tmp_path: Path):
    """The server in a container: NVML names processes by PIDs of the host's namespace,
    which mean nothing here. Two kernels share GPU 0; the one started first is learned
    while it is alone, the second by elimination; memory and utilisation samples (which
    carry the same foreign PIDs) go to the right kernel."""
    dev = fake_dev(tmp_path)
    m = GpuMonitor(device_path_prefix=str(dev / "nvidia"), utilization_window=10)
    with open(dev / "nvidia0") as gpu0:
        a = spawn(stdin=gpu0)
        b = spawn(stdin=gpu0)
    fake_gpu.add("proc", pid=2**22 + 11, nvml_pid=700011, dev=0, mem=4 * GiB)
    fake_gpu.add("util", pid=700011, dev=0, sm=3, mem=0)
    out = m.sample({"a": {a.pid}}, now=0)
    assert [(u.matched_by, u.memory_bytes, u.pids) for u in out["a"]] == [
        ("learned", 4 * GiB, [a.pid])
    ]
    # the second kernel starts using the same GPU
    fake_gpu.add("proc", pid=2**22 + 12, nvml_pid=700012, dev=0, mem=6 * GiB)
    fake_gpu.add("util", pid=700012, dev=0, sm=90, mem=40)
    for t in range(0, 12):
        out = m.sample({"a": {a.pid}, "b": {b.pid}}, now=t + 1)
    assert [(u.matched_by, u.memory_bytes, u.pids) for u in out["a"]] == [
        ("learned", 4 * GiB, [a.pid])
    ]
    assert [(u.matched_by, u.memory_bytes, u.pids) for u in out["b"]] == [
        ("learned", 6 * GiB, [b.pid])
    ]
    assert out["a"][0].utilization == 3 and out["b"][0].utilization == 90
    assert m.is_gpu_idle("a", 5, now=12) and not m.is_gpu_idle("b", 5, now=12)
    # usage() of one kernel (what the checkpointer asks) leaves the other's memory out
    assert [(u.memory_bytes, u.pids) for u in m.usage({b.pid})] == [(6 * GiB, [b.pid])]
    # a kernel whose process is replaced (e.g. restored by CRIU: new pids everywhere)
    fake_gpu.update("proc", {"nvml_pid": 700012}, nvml_pid=700099)
    fake_gpu.update("util", {"pid": 700012}, pid=700099)
    with open(dev / "nvidia0") as gpu0:
        b2 = spawn(stdin=gpu0)
    out = m.sample({"a": {a.pid}, "b": {b2.pid}}, now=13)
    assert [(u.memory_bytes, u.pids) for u in out["b"]] == [(6 * GiB, [b2.pid])]
    assert [(u.memory_bytes, u.pids) for u in out["a"]] == [(4 * GiB, [a.pid])]


def test_learned_pid_is_forgotten_with_its_process(fake_gpu, spawn, tmp_path: Path):
    """A learned NVML pid stands for one process: when that exits, or its NVML entry
    goes, the alias goes too, and the GPU's next process is learned afresh."""
    dev = fake_dev(tmp_path)
    m = GpuMonitor(device_path_prefix=str(dev / "nvidia"))
    with open(dev / "nvidia0") as gpu0:
        a = spawn(stdin=gpu0)
        b = spawn(stdin=gpu0)
    fake_gpu.add("proc", pid=2**22 + 21, nvml_pid=700021, dev=0, mem=GiB)
    assert [u.pids for u in m.sample({"a": {a.pid}})["a"]] == [[a.pid]]
    a.kill()
    a.wait()
    # NVML still lists a's entry for a moment: it is not b's for having been a's...
    out = m.sample({"b": {b.pid}})
    assert [(u.matched_by, u.pids) for u in out["b"]] == [("learned", [b.pid])]
    # ...only by elimination, afresh: the alias to the dead process was dropped first
    fake_gpu.update("proc", {"nvml_pid": 700021}, nvml_pid=700022, mem=3 * GiB)
    out = m.sample({"b": {b.pid}})
    assert [(u.matched_by, u.memory_bytes, u.pids) for u in out["b"]] == [
        ("learned", 3 * GiB, [b.pid])
    ]
    assert 700021 not in m._aliases


def test_mig_and_mps_flags(fake_gpu, spawn):
    fake_gpu.setup([{"uuid": UUID0, "total": 80 * GiB, "mig": 1, "name": H100}])
    p = spawn()
    fake_gpu.add("proc", pid=p.pid, dev=0, mem=GiB, mps=1)
    m = GpuMonitor()
    assert m.devices()[0]["mig"] is True
    (use,) = m.sample({"k": {p.pid}})["k"]
    assert use.mps is True
