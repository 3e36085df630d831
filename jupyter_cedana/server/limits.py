"""Limits that hold under concurrency: how many suspends and resumes run at once (the
others wait in line, `queued`), and the disk a dump may take (the checkpoint budget and
the free space of the checkpoint disk), reserved before the dump starts.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from traitlets import Float, Integer
from traitlets.config import LoggingConfigurable

from ..checkpoint.proctree import process_tree
from ..checkpoint.store import CheckpointStore
from ..errors import CheckpointCorrupt, Conflict, InsufficientStorage, NotFound
from ..timestamps import iso


class SuspendLimits(LoggingConfigurable):
    """How many transitions run at once, and how much of the disk a dump may use."""

    max_concurrent_suspends = Integer(
        2,
        help="Most suspends (GPU offload, dump to disk, commit of the image) that run at "
        "the same time; more wait in line (shown as queued), holding neither GPU memory "
        "copies nor disk reservations. Their dumps share the disk: more at once finish a "
        "batch little sooner and keep each kernel frozen longer (docs/benchmarks.md); 2 "
        "lets one kernel's dump overlap another's GPU copy or image fsync. 0: no limit.",
    ).tag(config=True)

    max_concurrent_resumes = Integer(
        4,
        help="Most resumes that run at the same time; more wait in line (shown as "
        "queued). 0: no limit.",
    ).tag(config=True)

    min_free_disk_bytes = Integer(
        1 << 30,
        help="Bytes that must stay free on the checkpoint disk after a dump of the "
        "estimated size (the kernel's resident memory and its GPU memory) and after the "
        "dumps already under way; a suspend that would leave less is refused before it "
        "starts, and the kernel keeps running.",
    ).tag(config=True)

    compact_chain_ratio = Float(
        1.1,
        help="A suspended kernel's chain of incremental images (CheckpointEngine.keep_base: "
        "a whole image and the deltas on it) that holds more than this many times the "
        "memory it restores is compacted in the background into one whole image, which "
        "takes the chain's place (docs/incremental.md). Below 1.2, where the next suspend "
        "would write a whole image itself, while the kernel is frozen. 0: never by size.",
    ).tag(config=True)

    compact_chain_deltas = Integer(
        8,
        help="A suspended kernel's chain with more deltas than this is compacted in the "
        "background too, whatever it holds: each delta is one more layer for its resume to "
        "read through. 0: no limit by count.",
    ).tag(config=True)


# -- concurrency ---------------------------------------------------------------------------


class Slots:
    """At most `limit()` holders at once; the others wait, first come first served."""

    def __init__(self, limit: Callable[[], int]):
        self._limit = limit
        self._holders: set[str] = set()
        self._waiting: dict[str, asyncio.Future[None]] = {}  # insertion order = arrival
        self._since: dict[str, float] = {}

    def _free(self) -> bool:
        limit = self._limit()
        return limit <= 0 or len(self._holders) < limit

    def position(self, key: str) -> int | None:
        """1 for the next in line; None when not waiting."""
        for i, waiting in enumerate(self._waiting, 1):
            if waiting == key:
                return i
        return None

    def waiting_since(self, key: str) -> float | None:
        return self._since.get(key) if key in self._waiting else None

    @property
    def waiting(self) -> list[str]:
        return list(self._waiting)

    def would_wait(self) -> bool:
        return bool(self._waiting) or not self._free()

    async def acquire(self, key: str) -> None:
        if not self.would_wait():
            self._holders.add(key)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        self._since[key] = time.time()
        try:
            await fut
        except BaseException:
            if self._waiting.get(key) is fut:
                del self._waiting[key]
            elif fut.done() and not fut.cancelled():
                # Granted, then cancelled before it could run: pass the slot on.
                self.release(key)
            raise
        finally:
            self._since.pop(key, None)

    def release(self, key: str) -> None:
        self._holders.discard(key)
        while self._waiting and self._free():
            key, fut = next(iter(self._waiting.items()))
            del self._waiting[key]
            if not fut.done():
                self._holders.add(key)
                fut.set_result(None)


class TransitionQueue:
    """One line of Slots per kind of transition (suspend, resume), keyed by kernel."""

    def __init__(self, limits: SuspendLimits):
        self._slots = {
            "suspend": Slots(lambda: limits.max_concurrent_suspends),
            "resume": Slots(lambda: limits.max_concurrent_resumes),
        }

    async def run(
        self,
        kernel_id: str,
        kind: str,
        start: Callable[[], Awaitable[Any]],
        on_queued: Callable[[int], None],
    ) -> Any:
        """Run `start()` once a `kind` slot is free; `on_queued(ahead)` if it must wait."""
        slots = self._slots[kind]
        key = f"{kernel_id}:{kind}"
        if slots.would_wait():
            on_queued(len(slots.waiting))
        await slots.acquire(key)
        try:
            return await start()
        finally:
            slots.release(key)

    def queued(self, kernel_id: str) -> dict[str, Any] | None:
        """The transition of this kernel waiting in line, and where it stands."""
        for kind, slots in self._slots.items():
            key = f"{kernel_id}:{kind}"
            position = slots.position(key)
            if position is not None:
                since = slots.waiting_since(key)
                return {
                    "action": kind,
                    "position": position,
                    "since": iso(since),
                }
        return None

    def waiting(self) -> list[tuple[str, str]]:
        """(kernel id, kind) of every transition waiting, first in line first."""
        return [
            (key.rsplit(":", 1)[0], kind)
            for kind, slots in self._slots.items()
            for key in slots.waiting
        ]

    def counts(self) -> dict[str, int]:
        return {kind: len(slots.waiting) for kind, slots in self._slots.items()}


async def settled(task: asyncio.Task[Any], what: str) -> Any:
    """Wait for a transition; one cancelled while it waited in line (its kernel was shut
    down, or the server is stopping) is an error for whoever waits, not a cancellation
    of their own request."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if task.cancelled() and not (current is not None and current.cancelling()):
            raise Conflict(
                f"{what} was cancelled while it waited for a free slot: the kernel was shut "
                "down, or the server is stopping"
            ) from None
        raise


