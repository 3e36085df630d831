"""CUDA checkpoint of a kernel's GPU memory: the procedures on top of the driver calls
of the native helper (cuda_helper.py). They add what the driver does not: preflight
refusals and a host-memory check (preflight.py), rollback on failure, restore
admission (is there GPU memory to restore into?) and GPU remapping by UUID.

Suspend: lock (with a timeout) -> checkpoint (device memory copied into the process's
host memory, the GPU freed). Resume: restore (onto the same or an equivalent GPU) ->
unlock; after a CRIU restore, while the restored process is still stopped.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from traitlets import Bool, Instance, Int, Unicode

from ..checkpoint.proctree import open_device_files
from ..errors import CedanaError, GpuError, InsufficientGpuMemory, NotCheckpointable
from .admission import admission_plan
from .cuda_helper import CudaCallError, CudaHelper
from .monitor import GpuMonitor, GpuUse
from .preflight import check_host_memory, preflight

__all__ = ["CudaCallError", "CudaCheckpointer", "CudaStateLeft", "OffloadResult"]

_LOCK_TIMEOUT = {"CUDA_ERROR_NOT_READY", "CUDA_ERROR_TIMEOUT"}
# The driver refuses what it cannot checkpoint (UVM/managed memory, CUDA IPC, ...).
_UNSUPPORTED = {"CUDA_ERROR_NOT_SUPPORTED", "CHECKPOINT_API_MISSING"}

Progress = Callable[[str, "int | None", "int | None"], Any]


class CudaStateLeft(GpuError):
    """A failed step could not put the kernel's CUDA processes back to running. `kept`:
    the offload to restore from later (the GPU memory is safe in host memory), or None
    when the CUDA state is lost (the driver's FAILED state)."""

    def __init__(self, message: str, kept: Mapping[str, Any] | None):
        super().__init__(message)
        self.kept = dict(kept) if kept is not None else None


class OffloadResult(dict):
    """What an offload did, as a JSON-ready dict (it goes into the checkpoint manifest).

    Keys: pids, processes [{pid, devices}], devices [{uuid, index, name, memory_bytes}],
    memory_bytes, bytes_freed (None without NVML), lock_s, checkpoint_s, gb_per_s,
    driver_version, offloaded_at. Falsy when nothing was offloaded (a CPU-only kernel).
    """

    def __bool__(self) -> bool:
        return bool(self.get("pids"))

    @property
    def pids(self) -> list[int]:
        return list(self.get("pids", []))

    @property
    def bytes_freed(self) -> int:
        return int(self.get("bytes_freed") or 0)

    def to_json(self) -> dict[str, Any]:
        return dict(self)

    @classmethod
    def empty(cls) -> OffloadResult:
        return cls(pids=[], processes=[], devices=[], memory_bytes=0, bytes_freed=0)


class CudaCheckpointer(CudaHelper):
    """Offload and restore of a kernel's GPU memory through the native helper."""

    lock_timeout_ms = Int(
        10_000,
        config=True,
        help="Milliseconds to wait for a kernel's in-flight GPU work before giving up a "
        "suspend (the kernel keeps running).",
    )
    allow_mig = Bool(
        False,
        config=True,
        help="Allow checkpointing kernels on MIG instances (off: refused in preflight).",
    )
    restore_headroom_bytes = Int(
        256 << 20,
        config=True,
        help="Free GPU memory a restore must leave beyond the checkpointed amount "
        "(a restore that runs out of GPU memory can leave the process stuck).",
    )
    host_memory_headroom_bytes = Int(
        1 << 30,
        config=True,
        help="Host memory that must stay free after an offload has moved a kernel's GPU "
        "memory into host memory (MemAvailable, and the limit of the kernel's cgroup); "
        "an offload that would not leave it is refused instead of inviting the OOM killer.",
    )
    cgroup_root = Unicode(
        "",
        config=True,
        help="Where the cgroup v2 hierarchy is mounted, for the host memory check; empty: "
        "found in /proc/self/mountinfo.",
    )
    meminfo_path = Unicode(
        "/proc/meminfo", config=True, help="Where the host memory check reads MemAvailable."
    )
    restore_frozen = Bool(
        True,
        config=True,
        help="Restore the GPU memory of a kernel restored from disk while it is still "
        "stopped, letting only the driver's restore thread run (ptrace), as CRIU's cuda "
        "plugin does, so that none of its code runs before its device memory is back. "
        "Off: restore it right after the kernel was continued.",
    )
    monitor = Instance(
        GpuMonitor, allow_none=True, help="GPU monitor for preflight, bytes freed and admission."
    )

    # ---- offload ----

    def _usage(self, pids: set[int]) -> list[GpuUse]:
        m = self.monitor
        return m.usage(pids) if m is not None and m.available else []

    def _free(self) -> dict[str, int] | None:
        m = self.monitor
        if m is None or not m.available:
            return None
        return {d["uuid"]: int(d["memory_free"]) for d in m.devices()}

    def _holds_gpu_files(self, pid: int) -> bool:
        prefix = self.monitor.device_path_prefix if self.monitor is not None else "/dev/nvidia"
        return bool(open_device_files(pid, prefix))

    async def offload(self, pids: Iterable[int], progress: Progress | None = None) -> OffloadResult:
        """Checkpoint the GPU memory of every CUDA process among `pids` (a kernel's tree).

        Returns an empty (falsy) result when none uses CUDA. Raises NotCheckpointable
        (preflight or driver refusal), InsufficientHostMemory, GpuError, or CudaStateLeft
        when a failure could not be rolled back; otherwise the processes are left running
        as before.
        """
        pids = {int(p) for p in pids}
        uses = self._usage(pids)
        if self._proc is None:
            await self.start()
        if not self.available:
            if uses:
                raise NotCheckpointable(
                    f"The kernel holds GPU memory but CUDA checkpointing is unavailable: "
                    f"{self._reason}"
                )
            return OffloadResult.empty()
        nvml_pids = {p for u in uses for p in u.pids} & pids
        states, no_state = await self._states(pids, nvml_pids)
        cuda_pids = sorted(set(states) | nvml_pids)
        if not cuda_pids:
            return OffloadResult.empty()
        preflight(
            cuda_pids,
            states,
            uses,
            no_state,
            driver_version=self.driver_version,
            min_driver_version=self.min_driver_version,
            mig_monitor=None if self.allow_mig else self.monitor,
        )
        memory = sum(u.memory_bytes for u in uses)
        check_host_memory(
            cuda_pids[0],
            memory,
            headroom=self.host_memory_headroom_bytes,
            cgroup_root=self.cgroup_root,
            meminfo_path=self.meminfo_path,
        )

        before = self._free()
        result = OffloadResult(
            pids=cuda_pids,
            processes=[
                {"pid": p, "devices": [_dev_json(u) for u in uses if p in u.pids]}
                for p in cuda_pids
            ],
            devices=[_dev_json(u) for u in uses],
            memory_bytes=memory,
            driver_version=self.driver_version,
            nvml_driver_version=self.monitor.driver_version if self.monitor else None,
            matched_by=sorted({u.matched_by for u in uses}),
        )
        t0 = time.monotonic()
        try:
            await _report(progress, "gpu-lock", 0, len(cuda_pids))
            for i, pid in enumerate(cuda_pids):
                await self._lock_or_explain(pid)
                await _report(progress, "gpu-lock", i + 1, len(cuda_pids))
            t1 = time.monotonic()
            await _report(progress, "gpu-checkpoint", 0, len(cuda_pids))
            for i, pid in enumerate(cuda_pids):
                await self.checkpoint(pid)
                await _report(progress, "gpu-checkpoint", i + 1, len(cuda_pids))
            t2 = time.monotonic()
        except BaseException as e:
            try:
                await self.put_back(result)
            except CudaStateLeft as left:
                raise CudaStateLeft(f"{_explain(e).message}; {left.message}", left.kept) from e
            if isinstance(e, asyncio.CancelledError):
                raise
            raise _explain(e, "; the kernel was put back to running") from e
        after = self._free()
        result["lock_s"] = round(t1 - t0, 6)
        result["checkpoint_s"] = round(t2 - t1, 6)
        held = int(result["memory_bytes"])
        result["gb_per_s"] = round(held / (t2 - t1) / 1e9, 3) if held and t2 > t1 else None
        if before is not None and after is not None:
            # only the kernel's GPUs: other tenants' allocations must not count
            uuids = {d["uuid"] for d in result["devices"]} or set(after)
            result["bytes_freed"] = sum(max(0, after.get(u, 0) - before.get(u, 0)) for u in uuids)
        else:
            result["bytes_freed"] = None
        result["offloaded_at"] = time.time()
        self.log.info(
            "Offloaded GPU memory of pids %s: %.2f GB in %.2f s (lock %.2f s)",
            cuda_pids,
            held / 1e9,
            t2 - t1,
            t1 - t0,
        )
        return result

    async def _states(
        self, pids: set[int], nvml_pids: set[int]
    ) -> tuple[dict[int, str], dict[int, str]]:
        """The driver's state of each CUDA process among `pids`, and for the others the
        CUresult that said they have none."""
        states: dict[int, str] = {}
        no_state: dict[int, str] = {}
        for pid in sorted(pids):
            try:
                s, err = await self.probe(pid)
            except CudaCallError as e:
                # An answer that does not say "no CUDA here": a process without any NVIDIA
                # device open and not seen by NVML cannot hold CUDA state all the same.
                if pid in nvml_pids or self._holds_gpu_files(pid):
                    raise GpuError(
                        f"Cannot tell the CUDA state of process {pid}: {e.message}"
                    ) from e
                self.log.debug("pid %s: %s; it holds no GPU: not a CUDA process", pid, e)
                continue
            if s is not None:
                states[pid] = s
            elif err is not None:
                no_state[pid] = err
        return states, no_state

    async def _lock_or_explain(self, pid: int) -> None:
        try:
            await self.lock(pid, self.lock_timeout_ms)
        except CudaCallError as e:
            if e.cuda_error in _LOCK_TIMEOUT:
                raise GpuError(
                    f"CUDA lock of pid {pid} timed out after {self.lock_timeout_ms} ms: the "
                    "kernel has GPU work in flight; it keeps running"
                ) from e
            raise

    async def put_back(self, result: Mapping[str, Any]) -> None:
        """Bring the processes of an offload (or a failed one) back to running, checking
        GPU memory first: a restore that runs out of it can wedge the process for good.
        Raises CudaStateLeft when they are not all running afterwards."""
        try:
            await self.restore(result, None, admission=True)
            return
        except (GpuError, InsufficientGpuMemory) as e:
            why = getattr(e, "message", str(e))
        lost = []
        for pid in result.get("pids") or []:
            try:
                s = await self.state(int(pid))
            except GpuError as e:
                s = f"unknown ({e.message})"
            if s not in ("running", "locked", "checkpointed"):
                lost.append(f"pid {pid} is {s}")
        if lost:
            raise CudaStateLeft(f"the kernel's CUDA state is lost ({'; '.join(lost)}): {why}", None)
        raise CudaStateLeft(f"its GPU memory stays in host memory: {why}", result)

    # ---- restore ----

    async def admit(self, state: Mapping[str, Any]) -> dict[str, str]:
        """Restore admission: which GPU each checkpointed GPU goes back to (old UUID ->
        new UUID; identity when it stays). Raises InsufficientGpuMemory when no GPU of
        the same model has room. Without NVML nothing can be checked: identity."""
        needs = list(state.get("devices") or [])
        m = self.monitor
        if not needs:
            return {}
        if m is None or not m.available:
            self.log.warning("GPU restore admission skipped: no NVML to check free memory")
            return {d["uuid"]: d["uuid"] for d in needs}
        return admission_plan(needs, m.devices(), self.restore_headroom_bytes)

    async def restore(
        self,
        state: Mapping[str, Any],
        new_pids: Mapping[int, int] | Iterable[int] | None = None,
        admission: bool | Mapping[str, str] = True,
        progress: Progress | None = None,
        frozen: bool = False,
    ) -> dict[str, Any]:
        """Restore GPU memory checkpointed by offload(), then unlock.

        `state` is offload()'s result (or its JSON from a manifest). `new_pids`: None when
        the processes are the same (offload tier); after a CRIU restore, {old: new} or the
        new process tree, in which the checkpointed CUDA process is looked up. `admission`:
        True checks free GPU memory first (InsufficientGpuMemory, nothing touched); a
        mapping is a plan from admit(); False skips the check. `frozen`: the processes are
        stopped (just restored by CRIU) and stay so; their restore threads run for the
        calls. A process already locked is only unlocked, one running is left alone. A
        failed restore leaves the processes checkpointed (CudaStateLeft when the driver
        lost them). Returns timings (JSON).
        """
        old_pids = [int(p) for p in state.get("pids") or []]
        if not old_pids:
            return {"pids": [], "restore_s": 0.0, "unlock_s": 0.0}
        pid_map = await self._map_pids(old_pids, new_pids, frozen)
        states = {old: await self.state(pid_map[old], thaw=frozen) for old in old_pids}
        for old, s in states.items():
            if s not in ("checkpointed", "locked", "running"):
                raise GpuError(f"CUDA process {pid_map[old]} is {s}: it cannot be restored")
        if isinstance(admission, Mapping):
            plan = dict(admission)
        elif admission and "checkpointed" in states.values():
            plan = await self.admit(state)
        else:
            plan = {}
        remap = any(o != n for o, n in plan.items())
        procs = {int(p["pid"]): p for p in state.get("processes") or []}
        restored: list[int] = []
        t0 = time.monotonic()
        try:
            await _report(progress, "gpu-restore", 0, len(old_pids))
            for i, old in enumerate(old_pids):
                new = pid_map[old]
                if states[old] == "checkpointed":
                    dmap = None
                    if remap:
                        # the driver wants every GPU of the process listed once any moves
                        uuids = [d["uuid"] for d in procs.get(old, {}).get("devices", [])]
                        dmap = {u: plan.get(u, u) for u in uuids or plan}
                    await self.restore_process(new, dmap, thaw=frozen)
                    restored.append(new)
                await _report(progress, "gpu-restore", i + 1, len(old_pids))
            t1 = time.monotonic()
            for old in old_pids:
                if states[old] != "running":
                    await self.unlock(pid_map[old], thaw=frozen)
            t2 = time.monotonic()
        except BaseException as e:
            raise await self._restore_failed(e, restored, list(pid_map.values()), frozen) from e
        held = int(state.get("memory_bytes") or 0)
        out = {
            "pids": [pid_map[p] for p in old_pids],
            "device_map": plan,
            "restore_s": round(t1 - t0, 6),
            "unlock_s": round(t2 - t1, 6),
            "gb_per_s": round(held / (t1 - t0) / 1e9, 3) if held and t1 > t0 else None,
        }
        self.log.info("Restored GPU memory of pids %s in %.2f s", out["pids"], t1 - t0)
        return out

    async def _restore_failed(
        self, e: BaseException, restored: list[int], pids: list[int], frozen: bool
    ) -> BaseException:
        """Keep every process checkpointed, as before the call, and say what happened."""
        if not frozen:  # a frozen (CRIU-restored) process is killed: its image has the state
            for new in restored:
                try:
                    if await self.state(new) == "locked":
                        await self.checkpoint(new)
                except Exception as e2:
                    self.log.error("Could not re-checkpoint CUDA process %s: %s", new, e2)
        if isinstance(e, asyncio.CancelledError):
            return e
        failed = []
        for pid in pids:
            try:
                if await self.state(pid, thaw=frozen) == "failed":
                    failed.append(pid)
            except GpuError:
                pass
        why = getattr(e, "message", None) or str(e)
        if failed:
            return CudaStateLeft(f"the driver lost the CUDA state of pids {failed}: {why}", None)
        if isinstance(e, CudaCallError) and e.cuda_error == "CUDA_ERROR_OUT_OF_MEMORY":
            # admission passed but memory went meanwhile; current drivers may then
            # refuse every later restore of this process (NVIDIA/cuda-checkpoint#44)
            return InsufficientGpuMemory(f"The GPU ran out of memory during restore: {why}")
        if isinstance(e, GpuError):
            return e
        return GpuError(f"CUDA restore failed: {e}")

    async def _map_pids(
        self,
        old_pids: list[int],
        new_pids: Mapping[int, int] | Iterable[int] | None,
        frozen: bool,
    ) -> dict[int, int]:
        if new_pids is None:
            return {p: p for p in old_pids}
        if isinstance(new_pids, Mapping):
            m = {int(k): int(v) for k, v in new_pids.items()}
            return {p: m.get(p, p) for p in old_pids}
        tree = sorted({int(p) for p in new_pids})
        out: dict[int, int] = {}
        candidates = []
        for p in tree:
            try:
                if await self.state(p, thaw=frozen) == "checkpointed":
                    candidates.append(p)
            except CudaCallError as e:
                self.log.debug("pid %s of the restored tree: %s", p, e)
        for old in old_pids:
            if old in candidates:
                out[old] = old
                candidates.remove(old)
        for old in old_pids:
            if old not in out:
                if not candidates:
                    raise GpuError(
                        f"No checkpointed CUDA process among pids {tree} to restore (was pid {old})"
                    )
                out[old] = candidates.pop(0)
        return out


def _dev_json(u: GpuUse) -> dict[str, Any]:
    return {"uuid": u.uuid, "index": u.index, "name": u.name, "memory_bytes": u.memory_bytes}


def _explain(e: BaseException, tail: str = "") -> CedanaError:
    """The error to raise for a failed offload (after rollback)."""
    if isinstance(e, CudaCallError) and e.cuda_error in _UNSUPPORTED:
        return NotCheckpointable(
            f"The driver cannot checkpoint this kernel (managed/UVM memory, CUDA IPC or "
            f"another unsupported feature): {e.message}{tail}"
        )
    if isinstance(e, GpuError):
        return GpuError(e.message + tail)
    return GpuError(f"GPU offload failed: {e!r}{tail}")


async def _report(progress: Progress | None, phase: str, done: int, total: int) -> None:
    if progress is None:
        return
    r = progress(phase, done, total)
    if inspect.isawaitable(r):
        await r
