"""Which CRIU dumps must not run together.

CRIU's parasite in the root task of a tree with its own PID namespace (the mounted /proc
is not that namespace's) makes `proc.crtools` in the task's working directory and mounts
a /proc there for a moment (criu/pie/parasite.c, get_proc_fd): two such dumps of tasks
sharing a working directory collide (EEXIST). A kernel's init works in a private
directory (cedana-init --chdir), so their dumps never share one; only a kernel adopted
from an image written before that keeps its user's directory. Dumps wait here only for
another dump using the same directory; every other one runs at once (SuspendLimits and
KernelParking.concurrency bound how many).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import AsyncIterator

# A lock lives while a dump holds or awaits it.
_locks: weakref.WeakValueDictionary[tuple[int, int], asyncio.Lock] = weakref.WeakValueDictionary()


def proc_mount_dir(pid: int) -> tuple[int, int] | None:
    """(device, inode) of the directory where a dump of the tree rooted at `pid` mounts
    its /proc; None when CRIU uses the mounted /proc (the tree shares our PID namespace)."""
    try:
        if os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid"):
            return None
        st = os.stat(f"/proc/{pid}/cwd")
    except OSError:
        return None  # gone: CRIU says so
    return st.st_dev, st.st_ino


@contextlib.asynccontextmanager
async def dump_turn(pid: int) -> AsyncIterator[None]:
    """Wait until no other dump uses the directory a dump of `pid` mounts /proc in."""
    key = proc_mount_dir(pid)
    if key is None:
        yield
        return
    lock = _locks.get(key)
    if lock is None:
        lock = _locks[key] = asyncio.Lock()
    async with lock:
        yield
