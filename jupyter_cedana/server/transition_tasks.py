"""The suspends and resumes in flight: one task per kernel and kind, started once (a
second request for the same transition joins the first), each run when a slot of its
kind is free (limits.TransitionQueue), and cancellable while it still waits in line."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .limits import TransitionQueue

__all__ = ["TransitionTasks"]


class TransitionTasks:
    """The task of each transition started and not finished, by kernel and kind."""

    def __init__(self, queue: TransitionQueue, log: Any, on_queued: Callable[[str, str], None]):
        self.queue = queue
        self.log = log
        self._on_queued = on_queued  # (kernel id, kind) of a transition that must wait
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    def pending(self, kernel_id: str) -> bool:
        """Whether a suspend or resume of the kernel is started and not finished."""
        return any(k.startswith(f"{kernel_id}:") for k in self._tasks)

    def of(self, kernel_id: str, kind: str) -> asyncio.Task[Any] | None:
        return self._tasks.get(f"{kernel_id}:{kind}")

    def all(self) -> list[asyncio.Task[Any]]:
        return list(self._tasks.values())

    def start(
        self,
        kernel_id: str,
        kind: str,
        start: Callable[[], Awaitable[Any]],
        on_done: Callable[[asyncio.Task[Any]], None],
    ) -> asyncio.Task[Any]:
        """The task of this transition: the one in flight, or a new one running `start()`
        once a slot is free, which calls `on_done(task)` when it ends."""
        key = f"{kernel_id}:{kind}"
        task = self._tasks.get(key)
        if task is None:
            task = asyncio.ensure_future(self._limited(kernel_id, kind, start))
            self._tasks[key] = task

            def done(t: asyncio.Task[Any], key: str = key) -> None:
                self._tasks.pop(key, None)
                on_done(t)

            task.add_done_callback(done)
        return task

    async def _limited(self, kernel_id: str, kind: str, start: Callable[[], Awaitable[Any]]) -> Any:
        """Run a transition once one of the `kind` slots is free (SuspendLimits)."""

        def queued(ahead: int) -> None:
            self.log.info("Kernel %s: %s queued behind %d others", kernel_id, kind, ahead)
            self._on_queued(kernel_id, kind)

        return await self.queue.run(kernel_id, kind, start, queued)

    def cancel_queued(self, which: Callable[[str], bool]) -> None:
        """Cancel transitions still waiting for a slot, of the kernels `which` selects."""
        for kid, kind in self.queue.waiting():
            task = self.of(kid, kind)
            if task is not None and which(kid):
                self.log.info("Kernel %s: queued %s cancelled", kid, kind)
                task.cancel()
