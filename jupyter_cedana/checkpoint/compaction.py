"""Compaction: a suspended kernel's chain of incremental images (incremental.py: a whole
image and the deltas on it) folded into one whole image, which then takes the chain's
place in one step a kill cannot split (exchange.py). docs/incremental.md, *Compaction*.

The fold reads every page the kernel's newest image holds, in whichever layer of the
chain holds it, checking every 64 KiB chunk it reads against that layer's chunk table
(and every other file against its CRC: chain_reader.py), and writes a whole image as a
dump would: one page file per page map, in the page map's order, with new chunk tables,
all-zero chunks as holes, the page maps' in-parent entries made present (their lazy marks
kept). The other files are the newest image's, copied; the manifest is the newest image's (its
`created` and `created_clock` too: it is the same checkpoint, taken at the same time, so
retention and the page index, which names the image by `created`, go on as before), with
the new files and `held_bytes` equal to its own size.

Named steps, each of which a kill may end (`compact`):
- fold: into a store temporary (`.<id>.tmp-<pid>-<n>.locked`): a kill leaves a temporary
  whose lock is gone, which gc removes; the chain is untouched.
- exchange (after `folded`): the folded image and the chain swap names at once, and the
  chain, now at the temporary's name (unlocked: the lock is on the folded image's
  directory), is renamed to a deletion name (`.<id>.del-<n>`); a kill leaves it at
  either name, both gc's.
- removal (after `exchanged`): the chain is deleted.

`sweep` removes what a kill left, as gc would; the compactor runs it once per kernel.

A `Job` is how a caller cancels: a resume sets `cancel` and waits for `settled`, which is
set as soon as the compaction has stopped short of the exchange, or done it; the fold
looks at `cancel` after every read of at most 4 MiB. Test holds: with the environment
variable JUPYTER_CEDANA_COMPACTION_HOLDS naming a directory, a step whose `arm-STEP` file
is there waits at it (creating `reached-STEP`) until `release-STEP` exists (or the job is
cancelled, before the exchange): tests/test_compaction*.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isal.isal_zlib import crc32

from .chain_reader import ChainReader
from .crimg import (
    PAGE_SIZE,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    decode,
    field_spans,
    pagemap_record,
    read_pagemap_entry,
)
from .durable import LOCKED_SUFFIX, fsync_path, replace_json_durably, writer_gone
from .incremental import INDEX_NAME, manifest_token
from .integrity import (
    CHUNK_SIZE,
    ChunkHasher,
    drop_written,
    is_page_file,
    punch_zeros,
    start_writeback,
    table_name,
    write_table,
)
from .store import MANIFEST, CheckpointStore

HOLD_ENV = "JUPYTER_CEDANA_COMPACTION_HOLDS"
STEPS = ("folding", "folded", "exchanged")
_READ = 4 << 20  # read (and checked) at once; and how often `cancel` is looked at
_WRITEBACK = 32 << 20
# The manifest keys that describe a delta and its chain, not the folded image.
_CHAIN_KEYS = ("base", "delta", "held_bytes", "files", "total_bytes")


class Cancelled(Exception):
    """The compaction was cancelled (a resume): nothing replaced, the temporary gone."""


@dataclass
class Job:
    """One compaction, as its caller sees it."""

    kernel_id: str
    cancel: threading.Event = field(default_factory=threading.Event)
    # Set once the chain is either kept for good (stopped before the exchange) or
    # replaced (exchanged): what a resume waits for.
    settled: threading.Event = field(default_factory=threading.Event)
    exchanged: bool = False
    step: str = ""
    # Held while the job decides to exchange and exchanges, so that a cancel set before
    # it is always seen.
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Chain:
    """What a kernel's image holds: layers (1: whole), bytes on disk (held), and the
    bytes of the pages it restores (its memory, as a whole image holds it)."""

    layers: int
    held_bytes: int
    memory_bytes: int


@dataclass
class Result:
    layers: int
    held_before: int
    held_after: int
    seconds: float
    read_bytes: int


def chain_of(store: CheckpointStore, kernel_id: str) -> Chain | None:
    """The kernel's image as a chain (manifests only: cheap); None without an image."""
    try:
        manifest = store.read_manifest(kernel_id)
        layers = store.layers(kernel_id, manifest)
    except Exception:
        return None
    held = int(manifest.get("held_bytes") or manifest.get("total_bytes") or 0)
    delta = manifest.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("pages"), int):
        memory = delta["pages"] * PAGE_SIZE
    else:
        memory = sum(
            int(m.get("size", 0)) for n, m in manifest.get("files", {}).items() if is_page_file(n)
        )
    return Chain(len(layers), held, memory)


