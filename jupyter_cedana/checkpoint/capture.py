"""Image capture: CRIU hands us its images as it dumps (`criu dump --stream`), and we write
them, so that a suspend goes at the disk's speed instead of the page cache's.

CRIU's img-streamer protocol: CRIU connects to `streamer-capture.sock` in the image
directory and, for every image file it opens, sends the file's name (a 4-byte length and an
`img_streamer_request_entry` protobuf) and then one byte carrying the read end of a pipe
(SCM_RIGHTS); it writes the file into that pipe and closes it. Pages arrive by `splice`
from the pipes CRIU's parasite `vmsplice`d the kernel's memory into, so they are copied
once, into our buffers, where each 64 KiB chunk's CRC-32 is taken; then they go to disk
with direct I/O (`O_DIRECT`), which does not allocate page cache (on a VM whose free memory
the host reclaims, page-cache writes cost 3-5x the CPU), and all-zero chunks are not written
at all (holes). Page files are written through the page cache instead where the file
system refuses `O_DIRECT` or the engine says so (`direct_image_writes`): writeback is
started as the file grows, and what is written back is dropped, so that the image holds
about two 32 MiB steps of page cache, not its own size. The files are the same as CRIU
writes itself: restore reads them as usual.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import queue
import selectors
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

from .crimg import PAGE_SIZE, ImageError, decode
from .delta_capture import DeltaPacker, DeltaSink
from .durable import pwrite_all, write_all
from .incremental import DeltaResult, DeltaStream, PageIndex, finish_delta
from .integrity import (
    CHUNK_SIZE,
    ChunkHasher,
    chunk_crcs,
    drop_written,
    is_page_file,
    start_writeback,
)

SOCKET_NAME = "streamer-capture.sock"  # CRIU's img-streamer.c
_BUF = 4 << 20
_WRITERS = 4  # writes in flight: a virtual disk is faster with more than one queued
_PIPE_SIZE = 1 << 20  # CRIU's own page pipes' size: one splice per pipe-full
_F_SETPIPE_SZ = 1031
_WRITEBACK_STEP = 32 << 20
_QUIET_AFTER_EXIT_S = 10.0  # CRIU gone, yet a pipe neither closed nor fed: give up

_Write = tuple["_Sink", int, "mmap.mmap | None", int, set[int]]


class CaptureFailed(Exception):
    pass


def _request_name(msg: bytes) -> str:
    """The `filename` (field 1, a string) of an img_streamer_request_entry."""
    try:
        fields = decode(msg)
    except ValueError as e:
        raise CaptureFailed(f"malformed request from CRIU: {e}") from None
    names = fields.get(1, [])
    if set(fields) != {1} or len(names) != 1 or not isinstance(names[0], bytes):
        raise CaptureFailed("malformed request from CRIU")
    name = names[0].decode(errors="replace")
    # Names come from CRIU, but a file is created for each: only plain names, here.
    if not name or "/" in name or name in (".", "..", SOCKET_NAME):
        raise CaptureFailed(f"CRIU asked for an unexpected image name {name!r}")
    return name


class _Sink:
    """One image file being received."""

    def __init__(self, directory: Path, name: str, rfd: int, direct: bool, chunk_size: int):
        self.name, self.rfd = name, rfd
        self.pages = is_page_file(name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self.fd = -1
        self.direct = False
        if self.pages and direct:
            try:
                self.fd = os.open(directory / name, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:  # no direct I/O on this file system
                    raise
        if self.fd < 0:
            self.fd = os.open(directory / name, flags, 0o600)
        self.hasher = ChunkHasher(chunk_size)  # page files: every byte received
        self.zero = 0  # bytes of all-zero chunks not written
        self.synced = 0  # writeback started up to here
        self.dropped = 0  # written back and dropped from the page cache up to here
        self.writing = 0  # buffers of it handed to the writers and not yet written
        self.buf: mmap.mmap | None = None
        self.fill = 0
        self.delta = DeltaStream()  # a dump on a base: each page's digest, and if written
        self.carry = b""  # a delta's part of a page read, until the rest comes

    @property
    def size(self) -> int:
        return self.hasher.size

    def close(self) -> None:
        if self.fd >= 0:
            if self.pages:
                os.ftruncate(self.fd, self.size)  # trailing holes still count
            os.close(self.fd)
            self.fd = -1


class ImageCapture:
    """Receives one CRIU dump's images into `directory` (see the module's docstring).

    start() before CRIU runs; finish() once CRIU has exited. Then `sums` holds, per page
    file, (size, chunk CRCs), `zero_bytes` the all-zero chunks not written, and `error`
    why receiving failed (CRIU then fails too: its pipes are closed on it)."""

    def __init__(
        self,
        directory: Path,
        chunk_size: int = CHUNK_SIZE,
        direct: bool = True,
        writers: int | None = None,
        writeback_step: int = _WRITEBACK_STEP,
        base: PageIndex | None = None,
    ):
        self._dir = directory
        # On a base, only pages whose content the base lacks are written (incremental.py).
        self._base = base
        self._packer = (
            DeltaPacker(base, self._recycle, self._queue_write, self._fail, self._failed)
            if base is not None
            else None
        )
        self.delta: DeltaResult | None = None
        self._step = writeback_step
        self._chunk_size = chunk_size
        self._zeros = bytes(chunk_size)
        self._direct = direct
        self._pool: queue.Queue[mmap.mmap] = queue.Queue()
        # (file, offset, buffer, bytes in it, its chunks that are zeros); a None buffer
        # closes the file, once its buffers are written; None ends a writer.
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._written = threading.Condition()  # over the sinks' `writing` and `synced`
        writers = writers or _WRITERS
        self._max_buffers = writers + 2
        self._buffers = 0
        self._criu_gone = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._receiver = threading.Thread(target=self._receive, name="cedana-capture", daemon=True)
        self._writers = [
            threading.Thread(target=self._write, name=f"cedana-capture-w{i}", daemon=True)
            for i in range(writers)
        ]
        self.sums: dict[str, tuple[int, list[int]]] = {}
        self._streams: dict[str, DeltaStream] = {}
        self.zero_bytes = 0
        self.direct_files = 0
        self.error: str | None = None

    def start(self) -> ImageCapture:
        try:
            self._bind()
            self._listener.listen(1)
        except BaseException:
            self._close_listener()
            raise
        self._receiver.start()
        for w in self._writers:
            w.start()
        if self._packer is not None:
            self._packer.start()
        return self

    def _bind(self) -> None:
        path = self._dir / SOCKET_NAME
        if len(os.fsencode(str(path))) < 100:
            self._listener.bind(str(path))
            return
        # Deep image directories exceed sun_path's 108 bytes: bind through a short name.
        dfd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._listener.bind(f"/proc/self/fd/{dfd}/{SOCKET_NAME}")
        finally:
            os.close(dfd)

    def finish(self) -> dict[str, tuple[int, list[int]]]:
        """Call once CRIU has exited: waits for what its pipes still hold."""
        self._criu_gone.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._receiver.join()
        for w in self._writers:
            w.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with contextlib.suppress(OSError):
            (self._dir / SOCKET_NAME).unlink()
        if self.error is None and self._base is not None:
            self._finish_delta(self._base)
        return self.sums if self.error is None else {}

    def _finish_delta(self, base: PageIndex) -> None:
        try:
            self.delta = finish_delta(self._dir, base, self._streams)
            for name in self.delta.rebuilt:
                self.sums[name] = chunk_crcs(self._dir / name, self._chunk_size)
        except (OSError, ImageError) as e:
            self._fail(f"making the image a delta on its base: {e}")

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why

    def _failed(self) -> bool:
        return self.error is not None

    def _recycle(self, buf: mmap.mmap) -> None:
        self._pool.put(buf)

    def _queue_write(self, sink: DeltaSink, offset: int, buf: mmap.mmap, n: int) -> None:
        assert isinstance(sink, _Sink)
        with self._written:
            sink.writing += 1
        self._writes.put((sink, offset, buf, n, set()))

    def _close_listener(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()

    # The receiving thread: CRIU's requests and pipes, multiplexed (CRIU writes several
    # files at once: a pagemap and its pages; a pipe left unread would block it).

    def _receive(self) -> None:
        sel = selectors.DefaultSelector()
        sinks: dict[int, _Sink] = {}
        conn: socket.socket | None = None
        quiet_since: float | None = None
        try:
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            sel.register(self._listener, selectors.EVENT_READ, "listen")
            while conn is not None or sinks or not self._criu_gone.is_set():
                events = sel.select(timeout=1.0)
                if self.error is not None:
                    break
                if self._criu_gone.is_set():
                    if conn is None and not sinks:
                        break  # CRIU never connected (it failed before, or was killed)
                    if events and any(key.data not in ("wake",) for key, _ in events):
                        quiet_since = None
                    elif quiet_since is None:
                        quiet_since = time.monotonic()
                    elif time.monotonic() - quiet_since > _QUIET_AFTER_EXIT_S:
                        self._fail("CRIU exited, but an image pipe stayed open")
                        break
                for key, _ in events:
                    if key.data == "wake":
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 64)
                    elif key.data == "listen":
                        conn, _ = self._listener.accept()
                        sel.unregister(self._listener)
                        self._close_listener()
                        sel.register(conn, selectors.EVENT_READ, "conn")
                    elif key.data == "conn":
                        assert conn is not None
                        sink = self._accept_file(conn)
                        if sink is None:
                            sel.unregister(conn)
                            conn.close()
                            conn = None
                        else:
                            sinks[sink.rfd] = sink
                            sel.register(sink.rfd, selectors.EVENT_READ, sink)
                    else:
                        sink = key.data
                        if not self._pump(sink):
                            sel.unregister(sink.rfd)
                            del sinks[sink.rfd]
                            self._end_file(sink)
        except Exception as e:  # any failure must fail the dump, not hang it
            self._fail(str(e) if isinstance(e, CaptureFailed) else f"{type(e).__name__}: {e}")
        finally:
            if self._packer is not None:  # its last buffers go to the writers first
                self._packer.close()
            # On failure CRIU finds its pipes closed (EPIPE) and fails the dump.
            for sink in sinks.values():
                with contextlib.suppress(OSError):
                    os.close(sink.rfd)
                if sink.pages:  # the writer may be writing to it: it closes it
                    self._writes.put((sink, sink.size, None, 0, set()))
                else:
                    with contextlib.suppress(OSError):
                        sink.close()
            if conn is not None:
                conn.close()
            self._close_listener()
            sel.close()
            for _ in self._writers:
                self._writes.put(None)

    def _accept_file(self, conn: socket.socket) -> _Sink | None:
        header = _recv_exact(conn, 4)
        if header is None:
            return None  # CRIU has no more files to send
        (length,) = struct.unpack("<I", header)
        if length > 4096:
            raise CaptureFailed("malformed request from CRIU")
        msg = _recv_exact(conn, length)
        if msg is None:
            raise CaptureFailed("CRIU hung up mid-request")
        name = _request_name(msg)
        _, fds, _, _ = socket.recv_fds(conn, 1, 1)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise CaptureFailed(f"CRIU sent no pipe for {name}")
        rfd = fds[0]
        os.set_blocking(rfd, False)
        with contextlib.suppress(OSError):
            fcntl.fcntl(rfd, _F_SETPIPE_SZ, _PIPE_SIZE)
        try:
            sink = _Sink(self._dir, name, rfd, self._direct, self._chunk_size)
        except OSError:
            os.close(rfd)
            raise
        self.direct_files += sink.direct
        return sink

    def _pump(self, sink: _Sink) -> bool:
        """Read what the pipe holds; False at its end."""
        if not sink.pages:
            try:
                data = os.read(sink.rfd, _PIPE_SIZE)
            except BlockingIOError:
                return True
            if data:
                try:
                    write_all(sink.fd, data)
                except OSError as e:  # said as a page file's writer says it
                    raise CaptureFailed(f"writing {sink.name}: {e.strerror or e}") from None
                return True
            return False
        while True:
            if sink.buf is None:
                sink.buf = self._take_buffer()
                sink.fill = len(sink.carry)
                sink.buf[: sink.fill] = sink.carry
                sink.carry = b""
            try:
                n = os.readv(sink.rfd, [memoryview(sink.buf)[sink.fill :]])
            except BlockingIOError:
                return True
            sink.fill += n
            if n and sink.fill < _BUF:
                continue
            if sink.fill:
                self._hand_to_writer(sink)
            if not n:
                return False

    def _take_buffer(self) -> mmap.mmap:
        while True:
            with contextlib.suppress(queue.Empty):
                return self._pool.get_nowait()
            if self._buffers < self._max_buffers:
                self._buffers += 1
                return mmap.mmap(-1, _BUF)  # page aligned, as O_DIRECT needs
            with contextlib.suppress(queue.Empty):
                return self._pool.get(timeout=0.5)
            if self.error is not None:
                raise CaptureFailed(self.error)

    def _hand_to_writer(self, sink: _Sink) -> None:
        """Chunk CRCs and zero chunks of a full buffer, then the writer writes it."""
        assert sink.buf is not None
        if self._packer is not None:  # on a base: hashed and packed on the packer's thread
            buf, n = sink.buf, sink.fill
            whole = n - n % PAGE_SIZE
            sink.carry = bytes(buf[whole:n])  # put at the start of the next buffer
            sink.buf = None
            self._packer.hand(sink, buf, whole)
            return
        size, n, offset = self._chunk_size, sink.fill, sink.size
        view = memoryview(sink.buf)[:n]
        seen = len(sink.hasher.maybe_zero)
        sink.hasher.update(view)
        # Only a chunk whose CRC is that of zeros can be zeros; compare just those.
        first = offset // size
        zero = {
            k
            for k in (i - first for i in sink.hasher.maybe_zero[seen:])
            if view[k * size : (k + 1) * size] == self._zeros
        }
        view.release()
        sink.zero += len(zero) * size
        with self._written:
            sink.writing += 1
        self._writes.put((sink, offset, sink.buf, n, zero))
        sink.buf = None

    def _end_file(self, sink: _Sink) -> None:
        os.close(sink.rfd)
        if sink.pages:
            if sink.buf is not None:
                self._pool.put(sink.buf)
                sink.buf = None
            if sink.carry:
                raise CaptureFailed(f"{sink.name}: CRIU's stream ended mid-page")
            if self._packer is not None:
                self._packer.then(lambda: self._seal(sink))
            else:
                self._seal(sink)
        else:
            sink.close()

    def _seal(self, sink: _Sink) -> None:
        """Once all of a page file's bytes are handed to the writers."""
        self.sums[sink.name] = (sink.size, sink.hasher.crcs())
        self._streams[sink.name] = sink.delta
        self._writes.put((sink, sink.size, None, 0, set()))  # closes it, after its writes

    # The writing threads: a buffer's non-zero chunk runs go to disk while the next fill,
    # several buffers at once (each at its own offset); a file is closed once all are in.

    def _write(self) -> None:
        while (item := self._writes.get()) is not None:
            sink, offset, buf, n, zero = item
            if buf is None:
                with self._written:
                    while sink.writing:
                        self._written.wait()
                self._guard(sink, sink.close)
                if self.error is None:
                    with self._written:
                        self.zero_bytes += sink.zero
                continue
            if self.error is None:
                self._guard(sink, self._write_buffer, sink, offset, buf, n, zero)
            self._pool.put(buf)
            with self._written:
                sink.writing -= 1
                self._written.notify_all()

    def _guard(self, sink: _Sink, work: Any, *args: Any) -> None:
        try:
            work(*args)
        except Exception as e:  # the receiver must learn of any failure
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            self._fail(f"writing {sink.name}: {why}")
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def _write_buffer(
        self, sink: _Sink, offset: int, buf: mmap.mmap, end: int, zero: set[int]
    ) -> None:
        view = memoryview(buf)
        size = self._chunk_size
        chunks = -(-end // size)
        run = None
        for i in range(chunks + 1):
            if i < chunks and i not in zero:
                run = i * size if run is None else run
            elif run is not None:
                pwrite_all(sink.fd, view[run : min(i * size, end)], offset + run)
                run = None
        view.release()
        if not sink.direct:
            with self._written:  # writers finish out of order: start what lies behind
                start = sink.synced if offset + end - sink.synced >= self._step else -1
                if start >= 0:
                    sink.synced = offset + end
                    drop_from, sink.dropped = sink.dropped, start
            if start >= 0:
                start_writeback(sink.fd, start, offset + end - start)
                # The range started one step before is done by now, or nearly: waiting
                # for it holds this writer back, and the page cache to about two steps.
                if start > drop_from:
                    drop_written(sink.fd, drop_from, start - drop_from)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            if out:
                raise CaptureFailed("CRIU hung up mid-request")
            return None
        out += part
    return out
