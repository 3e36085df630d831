"""Page digests (checkpoint/digests.py): the shipped native library gives exactly
hashlib's digests, a buffer handed to it can be closed right after, and where the library
cannot be loaded the Python path gives the same digests."""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from jupyter_cedana.checkpoint import digests

PAGE = digests.PAGE_SIZE


def expected(data: bytes) -> bytes:
    return b"".join(
        hashlib.sha256(data[i : i + PAGE]).digest()[: digests.DIGEST_SIZE]
        for i in range(0, len(data) - len(data) % PAGE, PAGE)
    )


def test_the_package_ships_the_native_digests() -> None:
    assert digests.LIBRARY.is_file(), "the build must install libcedana-digest.so in bin/"
    assert digests.native_digests() is not None


def test_native_digests_are_hashlibs_and_leave_the_buffer_closable() -> None:
    size = 257 * PAGE + 100  # a partial page at the end is not hashed
    data = os.urandom(size)
    buf = mmap.mmap(-1, size)
    buf.write(data)
    view = memoryview(buf)
    whole = size - size % PAGE
    half = whole // 2 // PAGE * PAGE
    with ThreadPoolExecutor(2) as pool:
        got = b"".join(pool.map(digests.page_digests, (view[:half], view[half:whole])))
    assert got == expected(data)
    assert digests.page_digests(data) == expected(data)  # read-only bytes too
    assert digests.page_digests(b"") == b""
    view.release()
    buf.close()  # raises BufferError if any export of the buffer outlived the call


def test_a_changed_byte_changes_only_its_pages_digest() -> None:
    data = bytearray(os.urandom(4 * PAGE))
    before = digests.page_digests(bytes(data))
    data[2 * PAGE + 7] ^= 1
    after = digests.page_digests(bytes(data))
    size = digests.DIGEST_SIZE
    changed = [
        i for i in range(4) if before[i * size : (i + 1) * size] != after[i * size : (i + 1) * size]
    ]
    assert changed == [2]


def test_without_the_library_the_digests_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(9 * PAGE)
    monkeypatch.setattr(digests, "native_digests", lambda: None)
    assert digests.page_digests(data) == expected(data)
