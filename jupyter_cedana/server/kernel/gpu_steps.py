"""The GPU steps of a suspend or resume that are not plain calls of the CUDA
checkpointer: undoing an offload after a failed dump, restoring GPU memory into a
CRIU-restored tree before it runs, and the `failed` state when the CUDA state of a
kernel cannot be put back (a base of the provisioner's, through Checkpointing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ...checkpoint.proctree import process_tree
from ...gpu.cuda import CudaStateLeft
from .transitions import KernelState, TransitionMachine


class GpuSteps:
    kernel_id: Any
    log: Any
    machine: TransitionMachine  # the kernel's state and transitions (the provisioner's)
    state: KernelState
    tier: str | None
    reason: str | None
    _gpu_state: dict[str, Any] | None = None
    # True once a kernel's CUDA state is lost (the driver's FAILED state): its process
    # lives on but can never use its GPU memory again; it needs a restart.
    _gpu_lost: bool = False

    def _gpu_progress(self, phase: str, done: int | None, total: int | None) -> None:
        self.machine.set_progress(phase, done, total)

    def _gpu_left(self, e: CudaStateLeft) -> None:
        """A GPU step failed and so did putting the kernel back: it is `failed`, never
        `running`. With its GPU memory kept in host memory a resume retries the restore."""
        self._gpu_state = e.kept
        self._gpu_lost = e.kept is None
        self.tier = "offload" if e.kept is not None else None
        self.machine.set_state(KernelState.failed, reason=e.message)
        self.log.error("Kernel %s failed: %s", self.kernel_id, e.message)

    async def _undo_offload(self, gpu: Any, gpu_state: dict[str, Any]) -> str | None:
        """After a failed dump: put the GPU memory back into the (continued) kernel.
        Returns why that failed too (the kernel is then `failed`), or None."""
        try:
            await gpu.put_back(gpu_state)
        except CudaStateLeft as e:
            self._gpu_left(e)
            return e.message
        return None

    def _gpu_restore_step(
        self, gpu: Any, gpu_state: dict[str, Any] | None, root: int, plan: Any
    ) -> tuple[Callable[[], Awaitable[None]] | None, Callable[[], Awaitable[None]] | None]:
        """The GPU restore of a CRIU-restored tree, as (before, after) it is continued:
        before by default, as CRIU's cuda plugin does, so that nothing of the kernel runs
        before its device memory is back (CudaCheckpointer.restore_frozen)."""
        if not gpu_state or gpu is None:
            return None, None
        frozen = bool(gpu.restore_frozen)

        async def step() -> None:
            self.machine.set_progress("gpu-restore", None, None)
            await gpu.restore(
                gpu_state,
                process_tree(root),
                admission=plan,
                progress=self._gpu_progress,
                frozen=frozen,
            )

        return (step, None) if frozen else (None, step)
