"""Lazy restore: the kernel runs as soon as CRIU has restored everything but its memory
pages, and native/cedana-pages serves those over userfaultfd, on demand and in the
background, checking each chunk's CRC before any page of it reaches the kernel.

Before CRIU runs, the image is checked as far as the restore itself reads it: every file
size, every file that is not a page file, and the chunks holding the pages CRIU restores
itself (stacks). The page files are checked chunk by chunk as they are served. An
incremental image's pages in its bases (incremental.py) are served from the bases' page
files, checked by their own chunk tables.

A damaged chunk, a failed read, or the page server dying: the kernel must not run on with
wrong memory. The server holds a copy of every userfaultfd, so a missing page blocks the
kernel instead of reading as zeros; the caller kills the kernel, and keeps the image.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ResumeFailed
from . import crimg, readahead
from .store import CheckpointStore

MAP_NAME = "pages.map"
LOG_NAME = "pages.log"


class PagesFailed(ResumeFailed):
    """The kernel's memory could not all be loaded: it must not run on."""

    code = "pages_failed"


class KernelExited(Exception):
    """Every process of the kernel ended before all its memory was loaded."""


class ProbeFailed(Exception):
    """The probe itself failed (CRIU could not run, or timed out): ask again next time."""


def unsupported_reason(criu: str, unprivileged: bool, pages: str) -> str | None:
    """Why lazy restore cannot work here (None: it can); ProbeFailed if it can't tell."""
    if not os.access(pages, os.X_OK):
        return f"{pages} is missing"
    cmd = [criu, "check", "--feature", "uffd-noncoop"]
    if unprivileged:
        cmd.insert(1, "--unprivileged")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise ProbeFailed(f"criu check failed: {e}") from e
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0 or "is supported" not in text:
        return f"CRIU says userfaultfd is not usable: {text.splitlines()[-1] if text else '?'}"
    return None


@dataclass
class Plan:
    """What a lazy restore of an image serves, and what must be checked before CRIU."""

    map_path: Path
    lazy_bytes: int
    eager_chunks: dict[str, set[int]] = field(default_factory=dict)
    # File ranges behind the pages CRIU restores itself in private file mappings: it
    # copies them on write, reading each file page first (readahead.py).
    read_ahead: readahead.Ranges = field(default_factory=dict)