# -- disk ----------------------------------------------------------------------------------


def _rollup(pid: int) -> int:
    """Resident plus swapped-out bytes of one process: what CRIU writes of its memory."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Rss:", "Swap:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total


def estimate_image_bytes(pid: int, gpu_bytes: int = 0) -> int:
    """What a dump of the tree at `pid` will write, at most: its memory, plus the GPU
    memory that the CUDA checkpoint copies into host memory before CRIU dumps it."""
    return sum(_rollup(p) for p in process_tree(pid)) + max(0, gpu_bytes)


def gpu_bytes(pid: int, monitor: Any, sampled: int) -> int:
    """GPU memory the tree at `pid` holds now, from the GPU monitor; `sampled` (the last
    policy check's) when it cannot say."""
    if monitor is None or not monitor.available:
        return sampled
    try:
        return sum(u.memory_bytes for u in monitor.usage(process_tree(pid)))
    except Exception:
        return sampled


@dataclass
class Image:
    kernel_id: str
    bytes: int


class Budget:
    """The checkpoint budget (`SuspendPolicy.max_checkpoint_bytes`) and the free space of
    the checkpoint disk, with a reservation per dump under way.

    Images count against the budget when someone owns them: a kernel of this server, or
    whatever `owners` name (e.g. parked kernels), each with its chain of bases (an
    incremental image's `held_bytes`). Images nobody owns, left by a crash, are reported
    instead (`orphans()`), and removed by `jupyter cedana gc`.

    The kept images of running kernels (`bases`: CheckpointEngine.keep_base) are a cache:
    dropping one (`drop_base`) only makes that kernel's next suspend a whole one. When a
    dump needs room the budget or the disk does not have, they are dropped first, the
    largest first, before the dump is refused. A suspended kernel's image is never one.
    """

    def __init__(
        self,
        store: Callable[[], CheckpointStore],
        limit: Callable[[], int],
        min_free: Callable[[], int],
        owners: Callable[[], Iterable[str]],
        bases: Callable[[], Iterable[str]] = lambda: (),
        drop_base: Callable[[str], bool] = lambda kernel_id: False,
    ):
        self._store = store
        self._limit = limit
        self._min_free = min_free
        self._owners = owners
        self._bases = bases
        self._drop_base = drop_base
        self._reserved: dict[str, int] = {}
        self._written: dict[str, int] = {}
        self.bases_dropped = 0  # kept bases dropped to make room since the start

    def images(self) -> list[Image]:
        store = self._store()
        found = []
        for kid in store.kernel_ids():
            try:
                manifest = store.read_manifest(kid)
                size = int(manifest.get("held_bytes") or manifest.get("total_bytes") or 0)
            except (NotFound, CheckpointCorrupt, ValueError, TypeError):
                continue
            found.append(Image(kid, size))
        return found

    def _make_room(self, kernel_id: str, fits: Callable[[], bool], own: bool = False) -> bool:
        """Drop kept bases of running kernels, the largest first, until `fits()`; the
        base of `kernel_id` itself only if `own` (it counts on the disk, not in the
        budget, where the image it becomes replaces it). Whether it fits now."""
        if fits():
            return True
        sizes = {i.kernel_id: i.bytes for i in self.images()}
        bases = [k for k in self._bases() if k in sizes and (own or k != kernel_id)]
        # Another kernel's first, then the kernel's own.
        for kid in sorted(bases, key=lambda k: (k == kernel_id, -sizes[k])):
            if self._drop_base(kid):
                self.bases_dropped += 1
                if fits():
                    return True
        return False

    def _split(self) -> tuple[list[Image], list[Image]]:
        owned = set(self._owners())
        images = self.images()
        return [i for i in images if i.kernel_id in owned], [
            i for i in images if i.kernel_id not in owned
        ]

    def orphans(self) -> list[Image]:
        return self._split()[1]

    def describe(self, orphans: list[Image]) -> str:
        return (
            f"{len(orphans)} checkpoint image(s), {_size(sum(i.bytes for i in orphans))} under "
            f"{self._store().root} belong to no kernel (left by a crash?); they do not count "
            "against the checkpoint budget, and `jupyter cedana gc` removes them: "
            + ", ".join(i.kernel_id for i in orphans)
        )

    @property
    def reserved(self) -> int:
        return sum(self._reserved.values())

    def snapshot(self) -> dict[str, Any]:
        owned, orphans = self._split()
        used = sum(i.bytes for i in owned)
        limit = self._limit()
        bases = set(self._bases())
        return {
            "limit": limit if limit > 0 else None,
            "used": used,
            # Of `used`: the kept images of running kernels, dropped first for room.
            "base_bytes": sum(i.bytes for i in owned if i.kernel_id in bases),
            "bases_dropped": self.bases_dropped,
            "reserved": self.reserved,
            "available": max(0, limit - used - self.reserved) if limit > 0 else None,
            "orphaned_images": len(orphans),
            "orphaned_bytes": sum(i.bytes for i in orphans),
            "orphaned_kernel_ids": sorted(i.kernel_id for i in orphans),
        }

    def reserve(self, kernel_id: str, estimate: int) -> None:
        """Reserve `estimate` bytes for a dump of `kernel_id`, or refuse with the reason.
        Every reservation is released with `release()`, whatever the dump's outcome."""
        if kernel_id in self._reserved:
            raise InsufficientStorage(f"A dump of kernel {kernel_id} is already under way")
        others = self.reserved
        limit = self._limit()
        if limit > 0:
            self._make_room(kernel_id, lambda: self._budget_fits(kernel_id, others + estimate))
            owned, _ = self._split()
            used = sum(i.bytes for i in owned if i.kernel_id != kernel_id)
            if used + others + estimate > limit:
                raise InsufficientStorage(
                    f"Checkpoint budget exceeded: this kernel's image would take about "
                    f"{_size(estimate)} (memory and GPU memory), and {_size(used)} of "
                    f"images plus {_size(others)} reserved by dumps under way leave "
                    f"{_size(max(0, limit - used - others))} of max_checkpoint_bytes="
                    f"{limit} ({_size(limit)}); the kernel keeps running. "
                    + _holders([i for i in owned if i.kernel_id != kernel_id])
                )
        pending = sum(
            max(0, size - self._written.get(kid, 0)) for kid, size in self._reserved.items()
        )
        margin = max(0, self._min_free())
        self._make_room(
            kernel_id, lambda: self.free_bytes() - pending - estimate >= margin, own=True
        )
        free = self.free_bytes()
        if free - pending - estimate < margin:
            raise InsufficientStorage(
                f"Not enough free space on the checkpoint disk: this kernel's image would "
                f"take about {_size(estimate)}, {_size(free)} is free, dumps under way "
                f"need {_size(pending)} more, and {_size(margin)} must stay free "
                f"(SuspendLimits.min_free_disk_bytes); the kernel keeps running. "
                + _holders([i for i in self.images() if i.kernel_id != kernel_id])
            )
        self._reserved[kernel_id] = estimate

    def reserve_compaction(self, kernel_id: str, nbytes: int) -> bool:
        """Room on the checkpoint disk for the whole image a compaction folds a chain
        into (server/kernel/compactor.py): disk and chain are both held until the
        exchange, so it is reserved like a dump (the dumps of other kernels see it), but
        never by dropping kept bases: a compaction waits for room instead. Whether it
        was reserved; release_compaction() ends it."""
        key = _COMPACTION + kernel_id
        if key in self._reserved:
            return False
        pending = sum(
            max(0, size - self._written.get(kid, 0)) for kid, size in self._reserved.items()
        )
        if self.free_bytes() - pending - nbytes < max(0, self._min_free()):
            return False
        self._reserved[key] = nbytes
        return True

    def release_compaction(self, kernel_id: str) -> None:
        self.release(_COMPACTION + kernel_id)

    def _budget_fits(self, kernel_id: str, more: int) -> bool:
        owned, _ = self._split()
        used = sum(i.bytes for i in owned if i.kernel_id != kernel_id)
        return used + more <= self._limit()

    def written(self, kernel_id: str, nbytes: int) -> None:
        """Progress of a dump: bytes of its reservation already on the disk."""
        if kernel_id in self._reserved:
            self._written[kernel_id] = nbytes

    def check_image(self, kernel_id: str, nbytes: int) -> None:
        """Before an image is committed: it must fit in the budget, even when the
        estimate was short (e.g. deleted files the kernel holds open are copied in)."""
        limit = self._limit()
        reserved = self._reserved.get(kernel_id, 0)
        if limit <= 0 or nbytes <= reserved:
            return
        others = self.reserved - reserved
        self._make_room(kernel_id, lambda: self._budget_fits(kernel_id, others + nbytes))
        owned, _ = self._split()
        used = sum(i.bytes for i in owned if i.kernel_id != kernel_id)
        if used + others + nbytes > limit:
            raise InsufficientStorage(
                f"Checkpoint budget exceeded: the image came to {_size(nbytes)}, more than "
                f"the {_size(reserved)} estimated, and does not fit in max_checkpoint_bytes="
                f"{limit} ({_size(used)} used, {_size(others)} reserved); it was "
                "discarded and the kernel keeps running"
            )
        self._reserved[kernel_id] = nbytes

    def release(self, kernel_id: str) -> None:
        self._reserved.pop(kernel_id, None)
        self._written.pop(kernel_id, None)

    def free_bytes(self) -> int:
        probe = self._store().root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        st = os.statvfs(probe)
        return st.f_bavail * st.f_frsize


#: Compactions are reserved under their own key: a kernel's compaction may still be
#: deleting its temporary image while the kernel, resumed, is suspended again.
_COMPACTION = "compaction:"

#: How many images a refusal names.
HOLDERS_SHOWN = 5


def _holders(images: list[Image]) -> str:
    """What takes the space, for a refusal, and what frees it: a budget stays blocked
    for as long as nobody learns which images hold it (e.g. of kernels an adoption
    refused, or of failed kernels)."""
    if not images:
        return ""
    images = sorted(images, key=lambda i: i.bytes, reverse=True)
    named = ", ".join(f"{i.kernel_id} ({_size(i.bytes)})" for i in images[:HOLDERS_SHOWN])
    more = len(images) - HOLDERS_SHOWN
    return (
        f"Checkpoint images, largest first: {named}"
        + (f" and {more} more" if more > 0 else "")
        + ". `jupyter cedana gc --dry-run` lists those no kernel can come back from "
        "(left by a crash, refused at adoption) and `jupyter cedana gc` removes them; "
        "shutting down a suspended or failed kernel frees its image."
    )


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
