"""The capture's part of an incremental dump (incremental.py): each full buffer's pages
hashed, those whose content the base holds dropped, the rest packed to the buffer's front
and handed to the writers.

This runs on a thread of its own, buffer after buffer in the order received, so that the
receiving thread goes on reading CRIU's pipes while a buffer is hashed: the kernel is
frozen until CRIU has sent every page, and CRIU waits whenever its pipe is full. Each
buffer's digests are taken on two threads at once (one native call per half, without
the GIL: digests.py)."""

from __future__ import annotations

import mmap
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from .crimg import PAGE_SIZE
from .digests import DIGEST_SIZE, page_digests
from .incremental import DeltaStream, PageIndex


class DeltaSink(Protocol):
    """What the packer uses of a page file being received."""

    delta: DeltaStream
    hasher: Any  # integrity.ChunkHasher: the CRCs of the bytes the file will hold

    @property
    def size(self) -> int: ...


# (page file, its buffer, the bytes of whole pages in it); or work to run in order after
# the buffers handed before it; or None, the end.
_Item = tuple[DeltaSink, mmap.mmap, int] | Callable[[], None] | None


class DeltaPacker:
    def __init__(
        self,
        base: PageIndex,
        recycle: Callable[[mmap.mmap], None],
        write: Callable[[DeltaSink, int, mmap.mmap, int], None],
        fail: Callable[[str], None],
        failed: Callable[[], bool],
    ):
        self._base = base
        self._recycle, self._write, self._fail, self._failed = recycle, write, fail, failed
        self._hashers = ThreadPoolExecutor(2, "cedana-capture-h")
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cedana-capture-d", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def hand(self, sink: DeltaSink, buf: mmap.mmap, whole: int) -> None:
        """`buf`'s first `whole` bytes (whole pages; the caller keeps any part page)."""
        self._queue.put((sink, buf, whole))

    def then(self, work: Callable[[], None]) -> None:
        """Run `work` once the buffers handed so far are packed and handed on."""
        self._queue.put(work)

    def close(self) -> None:
        """After the last buffer: waits for the packing of all of them."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()
        self._hashers.shutdown()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if callable(item):
                if not self._failed():
                    self._guard(item)
                continue
            sink, buf, whole = item
            if self._failed() or not self._guard(self._pack, sink, buf, whole):
                self._recycle(buf)

    def _guard(self, work: Callable[..., None], *args: Any) -> bool:
        try:
            work(*args)
            return True
        except Exception as e:  # the receiver must learn of any failure
            self._fail(f"packing an incremental image: {type(e).__name__}: {e}")
            return False

    def _pack(self, sink: DeltaSink, buf: mmap.mmap, whole: int) -> None:
        view = memoryview(buf)
        try:
            pages = whole // PAGE_SIZE
            half = pages // 2 * PAGE_SIZE
            parts = self._hashers.map(page_digests, (view[:half], view[half:whole]))
            digests = b"".join(parts)
            known = self._base.where
            kept = bytes(
                digests[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE] not in known for i in range(pages)
            )
            sink.delta.digests += digests
            sink.delta.kept += kept
            out = 0
            for i in range(pages):  # packed in place: a page only ever moves down
                if kept[i]:
                    if out != i:
                        view[out * PAGE_SIZE : (out + 1) * PAGE_SIZE] = view[
                            i * PAGE_SIZE : (i + 1) * PAGE_SIZE
                        ]
                    out += 1
            offset = sink.size
            sink.hasher.update(view[: out * PAGE_SIZE])
        finally:
            view.release()
        if out:
            self._write(sink, offset, buf, out * PAGE_SIZE)
        else:
            self._recycle(buf)
