"""Writes that survive a crash, and the locks that tell a writer at work from a dead one:
the checkpoint root's files (images, manifests, park records) are written under a
temporary name, fsynced and renamed into place, and each temporary is locked (flock) by
its writer for as long as it writes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = [
    "LOCKED_SUFFIX",
    "fsync_path",
    "lock_for_writing",
    "replace_json_durably",
    "stop_writing",
    "write_json_durably",
    "writer_gone",
]

# A dump in progress is `.<id>.tmp-<pid>-<n>` until its writer holds an flock on the
# directory, then `.<id>.tmp-<pid>-<n>.locked` for as long as it writes. The kernel drops
# the lock of a writer that dies however it dies, so a lock that can be taken proves the
# writer gone, where a PID cannot (in a container every server may be PID 1).
LOCKED_SUFFIX = ".locked"
# Descriptors holding the locks of this process's dumps in progress, by directory.
_WRITING: dict[str, int] = {}


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: dict[str, Any], flags: int = os.O_TRUNC) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | flags, 0o600)
    with os.fdopen(fd, "w") as f:
        # Held until written: a temporary file nobody holds was left by a dead writer.
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def replace_json_durably(path: Path, data: dict[str, Any]) -> None:
    """Write JSON under a temporary name, fsync it, rename it over `path` and fsync the
    directory: readers see the old content or the new, whole, even after a crash."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        write_json_durably(tmp, data, os.O_EXCL)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(path.parent, directory=True)


def lock_for_writing(start: Path) -> Path:
    """Lock the fresh directory `start` for this process and rename it to its locked name
    (LOCKED_SUFFIX), which it returns; the lock is held until stop_writing(). On failure
    the directory is removed."""
    fd = os.open(start, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tmp = start.with_name(start.name + LOCKED_SUFFIX)
        os.rename(start, tmp)
    except BaseException:
        os.close(fd)
        shutil.rmtree(start, ignore_errors=True)
        raise
    _WRITING[str(tmp)] = fd
    return tmp


def stop_writing(tmp: Path) -> None:
    """Release this process's lock of a directory from lock_for_writing(), by the name it
    had then."""
    fd = _WRITING.pop(str(tmp), None)
    if fd is not None:
        os.close(fd)


def writer_gone(path: Path) -> bool:
    """Whether nobody holds the writer's lock of a dump directory or a temporary file
    (its writer finished or died). False while it is held, or when it cannot be opened."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd`, however many writes it takes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` to `fd` at `offset`, however many writes it takes."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
