"""Checksums of image files: a CRC-32 per small file, and a table of CRC-32s per fixed-size
chunk for CRIU's page files, so that a lazily restored kernel's pages can be checked chunk
by chunk as they are served (native/cedana-pages.c reads the same tables).

Page files are hashed while CRIU writes them (FollowingHasher), which also starts their
writeback early, so that the fsync that makes a suspend durable has little left to do.
"""

from __future__ import annotations

import ctypes
import fnmatch
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# ISA-L's CRC-32: the same polynomial and values as zlib's, but 5-7x faster on the VMs we
# measured (zlib's ran at 1.5-2.2 GB/s, below the disk, so a suspend's capture was bound by
# hashing rather than by writing; docs/benchmarks.md, run 22). It releases the GIL too.
from isal.isal_zlib import crc32

CHUNK_SIZE = 64 << 10
PAGES_PATTERN = "pages-*.img"
TABLE_SUFFIX = ".chunks"
_READ = 4 << 20
_WRITEBACK_STEP = 32 << 20
_MAGIC = b"CDNCHNK1"
_HEADER = struct.Struct("<8sIIQ")  # magic, chunk size, reserved, size of the page file

ByteCounter = Callable[[int], None]


def is_page_file(name: str) -> bool:
    return fnmatch.fnmatchcase(name, PAGES_PATTERN)


def table_name(page_file: str) -> str:
    return page_file + TABLE_SUFFIX


