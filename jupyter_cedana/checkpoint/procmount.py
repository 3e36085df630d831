"""The kernel's /proc: its mount namespace's CRIU arguments, and which CRIU dumps must
not run together.

CRIU's parasite in the root task of a tree with its own PID namespace whose mounted /proc
is not that namespace's (a kernel started before kernels had their own mount namespace,
or where mounting was not allowed) makes `proc.crtools` in the task's working directory
and mounts a /proc there for a moment (criu/pie/parasite.c, get_proc_fd): two such dumps
of tasks sharing a working directory collide (EEXIST). A kernel's init works in a private
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

# A kernel with its own PID namespace has its own mount namespace (for that namespace's
# /proc, cedana-init --pidns): every mount in it but /proc is one of the host's, which
# CRIU finds by itself and mounts back from the host's at restore.
MOUNT_NS_ARGS = (
    "--ext-mount-map",
    "auto",
    "--enable-external-sharing",
    "--enable-external-masters",
)


def own_mount_ns(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    except OSError:
        return False


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
