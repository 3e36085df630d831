"""Kernel-state events (jupyter_events) and Prometheus metrics, from the provisioners'
state changes: what the sidebar and monitoring see of every suspend and resume."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import CedanaError
from ..package_files import EVENTS_DIR
from ..timestamps import iso
from . import metrics

EVENT_SCHEMA = "https://jupyter-cedana.readthedocs.io/events/kernel-state"
EVENT_SCHEMA_FILE = EVENTS_DIR / "kernel_state.yaml"


class KernelEvents:
    """Turns state changes into events and metrics; tells resume listeners."""

    def __init__(self, log: Any, event_logger: Callable[[], Any]):
        self.log = log
        self._event_logger = event_logger
        self._last_progress_event: dict[str, float] = {}
        self._previous_state: dict[str, str] = {}
        self.resume_listeners: list[Callable[[str], Any]] = []

    def on_change(self, prov: Any, what: str) -> None:
        kid = str(prov.kernel_id)
        state = prov.state.value
        if what == "progress":
            now = time.monotonic()
            if now - self._last_progress_event.get(kid, 0) < 0.25:
                return
            self._last_progress_event[kid] = now
            self.emit(kid, "progress", state, prov.tier, progress=prov.progress)
            return
        before = self._previous_state.get(kid, "running")
        self._previous_state[kid] = state
        if state == before and state != "failed":
            return
        if state == "suspending":
            self.emit(kid, "suspending", state, prov.tier)
        elif state == "resuming":
            self.emit(kid, "resuming", state, prov.tier)
        elif state == "suspended" and before in ("suspending", "running"):
            metrics.SUSPENDS.labels(prov.tier or "disk").inc()
            if prov.last_suspend_seconds is not None:
                metrics.SUSPEND_SECONDS.observe(prov.last_suspend_seconds)
            self.emit(
                kid,
                "suspended",
                state,
                prov.tier,
                duration=prov.last_suspend_seconds,
                bytes_=prov.checkpoint_bytes,
                gpu=prov.gpu_memory_freed,
            )
        elif state == "running" and before == "resuming":
            metrics.RESUMES.labels("disk").inc()
            if prov.last_resume_seconds is not None:
                metrics.RESUME_SECONDS.observe(prov.last_resume_seconds)
            self.emit(
                kid,
                "resumed",
                state,
                None,
                duration=prov.last_resume_seconds,
                reason=prov.reason,
                lost_after=_lost_after(prov),
            )
            for callback in self.resume_listeners:
                callback(kid)
        elif state == "running" and before == "suspending":
            metrics.FAILURES.labels("suspend", _reason_label(prov.reason)).inc()
            self.emit(kid, "failed", state, None, reason=prov.reason)
        elif state == "failed" or (state == "suspended" and before == "resuming"):
            metrics.FAILURES.labels("resume", _reason_label(prov.reason)).inc()
            lost = _lost_after(prov) if state == "failed" else None
            self.emit(kid, "failed", state, prov.tier, reason=prov.reason, lost_after=lost)

    def refused(self, kernel_id: str, state: str, error: CedanaError) -> None:
        """A suspend refused before the provisioner changed state."""
        metrics.FAILURES.labels("suspend", error.code).inc()
        self.emit(kernel_id, "failed", state, None, reason=error.message)

    def emit(
        self,
        kernel_id: str,
        action: str,
        state: str,
        tier: str | None,
        duration: float | None = None,
        bytes_: int | None = None,
        gpu: int | None = None,
        reason: str | None = None,
        progress: Any = None,
        lost_after: str | None = None,
    ) -> None:
        event_logger = self._event_logger()
        if event_logger is None:
            return
        data = {
            "kernel_id": kernel_id,
            "action": action,
            "state": state,
            "tier": tier,
            "duration_seconds": duration,
            "checkpoint_bytes": bytes_,
            "gpu_memory_freed_bytes": gpu,
            "reason": reason,
            "progress": progress.to_json() if progress is not None else None,
            "lost_after": lost_after,
        }
        try:
            event_logger.emit(schema_id=EVENT_SCHEMA, data=data)
        except Exception:
            self.log.exception("could not emit cedana event")


def _lost_after(prov: Any) -> str | None:
    """When what the kernel did since is lost (a lazy restore failed after it ran)."""
    return iso(getattr(prov, "work_lost_after", None))


def _reason_label(reason: str | None) -> str:
    """A low-cardinality label for a failure reason."""
    text = (reason or "").lower()
    for key in ("checksum", "truncated", "missing", "space", "size", "timeout", "gpu", "criu"):
        if key in text:
            return key
    return "other"
