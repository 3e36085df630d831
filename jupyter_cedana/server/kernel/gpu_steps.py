"""A kernel's GPU memory as its provisioner holds it between the steps of a suspend or
resume, and the GPU steps that are not plain calls of the CUDA checkpointer: undoing an
offload after a failed dump, restoring GPU memory into a CRIU-restored tree before it
runs, the `failed` state when the CUDA state of a kernel cannot be put back, and the
process an offloaded kernel keeps. Composed into the provisioner as `gpu_memory`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ...checkpoint.proctree import process_tree
from ...gpu.cuda import CudaStateLeft
from .transitions import KernelState, TransitionMachine


class GpuMemory:
    def __init__(self, machine: TransitionMachine, log: Any, kernel_id: Any):
        self.machine = machine  # the kernel's state and transitions (the provisioner's)
        self.log = log
        self.kernel_id = kernel_id
        # What the CUDA checkpointer handed back for the kernel's GPU memory: kept in host
        # memory while it is offloaded, and in its image's manifest once dumped.
        self.state: dict[str, Any] | None = None
        # True once the kernel's CUDA state is lost (the driver's FAILED state): its
        # process lives on but can never use its GPU memory again; it needs a restart.
        self.lost = False

    def forget(self) -> None:
        """The kernel has no GPU memory of ours any more (its process ended, or it was
        discarded)."""
        self.state = None
        self.lost = False

    def keeps_process(self) -> bool:
        """Not running, yet its process lives: offloaded, or failed by a GPU step."""
        machine = self.machine
        if machine.state == KernelState.failed:
            return machine.tier == "offload" or self.lost
        return machine.state == KernelState.suspended and machine.tier == "offload"

    def process_died(self, process: Any) -> bool:
        """An offloaded kernel keeps its process (so does one failed with its GPU state
        offloaded or lost); when that dies the kernel is dead (there is no image to resume
        from), and the provisioner's poll() must say so for the restarter."""
        if not self.keeps_process() or process is None or process.poll() is None:
            return False
        self.log.warning("Offloaded kernel %s exited", self.kernel_id)
        self.forget()
        self.machine.tier = None
        self.machine.set_state(KernelState.running, reason="the offloaded kernel's process exited")
        return True

    def progress(self, phase: str, done: int | None, total: int | None) -> None:
        self.machine.set_progress(phase, done, total)

    def left(self, e: CudaStateLeft) -> None:
        """A GPU step failed and so did putting the kernel back: it is `failed`, never
        `running`. With its GPU memory kept in host memory a resume retries the restore."""
        self.state = e.kept
        self.lost = e.kept is None
        self.machine.tier = "offload" if e.kept is not None else None
        self.machine.set_state(KernelState.failed, reason=e.message)
        self.log.error("Kernel %s failed: %s", self.kernel_id, e.message)

    async def undo_offload(self, gpu: Any, gpu_state: dict[str, Any]) -> str | None:
        """After a failed dump: put the GPU memory back into the (continued) kernel.
        Returns why that failed too (the kernel is then `failed`), or None."""
        try:
            await gpu.put_back(gpu_state)
        except CudaStateLeft as e:
            self.left(e)
            return e.message
        return None

    def restore_step(
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
                progress=self.progress,
                frozen=frozen,
            )

        return (step, None) if frozen else (None, step)
