"""What the suspend and resume of a kernel (suspender.py, resumer.py, lazy_memory.py)
use of the provisioner that holds them, declared here: the provisioner calls them, and
they see it only through this."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ...checkpoint.engine import CheckpointEngine
from .agent_kernel import AgentKernel
from .gpu_steps import GpuMemory
from .ports import PortHold
from .record import RecordHolder
from .transitions import KernelState, TransitionMachine


class KernelHandle(Protocol):
    kernel_id: Any
    log: Any
    connection_info: Any
    # Its process (a Popen, or the kernel at the agent) and the PID of its init.
    process: Any
    pid: int | None
    # What it holds beside the process.
    machine: TransitionMachine
    gpu_memory: GpuMemory
    port_hold: PortHold
    records: RecordHolder
    remote: AgentKernel | None
    # (kernel id, image bytes) -> None, or raises to refuse a dumped image.
    image_guard: Callable[[str, int], None] | None
    # What its suspends and resumes leave, read by the manager, the REST API, benchmarks.
    suspended_at: float | None
    checkpoint_bytes: int
    gpu_memory_freed: int
    last_suspend_seconds: float | None
    last_suspend_breakdown: dict[str, float] | None
    last_resume_seconds: float | None
    last_resume_breakdown: dict[str, Any] | None
    last_memory_in_at: float | None
    resumed_at: float | None
    image_taken_at: float | None
    work_lost_after: float | None

    @property
    def state(self) -> KernelState: ...
    @state.setter
    def state(self, value: KernelState) -> None: ...
    @property
    def tier(self) -> str | None: ...
    @tier.setter
    def tier(self, value: str | None) -> None: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def engine(self) -> CheckpointEngine: ...
    @property
    def kernel_id_str(self) -> str: ...
    def spec_name(self) -> str | None: ...
    def process_alive(self) -> bool: ...
    async def memory_loaded(self) -> None: ...
    def background(self, work: Awaitable[Any]) -> None: ...
    def summary(self) -> dict[str, Any]: ...
