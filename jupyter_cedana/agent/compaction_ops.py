"""Compaction at the agent: a dumped kernel's chain (a whole image and the deltas on it,
kept_bases.py) folded into one whole image in the background, which then takes the
chain's place (checkpoint/compaction.py: the same fold and exchange as a root server's;
docs/incremental.md, *Through the checkpoint agent*).

A dump that commits a delta asks for its kernel's chain to be looked at (`schedule`); it
is folded when it holds more than `ratio` times the memory it restores, or more than
`max_deltas` deltas (checkpoint.json's compact_chain_ratio, compact_chain_deltas, as
SuspendLimits' on a root server). One fold runs at a time, in a thread of its own at the
lowest CPU and I/O priority, never holding the kernel's record lock: no op waits for it
but the kernel's own `restore`, `discard` or `free_ports`, which cancel it first
(`cancel`: it stops within one read of at most 4 MiB, or has exchanged, a few
milliseconds), and a dump of the uid that needs the folded image's room in the quota
(`check_quota`). A fold starts only while no op holds the record's lock, in the same
event-loop step in which it sees that, so an op that takes the lock later finds the job
to cancel. A kill mid-way leaves the chain or the folded image at the kernel's name, and
a temporary or deletion name that `sweep_all` removes at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from ..checkpoint import compaction
from ..checkpoint.store import CheckpointStore
from .imagestore import ImageStore
from .kernels import KernelTable, State
from .protocol import AgentError

_log = logging.getLogger("jupyter_cedana.agent")

#: The defaults of a root server's SuspendLimits.compact_chain_ratio / _deltas.
DEFAULT_RATIO = 1.1
DEFAULT_DELTAS = 8


class AgentCompactor:
    def __init__(
        self,
        images: ImageStore,
        kernels: KernelTable,
        ratio: float = DEFAULT_RATIO,
        max_deltas: int = DEFAULT_DELTAS,
    ):
        self.images = images
        self.kernels = kernels
        self.ratio = ratio  # fold a chain holding more than this times its memory; 0: never
        self.max_deltas = max_deltas  # ... or more deltas than this; 0: no limit by count
        self.done: list[tuple[int, str, compaction.Result]] = []
        self._pending: dict[tuple[int, str], None] = {}
        self._jobs: dict[tuple[int, str], compaction.Job] = {}
        self._runs: dict[tuple[int, str], asyncio.Future[Any]] = {}
        self._worker: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.ratio > 0 or self.max_deltas > 0

    def schedule(self, uid: int, kid: str) -> None:
        """Look at the kernel's chain soon (after its dump), and fold it if due."""
        if not self.enabled:
            return
        self._pending[(uid, kid)] = None
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())

    def stop_soon(self, uid: int, kid: str) -> compaction.Job | None:
        """Cancel the kernel's fold without waiting: it never exchanges after this."""
        self._pending.pop((uid, kid), None)
        job = self._jobs.get((uid, kid))
        if job is not None:
            job.cancel.set()
        return job

    async def cancel(self, uid: int, kid: str) -> None:
        """Stop the kernel's fold short of its exchange, or let its exchange end: once
        this returns the kernel's image is one thing (chain or whole), not being replaced,
        and a fold stopped short has removed its temporary."""
        job = self.stop_soon(uid, kid)
        if job is None:
            return
        if not job.settled.is_set():
            await asyncio.to_thread(job.settled.wait)
        run = self._runs.get((uid, kid))
        if not job.exchanged and run is not None:
            # compact() settles before it deletes its temporary: a discard right after
            # must find nothing of the kernel (the chain's deletion after an exchange
            # is not waited for).
            await asyncio.wait({run})

    async def check_quota(self, uid: int, kid: str, tmp: Path) -> int:
        """ImageStore.check_quota for a dump in `tmp`; a dump refused only for the uid's
        folds in progress (their folded images count until their chains go) cancels them
        and is checked again: a fold never costs a dump its room."""
        try:
            return await asyncio.to_thread(self.images.check_quota, uid, kid, tmp)
        except AgentError as e:
            folds = [key for key in self._jobs if key[0] == uid and key[1] != kid]
            if e.code != "refused" or not folds:
                raise
        for key in folds:
            _log.info("kernel %s: its fold is cancelled to make room for a dump", key[1])
            run = self._runs.get(key)
            await self.cancel(*key)
            if run is not None:  # an exchanged fold: its chain's deletion
                await asyncio.wait({run})
        return await asyncio.to_thread(self.images.check_quota, uid, kid, tmp)

    async def idle(self) -> None:
        while self._worker is not None and not self._worker.done():
            await asyncio.wait({self._worker})

    def sweep_all(self) -> None:
        """What a fold (or a dump) cut short by the agent's death left in every uid's
        store: a folded image never exchanged, a chain exchanged and not deleted. Run at
        start, before any op: no writer of this agent holds anything yet."""
        root = self.images.root
        if not root.is_dir():
            return
        for uid_dir in root.iterdir():
            if uid_dir.is_symlink() or not uid_dir.is_dir() or not uid_dir.name.isdigit():
                continue
            store = CheckpointStore(uid_dir)
            kids = set()
            for entry in uid_dir.iterdir():
                name = entry.name
                for mark in (".tmp-", ".del-"):
                    if name.startswith(".") and mark in name:
                        kids.add(name[1 : name.index(mark)])
            for kid in sorted(kids):
                with contextlib.suppress(OSError):
                    for gone in compaction.sweep(store, kid):
                        _log.info(
                            "kernel %s: %s, left by a fold or dump cut short, removed", kid, gone
                        )

    # -- the worker -----------------------------------------------------------------------

    def _due(self, store: CheckpointStore, kid: str) -> compaction.Chain | None:
        chain = compaction.chain_of(store, kid)
        if chain is None or chain.layers < 2:
            return None
        over = self.ratio > 0 and chain.held_bytes > self.ratio * chain.memory_bytes
        if over or (self.max_deltas > 0 and chain.layers - 1 > self.max_deltas):
            return chain
        return None

    def _room(self, uid: int, chain: compaction.Chain) -> bool:
        """The folded image fits beside the chain: in the uid's quota (other kernels'
        dumps must not be refused for it) and on the disk."""
        if self.images.usage(uid) + chain.memory_bytes > self.images.quota_bytes:
            return False
        st = os.statvfs(self.images.root)
        return st.f_bavail * st.f_frsize > chain.memory_bytes

    async def _work(self) -> None:
        while self._pending:
            key = next(iter(self._pending))
            del self._pending[key]
            uid, kid = key
            try:
                await self._fold(uid, kid)
            except Exception as e:  # never the worker's end: the chain is kept
                _log.warning("kernel %s: its chain is not compacted: %s", kid, e)

    async def _fold(self, uid: int, kid: str) -> None:
        store = self.images.for_uid(uid)
        chain = await asyncio.to_thread(self._due, store, kid)
        if chain is None:
            return
        if not await asyncio.to_thread(self._room, uid, chain):
            _log.info(
                "kernel %s: its chain (%d layers, %d bytes) is not compacted: no room for "
                "the folded image (quota or disk) now",
                kid,
                chain.layers,
                chain.held_bytes,
            )
            return
        record = self.kernels.get(uid, kid)
        # Seen in the same step as the job is registered (no await between): an op that
        # takes the lock after this finds the job and cancels it.
        if record is None or record.state != State.dumped or record.lock.locked():
            return
        job = self._jobs[(uid, kid)] = compaction.Job(kid)
        run = self._runs[(uid, kid)] = asyncio.ensure_future(
            compaction.in_polite_thread(
                "cedana-agent-compaction", compaction.compact, store, kid, job
            )
        )
        try:
            result = await run
        except compaction.Cancelled as e:
            _log.info("kernel %s: compaction stopped, its chain kept: %s", kid, e)
            return
        except Exception as e:
            # A damaged chain is kept as it is: its restore says what is damaged.
            _log.warning("kernel %s: compaction failed, its chain kept: %s", kid, e)
            return
        finally:
            self._jobs.pop((uid, kid), None)
            self._runs.pop((uid, kid), None)
        if result is None:
            return
        self.done.append((uid, kid, result))
        record = self.kernels.get(uid, kid)
        if record is not None and record.state == State.dumped:
            record.held_bytes = result.held_after  # what `list` says
        _log.info(
            "kernel %s: its chain of %d images (%d bytes) compacted into one whole image "
            "(%d bytes) in %.1f s",
            kid,
            result.layers,
            result.held_before,
            result.held_after,
            result.seconds,
        )
