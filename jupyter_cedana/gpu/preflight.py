"""The refusals of an offload before it touches the kernel: what the driver cannot
checkpoint (several CUDA processes, an old driver, a process without checkpointable
state, MPS, MIG) and an offload that would leave too little host memory. Apart from
cuda.py because they only judge what was gathered there, and touch no process: a
refusal leaves the kernel as it was.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InsufficientHostMemory, NotCheckpointable
from .cuda_helper import cuda_version
from .hostmem import host_room
from .monitor import GpuMonitor, GpuUse

GiB = 1 << 30


def preflight(
    cuda_pids: list[int],
    states: dict[int, str],
    uses: list[GpuUse],
    no_state: dict[int, str],
    *,
    driver_version: int | None,
    min_driver_version: int,
    mig_monitor: GpuMonitor | None,
) -> None:
    """Raise NotCheckpointable for what the driver would refuse, or get wrong. `states`:
    the driver's state of each CUDA process, `no_state` the answer of the others;
    `mig_monitor`: where to look for GPUs in MIG mode (None: MIG is allowed)."""
    if len(cuda_pids) > 1:
        raise NotCheckpointable(
            f"GPU work in several processes of the kernel's tree (pids "
            f"{', '.join(map(str, cuda_pids))}): the driver checkpoints processes one at a "
            "time and cannot capture state shared between them (CUDA IPC)"
        )
    version = driver_version or 0
    if version < min_driver_version:
        raise NotCheckpointable(
            f"CUDA driver API {cuda_version(version)} is older than "
            f"{cuda_version(min_driver_version)}: the checkpoint API needs driver r570+"
        )
    for pid in cuda_pids:
        if pid not in states:
            raise NotCheckpointable(
                f"Process {pid} holds GPU memory, but the driver has no checkpointable "
                f"CUDA state for it ({no_state.get(pid, 'no answer')})"
            )
    for pid, s in states.items():
        if s != "running":
            raise NotCheckpointable(f"CUDA process {pid} is {s}, not running")
    for u in uses:
        if u.mps:
            raise NotCheckpointable(
                f"GPU {u.index} ({u.uuid}) is used through MPS, which the driver cannot checkpoint"
            )
    if mig_monitor is not None:
        mig = {d["uuid"] for d in mig_monitor.devices() if d.get("mig")}
        for u in uses:
            if u.uuid in mig:
                raise NotCheckpointable(
                    f"GPU {u.index} ({u.uuid}) is in MIG mode; checkpointing MIG "
                    "instances is off (CudaCheckpointer.allow_mig)"
                )


def check_host_memory(
    pid: int, gpu_bytes: int, *, headroom: int, cgroup_root: str, meminfo_path: str
) -> None:
    """The offload copies the GPU memory into the process's host memory: refuse when
    that would leave less than the headroom (the OOM killer would pick a kernel)."""
    room = host_room(
        pid,
        cgroup_root=Path(cgroup_root) if cgroup_root else None,
        meminfo=Path(meminfo_path),
    )
    need = gpu_bytes + headroom
    if room is not None and room.bytes < need:
        raise InsufficientHostMemory(
            f"Offloading {gpu_bytes / GiB:.2f} GiB of GPU memory needs "
            f"{need / GiB:.2f} GiB of host memory (with "
            f"{headroom / GiB:.2f} GiB headroom), but only "
            f"{room.bytes / GiB:.2f} GiB is free ({room.source}); the kernel keeps running"
        )
