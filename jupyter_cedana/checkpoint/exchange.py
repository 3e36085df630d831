"""Swapping two directory entries in one step: `renameat2(RENAME_EXCHANGE)`.

A compacted image replaces a kernel's chain of incremental images (compaction.py). The
store's commit renames the old image away and then the new one into place, which a kill
between the two renames would split, leaving no image at the kernel's name; an exchange
is one journaled operation (Linux 3.15 on, ext4, xfs, btrfs and tmpfs among others):
after a kill, or a crash once the directory is fsynced, the name holds the old image or
the new one, and the other name holds the other.
"""

from __future__ import annotations

import ctypes
import errno
import os

RENAME_EXCHANGE = 1 << 1
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # glibc 2.28 on
if _renameat2 is not None:
    _renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    _renameat2.restype = ctypes.c_int


class ExchangeUnsupported(OSError):
    """The C library or the filesystem has no RENAME_EXCHANGE."""


def rename_exchange(a: os.PathLike[str] | str, b: os.PathLike[str] | str) -> None:
    """Swap the entries `a` and `b` (both must exist, on one filesystem) atomically.
    OSError as renameat2 fails; ExchangeUnsupported where it cannot exchange at all."""
    if _renameat2 is None:
        raise ExchangeUnsupported(errno.ENOSYS, "renameat2 is not in this C library")
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        raise ExchangeUnsupported(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")
    raise OSError(err, os.strerror(err), str(a), None, str(b))
