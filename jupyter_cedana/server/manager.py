"""Suspend manager: the policy loop over the facts of every kernel (kernel_facts.py), which
the REST view (kernel_view.py) shows too, and the one place where suspends and resumes
are started.

handlers → SuspendManager → CedanaProvisioner → CheckpointEngine
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import Any

from traitlets import Any as AnyTrait
from traitlets import Instance, default
from traitlets.config import LoggingConfigurable

from ..checkpoint.engine import CheckpointEngine
from ..checkpoint.proctree import process_tree
from ..checkpoint.store import validate_kernel_id
from ..checkpoint.store_gc import recorded_kernel_ids
from ..errors import CedanaError, Conflict, EngineUnavailable, InsufficientStorage, NotFound
from . import metrics
from .backoff import SuspendBackoff
from .kernel.bases import drop_base, kept_bases
from .kernel.checkpoint_agent import agent_for
from .kernel.compactor import Compactor, compactor_for
from .kernel.provisioner import CedanaProvisioner, KernelState
from .kernel_events import EVENT_SCHEMA, EVENT_SCHEMA_FILE, KernelEvents
from .kernel_facts import between_processes, kernel_facts, touch
from .kernel_view import kernel_view
from .limits import Budget, SuspendLimits, TransitionQueue, estimate_image_bytes, gpu_bytes, settled
from .policy import KernelFacts, SuspendPolicy, retention_ended, suspended_for
from .retention import RetentionClock
from .status import server_status
from .transition_tasks import TransitionTasks

MAX_KEEP_AWAKE = 7 * 24 * 3600

__all__ = ["EVENT_SCHEMA", "EVENT_SCHEMA_FILE", "SuspendManager"]


class SuspendManager(LoggingConfigurable):
    """Tracks every kernel of the server and suspends or resumes them."""

    kernel_manager = AnyTrait(help="The server's MappingKernelManager.")
    engine = Instance(CheckpointEngine)
    policy = Instance(SuspendPolicy)
    gpu_monitor = AnyTrait(None, allow_none=True, help="GpuMonitor, or None without NVML.")
    event_logger = AnyTrait(None, allow_none=True, help="jupyter_events EventLogger.")
    limits = Instance(SuspendLimits)
    backoff = Instance(SuspendBackoff)

    @default("limits")
    def _default_limits(self) -> SuspendLimits:
        return SuspendLimits(parent=self)

    @default("backoff")
    def _default_backoff(self) -> SuspendBackoff:
        return SuspendBackoff(parent=self)

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._attached: set[int] = set()
        self._keep_awake: dict[str, float] = {}
        self.retention_clock = RetentionClock(lambda: self.engine.store)
        self._gpus: dict[str, list[Any]] = {}
        self._gpus_before_suspend: dict[str, int] = {}
        self._asked: set[str] = set()  # kernels a person asked to suspend
        self._loop_task: asyncio.Task[None] | None = None
        self._last_tick = time.monotonic()
        self.events = KernelEvents(self.log, lambda: self.event_logger)
        self._suspend_guards: list[Any] = []
        # Every resume is something a person did (a cell, Resume): not idle since.
        self.on_resumed(lambda kid: touch(self.kernel_manager, kid))
        self.queue = TransitionQueue(self.limits)
        self.in_flight = TransitionTasks(
            self.queue,
            self.log,
            lambda kid, kind: self._emit(kid, "queued", self.state_of(kid), None, reason=kind),
        )
        self.budget = Budget(
            store=lambda: self.engine.store,
            limit=lambda: self.policy.max_checkpoint_bytes,
            min_free=lambda: self.limits.min_free_disk_bytes,
            owners=self.owned_image_ids,
            bases=lambda: kept_bases(self),
            drop_base=lambda kid: drop_base(self, kid),
        )

    async def on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        """jupyter_server's kernel action events: a restart is something a person did."""
        if data.get("action") == "restart" and data.get("status") == "success":
            touch(self.kernel_manager, str(data.get("kernel_id")))

    def on_resumed(self, callback: Any) -> None:
        """callback(kernel_id) after every successful resume, whoever asked for it."""
        self.events.resume_listeners.append(callback)

    def owned_image_ids(self) -> set[str]:
        """Kernels whose images are someone's: this server's, and parked ones (whose
        records a server may adopt: one that does not parse leaves its image to nobody,
        reported as an orphan, for `jupyter cedana gc`)."""
        km = self.kernel_manager
        owned = set(km.list_kernel_ids()) if km is not None else set()
        owned |= recorded_kernel_ids(self.engine.store)
        return owned

    def suspended_seconds(self, kernel_id: str, prov: CedanaProvisioner) -> float:
        since = self.retention_clock.since(kernel_id, prov)
        return suspended_for(since, self.policy.retention)

    def add_suspend_guard(self, guard: Any) -> None:
        """guard(kernel_id) -> True while the policy must not suspend that kernel (the
        message gate: messages held, being delivered, or a client connecting)."""
        self._suspend_guards.append(guard)

    def _guarded(self, kernel_id: str) -> bool:
        return any(guard(kernel_id) for guard in self._suspend_guards)

    def transition_pending(self, kernel_id: str) -> bool:
        """Whether a suspend or resume of the kernel is started and not finished."""
        return self.in_flight.pending(kernel_id)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None:
            self.report_orphans()
            self.compactor()  # configured before the first suspend asks for it
            self._loop_task = asyncio.ensure_future(self._run())

    def report_orphans(self) -> None:
        orphans = self.budget.orphans()
        if orphans:
            self.log.warning("jupyter-cedana: %s", self.budget.describe(orphans))

    async def stop(self, deadline: float = 20.0) -> None:
        """Stop the policy loop and wait for the suspends and resumes in flight, all
        together and `deadline` seconds at most (KernelParking.deadline: the spawners'
        kill is configured after it); the kernels' shutdown aborts what is left."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
            self._loop_task = None
        await self.compactor().stop()  # short of the exchange: the chains stay
        self.in_flight.cancel_queued(lambda kid: True)
        in_flight = self.in_flight.all()
        if in_flight:
            await asyncio.wait(in_flight, timeout=max(0.0, deadline))

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:
                self.log.exception("cedana policy check failed")
            await asyncio.sleep(max(0.2, self.policy.check_interval))

    def compactor(self) -> Compactor:
        """The checkpoint root's compactor of chains, with this server's limits."""
        found = compactor_for(self.engine.store)
        found.ratio = self.limits.compact_chain_ratio
        found.max_deltas = self.limits.compact_chain_deltas
        found.reserve = self.budget.reserve_compaction
        found.release = self.budget.release_compaction
        return found

    # -- lookups --------------------------------------------------------------------------

    def kernel(self, kernel_id: str) -> Any:
        validate_kernel_id(kernel_id)
        try:
            return self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            raise NotFound(f"No kernel with id {kernel_id}") from None

    def provisioner_of(self, kernel: Any) -> CedanaProvisioner | None:
        prov = getattr(kernel, "provisioner", None)
        if isinstance(prov, CedanaProvisioner):
            if id(prov) not in self._attached:
                self._attached.add(id(prov))
                prov.add_listener(self._on_change)
                prov.image_guard = self.budget.check_image
            return prov
        return None

    def state_of(self, kernel_id: str) -> str:
        try:
            kernel = self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            return "unknown"
        prov = self.provisioner_of(kernel)
        return prov.state.value if prov else KernelState.running.value

    # -- facts, view ----------------------------------------------------------------------

    def gpus_of(self, kernel_id: str) -> list[Any]:
        """The kernel's GPUs as last sampled (GpuMonitor)."""
        return self._gpus.get(kernel_id, [])

    def keep_awake_until(self, kernel_id: str) -> float | None:
        return self._keep_awake.get(kernel_id)

    def facts(self, kernel_id: str, kernel: Any) -> KernelFacts:
        """What the policy decides on (kernel_facts.py)."""
        return kernel_facts(self, kernel_id, kernel)

    def view(self, kernel_id: str) -> dict[str, Any]:
        """The kernel as the REST API shows it (kernel_view.py)."""
        return kernel_view(self, kernel_id)

    def list_kernels(self) -> list[dict[str, Any]]:
        views = []
        for kid in list(self.kernel_manager.list_kernel_ids()):
            with contextlib.suppress(NotFound):
                views.append(self.view(kid))
        return views

    def status(self) -> dict[str, Any]:
        agent = agent_for(self.parent)
        return server_status(
            self.engine,
            self.gpu_monitor,
            self.budget,
            self.queue,
            agent.socket if agent is not None else None,
            agent.features if agent is not None else frozenset(),
        )

    # -- actions --------------------------------------------------------------------------

    def _managed(self, kernel_id: str) -> CedanaProvisioner:
        prov = self.provisioner_of(self.kernel(kernel_id))
        if prov is None:
            raise Conflict(
                f"Kernel {kernel_id} was not started by cedana-provisioner and cannot be suspended"
            )
        return prov

    async def suspend(
        self, kernel_id: str, tier: str = "disk", wait: bool = True, auto: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """Start (and by default finish) a suspend; returns the view and whether it is done.
        `auto`: asked by the policy, which may change its mind while the suspend waits."""
        if tier not in ("disk", "offload"):
            raise CedanaError(f"Unknown tier {tier!r}", code="bad_request", status=400)
        prov = self._managed(kernel_id)
        if not self.engine.probe().available and tier == "disk":
            error = EngineUnavailable(f"Checkpointing is unavailable: {self.engine.probe().reason}")
            self.note_suspend_failure(kernel_id, error)
            raise error
        if prov.state == KernelState.suspended and (prov.tier == tier or tier == "offload"):
            raise Conflict(f"Kernel {kernel_id} is already suspended ({prov.tier})")
        if prov.state in (KernelState.resuming,):
            raise Conflict(f"Kernel {kernel_id} is resuming; suspend it once it runs")
        if prov.state == KernelState.failed:
            raise Conflict(f"Kernel {kernel_id} failed to resume ({prov.reason}); resume it first")
        if not auto:
            # It may join a queued automatic suspend, which must then not be dropped.
            self._asked.add(kernel_id)
        return await self._transition(
            kernel_id, "suspend", lambda: self._suspend_now(kernel_id, prov, tier, auto), wait
        )

    async def _suspend_now(
        self, kernel_id: str, prov: CedanaProvisioner, tier: str, auto: bool
    ) -> Any:
        """The suspend itself, once it has a slot: the disk it will take is reserved
        first, and a failure is remembered so that the policy backs off."""
        asked = kernel_id in self._asked
        self._asked.discard(kernel_id)
        auto = auto and not asked
        if auto and not self._still_due(kernel_id, tier):
            self.log.info("Policy: kernel %s no longer due for suspend; not suspending", kernel_id)
            self._emit(kernel_id, "dequeued", prov.state.value, prov.tier)
            return None
        reserve = tier == "disk" and (
            prov.state == KernelState.running
            or (prov.state == KernelState.suspended and prov.tier == "offload")
        )
        if prov.state == KernelState.running:
            self._gpus_before_suspend[kernel_id] = len(self._gpus.get(kernel_id, []))
        try:
            if reserve:
                try:
                    self.budget.reserve(kernel_id, self._estimate(kernel_id, prov))
                except InsufficientStorage as e:
                    self.note_suspend_failure(kernel_id, e)  # the kernel never left running
                    raise
            result = await prov.suspend(tier)
        except CedanaError as e:
            if auto or not isinstance(e, Conflict):
                self.backoff.failed(kernel_id, e, self._last_activity(kernel_id))
            raise
        finally:
            if reserve:
                self.budget.release(kernel_id)
        self.backoff.succeeded(kernel_id)
        return result

    def _last_activity(self, kernel_id: str) -> dt.datetime | None:
        try:
            return getattr(self.kernel_manager.get_kernel(kernel_id), "last_activity", None)
        except KeyError:
            return None

    def _still_due(self, kernel_id: str, tier: str) -> bool:
        """Whether the policy still wants this suspend (the kernel may have run code, or
        been kept awake, while the suspend waited for a slot)."""
        try:
            kernel = self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            return False
        decision = self.policy.decide(self.facts(kernel_id, kernel))
        return (
            decision.action == tier
            and not self._guarded(kernel_id)
            and not between_processes(kernel)
            and self.backoff.blocking(kernel_id, self._last_activity(kernel_id)) is None
        )

    def _estimate(self, kernel_id: str, prov: CedanaProvisioner) -> int:
        """The bytes a dump will write: memory, and GPU memory unless already offloaded
        (then it is in host memory)."""
        if prov.state != KernelState.running or not prov.pid:
            return estimate_image_bytes(prov.pid or 0)
        sampled = sum(g.memory_bytes for g in self._gpus.get(kernel_id, []))
        return estimate_image_bytes(prov.pid, gpu_bytes(prov.pid, self.gpu_monitor, sampled))

    async def resume(self, kernel_id: str, wait: bool = True) -> tuple[dict[str, Any], bool]:
        prov = self._managed(kernel_id)
        if prov.state == KernelState.running:
            raise Conflict(f"Kernel {kernel_id} is running, not suspended")
        if prov.state == KernelState.suspending:
            raise Conflict(f"Kernel {kernel_id} is being suspended; resume it once it is")
        return await self._transition(kernel_id, "resume", prov.resume, wait)

    async def _transition(
        self, kernel_id: str, kind: str, start: Callable[[], Awaitable[Any]], wait: bool
    ) -> tuple[dict[str, Any], bool]:
        def done(t: asyncio.Task[Any]) -> None:
            if kind == "suspend":
                self._asked.discard(kernel_id)
            if not t.cancelled() and t.exception() is not None and not wait:
                self.log.warning("Background %s:%s failed: %s", kernel_id, kind, t.exception())

        task = self.in_flight.start(kernel_id, kind, start, done)
        if not wait:
            await asyncio.sleep(0)  # let the transition mark its state
            return self.view(kernel_id), task.done()
        await settled(task, f"The {kind} of kernel {kernel_id}")
        return self.view(kernel_id), True

    async def ensure_running(self, kernel_id: str) -> None:
        """Wait for a transition in flight, then resume if the kernel is not running."""
        for kind in ("suspend", "resume"):
            task = self.in_flight.of(kernel_id, kind)
            if task is not None:
                with contextlib.suppress(CedanaError):
                    await settled(task, f"The transition of kernel {kernel_id}")
        if self.state_of(kernel_id) != KernelState.running.value:
            await self.resume(kernel_id)

    def keep_awake(self, kernel_id: str, seconds: float) -> dict[str, Any]:
        self.kernel(kernel_id)
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
        self.retention_clock.forget_except(ids)
        self.backoff.forget_except(set(ids))
        self.in_flight.cancel_queued(lambda kid: kid not in ids)
        self._sample_gpus(ids)
        compactor = self.compactor()
        suspended = 0
        freed = 0
        for kid in ids:
            try:
                kernel = self.kernel_manager.get_kernel(kid)
            except KeyError:
                continue
            prov = self.provisioner_of(kernel)
            if prov is not None and prov.state == KernelState.suspended:
                compactor.schedule(prov)  # its chain folded in the background, if due
                suspended += 1
                freed += prov.gpu_memory_freed
                metrics.GPU_SECONDS_RECLAIMED.inc(self._gpus_before_suspend.get(kid, 0) * elapsed)
            decision = self.policy.decide(self.facts(kid, kernel))
            if decision.action is None or self.transition_pending(kid):
                continue
            if decision.action != "shutdown" and (self._guarded(kid) or between_processes(kernel)):
                continue
            if decision.action == "shutdown":
                self.log.info("Policy: shut down kernel %s (%s)", kid, decision.reason)
                await self.kernel_manager.shutdown_kernel(kid)
                continue
            setback = self.backoff.blocking(kid, getattr(kernel, "last_activity", None))
            if setback is not None:
                self.log.debug("Policy: not suspending kernel %s: %s", kid, setback.describe())
                continue
            self.log.info("Policy: %s kernel %s (%s)", decision.action, kid, decision.reason)
            try:
                await self.suspend(kid, tier=decision.action, wait=False, auto=True)
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
                prov = self.provisioner_of(self.kernel_manager.get_kernel(kid))
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
            prov = self.provisioner_of(self.kernel_manager.get_kernel(kernel_id))
        except KeyError:
            return True
        if prov is None or prov.state == KernelState.running:
            return True
        return prov.state in (KernelState.suspended, KernelState.failed) and retention_ended(
            self.policy.retention, self.retention_clock.since(kernel_id, prov)
        )

    # -- events ---------------------------------------------------------------------------

    def _on_change(self, prov: CedanaProvisioner, what: str) -> None:
        if what == "state":
            self.retention_clock.note(prov)
        progress = prov.progress
        if what == "progress" and progress is not None and progress.phase == "dump":
            self.budget.written(str(prov.kernel_id), progress.bytes_done or 0)
        self.events.on_change(prov, what)

    def note_suspend_failure(self, kernel_id: str, error: CedanaError) -> None:
        """A suspend refused before the provisioner changed state (e.g. CRIU missing)."""
        self.events.refused(kernel_id, self.state_of(kernel_id), error)

    def _emit(self, kernel_id: str, action: str, state: str, tier: str | None, **kw: Any) -> None:
        self.events.emit(kernel_id, action, state, tier, **kw)
