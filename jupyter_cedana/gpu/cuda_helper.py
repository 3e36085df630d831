"""Client of the native CUDA checkpoint helper `cedana-cuda --serve`.

The helper is one long-lived process (cuInit paid once) that calls the driver's
cuCheckpointProcess* API; this module speaks its JSON-lines protocol, one request at a
time. The procedures built on these calls (offload, rollback, admission, restore) are
in cuda.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from traitlets import Float, Int, Unicode
from traitlets.config import LoggingConfigurable

from ..errors import GpuError
from ..package_files import BIN_DIR

DEFAULT_HELPER = BIN_DIR / "cedana-cuda"

# What the driver answers for a pid without checkpointable CUDA state: the CUDA 13 header
# lists INVALID_VALUE, NOT_INITIALIZED and NOT_SUPPORTED for cuCheckpointProcessGetState,
# without saying which a process that never used CUDA gets; NOT_FOUND is what the
# helper's callers have seen for restore-thread lookups.
NOT_CUDA = frozenset(
    {
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_NOT_INITIALIZED",
        "CUDA_ERROR_NOT_FOUND",
        "CUDA_ERROR_NOT_SUPPORTED",
    }
)


class CudaCallError(GpuError):
    """One driver call failed; `cuda_error` is the CUresult name, `cuda_code` its number."""

    def __init__(self, message: str, cuda_error: str, cuda_code: int):
        super().__init__(message)
        self.cuda_error = cuda_error
        self.cuda_code = cuda_code


class CudaHelper(LoggingConfigurable):
    """The helper process and one method per driver call."""

    helper_path = Unicode(
        str(DEFAULT_HELPER), config=True, help="Path of the native helper (cedana-cuda)."
    )
    libcuda_path = Unicode(
        "",
        config=True,
        help="Driver library the helper loads (sets CEDANA_LIBCUDA); empty: libcuda.so.1.",
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

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proc: asyncio.subprocess.Process | None = None
        self._io = asyncio.Lock()
        self._next_id = 0
        self._info: dict[str, Any] | None = None
        self._reason: str | None = "not started"

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
                cuda_version(info.get("driver_version", 0)),
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
        except TimeoutError:
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
            except (TimeoutError, ConnectionError, BrokenPipeError) as e:
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
    # thaw=True: the process is stopped (just restored by CRIU); its restore thread is
    # let run for the call (see native/cedana-cuda.c).

    async def probe(self, pid: int, thaw: bool = False) -> tuple[str | None, str | None]:
        """(state, None) for a CUDA process (running/locked/checkpointed/failed), or
        (None, CUresult name) when the driver says `pid` has no CUDA state."""
        try:
            resp = await self._op("get_state", pid, **_thaw(thaw))
        except CudaCallError as e:
            if e.cuda_error in NOT_CUDA:
                return None, e.cuda_error
            raise
        return str(resp["state"]), None

    async def state(self, pid: int, thaw: bool = False) -> str | None:
        """running/locked/checkpointed/failed, or None when `pid` is not a CUDA process."""
        return (await self.probe(pid, thaw))[0]

    async def lock(self, pid: int, timeout_ms: int) -> float:
        """Lock (block new CUDA calls, wait for work in flight). Returns seconds taken."""
        return float((await self._op("lock", pid, timeout_ms=int(timeout_ms)))["elapsed_s"])

    async def checkpoint(self, pid: int) -> float:
        """Copy device memory into host memory and release the GPU. Returns seconds."""
        return float((await self._op("checkpoint", pid))["elapsed_s"])

    async def restore_process(
        self, pid: int, device_map: Mapping[str, str] | None = None, thaw: bool = False
    ) -> float:
        """Put device memory back (optionally onto other GPUs: old UUID -> new UUID; then
        every GPU of the process must be listed). The process ends LOCKED. Returns seconds."""
        kw: dict[str, Any] = _thaw(thaw)
        if device_map:
            kw["device_map"] = ",".join(f"{o}={n}" for o, n in device_map.items())
        return float((await self._op("restore", pid, **kw))["elapsed_s"])

    async def unlock(self, pid: int, thaw: bool = False) -> float:
        return float((await self._op("unlock", pid, **_thaw(thaw)))["elapsed_s"])


def _thaw(thaw: bool) -> dict[str, Any]:
    return {"thaw": 1} if thaw else {}


def cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "unknown"


def _capability_reason(info: Mapping[str, Any], min_version: int) -> str | None:
    if not info.get("ok"):
        return f"CUDA checkpoint helper failed: {info.get('message')}"
    if not info.get("loaded"):
        return f"no NVIDIA driver ({info.get('init_message') or 'libcuda.so.1 not found'})"
    if not info.get("checkpoint_api"):
        return (
            f"driver (CUDA {cuda_version(int(info.get('driver_version') or 0))}) has no CUDA "
            "checkpoint API: needs driver r570+ (CUDA 12.8)"
        )
    if info.get("init_result", 0) != 0:
        return f"cuInit failed: {info.get('init_error')} ({info.get('init_message')})"
    return None
