"""What the REST API and the sidebar show of a kernel: its state, why it is (not)
suspended, when it will be, and the progress of a transition (docs/rest-api.yaml)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from ..timestamps import iso
from .kernel.bases import checkpoint_disk
from .kernel_facts import FactSource
from .policy import KernelFacts

if TYPE_CHECKING:
    from .backoff import SuspendBackoff
    from .limits import TransitionQueue


class ViewSource(FactSource, Protocol):
    """What the view is read from: the manager (manager.SuspendManager), declared here so
    that the manager depends on this module and not the other way round."""

    @property
    def backoff(self) -> SuspendBackoff: ...
    @property
    def queue(self) -> TransitionQueue: ...
    def kernel(self, kernel_id: str) -> Any: ...
    def facts(self, kernel_id: str, kernel: Any) -> KernelFacts: ...


def kernel_view(manager: ViewSource, kernel_id: str) -> dict[str, Any]:
    """The kernel's view (NotFound for an unknown or invalid id)."""
    kernel = manager.kernel(kernel_id)
    prov = manager.provisioner_of(kernel)
    facts = manager.facts(kernel_id, kernel)
    decision = manager.policy.decide(facts)
    probe = manager.engine.probe()
    now = time.time()
    last = getattr(kernel, "last_activity", None)
    state = facts.state
    setback = manager.backoff.blocking(kernel_id, last) if state == "running" else None
    reason = None
    if setback is not None:
        reason = setback.describe()
    elif prov is not None and prov.reason:
        reason = prov.reason
    elif decision.reason and decision.action is None:
        reason = decision.reason
    suspendable = state == "running" and prov is not None and probe.available
    if prov is None:
        reason = reason or "not started by cedana-provisioner (its kernelspec opts out)"
    elif not probe.available:
        reason = f"checkpointing unavailable: {probe.reason}"
    keep = manager.keep_awake_until(kernel_id)
    suspend_at = None
    if state == "running" and decision.due_in is not None:
        due = now + decision.due_in
        suspend_at = iso(max(due, setback.retry_at) if setback is not None else due)
    return {
        "id": kernel_id,
        "name": facts.kernelspec,
        "state": state,
        "tier": prov.tier if prov else None,
        "execution_state": facts.execution_state,
        "last_activity": last.isoformat() if last is not None else None,
        "idle_seconds": round(facts.idle_seconds, 3),
        "suspend_at": suspend_at,
        "suspended_at": iso(prov.suspended_at) if prov else None,
        "keep_awake_until": iso(keep) if keep and keep > now else None,
        "checkpoint_bytes": prov.checkpoint_bytes if prov else 0,
        "checkpoint_disk": (
            checkpoint_disk(manager.engine.store, kernel_id, prov) if prov else None
        ),
        "last_suspend_seconds": prov.last_suspend_seconds if prov else None,
        "last_resume_seconds": prov.last_resume_seconds if prov else None,
        "gpus": [g.to_json() for g in manager.gpus_of(kernel_id)],
        "suspendable": suspendable,
        "reason": reason,
        "progress": prov.progress.to_json() if prov and prov.progress else None,
        "queued": manager.queue.queued(kernel_id),
        "backoff": setback.to_json() if setback is not None else None,
    }
