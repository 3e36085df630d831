"""Suspend manager: the policy loop, the REST-facing view of every kernel, and the one
place where suspends and resumes are started.

handlers → SuspendManager → CedanaProvisioner → CheckpointEngine
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from pathlib import Path
from typing import Any

from traitlets import Any as AnyTrait
from traitlets import Instance
from traitlets.config import LoggingConfigurable

from . import metrics
from .checkpoint import validate_kernel_id
from .engine import CheckpointEngine, tree_rss
from .errors import CedanaError, Conflict, EngineUnavailable, NotFound
from .policy import Decision, KernelFacts, SuspendPolicy
from .proctree import process_tree
from .provisioner import CedanaProvisioner, KernelState

EVENT_SCHEMA = "https://jupyter-cedana.readthedocs.io/events/kernel-state"
EVENT_SCHEMA_FILE = Path(__file__).parent / "events" / "kernel_state.yaml"
MAX_KEEP_AWAKE = 7 * 24 * 3600


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc).isoformat()


class SuspendManager(LoggingConfigurable):
    """Tracks every kernel of the server and suspends or resumes them."""

    kernel_manager = AnyTrait(help="The server's MappingKernelManager.")
    engine = Instance(CheckpointEngine)
    policy = Instance(SuspendPolicy)
    gpu_monitor = AnyTrait(None, allow_none=True, help="GpuMonitor, or None without NVML.")
    event_logger = AnyTrait(None, allow_none=True, help="jupyter_events EventLogger.")

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._attached: set[int] = set()
        self._keep_awake: dict[str, float] = {}
        self._decisions: dict[str, Decision] = {}
        self._gpus: dict[str, list[Any]] = {}
        self._gpus_before_suspend: dict[str, int] = {}
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._last_tick = time.monotonic()
        self._last_progress_event: dict[str, float] = {}
        self._previous_state: dict[str, str] = {}
        self._resume_listeners: list[Any] = []
        self._suspend_guards: list[Any] = []

    def on_resumed(self, callback: Any) -> None:
        """callback(kernel_id) after every successful resume, whoever asked for it."""
        self._resume_listeners.append(callback)

    def add_suspend_guard(self, guard: Any) -> None:
        """guard(kernel_id) -> True while the policy must not suspend that kernel (the
        message gate: messages held, being delivered, or a client connecting)."""
        self._suspend_guards.append(guard)

    def transition_pending(self, kernel_id: str) -> bool:
        """Whether a suspend or resume of the kernel is started and not finished."""
        return any(k.startswith(f"{kernel_id}:") for k in self._tasks)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
            self._loop_task = None
        for task in list(self._tasks.values()):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), timeout=30)

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:
                self.log.exception("cedana policy check failed")
            await asyncio.sleep(max(0.2, self.policy.check_interval))

    # -- lookups --------------------------------------------------------------------------

    def _kernel(self, kernel_id: str) -> Any:
        validate_kernel_id(kernel_id)
        try:
            return self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            raise NotFound(f"No kernel with id {kernel_id}") from None

    def _provisioner(self, kernel: Any) -> CedanaProvisioner | None:
        prov = getattr(kernel, "provisioner", None)
        if isinstance(prov, CedanaProvisioner):
            if id(prov) not in self._attached:
                self._attached.add(id(prov))
                prov.add_listener(self._on_change)
            return prov
        return None

    def state_of(self, kernel_id: str) -> str:
        try:
            kernel = self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            return "unknown"
        prov = self._provisioner(kernel)
        return prov.state.value if prov else KernelState.running.value

    # -- facts, view ----------------------------------------------------------------------

    def _idle_seconds(self, kernel: Any) -> float:
        last = getattr(kernel, "last_activity", None)
        if last is None:
            return 0.0
        return max(0.0, (dt.datetime.now(dt.timezone.utc) - last).total_seconds())

    def _facts(self, kernel_id: str, kernel: Any) -> KernelFacts:
        prov = self._provisioner(kernel)
        gpus = self._gpus.get(kernel_id, [])
        extra = []
        info = self.engine.probe()
        if not info.available:
            extra.append(f"checkpointing unavailable: {info.reason}")
        gpu_idle = True
        if self.gpu_monitor is not None and gpus:
            gpu_idle = self.gpu_monitor.is_gpu_idle(
                kernel_id, self.policy.gpu_utilization_threshold
            )
        now = time.time()
        return KernelFacts(
            kernel_id=kernel_id,
            kernelspec=getattr(kernel, "kernel_name", ""),
            spec_metadata=dict(getattr(getattr(kernel, "kernel_spec", None), "metadata", {}) or {}),
            state=prov.state.value if prov else "running",
            tier=prov.tier if prov else None,
            execution_state=getattr(kernel, "execution_state", "unknown"),
            idle_seconds=self._idle_seconds(kernel),
            connections=int(
                getattr(self.kernel_manager, "_kernel_connections", {}).get(kernel_id, 0)
            ),
            gpu_memory_bytes=sum(g.memory_bytes for g in gpus),
            gpu_idle=gpu_idle,
            keep_awake_seconds=max(0.0, self._keep_awake.get(kernel_id, 0.0) - now),
            suspended_seconds=now - prov.suspended_at if prov and prov.suspended_at else 0.0,
            managed=prov is not None,
            extra_reasons=extra,
        )

    def view(self, kernel_id: str) -> dict[str, Any]:
        kernel = self._kernel(kernel_id)
        prov = self._provisioner(kernel)
        facts = self._facts(kernel_id, kernel)
        decision = self.policy.decide(facts)
        now = time.time()
        last = getattr(kernel, "last_activity", None)
        state = facts.state
        reason = None
        if prov is not None and prov.reason:
            reason = prov.reason
        elif decision.reason and decision.action is None:
            reason = decision.reason
        suspendable = state == "running" and prov is not None and self.engine.probe().available
        if prov is None:
            reason = reason or "not started by cedana-provisioner (its kernelspec opts out)"
        elif not self.engine.probe().available:
            reason = f"checkpointing unavailable: {self.engine.probe().reason}"
        keep = self._keep_awake.get(kernel_id)
        gpus = self._gpus.get(kernel_id, [])
        suspend_at = None
        if state == "running" and decision.due_in is not None:
            suspend_at = _iso(now + decision.due_in)
        return {
            "id": kernel_id,
            "name": facts.kernelspec,
            "state": state,
            "tier": prov.tier if prov else None,
            "execution_state": facts.execution_state,
            "last_activity": last.isoformat() if last is not None else None,
            "idle_seconds": round(facts.idle_seconds, 3),
            "suspend_at": suspend_at,
            "suspended_at": _iso(prov.suspended_at) if prov else None,
            "keep_awake_until": _iso(keep) if keep and keep > now else None,
            "checkpoint_bytes": prov.checkpoint_bytes if prov else 0,
            "last_suspend_seconds": prov.last_suspend_seconds if prov else None,
            "last_resume_seconds": prov.last_resume_seconds if prov else None,
            "gpus": [g.to_json() for g in gpus],
            "suspendable": suspendable,
            "reason": reason,
            "progress": prov.progress.to_json() if prov and prov.progress else None,
        }

    def list_kernels(self) -> list[dict[str, Any]]:
        views = []
        for kid in list(self.kernel_manager.list_kernel_ids()):
            with contextlib.suppress(NotFound):
                views.append(self.view(kid))
        return views

    def status(self) -> dict[str, Any]:
        info = self.engine.probe()
        usage = self.engine.store.usage()
        gpu: dict[str, Any] = {
            "available": False,
            "reason": "GPU monitor not loaded",
            "driver_version": None,
            "devices": [],
            "checkpoint": False,
        }
        if self.gpu_monitor is not None:
            gpu["available"] = bool(self.gpu_monitor.available)
            gpu["reason"] = self.gpu_monitor.reason
            gpu["driver_version"] = self.gpu_monitor.driver_version
            gpu["devices"] = self.gpu_monitor.devices() if self.gpu_monitor.available else []
        gpu["checkpoint"], cuda_reason = self.engine.cuda_status()
        if gpu["available"] and not gpu["checkpoint"]:
            gpu["reason"] = f"GPU memory cannot be checkpointed: {cuda_reason}"
        return {
            "available": info.available,
            "reason": info.reason,
            "criu_version": info.criu_version,
            "root": info.pidns,
            "checkpoint_root": str(self.engine.store.root),
            "bytes_used": usage.bytes_used,
            "bytes_free": usage.bytes_free,
            "gpu": gpu,
        }

    # -- actions --------------------------------------------------------------------------

    def _managed(self, kernel_id: str) -> CedanaProvisioner:
        prov = self._provisioner(self._kernel(kernel_id))
        if prov is None:
            raise Conflict(
                f"Kernel {kernel_id} was not started by cedana-provisioner and cannot be suspended"
            )
        return prov

    def _check_storage(self, prov: CedanaProvisioner) -> None:
        limit = self.policy.max_checkpoint_bytes
        if limit <= 0 or prov.pid is None:
            return
        used = self.engine.store.usage().bytes_used
        need = tree_rss(prov.pid)
        if used + need > limit:
            raise Conflict(
                f"Checkpoint storage limit reached: {used + need} bytes needed of "
                f"max_checkpoint_bytes={limit}; the kernel keeps running"
            )

    async def suspend(
        self, kernel_id: str, tier: str = "disk", wait: bool = True
    ) -> tuple[dict[str, Any], bool]:
        """Start (and by default finish) a suspend; returns the view and whether it is done."""
        if tier not in ("disk", "offload"):
            raise CedanaError(f"Unknown tier {tier!r}", code="bad_request", status=400)
        prov = self._managed(kernel_id)
        if not self.engine.probe().available and tier == "disk":
            raise EngineUnavailable(f"Checkpointing is unavailable: {self.engine.probe().reason}")
        if prov.state == KernelState.suspended and (prov.tier == tier or tier == "offload"):
            raise Conflict(f"Kernel {kernel_id} is already suspended ({prov.tier})")
        if prov.state in (KernelState.resuming,):
            raise Conflict(f"Kernel {kernel_id} is resuming; suspend it once it runs")
        if prov.state == KernelState.failed:
            raise Conflict(f"Kernel {kernel_id} failed to resume ({prov.reason}); resume it first")
        if prov.state == KernelState.running:
            self._check_storage(prov)
            self._gpus_before_suspend[kernel_id] = len(self._gpus.get(kernel_id, []))
        return await self._transition(kernel_id, "suspend", lambda: prov.suspend(tier), wait)

    async def resume(self, kernel_id: str, wait: bool = True) -> tuple[dict[str, Any], bool]:
        prov = self._managed(kernel_id)
        if prov.state == KernelState.running:
            raise Conflict(f"Kernel {kernel_id} is running, not suspended")
        if prov.state == KernelState.suspending:
            raise Conflict(f"Kernel {kernel_id} is being suspended; resume it once it is")
        return await self._transition(kernel_id, "resume", prov.resume, wait)

    async def _transition(
        self, kernel_id: str, kind: str, start: Any, wait: bool
    ) -> tuple[dict[str, Any], bool]:
        task = self._tasks.get(f"{kernel_id}:{kind}")
        if task is None:
            task = asyncio.ensure_future(start())
            key = f"{kernel_id}:{kind}"
            self._tasks[key] = task

            def done(t: asyncio.Task[Any], key: str = key) -> None:
                self._tasks.pop(key, None)
                if not t.cancelled() and t.exception() is not None and not wait:
                    self.log.warning("Background %s failed: %s", key, t.exception())

            task.add_done_callback(done)
        if not wait:
            await asyncio.sleep(0)  # let the transition mark its state
            return self.view(kernel_id), task.done()
        await asyncio.shield(task)
        return self.view(kernel_id), True

    async def ensure_running(self, kernel_id: str) -> None:
        """Wait for a transition in flight, then resume if the kernel is not running."""
        for key in (f"{kernel_id}:suspend", f"{kernel_id}:resume"):
            task = self._tasks.get(key)
            if task is not None:
                with contextlib.suppress(CedanaError):
                    await asyncio.shield(task)
        if self.state_of(kernel_id) != KernelState.running.value:
            await self.resume(kernel_id)

    def keep_awake(self, kernel_id: str, seconds: float) -> dict[str, Any]:
        self._kernel(kernel_id)
        if not 0 <= seconds <= MAX_KEEP_AWAKE:
            raise CedanaError(
                f"seconds must be between 0 and {MAX_KEEP_AWAKE}", code="bad_request", status=400
            )
        if seconds == 0:
            self._keep_awake.pop(kernel_id, None)
        else:
            self._keep_awake[kernel_id] = time.time() + seconds
        view = self.view(kernel_id)
        self._emit(kernel_id, "keep-awake", view["state"], view.get("tier"))
        return view

    # -- policy loop ----------------------------------------------------------------------

    async def check(self) -> None:
        """One pass of the policy over every kernel."""
        now = time.monotonic()
        elapsed, self._last_tick = now - self._last_tick, now
        ids = list(self.kernel_manager.list_kernel_ids())
        for gone in set(self._keep_awake) - set(ids):
            self._keep_awake.pop(gone, None)
        self._sample_gpus(ids)
        suspended = 0
        freed = 0
        for kid in ids:
            try:
                kernel = self.kernel_manager.get_kernel(kid)
            except KeyError:
                continue
            prov = self._provisioner(kernel)
            if prov is not None and prov.state == KernelState.suspended:
                suspended += 1
                freed += prov.gpu_memory_freed
                metrics.GPU_SECONDS_RECLAIMED.inc(self._gpus_before_suspend.get(kid, 0) * elapsed)
            decision = self.policy.decide(self._facts(kid, kernel))
            self._decisions[kid] = decision
            if decision.action is None or any(k.startswith(kid) for k in self._tasks):
                continue
            if decision.action != "shutdown" and any(g(kid) for g in self._suspend_guards):
                continue
            self.log.info("Policy: %s kernel %s (%s)", decision.action, kid, decision.reason)
            if decision.action == "shutdown":
                await self.kernel_manager.shutdown_kernel(kid)
                continue
            try:
                await self.suspend(kid, tier=decision.action, wait=False)
            except CedanaError as e:
                self.log.info("Policy could not suspend kernel %s: %s", kid, e.message)
        metrics.SUSPENDED_KERNELS.set(suspended)
        metrics.GPU_MEMORY_FREED.set(freed)
        metrics.CHECKPOINT_BYTES.set(self.engine.store.usage().bytes_used)

    def _sample_gpus(self, ids: list[str]) -> None:
        if self.gpu_monitor is None or not self.gpu_monitor.available:
            return
        trees: dict[str, set[int]] = {}
        for kid in ids:
            with contextlib.suppress(KeyError):
                prov = self._provisioner(self.kernel_manager.get_kernel(kid))
                if prov is not None and prov.state == KernelState.running and prov.pid:
                    trees[kid] = process_tree(prov.pid)
        try:
            sampled = self.gpu_monitor.sample(trees)
        except Exception as e:
            self.log.warning("GPU sampling failed: %s", e)
            return
        for kid in trees:
            self._gpus[kid] = sampled.get(kid, [])
        for kid in set(self._gpus) - set(ids):
            self._gpus.pop(kid, None)

    def allows_cull(self, kernel_id: str) -> bool:
        """jupyter_server's culler may shut a kernel down only if it is running, or if it
        has been suspended for longer than the retention time."""
        try:
            prov = self._provisioner(self.kernel_manager.get_kernel(kernel_id))
        except KeyError:
            return True
        if prov is None or prov.state == KernelState.running:
            return True
        if prov.state != KernelState.suspended or not prov.suspended_at:
            return False
        return self.policy.retention > 0 and time.time() - prov.suspended_at > self.policy.retention

    # -- events ---------------------------------------------------------------------------

    def _on_change(self, prov: CedanaProvisioner, what: str) -> None:
        kid = str(prov.kernel_id)
        state = prov.state.value
        if what == "progress":
            now = time.monotonic()
            if now - self._last_progress_event.get(kid, 0) < 0.25:
                return
            self._last_progress_event[kid] = now
            self._emit(kid, "progress", state, prov.tier, progress=prov.progress)
            return
        before = self._previous_state.get(kid, "running")
        self._previous_state[kid] = state
        if state == before and state != "failed":
            return
        if state == "suspending":
            self._emit(kid, "suspending", state, prov.tier)
        elif state == "resuming":
            self._emit(kid, "resuming", state, prov.tier)
        elif state == "suspended" and before in ("suspending", "running"):
            metrics.SUSPENDS.labels(prov.tier or "disk").inc()
            if prov.last_suspend_seconds is not None:
                metrics.SUSPEND_SECONDS.observe(prov.last_suspend_seconds)
            self._emit(
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
            self._emit(kid, "resumed", state, None, duration=prov.last_resume_seconds)
            for callback in self._resume_listeners:
                callback(kid)
        elif state == "running" and before == "suspending":
            metrics.FAILURES.labels("suspend", _reason_label(prov.reason)).inc()
            self._emit(kid, "failed", state, None, reason=prov.reason)
        elif state == "failed" or (state == "suspended" and before == "resuming"):
            metrics.FAILURES.labels("resume", _reason_label(prov.reason)).inc()
            self._emit(kid, "failed", state, prov.tier, reason=prov.reason)

    def note_suspend_failure(self, kernel_id: str, error: CedanaError) -> None:
        """A suspend refused before the provisioner changed state (e.g. CRIU missing)."""
        metrics.FAILURES.labels("suspend", error.code).inc()
        self._emit(kernel_id, "failed", self.state_of(kernel_id), None, reason=error.message)

    def _emit(
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
    ) -> None:
        if self.event_logger is None:
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
        }
        try:
            self.event_logger.emit(schema_id=EVENT_SCHEMA, data=data)
        except Exception:
            self.log.exception("could not emit cedana event")


def _reason_label(reason: str | None) -> str:
    """A low-cardinality label for a failure reason."""
    text = (reason or "").lower()
    for key in ("checksum", "truncated", "missing", "space", "size", "timeout", "gpu", "criu"):
        if key in text:
            return key
    return "other"