def file_crc32(path: Path, on_bytes: ByteCounter | None = None) -> int:
    """CRC-32 of a file: catches truncation and bit rot at several GB/s, unlike sha256."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = crc32(view[:n], crc)
            if on_bytes is not None:
                on_bytes(n)
    return crc


class ChunkHasher:
    """CRC-32 of every `chunk_size` bytes of a stream fed in pieces of any size; notes the
    chunks that may be all zeros (their CRC is that of zeros)."""

    def __init__(self, chunk_size: int = CHUNK_SIZE):
        self.chunk_size = chunk_size
        self.size = 0
        self.maybe_zero: list[int] = []
        self._zero_crc = crc32(bytes(chunk_size))
        self._crcs: list[int] = []
        self._crc = 0
        self._fill = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.chunk_size - self._fill)
            self._crc = crc32(data[:take], self._crc)
            self._fill += take
            self.size += take
            data = data[take:]
            if self._fill == self.chunk_size:
                if self._crc == self._zero_crc:
                    self.maybe_zero.append(len(self._crcs))
                self._crcs.append(self._crc)
                self._crc, self._fill = 0, 0

    def crcs(self) -> list[int]:
        """The table so far; a last partial chunk counts as a chunk."""
        return self._crcs + ([self._crc] if self._fill else [])


def chunk_crcs(path: Path, chunk_size: int = CHUNK_SIZE) -> tuple[int, list[int]]:
    hasher = ChunkHasher(chunk_size)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ)
        view = memoryview(buf)
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.size, hasher.crcs()


def write_table(path: Path, chunk_size: int, size: int, crcs: list[int]) -> None:
    data = _HEADER.pack(_MAGIC, chunk_size, 0, size) + struct.pack(f"<{len(crcs)}I", *crcs)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def read_table(path: Path) -> tuple[int, int, list[int]]:
    """(chunk size, page file size, CRCs) of a chunk table; ValueError if malformed."""
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise ValueError(f"{path.name} is too short")
    magic, chunk_size, _, size = _HEADER.unpack_from(data)
    count = (len(data) - _HEADER.size) // 4
    if magic != _MAGIC or chunk_size <= 0 or count != -(-size // chunk_size):
        raise ValueError(f"{path.name} is not a chunk table for {size} bytes")
    return chunk_size, size, list(struct.unpack_from(f"<{count}I", data, _HEADER.size))


def first_bad_chunk(
    path: Path,
    chunk_size: int,
    crcs: list[int],
    on_bytes: ByteCounter | None = None,
    only: set[int] | None = None,
) -> int | None:
    """Index of the first chunk whose CRC differs (or that is missing), else None.
    `only`: check just these chunks (reading nothing else)."""
    with open(path, "rb", buffering=0) as f:
        indexes = sorted(only) if only is not None else range(len(crcs))
        buf = bytearray(chunk_size)
        view = memoryview(buf)
        if only is None:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        else:
            # Scattered chunks (the stacks a lazy restore checks before CRIU): ask for
            # all at once, so that the disk serves them together, not one read at a time.
            for i in indexes:
                os.posix_fadvise(f.fileno(), i * chunk_size, chunk_size, os.POSIX_FADV_WILLNEED)
        for i in indexes:
            n = os.preadv(f.fileno(), [buf], i * chunk_size)
            if i >= len(crcs) or crc32(view[:n]) != crcs[i] or n == 0:
                return i
            if on_bytes is not None:
                on_bytes(n)
    return None


_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def punch_zeros(fd: int, hasher: ChunkHasher, checked: int) -> tuple[int, int]:
    """Turn the all-zero chunks noted since index `checked` into holes, before they are
    written back: zero pages cost no disk writes and no disk reads then (they read back
    as zeros, same CRC). Returns (chunks looked at, bytes punched)."""
    punched = 0
    todo = [i for i in hasher.maybe_zero if i >= checked]
    size = hasher.chunk_size
    zeros = bytes(size)
    for i in todo:
        if _fallocate is None or os.pread(fd, size, i * size) != zeros:
            continue
        if _fallocate(fd, _PUNCH_HOLE, i * size, size) != 0:
            break  # a file system without holes: keep the zeros
        punched += size
    return (todo[-1] + 1 if todo else checked), punched


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range to disk now, without waiting for it."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def drop_written(fd: int, offset: int, length: int) -> None:
    """Wait until a range is written back and drop it from the page cache: a file written
    through it then holds a bounded amount of memory, reused from range to range, instead
    of memory as large as itself (not yet durable: the disk's cache needs an fsync)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WAIT)
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class FollowingHasher:
    """Chunk CRC tables of CRIU's page files while CRIU is still writing them (they only
    grow), so that committing an image does not read gigabytes a second time; their
    writeback started as they grow, so that the final fsync waits for little; and their
    all-zero chunks made holes before they are written (CRIU skips pages never touched,
    not pages written with zeros)."""

    def __init__(self, directory: Path, chunk_size: int = CHUNK_SIZE):
        self._dir = directory
        self._chunk_size = chunk_size
        self._done = threading.Event()
        self._hashers: dict[str, ChunkHasher] = {}
        self._failed = False
        self.zero_bytes = 0  # all-zero chunks turned into holes
        self._thread = threading.Thread(target=self._run, name="cedana-crc", daemon=True)

    def start(self) -> FollowingHasher:
        self._thread.start()
        return self

    def finish(self) -> dict[str, tuple[int, list[int]]]:
        """Call once the writer has exited: hashes what is left and returns, per page
        file, (bytes hashed, chunk CRCs); empty if reading failed."""
        self._done.set()
        self._thread.join()
        if self._failed:
            return {}
        return {name: (h.size, h.crcs()) for name, h in self._hashers.items()}

    def _run(self) -> None:
        handles: dict[str, Any] = {}
        synced: dict[str, int] = {}
        zero_checked: dict[str, int] = {}
        buf = bytearray(_READ)
        view = memoryview(buf)
        try:
            while True:
                last_pass = self._done.is_set()
                progressed = False
                for path in sorted(self._dir.glob(PAGES_PATTERN)):
                    f = handles.get(path.name)
                    if f is None:
                        f = handles[path.name] = open(path, "r+b", buffering=0)  # noqa: SIM115
                        self._hashers[path.name] = ChunkHasher(self._chunk_size)
                    hasher = self._hashers[path.name]
                    while n := f.readinto(buf):
                        hasher.update(view[:n])
                        progressed = True
                        done = synced.get(path.name, 0)
                        if hasher.size - done >= _WRITEBACK_STEP:
                            checked, punched = punch_zeros(
                                f.fileno(), hasher, zero_checked.get(path.name, 0)
                            )
                            zero_checked[path.name] = checked
                            self.zero_bytes += punched
                            start_writeback(f.fileno(), done, hasher.size - done)
                            synced[path.name] = hasher.size
                    if last_pass:
                        _, punched = punch_zeros(f.fileno(), hasher, zero_checked.get(path.name, 0))
                        self.zero_bytes += punched
                if last_pass:
                    return
                if not progressed:
                    self._done.wait(0.005)
        except OSError:
            self._failed = True  # commit() then hashes everything itself
        finally:
            for f in handles.values():
                f.close()
