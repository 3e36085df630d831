"""Signals to a kernel's process tree around CRIU: continuing a tree CRIU left stopped
(after a dump, or a restore), killing one, and waiting until killed processes are gone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...checkpoint.proctree import group_stopped, process_tree, stat_fields


def continue_tree(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def continue_restored(
    root: int,
    log: Any,
    timeout: float = 10.0,
    before: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """CRIU writes the pidfile while the restored tasks are still ptrace-stopped and
    stops them for good (SIGSTOP) only as it detaches: a SIGCONT sent before that is
    overtaken. Wait for the group stop of every task, run `before` (the GPU restore),
    continue, and make sure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = process_tree(root)
        if pids and all(group_stopped(p) for p in pids):
            break
        await asyncio.sleep(0.002)
    else:
        log.warning("Restored kernel %s did not report stopped; continuing it", root)
    if before is not None:
        await before()
    # Every task was seen stopped, so CRIU has let go and no stop is still on its
    # way: the first look may be early (the kernel's first output waits for it).
    settle = time.monotonic() + 1.0
    delay = 0.001
    while True:
        continue_tree(process_tree(root))
        await asyncio.sleep(delay)
        if time.monotonic() > settle or not any(proc_state(p) == "T" for p in process_tree(root)):
            break
        delay = min(delay * 2, 0.02)


def kill_tree(root: int, pidns: bool) -> None:
    """SIGKILL a kernel tree: its PID-namespace init takes the namespace with it;
    without a namespace every process is killed, children first."""
    if not root:
        return
    targets = [root] if pidns else sorted(process_tree(root), reverse=True)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def proc_state(pid: int) -> str:
    fields = stat_fields(pid)
    return fields[0] if fields else "?"


async def gone(pids: set[int], timeout: float = 5.0) -> None:
    """Wait until killed processes have really exited (SIGKILL is not synchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(proc_state(p) not in ("?", "Z", "X") for p in pids):
        await asyncio.sleep(0.01)
