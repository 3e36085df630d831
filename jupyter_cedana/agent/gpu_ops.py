"""The GPU memory of the agent's kernels: the CUDA checkpoint before a dump and the CUDA
restore after a CRIU restore, through the same CudaCheckpointer (and native helper) a
root server uses in-process (gpu/cuda.py), run by the agent as root.

Dump: lock -> checkpoint (the GPU memory copied into the kernel's host memory, the GPU
freed) -> CRIU dump; a failed dump puts the GPU memory back (restore -> unlock) and the
kernel runs on. The offload's result goes into the image's manifest, which only root
writes (0600 in the agent's 0700 store). Restore: admission (free GPU memory) before
CRIU runs, then CRIU restore -> CUDA restore -> unlock while the tree is still stopped
-> the tree continues. A failed CUDA restore kills the restored tree; the image stays.

Which driver libraries are loaded is root's choice alone (`cuda_library` in the agent's
checkpoint.json: a directory holding libcuda.so.1 and libnvidia-ml.so.1; default the
system's), never a caller's: no request and no kernel environment reaches it, and the
helper and that directory must be root's (criu.check_root_only), as they run as root.

Offload tier (offload_ops.py): the GPU memory of a running kernel checkpointed into its
host memory, the process kept (`keep`), then put back (`reload`). While it is, a dump
takes that state as its own (no second lock) and a failed dump leaves it offloaded.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..checkpoint.proctree import open_device_files
from ..errors import CedanaError, NotCheckpointable
from ..gpu.cuda import CudaCheckpointer, CudaStateLeft
from ..gpu.monitor import GpuMonitor
from .criu import CriuSettings, UnsafeSetup, check_root_only
from .protocol import AgentError

LIBCUDA = "libcuda.so.1"
LIBNVML = "libnvidia-ml.so.1"
_log = logging.getLogger("jupyter_cedana.agent")

Frames = Callable[[dict[str, Any]], None]


class AgentGpu:
    def __init__(self, settings: CriuSettings):
        self.library_dir = settings.cuda_library or ""
        self.monitor = GpuMonitor(log=_log)
        self.cuda = CudaCheckpointer(
            monitor=self.monitor,
            helper_path=settings.cuda_helper,
            libcuda_path=os.path.join(self.library_dir, LIBCUDA) if self.library_dir else "",
            lock_timeout_ms=settings.cuda_lock_timeout_ms,
            host_memory_headroom_bytes=settings.cuda_host_headroom_bytes,
            log=_log,
        )
        self._nvml_loaded = False
        # CUDA pid -> the offload tier's state of its kernel, until reloaded or forgotten.
        self._kept: dict[int, dict[str, Any]] = {}

    def check_setup(self) -> None:
        """Refuse (UnsafeSetup) a helper or driver library someone but root could change:
        the agent runs them as root."""
        if os.path.exists(self.cuda.helper_path):
            check_root_only(self.cuda.helper_path, "CUDA checkpoint helper", is_dir=False)
        if self.library_dir:
            check_root_only(self.library_dir, "CUDA driver library directory", is_dir=True)
            for name in (LIBCUDA, LIBNVML):
                path = os.path.join(self.library_dir, name)
                if os.path.lexists(path):
                    check_root_only(path, "CUDA driver library", is_dir=False)

    def _load_nvml(self) -> None:
        """pynvml loads libnvidia-ml.so.1 by its bare name; loaded first from root's
        directory, that name resolves to it."""
        if self._nvml_loaded:
            return
        self._nvml_loaded = True
        path = os.path.join(self.library_dir, LIBNVML) if self.library_dir else ""
        if path and os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)

    async def offload(self, pids: Iterable[int], frames: Frames) -> Mapping[str, Any]:
        """Checkpoint the GPU memory of the tree's CUDA processes (an empty result for a
        CPU-only kernel). On failure the tree runs on with its GPU memory, or the error
        says what is left (CudaStateLeft). A tree offloaded already (the offload tier)
        gives the state it holds: its processes are checkpointed, not to be locked again."""
        pids = set(pids)
        held = self.kept_for(pids)
        if held is not None:
            return held
        self.check_setup()
        self._load_nvml()
        result = await self.cuda.offload(pids, progress=_progress(frames))
        if not result and not self.cuda.available:
            # Without NVML nor a driver the usage cannot be seen; a process holding a GPU
            # open would lose its GPU memory in a CPU-only image.
            prefix = self.monitor.device_path_prefix
            if any(open_device_files(p, prefix) for p in pids):
                raise NotCheckpointable(
                    "The kernel has an NVIDIA GPU open but the agent cannot checkpoint CUDA: "
                    f"{self.cuda.reason}"
                )
        return result

    async def put_back(self, state: Mapping[str, Any]) -> str | None:
        """After a failed dump, into the continued tree: None, or why the GPU memory could
        not be put back. A kernel offloaded before the dump stays so."""
        if self.kept_for(int(p) for p in state.get("pids") or []) is not None:
            return None
        try:
            await self.cuda.put_back(state)
        except CudaStateLeft as e:
            _log.error("GPU memory not put back after a failed dump: %s", e.message)
            return e.message
        return None

    async def admit(self, state: Mapping[str, Any] | None) -> dict[str, str]:
        """Before CRIU runs: where the GPU memory goes (InsufficientGpuMemory: nowhere)."""
        if not state:
            return {}
        self.check_setup()
        self._load_nvml()
        return await self.cuda.admit(state)

    async def restore(
        self,
        state: Mapping[str, Any],
        tasks: Iterable[int],
        plan: Mapping[str, str],
        frames: Frames,
    ) -> dict[str, Any]:
        """The CUDA restore and unlock of a CRIU-restored tree that is still stopped."""
        frames({"phase": "gpu-restore", "done": None, "total": None})
        return await self.cuda.restore(
            state, list(tasks), admission=plan, progress=_progress(frames), frozen=True
        )

    def kept_for(self, pids: Iterable[int]) -> dict[str, Any] | None:
        """The offload tier's state of the tree of `pids`, if it is offloaded."""
        return next((self._kept[p] for p in pids if p in self._kept), None)

    async def keep(self, pids: Iterable[int], frames: Frames) -> dict[str, Any]:
        """The offload tier: the GPU memory into host memory, the process kept; an empty
        result for a tree with none (nothing kept)."""
        result = await self.offload(pids, frames)
        if not result:  # an empty OffloadResult is falsy, its dict is not
            return {}
        state = dict(result)
        for pid in state.get("pids") or []:
            self._kept[int(pid)] = state
        return state

    async def reload(self, state: Mapping[str, Any], frames: Frames) -> dict[str, Any]:
        """Put an offloaded tree's GPU memory back, free GPU memory checked first
        (InsufficientGpuMemory: nothing touched). On failure it stays offloaded
        (CudaStateLeft with nothing kept: the driver lost it)."""
        self.check_setup()
        self._load_nvml()
        restored = await self.cuda.restore(state, None, admission=True, progress=_progress(frames))
        self.forget(state)
        return restored

    def forget(self, state: Mapping[str, Any]) -> None:
        """The tree no longer holds that state: reloaded, dumped, or exited."""
        for pid in state.get("pids") or []:
            if self._kept.get(int(pid)) is state:
                del self._kept[int(pid)]

    async def close(self) -> None:
        await self.cuda.stop()


def gpu_summary(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a reply tells the server of an offload: bytes held and freed, timings."""
    keys = ("memory_bytes", "bytes_freed", "lock_s", "checkpoint_s", "gb_per_s", "devices")
    return {k: state.get(k) for k in keys if k in state}


def as_agent_error(e: CedanaError, left: str | None = None) -> AgentError:
    """A GPU step's failure as the agent's answer; `left`: what putting back could not do."""
    message = e.message if left is None else f"{e.message}; {left}"
    if isinstance(e, NotCheckpointable | UnsafeSetup):
        return AgentError("refused", message)
    return AgentError("failed", message)


def _progress(frames: Frames) -> Callable[[str, int | None, int | None], None]:
    def report(phase: str, done: int | None, total: int | None) -> None:
        frames({"phase": phase, "done": done, "total": total})

    return report
