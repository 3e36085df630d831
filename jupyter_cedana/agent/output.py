"""A kernel's stdout and stderr: a file of root's the kernel's descriptors point to.

`<state>/output/<uid>/<kernel_id>.log` (0600, directories 0700). The agent opens it
O_WRONLY|O_APPEND and hands it to cedana-init as descriptors 1 and 2, so the kernel,
its init and its watcher write there whether or not an agent is running: a kernel that
prints while the agent restarts neither blocks on a full pipe nor gets EPIPE, and its
output is there for the next agent's `log` op. The file is opened before the kernel
drops to its user; the user cannot open it by name.

CRIU refuses to restore a regular file whose size changed since the dump, except one
opened write-only with O_APPEND (a log file, in CRIU's words): exactly this one.

The size is capped without moving a byte the kernel writes: once the file holds more
than `limit` bytes past what was dropped, the agent punches a hole over the oldest
whole blocks (fallocate PUNCH_HOLE|KEEP_SIZE), which frees them; the file keeps its
length, the kernel keeps appending at its end, and `dropped` is where the data starts
(SEEK_DATA), so a restarted agent knows it too. A filesystem that cannot punch holes
gets the file truncated to nothing instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

LIMIT = 1 << 20
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_BLOCK = 4096

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_hole(fd: int, length: int) -> None:
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class KernelOutput:
    """The tail of a kernel's output, read from its file (the interface of KernelLog)."""

    def __init__(self, path: Path, limit: int = LIMIT):
        self.path = path
        self.limit = limit
        self._writer: int | None = None
        self._truncated = 0  # bytes dropped by truncation, where holes cannot be punched

    def open_writer(self) -> int:
        """The descriptor the kernel gets as stdout and stderr (the caller closes it)."""
        for d in (self.path.parent.parent, self.path.parent):
            with contextlib.suppress(FileExistsError):
                d.mkdir(mode=0o700)
        self.close_writer()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._writer = os.open(self.path, flags, 0o600)
        os.ftruncate(self._writer, 0)
        return self._writer

    def close_writer(self) -> None:
        if self._writer is not None:
            os.close(self._writer)
            self._writer = None

    def _extent(self, fd: int) -> tuple[int, int]:
        """(where the kept data starts, the file's length)."""
        size = os.fstat(fd).st_size
        try:
            start = os.lseek(fd, 0, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: no data at all (empty, or all hole)
                raise
            start = size
        return min(start, size), size

    @property
    def dropped(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return self._truncated
        try:
            return self._extent(fd)[0] + self._truncated
        finally:
            os.close(fd)

    def tail(self, nbytes: int | None = None) -> bytes:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return b""
        try:
            start, size = self._extent(fd)
            begin = start if nbytes is None else max(start, size - max(nbytes, 0))
            return os.pread(fd, size - begin, begin) if size > begin else b""
        finally:
            os.close(fd)

    def enforce_limit(self) -> None:
        """Drops the oldest output over the limit (called now and then by the agent)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            start, size = self._extent(fd)
            if size - start <= self.limit + _BLOCK:
                return
            cut = (size - self.limit) // _BLOCK * _BLOCK
            try:
                punch_hole(fd, cut)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                os.ftruncate(fd, 0)  # the kernel's O_APPEND writes go on at the new end
                self._truncated += size
        finally:
            os.close(fd)

    def remove(self) -> None:
        self.close_writer()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
