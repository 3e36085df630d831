"""The kernel's transition state machine: states, allowed transitions, the per-kernel
lock, progress, and the listeners told of every change.

    running → suspending → suspended → resuming → running
                  │                        │            │
                  └→ running (failed       │            └→ failed (a lazily restored
                     suspend: runs on)     │               kernel's memory could not all
                                           │               be loaded: killed, image kept,
                                           │               what it did since its resume
                                           │               lost, and the reason says so)
                                           └→ failed (image kept) / suspended
                                              (cancelled or refused by admission)

A suspended or failed kernel may also be discarded (→ running, as a fresh start).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import Conflict


class KernelState(str, enum.Enum):
    running = "running"
    suspending = "suspending"
    suspended = "suspended"
    resuming = "resuming"
    failed = "failed"


_S = KernelState
ALLOWED: dict[KernelState, frozenset[KernelState]] = {
    _S.running: frozenset({_S.suspending, _S.running, _S.failed}),
    # suspended → suspending: an offloaded kernel going to disk.
    _S.suspended: frozenset({_S.resuming, _S.suspending, _S.running}),
    _S.suspending: frozenset({_S.suspended, _S.running, _S.failed}),
    _S.resuming: frozenset({_S.running, _S.failed, _S.suspended}),
    _S.failed: frozenset({_S.resuming, _S.running, _S.failed, _S.suspended}),
}


class IllegalTransition(RuntimeError):
    """A bug: code asked for a state change the machine does not have."""


@dataclass
class Progress:
    phase: str
    fraction: float
    bytes_done: int | None = None
    bytes_total: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Listener = Callable[[Any, str], None]
SuspendHook = Callable[[Any], Awaitable[None]]


class TransitionMachine:
    """A kernel's state, and its transitions one at a time; the provisioner holds one
    (`machine`) and gives itself to listeners and hooks as `owner`."""

    def __init__(self, owner: Any, log: Any, kernel_id: Any):
        self.owner = owner
        self.log = log
        self.kernel_id = kernel_id
        self.state = KernelState.running
        self.tier: str | None = None
        self.reason: str | None = None
        self.progress: Progress | None = None
        self._lock = asyncio.Lock()
        self._inflight: tuple[str, asyncio.Future[Any]] | None = None
        self._listeners: list[Listener] = []
        self._suspend_hooks: list[SuspendHook] = []
        self._aborted: str | None = None
        self._runner: asyncio.Task[Any] | None = None

    def add_listener(self, listener: Listener) -> None:
        """Called with (owner, what) on every state or progress change."""
        self._listeners.append(listener)

    def add_suspend_hook(self, hook: SuspendHook) -> None:
        """Awaited with (owner) before a running kernel is frozen, while it runs."""
        self._suspend_hooks.append(hook)

    async def before_suspend(self) -> None:
        for hook in list(self._suspend_hooks):
            try:
                await hook(self.owner)
            except Exception:  # a broken hook must not keep a kernel from being suspended
                self.log.exception("cedana suspend hook failed")

    def notify(self, what: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(self.owner, what)
            except Exception:  # a broken observer must not break a suspend
                self.log.exception("cedana listener failed")

    def set_state(self, state: KernelState, reason: str | None = None) -> None:
        if state not in ALLOWED[self.state]:
            raise IllegalTransition(f"{self.state.value} → {state.value}")
        self.state = state
        self.reason = reason
        if state in (KernelState.running, KernelState.suspended, KernelState.failed):
            self.progress = None
        self.notify("state")

    def note_reason(self, reason: str | None) -> None:
        """Keep the kernel's state and say what is wrong with it (the sidebar shows it)."""
        self.reason = reason
        self.notify("state")

    def set_progress(self, phase: str, done: int | None, total: int | None) -> None:
        fraction = min(1.0, done / total) if done is not None and total else 0.0
        self.progress = Progress(phase, fraction, done, total)
        self.notify("progress")

    def progress_from(self, default: str) -> Callable[[dict[str, Any]], None]:
        """A callback that makes the checkpoint agent's progress frames this kernel's
        progress (the same phase names; `default` for a frame that names none)."""

        def update(frame: dict[str, Any]) -> None:
            done, total = frame.get("done"), frame.get("total")
            self.set_progress(
                str(frame.get("phase") or default),
                done if isinstance(done, int) else None,
                total if isinstance(total, int) else None,
            )

        return update

    @property
    def transition_in_flight(self) -> str | None:
        """The kind of transition running now ("suspend-disk", "resume", ...), or None."""
        return self._inflight[0] if self._inflight is not None else None

    @property
    def inflight(self) -> asyncio.Future[Any] | None:
        """The transition running now, done when it ends, or None."""
        return self._inflight[1] if self._inflight is not None else None

    async def once(self, kind: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """Run a transition under the kernel's lock; a concurrent request for the same
        transition waits for the running one and gets its result. A shutdown or restart
        may abort it (abort_transition): its callers then get a Conflict."""
        if self._inflight is not None and self._inflight[0] == kind:
            try:
                return await asyncio.shield(self._inflight[1])
            except asyncio.CancelledError:
                self.raise_if_aborted()
                raise
        async with self._lock:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._inflight = (kind, fut)
            self._runner = asyncio.current_task()
            self._aborted = None
            try:
                result = await work()
            except BaseException as e:
                if isinstance(e, asyncio.CancelledError) and self._aborted is not None:
                    fut.cancel()  # joiners are told by raise_if_aborted
                    uncancel = getattr(self._runner, "uncancel", None)
                    if uncancel is not None:
                        uncancel()  # the cancellation was ours, not the caller's
                    self.raise_if_aborted()
                fut.set_exception(e)
                # Nobody else may be waiting: retrieve the exception so asyncio stays quiet.
                fut.exception()
                raise
            else:
                fut.set_result(result)
                return result
            finally:
                self._inflight = None
                self._runner = None

    def raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise Conflict(self._aborted) from None

    async def abort_transition(self, why: str) -> None:
        """Cancel the transition in flight, if any, and wait until it has rolled back
        (a suspend leaves the kernel running, a resume leaves it suspended)."""
        inflight, runner = self._inflight, self._runner
        if inflight is None or runner is None or runner is asyncio.current_task():
            return
        self.log.info("Aborting %s of kernel %s: %s", inflight[0], self.kernel_id, why)
        self._aborted = f"Kernel {self.kernel_id}: {inflight[0]} abandoned, {why}"
        runner.cancel()
        await asyncio.wait({inflight[1]})
        # The lock is released as the runner unwinds: let that happen before going on.
        async with self._lock:
            pass
