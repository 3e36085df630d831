"""Reading ahead the library pages a restore copies on write.

CRIU restores the written pages of a kernel's private file mappings itself, in a lazy
restore too: the libraries' data and relocations, about 3 MB for a Python kernel with
numpy. Each goes into a private mapping of its file, and writing a page there first reads
the file's page (copy on write): one synchronous disk read after another while the
person waits for the first output, 0.06-0.10 s of `criu restore` where the libraries
have left the page cache (docs/benchmarks.md). Asked for all at once (posix_fadvise
WILLNEED) while the image is checked, or as CRIU starts, the disk serves them together.

Advisory only: a path that is gone, or is not a regular file, is skipped, and a file
changed since the suspend only makes the reading useless.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from . import crimg

Ranges = dict[str, list[tuple[int, int]]]  # path -> [(offset, length)], merged


def ranges(
    paths: Mapping[int, str], areas: Sequence[crimg.Area], written: Iterable[tuple[int, int]]
) -> Ranges:
    """The file bytes behind `written` ([(start, end)] addresses of one process: the pages
    CRIU restores itself) where they lie in private file mappings among `areas` (in
    address order); `paths`: file id -> path."""
    files = [a for a in areas if a.private_file]
    starts = [a.start for a in files]
    wanted: dict[str, list[tuple[int, int]]] = {}
    for lo, hi in written:
        k = max(bisect.bisect_right(starts, lo) - 1, 0)
        while k < len(files) and files[k].start < hi:
            a = files[k]
            path = paths.get(a.file_id)
            bottom, top = max(lo, a.start), min(hi, a.end)
            if path is not None and bottom < top:
                wanted.setdefault(path, []).append((a.offset + bottom - a.start, top - bottom))
            k += 1
    return {path: _merged(pieces) for path, pieces in wanted.items()}


def merge(many: Iterable[Ranges]) -> Ranges:
    out: dict[str, list[tuple[int, int]]] = {}
    for r in many:
        for path, pieces in r.items():
            out.setdefault(path, []).extend(pieces)
    return {path: _merged(pieces) for path, pieces in out.items()}


def _merged(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, length in sorted(pieces):
        if out and off <= out[-1][0] + out[-1][1]:
            last_off, last_len = out[-1]
            out[-1] = (last_off, max(last_len, off + length - last_off))
        else:
            out.append((off, length))
    return out


def read_ahead(wanted: Ranges) -> int:
    """Ask for these bytes to be read into the page cache; returns how many were asked
    for (of regular files that could be opened)."""
    asked = 0
    for path, pieces in wanted.items():
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue  # a device, a FIFO: opening it could block or act
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            for off, length in pieces:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
                    asked += length
        finally:
            os.close(fd)
    return asked


def file_paths(images: Path) -> dict[int, str]:
    """File id -> path, as far as files.img can be read (CRIU says what is wrong with it,
    if anything: reading ahead is only advice)."""
    try:
        return crimg.regular_files(images)
    except (OSError, crimg.ImageError):
        return {}


def of_image(images: Path) -> Ranges:
    """The ranges of a whole restore, from the image itself (CRIU restores every page
    then): advisory, so an image that cannot be read gives none (CRIU will say why)."""
    try:
        paths = file_paths(images)
        many = []
        for pid in crimg.pids(images):
            written = [(r.vaddr, r.end) for r in crimg.pagemap(images, pid) if r.present]
            many.append(ranges(paths, crimg.areas(images, pid), written))
    except (OSError, crimg.ImageError):
        return {}
    return merge(many)


def start(wanted: Callable[[], Ranges]) -> threading.Thread:
    """Work out what is `wanted` and ask for it in a thread of its own, so that the checks
    and the restore go on meanwhile (opening the files can wait for the disk)."""

    def run() -> None:
        read_ahead(wanted())

    thread = threading.Thread(target=run, name="cedana-readahead", daemon=True)
    thread.start()
    return thread