def sweep(store: CheckpointStore, kernel_id: str) -> list[str]:
    """Remove what a compaction (or a dump) of the kernel killed mid-way left: its
    temporaries whose writer's lock is gone (a folded image not exchanged, or a chain
    exchanged and not deleted) and deletions left half done. Returns their names.
    Anything a live writer holds is left alone."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(store.root):
            name = entry.name
            if not name.startswith(f".{kernel_id}.") or not entry.is_dir(follow_symlinks=False):
                continue
            rest = name[len(kernel_id) + 2 :]
            dead = rest.startswith("tmp-") and name.endswith(LOCKED_SUFFIX)
            if (dead and writer_gone(Path(entry.path))) or rest.startswith("del-"):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(name)
    return removed


def hold(step: str, job: Job | None) -> None:
    """A test's hold at `step` (module docstring); nothing when none is armed."""
    where = os.environ.get(HOLD_ENV)
    if job is not None:
        job.step = step
    if not where:
        return
    armed = Path(where) / f"arm-{step}"
    if not armed.exists():
        return
    armed.unlink(missing_ok=True)
    (Path(where) / f"reached-{step}").touch()
    release = Path(where) / f"release-{step}"
    while not release.exists():
        if job is not None and not job.exchanged and job.cancel.is_set():
            raise Cancelled(f"compaction of {job.kernel_id} cancelled at {step}")
        time.sleep(0.005)
    release.unlink(missing_ok=True)


def polite() -> None:
    """Lowest CPU and I/O priority for the calling thread (Linux applies both per
    thread): the compaction runs beside kernels and suspends, which come first."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    number = {"x86_64": 251, "aarch64": 30}.get(platform.machine())
    if number is not None:  # ioprio_set(IOPRIO_WHO_PROCESS, tid, IOPRIO_CLASS_IDLE)
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).syscall(number, 1, tid, 3 << 13)


async def in_polite_thread(name: str, work: Callable[..., Any], *args: Any) -> Any:
    """`work(*args)` in a thread of its own (named `name`), at the lowest CPU and I/O
    priority (`polite`: a pool's thread would keep that priority for whatever ran in it
    next), awaited without holding the event loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        polite()
        try:
            result = work(*args)
        except BaseException as e:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, None, e)
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def compact(store: CheckpointStore, kernel_id: str, job: Job | None = None) -> Result | None:
    """Fold the kernel's chain into a whole image and put it in the chain's place; None
    when its image is already whole. Cancelled when `job` is cancelled before the
    exchange; CheckpointCorrupt (a damaged chunk or file: the chain is kept as it is, and
    its resume reports the damage), ImageError or OSError when it cannot be folded."""
    job = job or Job(kernel_id)
    t0 = time.monotonic()
    tmp: Path | None = None
    doomed: Path | None = None
    try:
        manifest = store.check_sizes(kernel_id)
        if not manifest.get("base"):
            return None
        token = manifest_token(manifest)
        layers = [(where, layer) for where, layer, _ in store.layers(kernel_id, manifest)]
        tmp = store.begin(kernel_id)
        fold = _Fold(store, kernel_id, layers, tmp, job)
        files = fold.run()
        total = sum(meta["size"] for meta in files.values())
        folded = {k: v for k, v in manifest.items() if k not in _CHAIN_KEYS}
        folded.update(files=files, total_bytes=total, held_bytes=total)
        folded["compacted"] = {
            "at": time.time(),
            "layers": len(layers),
            "held_before": int(manifest.get("held_bytes") or 0),
        }
        replace_json_durably(tmp / MANIFEST, folded)
        index = layers[0][0] / INDEX_NAME
        with contextlib.suppress(FileNotFoundError):
            # The same pages at the same addresses, and the same `created`: the index
            # of the chain's newest image is the folded image's.
            shutil.copyfile(index, tmp / INDEX_NAME)
            os.chmod(tmp / INDEX_NAME, 0o600)
            fsync_path(tmp / INDEX_NAME)
        fsync_path(tmp, directory=True)
        hold("folded", job)
        with job.lock:
            if job.cancel.is_set():
                raise Cancelled(f"compaction of {kernel_id} cancelled before the exchange")
            if manifest_token(store.read_manifest(kernel_id)) != token:
                raise Cancelled(f"the image of {kernel_id} changed during its compaction")
            doomed = store.exchange(kernel_id, tmp)
            job.exchanged = True
        tmp = None
    finally:
        job.settled.set()
        if tmp is not None:
            store.discard(tmp)
    hold("exchanged", job)
    shutil.rmtree(doomed, ignore_errors=True)
    return Result(
        len(layers),
        int(manifest.get("held_bytes") or 0),
        total,
        time.monotonic() - t0,
        fold.read_bytes,
    )