def plan(store: CheckpointStore, kernel_id: str, manifest: dict[str, Any], work: Path) -> Plan:
    """Read the image's page maps and write the page server's map into `work`. Call only
    after the image's small files are verified (the map is built from them)."""
    images = store.path(kernel_id)
    # The image's page files, then its bases' (an incremental image: base/NAME, ...).
    layers = store.layers(kernel_id, manifest)
    page_files: list[tuple[str, str, dict[str, Any], int]] = []  # name, table, meta, CRC
    for _, layer, prefix in layers:
        files = layer["files"]
        for name in sorted(n for n, m in files.items() if "chunks" in m):
            table = files[name]["chunks"]
            page_files.append((prefix + name, prefix + table, files[name], files[table]["crc32"]))
    index = {name: i for i, (name, _, _, _) in enumerate(page_files)}
    chunk_size = page_files[0][2]["chunk_size"] if page_files else 4096
    if any(meta["chunk_size"] != chunk_size for _, _, meta, _ in page_files):
        raise ResumeFailed(f"Checkpoint of {kernel_id} mixes chunk sizes")
    lines = [f"cedana-pages-map 1 chunk {chunk_size}"]
    for name, table, meta, crc in page_files:
        # The page server reads the table itself, checked against this CRC.
        lines.append(f"file {meta['size']} {name} {table} {crc:08x}")
    eager: dict[str, set[int]] = {}
    below: dict[tuple[int, int], list[crimg.PageRun]] = {}  # (layer, pid): its page runs

    def in_base(depth: int, pid: int, lo: int, hi: int) -> list[tuple[str, int, int, int]]:
        """(page file, offset, lo, hi) of the pages [lo, hi) that layer `depth` holds
        itself or through its own base."""
        if depth >= len(layers):
            raise crimg.ImageError(f"page {lo:#x} of process {pid} is in no base")
        where, _, prefix = layers[depth]
        runs = below.get((depth, pid))
        if runs is None:
            runs = below[(depth, pid)] = crimg.pagemap(where, pid)
        out: list[tuple[str, int, int, int]] = []
        at = lo
        for run in runs[max(0, bisect.bisect_right([r.vaddr for r in runs], lo) - 1) :]:
            a, b = max(run.vaddr, at), min(run.end, hi)
            if a >= hi:
                break
            if a >= b:
                continue
            if a != at:
                break  # a hole: said below
            if run.present:
                out.append((prefix + run.pages_file, run.offset + (a - run.vaddr), a, b))
            elif run.flags & crimg.PE_PARENT:
                out.extend(in_base(depth + 1, pid, a, b))
            else:
                break
            at = b
        if at != hi:
            raise crimg.ImageError(f"page {at:#x} of process {pid} is in no base")
        return out

    to_read: list[readahead.Ranges] = []
    lazy_bytes = 0
    try:
        paths = readahead.file_paths(images)
        for pid in crimg.pids(images):
            runs = crimg.pagemap(images, pid)
            areas = crimg.areas(images, pid)
            vmas = [(a.start, a.end) for a in areas]
            ends = [end for _, end in vmas]
            written: list[tuple[int, int]] = []
            pieces: list[tuple[int, int, int, int]] = []  # file, offset, lo, hi
            for run in runs:
                if run.present:
                    sources = [(run.pages_file, run.offset, run.vaddr, run.end)]
                elif run.flags & crimg.PE_PARENT:  # in a base: CRIU reads it, or we serve it
                    sources = in_base(1, pid, run.vaddr, run.end)
                else:
                    continue
                for name, offset, start, end in sources:
                    if name not in index:
                        raise ResumeFailed(
                            f"Checkpoint of {kernel_id} has no chunk table for {name}"
                        )
                    if not run.lazy:
                        written.append((start, end))
                        first = offset // chunk_size
                        last = (offset + end - start - 1) // chunk_size
                        eager.setdefault(name, set()).update(range(first, last + 1))
                        continue
                    # UFFDIO_COPY works within one memory area: split runs at area bounds.
                    k = bisect.bisect_right(ends, start)
                    fi = index[name]
                    while k < len(vmas) and vmas[k][0] < end:
                        lo, hi = max(vmas[k][0], start), min(vmas[k][1], end)
                        if lo < hi:
                            lazy_bytes += hi - lo
                            pieces.append((fi, offset + (lo - start), lo, hi))
                        k += 1
            to_read.append(readahead.ranges(paths, areas, written))
            pieces.sort()
            lines.append(f"task {pid} {len(pieces)}")
            lines.extend(f"{lo:x} {hi:x} {f} {off:x}" for f, off, lo, hi in pieces)
    except (OSError, crimg.ImageError) as e:
        raise ResumeFailed(
            f"Checkpoint of {kernel_id} cannot be read for a lazy restore: {e}"
        ) from e
    path = work / MAP_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return Plan(path, lazy_bytes, eager, readahead.merge(to_read))


def check_before_restore(
    store: CheckpointStore,
    kernel_id: str,
    manifest: dict[str, Any],
    work: Path,
    read_ahead: bool = True,
) -> Plan:
    """Everything CRIU itself reads, checked; then the page server's map. `read_ahead`:
    meanwhile, the library pages CRIU will copy are asked of the disk (readahead)."""
    store.verify_small_files(kernel_id, manifest)
    p = plan(store, kernel_id, manifest, work)
    if read_ahead and p.read_ahead:
        readahead.start(lambda: p.read_ahead)
    for name, chunks in p.eager_chunks.items():
        store.verify_chunks(kernel_id, manifest, name, chunks)
    return p


Progress = Callable[[int, int], None]


