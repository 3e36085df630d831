"""CUDA checkpoint of a kernel's GPU memory, through the native helper `cedana-cuda --serve`.

The helper is one long-lived process (cuInit paid once) that calls the driver's
cuCheckpointProcess* API; this module speaks its JSON-lines protocol and adds what
the driver does not: preflight refusals, rollback on failure, restore admission
(is there GPU memory to restore into?) and GPU remapping by UUID.

Suspend: lock (with a timeout) -> checkpoint (device memory copied into the
process's host memory, the GPU freed). Resume: restore (onto the same or an
equivalent GPU) -> unlock.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from traitlets import Bool, Float, Instance, Int, Unicode
from traitlets.config import LoggingConfigurable

from .errors import GpuError, InsufficientGpuMemory, NotCheckpointable
from .gpu import GpuMonitor, GpuUse

DEFAULT_HELPER = Path(__file__).parent / "bin" / "cedana-cuda"

# Answers of cuCheckpointProcessGetState for a pid that is not a CUDA process.
_NOT_CUDA = {"CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_NOT_FOUND"}
_LOCK_TIMEOUT = {"CUDA_ERROR_NOT_READY", "CUDA_ERROR_TIMEOUT"}
# The driver refuses what it cannot checkpoint (UVM/managed memory, CUDA IPC, ...).
_UNSUPPORTED = {"CUDA_ERROR_NOT_SUPPORTED", "CHECKPOINT_API_MISSING"}

GiB = 1 << 30

Progress = Callable[[str, "int | None", "int | None"], Any]


class CudaCallError(GpuError):
    """One driver call failed; `cuda_error` is the CUresult name, `cuda_code` its number."""

    def __init__(self, message: str, cuda_error: str, cuda_code: int):
        super().__init__(message)
        self.cuda_error = cuda_error
        self.cuda_code = cuda_code


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


class CudaCheckpointer(LoggingConfigurable):
    """Client of the native CUDA checkpoint helper, plus the offload/restore procedures."""

    helper_path = Unicode(
        str(DEFAULT_HELPER), config=True, help="Path of the native helper (cedana-cuda)."
    )
    libcuda_path = Unicode(
        "",
        config=True,
        help="Driver library the helper loads (sets CEDANA_LIBCUDA); empty: libcuda.so.1.",
    )
    lock_timeout_ms = Int(
        10_000,
        config=True,
        help="Milliseconds to wait for a kernel's in-flight GPU work before giving up a "
        "suspend (the kernel keeps running).",
    )
    request_timeout = Float(
        1800.0,
        config=True,
        help="Seconds to wait for one helper request (checkpointing a large GPU takes long).",
    )
    min_driver_version = Int(
        12080,
        config=True,
        help="Lowest CUDA driver API version (cuDriverGetVersion) to checkpoint with: "
        "12080 = CUDA 12.8, driver r570, the first with GPU remapping on restore.",
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
    monitor = Instance(
        GpuMonitor, allow_none=True, help="GPU monitor for preflight, bytes freed and admission."
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proc: asyncio.subprocess.Process | None = None
        self._io = asyncio.Lock()
        self._next_id = 0
        self._info: dict[str, Any] | None = None
        self._reason: str | None = "not started"

    # ---- helper process ----

    async def start(self) -> None:
        """Start the helper (idempotent) and read the driver's capabilities."""
        if self._proc is not None and self._proc.returncode is None:
            return
        path = Path(self.helper_path)
        if not os.access(path, os.X_OK):
            self._info = None
            self._reason = f"native helper not found at {path}"
            self.log.info("CUDA checkpointing off: %s", self._reason)
            return
        env = dict(os.environ)
        if self.libcuda_path:
            env["CEDANA_LIBCUDA"] = self.libcuda_path
        self._proc = await asyncio.create_subprocess_exec(
            str(path),
            "--serve",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 20,
        )
        info = await self._call({"op": "info"})
        self._info = info
        self._reason = _capability_reason(info, self.min_driver_version)
        if self._reason:
            self.log.info("CUDA checkpointing off: %s", self._reason)
        else:
            self.log.info(
                "CUDA checkpointing on: driver API %s (%s)",
                _cuda_version(info.get("driver_version", 0)),
                info.get("library"),
            )

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        if proc.stdin:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()

    @property
    def available(self) -> bool:
        """The driver can checkpoint here (helper started, libcuda loaded, API present)."""
        return self._info is not None and self._reason is None

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def driver_version(self) -> int | None:
        """cuDriverGetVersion (e.g. 12080), None before start or without a driver."""
        return (self._info or {}).get("driver_version") or None

    async def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        async with self._io:
            proc = self._proc
            if proc is None or proc.returncode is not None or not proc.stdin or not proc.stdout:
                raise GpuError("the CUDA checkpoint helper is not running")
            self._next_id += 1
            req = {"id": self._next_id, **req}
            try:
                proc.stdin.write((json.dumps(req) + "\n").encode())
                await proc.stdin.drain()
                line = await asyncio.wait_for(proc.stdout.readline(), self.request_timeout)
            except (asyncio.TimeoutError, ConnectionError, BrokenPipeError) as e:
                # A stuck or dead helper would answer later requests out of turn.
                self._proc = None
                if proc.returncode is None:
                    proc.kill()
                raise GpuError(f"CUDA checkpoint helper failed on {req['op']}: {e!r}") from e
            if not line:
                self._proc = None
                raise GpuError(f"CUDA checkpoint helper exited during {req['op']}")
            resp: dict[str, Any] = json.loads(line)
            if resp.get("id") != req["id"]:
                self._proc = None
                proc.kill()
                raise GpuError("CUDA checkpoint helper answered out of turn")
            return resp

    async def _op(self, op: str, pid: int, **kw: Any) -> dict[str, Any]:
        if self._proc is None or self._proc.returncode is not None:
            await self.start()
        if not self.available:
            raise GpuError(f"CUDA checkpointing unavailable: {self._reason}")
        resp = await self._call({"op": op, "pid": int(pid), **kw})
        if not resp.get("ok"):
            raise CudaCallError(
                f"CUDA {op} of pid {pid} failed: {resp.get('message')} ({resp.get('error')})",
                str(resp.get("error")),
                int(resp.get("code", -1)),
            )
        return resp

    # ---- the driver calls ----

    async def state(self, pid: int) -> str | None:
        """running/locked/checkpointed/failed, or None when `pid` is not a CUDA process."""
        try:
            return str((await self._op("get_state", pid))["state"])
        except CudaCallError as e:
            if e.cuda_error in _NOT_CUDA:
                return None
            raise

    async def lock(self, pid: int, timeout_ms: int | None = None) -> float:
        """Lock (block new CUDA calls, wait for work in flight). Returns seconds taken."""
        ms = self.lock_timeout_ms if timeout_ms is None else timeout_ms
        return float((await self._op("lock", pid, timeout_ms=int(ms)))["elapsed_s"])

    async def checkpoint(self, pid: int) -> float:
        """Copy device memory into host memory and release the GPU. Returns seconds."""
        return float((await self._op("checkpoint", pid))["elapsed_s"])

    async def restore_process(self, pid: int, device_map: Mapping[str, str] | None = None) -> float:
        """Put device memory back (optionally onto other GPUs: old UUID -> new UUID; then
        every GPU of the process must be listed). The process ends LOCKED. Returns seconds."""
        kw: dict[str, Any] = {}
        if device_map:
            kw["device_map"] = ",".join(f"{o}={n}" for o, n in device_map.items())
        return float((await self._op("restore", pid, **kw))["elapsed_s"])

    async def unlock(self, pid: int) -> float:
        return float((await self._op("unlock", pid))["elapsed_s"])

    # ---- offload ----

    def _usage(self, pids: set[int]) -> list[GpuUse]:
        m = self.monitor
        return m.usage(pids) if m is not None and m.available else []

    def _free(self) -> dict[str, int] | None:
        m = self.monitor
        if m is None or not m.available:
            return None
        return {d["uuid"]: int(d["memory_free"]) for d in m.devices()}

    async def offload(self, pids: Iterable[int], progress: Progress | None = None) -> OffloadResult:
        """Checkpoint the GPU memory of every CUDA process among `pids` (a kernel's tree).

        Returns an empty (falsy) result when none uses CUDA. Raises NotCheckpointable
        (preflight or driver refusal) or GpuError; on any failure the processes are
        left running as before.
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
        states: dict[int, str] = {}
        for pid in sorted(pids):
            try:
                s = await self.state(pid)
            except CudaCallError as e:
                if e.cuda_error in _UNSUPPORTED:
                    raise NotCheckpointable(
                        f"The driver cannot checkpoint process {pid}: {e.message}"
                    ) from e
                raise
            if s is not None:
                states[pid] = s
        nvml_pids = {p for u in uses for p in u.pids} & pids
        cuda_pids = sorted(set(states) | nvml_pids)
        if not cuda_pids:
            return OffloadResult.empty()
        self._preflight(cuda_pids, states, uses)

        before = self._free()
        result = OffloadResult(
            pids=cuda_pids,
            processes=[
                {"pid": p, "devices": [_dev_json(u) for u in uses if p in u.pids]}
                for p in cuda_pids
            ],
            devices=[_dev_json(u) for u in uses],
            memory_bytes=sum(u.memory_bytes for u in uses),
            driver_version=self.driver_version,
            nvml_driver_version=self.monitor.driver_version if self.monitor else None,
            matched_by=sorted({u.matched_by for u in uses}),
        )
        done: list[int] = []  # processes locked or further
        t0 = time.monotonic()
        try:
            await _report(progress, "gpu-lock", 0, len(cuda_pids))
            for i, pid in enumerate(cuda_pids):
                done.append(pid)
                await self._lock_or_explain(pid)
                await _report(progress, "gpu-lock", i + 1, len(cuda_pids))
            t1 = time.monotonic()
            await _report(progress, "gpu-checkpoint", 0, len(cuda_pids))
            for i, pid in enumerate(cuda_pids):
                await self.checkpoint(pid)
                await _report(progress, "gpu-checkpoint", i + 1, len(cuda_pids))
            t2 = time.monotonic()
        except BaseException as e:
            problems = await self._rollback(done)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise _explain(e, problems) from e
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

    def _preflight(self, cuda_pids: list[int], states: dict[int, str], uses: list[GpuUse]) -> None:
        if len(cuda_pids) > 1:
            raise NotCheckpointable(
                f"GPU work in several processes of the kernel's tree (pids "
                f"{', '.join(map(str, cuda_pids))}): the driver checkpoints processes one at a "
                "time and cannot capture state shared between them (CUDA IPC)"
            )
        version = self.driver_version or 0
        if version < self.min_driver_version:
            raise NotCheckpointable(
                f"CUDA driver API {_cuda_version(version)} is older than "
                f"{_cuda_version(self.min_driver_version)}: the checkpoint API needs driver r570+"
            )
        for pid, s in states.items():
            if s != "running":
                raise NotCheckpointable(f"CUDA process {pid} is {s}, not running")
        for u in uses:
            if u.mps:
                raise NotCheckpointable(
                    f"GPU {u.index} ({u.uuid}) is used through MPS, which the driver "
                    "cannot checkpoint"
                )
        if not self.allow_mig and self.monitor is not None:
            mig = {d["uuid"] for d in self.monitor.devices() if d.get("mig")}
            for u in uses:
                if u.uuid in mig:
                    raise NotCheckpointable(
                        f"GPU {u.index} ({u.uuid}) is in MIG mode; checkpointing MIG "
                        "instances is off (CudaCheckpointer.allow_mig)"
                    )

    async def _lock_or_explain(self, pid: int) -> None:
        try:
            await self.lock(pid)
        except CudaCallError as e:
            if e.cuda_error in _LOCK_TIMEOUT:
                raise GpuError(
                    f"CUDA lock of pid {pid} timed out after {self.lock_timeout_ms} ms: the "
                    "kernel has GPU work in flight; it keeps running"
                ) from e
            raise

    async def _rollback(self, pids: list[int]) -> list[str]:
        """Put each process back to RUNNING; returns what could not be undone."""
        problems = []
        for pid in reversed(pids):
            try:
                s = await self.state(pid)
                if s == "checkpointed":
                    await self.restore_process(pid)
                    s = "locked"
                if s == "locked":
                    await self.unlock(pid)
            except Exception as e:  # keep undoing the others
                problems.append(f"pid {pid}: {e}")
                self.log.error("Could not put CUDA process %s back to running: %s", pid, e)
        return problems

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
        devices = {d["uuid"]: d for d in m.devices()}
        room = {u: d["memory_free"] - self.restore_headroom_bytes for u, d in devices.items()}
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

    async def restore(
        self,
        state: Mapping[str, Any],
        new_pids: Mapping[int, int] | Iterable[int] | None = None,
        admission: bool | Mapping[str, str] = True,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Restore GPU memory checkpointed by offload() -> then unlock.

        `state` is offload()'s result (or its JSON from a manifest). `new_pids`: None when
        the processes are the same (offload tier); after a CRIU restore, {old: new} or the
        new process tree, in which the checkpointed CUDA process is looked up. `admission`:
        True checks free GPU memory first (InsufficientGpuMemory, nothing touched); a
        mapping is a plan from admit(); False skips the check. A failed restore leaves the
        process checkpointed. Returns timings (JSON).
        """
        old_pids = [int(p) for p in state.get("pids") or []]
        if not old_pids:
            return {"pids": [], "restore_s": 0.0, "unlock_s": 0.0}
        if isinstance(admission, Mapping):
            plan = dict(admission)
        elif admission:
            plan = await self.admit(state)
        else:
            plan = {}
        pid_map = await self._map_pids(old_pids, new_pids)
        remap = any(o != n for o, n in plan.items())
        procs = {int(p["pid"]): p for p in state.get("processes") or []}
        restored: list[int] = []
        t0 = time.monotonic()
        try:
            await _report(progress, "gpu-restore", 0, len(old_pids))
            for i, old in enumerate(old_pids):
                new = pid_map[old]
                dmap = None
                if remap:
                    # the driver wants every GPU of the process listed once any is remapped
                    uuids = [d["uuid"] for d in procs.get(old, {}).get("devices", [])] or list(plan)
                    dmap = {u: plan.get(u, u) for u in uuids}
                await self.restore_process(new, dmap)
                restored.append(new)
                await _report(progress, "gpu-restore", i + 1, len(old_pids))
            t1 = time.monotonic()
            for new in restored:
                await self.unlock(new)
            t2 = time.monotonic()
        except BaseException as e:
            # keep every process checkpointed, as before the call
            for new in restored:
                try:
                    if await self.state(new) == "locked":
                        await self.checkpoint(new)
                except Exception as e2:
                    self.log.error("Could not re-checkpoint CUDA process %s: %s", new, e2)
            if isinstance(e, CudaCallError) and e.cuda_error == "CUDA_ERROR_OUT_OF_MEMORY":
                # admission passed but memory went meanwhile; current drivers may then
                # refuse every later restore of this process (NVIDIA/cuda-checkpoint#44)
                raise InsufficientGpuMemory(
                    f"The GPU ran out of memory during restore: {e.message}"
                ) from e
            if isinstance(e, asyncio.CancelledError | GpuError):
                raise
            raise GpuError(f"CUDA restore failed: {e}") from e
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

    async def _map_pids(
        self, old_pids: list[int], new_pids: Mapping[int, int] | Iterable[int] | None
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
            if await self.state(p) == "checkpointed":
                candidates.append(p)
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


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "unknown"


def _capability_reason(info: Mapping[str, Any], min_version: int) -> str | None:
    if not info.get("ok"):
        return f"CUDA checkpoint helper failed: {info.get('message')}"
    if not info.get("loaded"):
        return f"no NVIDIA driver ({info.get('init_message') or 'libcuda.so.1 not found'})"
    if not info.get("checkpoint_api"):
        return (
            f"driver (CUDA {_cuda_version(int(info.get('driver_version') or 0))}) has no CUDA "
            "checkpoint API: needs driver r570+ (CUDA 12.8)"
        )
    if info.get("init_result", 0) != 0:
        return f"cuInit failed: {info.get('init_error')} ({info.get('init_message')})"
    return None


def _explain(e: BaseException, problems: list[str]) -> Exception:
    """The error to raise for a failed offload, after rollback."""
    tail = (
        "; the kernel was put back to running"
        if not problems
        else "; putting the kernel back failed too: " + "; ".join(problems)
    )
    if isinstance(e, CudaCallError) and e.cuda_error in _UNSUPPORTED:
        return NotCheckpointable(
            f"The driver cannot checkpoint this kernel (managed/UVM memory, CUDA IPC or "
            f"another unsupported feature): {e.message}{tail}"
        )
    if isinstance(e, GpuError):
        return GpuError(e.message + tail)
    return GpuError(f"GPU offload failed: {e}{tail}")


async def _report(progress: Progress | None, phase: str, done: int, total: int) -> None:
    if progress is None:
        return
    r = progress(phase, done, total)
    if inspect.isawaitable(r):
        await r