class _Fold:
    def __init__(
        self,
        store: CheckpointStore,
        kernel_id: str,
        layers: list[tuple[Path, dict[str, Any]]],
        tmp: Path,
        job: Job,
    ):
        self.kid, self.layers, self.tmp, self.job = kernel_id, layers, tmp, job
        self.chain = ChainReader(store, kernel_id, layers)
        self.read_bytes = 0
        self.files: dict[str, dict[str, Any]] = {}

    def run(self) -> dict[str, dict[str, Any]]:
        top = self.layers[0][1]
        try:
            for name in sorted(top["files"]):
                if name.startswith("pagemap-") and name.endswith(".img"):
                    self.fold_pagemap(name)
                elif not is_page_file(name) and not (
                    name.endswith(".chunks") and is_page_file(name[: -len(".chunks")])
                ):
                    data = self.chain.verified(0, name)
                    self.write_small(name, data)
                if self.job.cancel.is_set():
                    raise Cancelled(f"compaction of {self.kid} cancelled")
        finally:
            self.read_bytes += self.chain.close()
        return self.files

    def write_small(self, name: str, data: bytes) -> None:
        path = self.tmp / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {"size": len(data), "crc32": crc32(data)}

    def fold_pagemap(self, name: str) -> None:
        data = self.chain.verified(0, name)
        spans = field_spans(data, name)
        head_end = spans[1][0] - 4 if len(spans) > 1 else len(data)
        records = [data[:head_end]]
        pages_file = self.chain.runs(0, name)[2]
        pieces: list[tuple[int, int, int]] = []
        offset = 0  # in the top's page file
        for lo, hi in spans[1:]:
            vaddr, count, flags = read_pagemap_entry(data, lo, hi)
            wide = 5 in decode(data[lo:hi])
            if flags & PE_PRESENT:
                self.chain.resolve(0, name, vaddr, vaddr + count * PAGE_SIZE, pieces)
                offset += count * PAGE_SIZE
            elif flags & PE_PARENT:
                self.chain.resolve(1, name, vaddr, vaddr + count * PAGE_SIZE, pieces)
                flags = PE_PRESENT | (flags & PE_LAZY)
            records.append(pagemap_record(vaddr, count, flags, wide))
        self.write_pages(name, pages_file, pieces)
        self.write_small(name, b"".join(records))

    def write_pages(
        self, pagemap: str, pages_file: str, pieces: list[tuple[int, int, int]]
    ) -> None:
        """The folded page file of page map `pagemap`, from its pieces in the layers."""
        path = self.tmp / pages_file
        hasher = ChunkHasher(CHUNK_SIZE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            written = synced = 0
            for depth, offset, length in pieces:
                # Each layer numbers its page files itself: the layer's page map names it.
                source = self.chain.source(depth, self.chain.runs(depth, pagemap)[2])
                while length:
                    take = min(length, _READ)
                    block = memoryview(source.read(offset, take))
                    hasher.update(block)
                    while block:
                        n = os.write(fd, block)
                        block = block[n:]
                    written += take
                    offset += take
                    length -= take
                    if written - synced >= _WRITEBACK:  # bounded page cache, early writes
                        start_writeback(fd, synced, written - synced)
                        if synced:
                            drop_written(fd, 0, synced)
                        synced = written
                    if self.job.cancel.is_set():
                        raise Cancelled(f"compaction of {self.kid} cancelled")
                    if self.job.step != "folding":
                        hold("folding", self.job)
            punch_zeros(fd, hasher, 0)
            os.fsync(fd)
            drop_written(fd, 0, written)
        finally:
            os.close(fd)
        table = table_name(pages_file)
        write_table(self.tmp / table, CHUNK_SIZE, hasher.size, hasher.crcs())
        fsync_path(self.tmp / table)
        table_bytes = (self.tmp / table).read_bytes()
        self.files[pages_file] = {"size": hasher.size, "chunk_size": CHUNK_SIZE, "chunks": table}
        self.files[table] = {"size": len(table_bytes), "crc32": crc32(table_bytes)}
