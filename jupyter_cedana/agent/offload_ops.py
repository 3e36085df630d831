"""The agent's offload tier: `offload` and `reload` (docs/agent.md#gpu-memory).

`offload` checkpoints the GPU memory of a running kernel the agent launched or restored
for the caller into that kernel's own host memory and frees the GPU, the process kept
(lock -> checkpoint, as a dump's first step, gpu_ops.py); `reload` puts it back
(admission -> restore -> unlock). While offloaded the record says so (`list`, `poll`),
its signals but SIGKILL are refused (its CUDA calls block, as in-process), and a `dump`
takes the offloaded state as its own, without a second lock (AgentGpu.offload).
"""

from __future__ import annotations

import logging
from typing import Any

from ..checkpoint.proctree import process_tree
from ..errors import CedanaError, InsufficientGpuMemory
from ..gpu.cuda import CudaStateLeft
from .gpu_ops import AgentGpu, as_agent_error, gpu_summary
from .imagestore import kernel_id_arg
from .kernels import KernelRecord, KernelTable, State
from .protocol import AgentError
from .service import Caller, Progress, ProgressFrames, Service

_log = logging.getLogger("jupyter_cedana.agent")


class OffloadOps:
    def __init__(self, kernels: KernelTable, gpu: AgentGpu):
        self.kernels = kernels
        self.gpu = gpu
        kernels.on_change(self._changed)

    def register(self, service: Service) -> None:
        service.register("offload", self.op_offload)
        service.register("reload", self.op_reload)

    def _changed(self, record: KernelRecord) -> None:
        """A dumped or exited kernel holds no offloaded GPU memory any more: its pids
        must not be taken for it by a later dump."""
        if record.offloaded is not None and record.state in (State.dumped, State.exited):
            self.gpu.forget(record.offloaded)
            record.offloaded = None

    async def op_offload(
        self, caller: Caller, args: dict[str, Any], progress: Progress
    ) -> dict[str, Any]:
        kid = kernel_id_arg(args)
        record = self.kernels.lookup(caller.uid, kid)
        frames = ProgressFrames(progress)
        try:
            async with record.lock:
                if record.state != State.running or record.init_pid <= 0:
                    raise AgentError(
                        "conflict", f"kernel {kid} is {record.state.value}, not running"
                    )
                if record.offloaded is not None:
                    raise AgentError("conflict", f"kernel {kid} is offloaded already")
                try:
                    state = await self.gpu.keep(_tree(record.init_pid), frames)
                except CudaStateLeft as e:
                    record.note = f"its GPU memory could not be offloaded nor put back: {e.message}"
                    raise as_agent_error(e) from e
                except CedanaError as e:
                    raise as_agent_error(e) from e
                if not state:
                    raise AgentError(
                        "conflict", f"kernel {kid} holds no GPU memory: nothing to offload"
                    )
                record.offloaded = state
                record.note = None
        finally:
            await frames.close()
        _log.info("kernel %s of uid %d offloaded", kid, caller.uid)
        return {
            "kernel_id": kid,
            "pid": record.init_pid,
            "gpu": gpu_summary(state),
            "gpu_memory_freed": int(state.get("bytes_freed") or 0),
        }

    async def op_reload(
        self, caller: Caller, args: dict[str, Any], progress: Progress
    ) -> dict[str, Any]:
        kid = kernel_id_arg(args)
        record = self.kernels.lookup(caller.uid, kid)
        frames = ProgressFrames(progress)
        try:
            async with record.lock:
                state = record.offloaded
                if record.state != State.running or state is None:
                    raise AgentError("conflict", f"kernel {kid} is not offloaded")
                try:
                    restored = await self.gpu.reload(state, frames)
                except InsufficientGpuMemory as e:
                    raise AgentError("failed", f"{e.message}; it stays offloaded") from e
                except CudaStateLeft as e:
                    # The driver lost it: no reload can work; the process lives on.
                    record.note = f"its CUDA state is lost: {e.message}; restart it"
                    raise AgentError("failed", record.note) from e
                except CedanaError as e:
                    raise AgentError("failed", f"{e.message}; it stays offloaded") from e
                record.offloaded = None
        finally:
            await frames.close()
        _log.info("kernel %s of uid %d reloaded", kid, caller.uid)
        return {
            "kernel_id": kid,
            "pid": record.init_pid,
            "gpu": restored,
            "gpu_memory_restored": int(state.get("memory_bytes") or 0),
        }


def _tree(pid: int) -> set[int]:
    return set(process_tree(pid))