class PageServer:
    """One cedana-pages daemon serving one restored kernel's memory."""

    # Copier threads of the page servers running now. They share one budget: on a
    # workspace resuming many kernels at once, several copiers each would take the CPU
    # the kernels need for their first output (10 x 0.5 GB at once on 2 cores: 2.7 s to
    # the last first output with 4 each, 2.3 s with 1), while each kernel's own copier
    # already overlaps with the others'.
    copiers_busy = 0

    def __init__(
        self,
        binary: str,
        images: Path,
        work: Path,
        pidfile: Path,
        the_plan: Plan,
        log: Any,
        copiers: int = 2,
    ):
        self.binary = binary
        self.copiers_max = copiers
        self.copiers = 0  # its share of the budget, from start() until it has ended
        self.images = images
        self.work = work
        self.pidfile = pidfile
        self.plan = the_plan
        self.log = log
        self.bytes_done = 0
        self.started = time.monotonic()
        self.done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._proc: asyncio.subprocess.Process | None = None
        self._holder: socket.socket | None = None
        self._held: list[int] = []
        self._reader: asyncio.Task[None] | None = None
        self._progress: Progress | None = None
        self._error: str | None = None

    async def start(self, progress: Progress | None = None) -> None:
        """Start the daemon; returns once it listens for CRIU."""
        self._progress = progress
        self.copiers = max(1, self.copiers_max - PageServer.copiers_busy)
        PageServer.copiers_busy += self.copiers
        try:
            await self._start()
        except BaseException:
            self._give_back_copiers()
            raise

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        self._holder = ours
        cmd = [self.binary, "--images", str(self.images), "--map", str(self.plan.map_path)]
        cmd += ["--pidfile", str(self.pidfile), "--holder-fd", str(theirs.fileno())]
        cmd += ["--copiers", str(self.copiers), "--parent-pid", str(os.getpid())]
        (self.work / "lazy-pages.socket").unlink(missing_ok=True)
        log_fd = os.open(self.work / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd,
                cwd=self.work,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log_fd,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            os.close(log_fd)
            theirs.close()
        loop = asyncio.get_running_loop()
        loop.add_reader(ours.fileno(), self._take_fds)
        line = await self._line()
        if line != "ready":
            await self.stop()
            raise PagesFailed(f"The page server did not start: {line or self._exit_text()}")
        self._reader = asyncio.ensure_future(self._follow())

    def _take_fds(self) -> None:
        """Keep a copy of each userfaultfd the daemon receives (see the module doc)."""
        assert self._holder is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._holder, 64, 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            self._held.extend(fds)
            if not data:
                asyncio.get_running_loop().remove_reader(self._holder.fileno())
                return

    async def _line(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        raw = await self._proc.stdout.readline()
        return raw.decode(errors="replace").strip()

    async def _follow(self) -> None:
        try:
            while line := await self._line():
                word, _, rest = line.partition(" ")
                if word == "progress":
                    done, total = (int(x) for x in rest.split())
                    self.bytes_done = done
                    if self._progress is not None:
                        self._progress(done, total or self.plan.lazy_bytes)
                elif word == "done":
                    self.bytes_done = int(rest.split()[0])
                elif word == "error":
                    self._error = rest
                    self._settle(PagesFailed(f"Loading the kernel's memory failed: {rest}"))
                elif word == "exited":
                    self._settle(KernelExited("the kernel exited while its memory loaded"))
            rc = await self._proc.wait() if self._proc is not None else None
        except asyncio.CancelledError:
            raise
        finally:
            self._give_back_copiers()
        if rc == 0 and self._error is None:
            self._settle(None)
        else:
            left = self.plan.lazy_bytes - self.bytes_done
            self._settle(
                PagesFailed(
                    f"The page server stopped ({self._exit_text()}) with {max(left, 0)} bytes "
                    "of the kernel's memory not loaded"
                )
            )

    def _give_back_copiers(self) -> None:
        PageServer.copiers_busy -= self.copiers
        self.copiers = 0

    def _exit_text(self) -> str:
        rc = self._proc.returncode if self._proc is not None else None
        if rc is None:
            return "still running"
        if rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"exit {rc}"

    def _settle(self, error: BaseException | None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(time.monotonic() - self.started)
        else:
            self.done.set_exception(error)
            self.done.exception()  # retrieved: the owner reads it from its own task

    async def stop(self) -> None:
        """Kill the daemon (after the kernel, if the kernel must not run on) and let go of
        the userfaultfds."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()
        if self._reader is not None:
            with contextlib.suppress(BaseException):
                await self._reader
        self._give_back_copiers()
        self.release()

    def release(self) -> None:
        if self._holder is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._holder.fileno())
            self._take_fds_quietly()
            self._holder.close()
            self._holder = None
        for fd in self._held:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._held = []

    def _take_fds_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self._take_fds()
