"""Restore admission: where checkpointed GPU memory can go back, decided from NVML's
free memory before anything is restored (a restore that runs out of GPU memory can leave
the process stuck for good, NVIDIA/cuda-checkpoint#44)."""

from __future__ import annotations

from typing import Any

from ..errors import InsufficientGpuMemory

GiB = 1 << 30


def admission_plan(
    needs: list[dict[str, Any]], gpus: list[dict[str, Any]], headroom: int
) -> dict[str, str]:
    """Old UUID -> new UUID for each checkpointed GPU in `needs` ({uuid, name,
    memory_bytes}): the same GPU when it has the memory plus `headroom` free, else the
    roomiest other GPU of the same model (not in MIG mode). `gpus` as
    GpuMonitor.devices(). Raises InsufficientGpuMemory when one does not fit anywhere."""
    devices = {d["uuid"]: d for d in gpus}
    room = {u: d["memory_free"] - headroom for u, d in devices.items()}
    plan: dict[str, str] = {}
    for need in sorted(needs, key=lambda d: -int(d.get("memory_bytes") or 0)):
        uuid, mem, name = need["uuid"], int(need.get("memory_bytes") or 0), need.get("name")
        if uuid in devices and room[uuid] >= mem:
            target = uuid
        else:
            others = [
                u
                for u, d in devices.items()
                if u != uuid and d["name"] == name and not d.get("mig") and room[u] >= mem
            ]
            if not others:
                here = (
                    f"{max(0, room[uuid]) / GiB:.2f} GiB free (after headroom) there"
                    if uuid in devices
                    else "that GPU is gone"
                )
                raise InsufficientGpuMemory(
                    f"Not enough free GPU memory to restore {mem / GiB:.2f} GiB onto "
                    f"{name} {uuid}: {here}, and no other {name} has room; the kernel "
                    "stays suspended"
                )
            target = max(others, key=lambda u: room[u])
        room[target] -= mem
        plan[uuid] = target
    return plan
