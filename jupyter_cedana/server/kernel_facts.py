"""What the policy decides on (policy.KernelFacts), gathered from jupyter_server's kernel,
its provisioner, the sampled GPUs and the manager's keep-awake times; and touch(), which
restarts the idle countdown read here. Apart from the manager, as kernel_view.py is, so
that the manager keeps to starting transitions and running the loop; the policy loop,
the REST view and a queued suspend's second look all read a kernel through this.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from typing import TYPE_CHECKING, Any, Protocol

from .kernel.bases import Kernels
from .policy import KernelFacts, SuspendPolicy

if TYPE_CHECKING:
    from ..checkpoint.engine import CheckpointEngine
    from .kernel.provisioner import CedanaProvisioner


class FactSource(Kernels, Protocol):
    """What the facts are read from: the manager (manager.SuspendManager), declared here
    so that the manager depends on this module and not the other way round."""

    @property
    def engine(self) -> CheckpointEngine: ...
    @property
    def policy(self) -> SuspendPolicy: ...
    @property
    def gpu_monitor(self) -> Any: ...
    def gpus_of(self, kernel_id: str) -> list[Any]: ...
    def keep_awake_until(self, kernel_id: str) -> float | None: ...
    def suspended_seconds(self, kernel_id: str, prov: CedanaProvisioner) -> float: ...


def kernel_facts(manager: FactSource, kernel_id: str, kernel: Any) -> KernelFacts:
    prov = manager.provisioner_of(kernel)
    gpus = manager.gpus_of(kernel_id)
    extra = []
    info = manager.engine.probe()
    if not info.available:
        extra.append(f"checkpointing unavailable: {info.reason}")
    gpu_idle = True
    if manager.gpu_monitor is not None and gpus:
        gpu_idle = manager.gpu_monitor.is_gpu_idle(
            kernel_id, manager.policy.gpu_utilization_threshold
        )
    now = time.time()
    return KernelFacts(
        kernel_id=kernel_id,
        kernelspec=getattr(kernel, "kernel_name", ""),
        spec_metadata=dict(getattr(getattr(kernel, "kernel_spec", None), "metadata", {}) or {}),
        state=prov.state.value if prov else "running",
        tier=prov.tier if prov else None,
        execution_state=getattr(kernel, "execution_state", "unknown"),
        idle_seconds=idle_seconds(kernel),
        connections=int(
            getattr(manager.kernel_manager, "_kernel_connections", {}).get(kernel_id, 0)
        ),
        gpu_memory_bytes=sum(g.memory_bytes for g in gpus),
        gpu_idle=gpu_idle,
        keep_awake_seconds=max(0.0, (manager.keep_awake_until(kernel_id) or 0.0) - now),
        suspended_seconds=manager.suspended_seconds(kernel_id, prov) if prov else 0.0,
        managed=prov is not None,
        extra_reasons=extra,
    )


def idle_seconds(kernel: Any) -> float:
    last = getattr(kernel, "last_activity", None)
    if last is None:
        return 0.0
    return max(0.0, (dt.datetime.now(dt.UTC) - last).total_seconds())


def between_processes(kernel: Any) -> bool:
    """Starting, restarting or shutting down: no settled process to freeze, and the
    execution state and activity seen are the previous process's."""
    ready = getattr(kernel, "_ready", None)  # jupyter_client's future of the start
    return bool(getattr(kernel, "shutting_down", False)) or (ready is not None and not ready.done())


def touch(kernel_manager: Any, kernel_id: str) -> None:
    """Record activity a person caused: the idle countdown starts again."""
    with contextlib.suppress(KeyError):
        now = dt.datetime.now(dt.UTC)
        kernel_manager.get_kernel(kernel_id).last_activity = now
        kernel_manager.last_kernel_activity = now
