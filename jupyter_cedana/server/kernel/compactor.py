"""When the chains of suspended kernels are compacted (checkpoint/compaction.py): in the
background, one at a time, in a thread of the lowest CPU and I/O priority, never while a
suspend or resume of that kernel runs (docs/incremental.md, *Compaction*).

A suspend that commits a delta asks for its kernel's chain to be looked at
(`schedule`), and so does the policy tick for every suspended kernel (the manager); a
chain is folded when it holds more than `ratio` times the memory it restores, or more
than `max_deltas` deltas (SuspendLimits.compact_chain_ratio, compact_chain_deltas; both
0 until a manager configures them). A resume, and any state change of the kernel,
cancels its compaction: `cancel` returns once the chain is either kept (the fold stopped
within one read of at most 4 MiB, or a test's hold) or replaced (the exchange done: a
few milliseconds), and the resume reads whichever is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from ...checkpoint import compaction
from ...checkpoint.incremental import INDEX_NAME
from ...checkpoint.store import MANIFEST, CheckpointStore
from .transitions import KernelState


class Kernel(Protocol):
    """What the compactor uses of a provisioner (provisioner.CedanaProvisioner), declared here:
    the provisioner calls the compactor, not the other way round."""

    state: Any
    tier: str | None
    remote: Any
    machine: Any
    checkpoint_bytes: int

    @property
    def kernel_id_str(self) -> str: ...


_COMPACTORS: dict[str, Compactor] = {}


def compactor_for(store: CheckpointStore) -> Compactor:
    """The compactor of a checkpoint root (one per root: provisioners and the manager
    find the same one)."""
    key = str(store.root)
    found = _COMPACTORS.get(key)
    if found is None:
        found = _COMPACTORS[key] = Compactor(store)
    return found


class Compactor:
    def __init__(self, store: CheckpointStore):
        self.store = store
        self.log = logging.getLogger("jupyter_cedana.compaction")
        self.ratio = 0.0  # fold a chain holding more than this times its memory; 0: never
        self.max_deltas = 0  # ... or more deltas than this; 0: no limit by count
        # (kernel id, bytes) -> whether the disk has room for the folded image; it is
        # then counted as a dump's reservation until release() (the manager's budget).
        self.reserve: Callable[[str, int], bool] = self._room_on_disk
        self.release: Callable[[str], None] = lambda kernel_id: None
        self.done: list[tuple[str, compaction.Result]] = []  # what was compacted
        self._pending: dict[str, Kernel] = {}
        self._jobs: dict[str, compaction.Job] = {}
        self._judged: dict[str, tuple[int, int]] = {}  # manifests judged not due
        self._watched: set[int] = set()
        self._swept: set[str] = set()
        self._worker: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.ratio > 0 or self.max_deltas > 0

    def schedule(self, prov: Kernel) -> None:
        """Look at the kernel's chain soon, and fold it if due."""
        if not self.enabled or prov.remote is not None:
            return
        if id(prov) not in self._watched:
            self._watched.add(id(prov))
            prov.machine.add_listener(self._on_change)
        self._pending[prov.kernel_id_str] = prov
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())

    async def cancel(self, kernel_id: str) -> None:
        """Stop the kernel's compaction short of its exchange, or let its exchange end:
        either way, once this returns the kernel's image is one whole thing, not being
        replaced."""
        self._pending.pop(kernel_id, None)
        job = self._jobs.get(kernel_id)
        if job is None:
            return
        job.cancel.set()
        if not job.settled.is_set():
            await asyncio.to_thread(job.settled.wait)

    async def idle(self) -> None:
        """Returns once every compaction asked for has ended (benches, tests)."""
        while self._worker is not None and not self._worker.done():
            await asyncio.wait({self._worker})

    async def stop(self) -> None:
        """Cancel every compaction (a server stopping); returns once none is in flight."""
        self._pending.clear()
        for job in list(self._jobs.values()):
            job.cancel.set()
        if self._worker is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._worker
            self._worker = None

    def _on_change(self, prov: Any, what: str) -> None:
        if what != "state" or prov.state == KernelState.suspended:
            return
        self._pending.pop(prov.kernel_id_str, None)
        job = self._jobs.get(prov.kernel_id_str)
        if job is not None:  # a resume (it waits in cancel()), a shutdown, a failure
            job.cancel.set()

    def _due(self, kernel_id: str) -> compaction.Chain | None:
        if kernel_id not in self._swept:  # what a server killed mid-way left
            self._swept.add(kernel_id)
            for name in compaction.sweep(self.store, kernel_id):
                self.log.info(
                    "Kernel %s: %s, left by a compaction cut short, removed", kernel_id, name
                )
        images = self.store.path(kernel_id)
        try:
            st = os.stat(images / MANIFEST)
        except OSError:
            return None
        seen = (st.st_ino, st.st_mtime_ns)
        if self._judged.get(kernel_id) == seen:
            return None
        chain = compaction.chain_of(self.store, kernel_id)
        if chain is None or chain.layers < 2:
            self._judged[kernel_id] = seen
            return None
        over = self.ratio > 0 and chain.held_bytes > self.ratio * chain.memory_bytes
        if not over and not (self.max_deltas > 0 and chain.layers - 1 > self.max_deltas):
            self._judged[kernel_id] = seen
            return None
        return chain

    async def _indexed(self, prov: Kernel, wait: float = 30.0) -> bool:
        """Whether the kernel is still suspended, once its newest image's page index is
        saved (a delta's commit saves it in the background, seconds at most): the folded
        image takes it over, so that the next suspend after a resume is a delta at once.
        After `wait` seconds without it, the fold goes on (the index is made again after
        the next resume)."""
        index = self.store.path(prov.kernel_id_str) / INDEX_NAME
        deadline = asyncio.get_running_loop().time() + wait
        while prov.state == KernelState.suspended and not index.exists():
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.1)
        return prov.state == KernelState.suspended

    def _room_on_disk(self, kernel_id: str, nbytes: int) -> bool:
        st = os.statvfs(self.store.root)
        return st.f_bavail * st.f_frsize > nbytes

    async def _work(self) -> None:
        while self._pending:
            kid, prov = next(iter(self._pending.items()))
            del self._pending[kid]
            if prov.state != KernelState.suspended or prov.tier != "disk":
                continue
            chain = await asyncio.to_thread(self._due, kid)
            if chain is None or not await self._indexed(prov):
                continue
            if not self.reserve(kid, chain.memory_bytes):
                self.log.info(
                    "Kernel %s: its chain (%d layers, %.1f MB) is not compacted: the "
                    "checkpoint disk has no room for the folded image now",
                    kid,
                    chain.layers,
                    chain.held_bytes / 1e6,
                )
                continue
            # Registered on the event loop, in the same step as the state was seen
            # suspended: a resume that starts after this finds the job to cancel.
            job = self._jobs[kid] = compaction.Job(kid)
            try:
                result = await compaction.in_polite_thread(
                    "cedana-compaction", compaction.compact, self.store, kid, job
                )
            except compaction.Cancelled as e:
                self.log.info("Kernel %s: compaction stopped, its chain kept: %s", kid, e)
                continue
            except Exception as e:
                # Its chain is kept as it was; a damaged one fails its resume, which
                # says so: nothing more to do here than to say it once.
                self._judged[kid] = _stat_of(self.store, kid)
                self.log.warning("Kernel %s: compaction failed, its chain kept: %s", kid, e)
                continue
            finally:
                self._jobs.pop(kid, None)
                self.release(kid)
            if result is None:
                continue
            self.done.append((kid, result))
            if prov.state == KernelState.suspended:
                prov.checkpoint_bytes = result.held_after
            self.log.info(
                "Kernel %s: its chain of %d images (%.1f MB) compacted into one whole "
                "image (%.1f MB) in %.1f s",
                kid,
                result.layers,
                result.held_before / 1e6,
                result.held_after / 1e6,
                result.seconds,
            )


def _stat_of(store: CheckpointStore, kernel_id: str) -> tuple[int, int]:
    try:
        st = os.stat(store.path(kernel_id) / MANIFEST)
    except OSError:
        return (0, 0)
    return (st.st_ino, st.st_mtime_ns)
