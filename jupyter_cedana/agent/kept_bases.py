"""Incremental images at the agent: a restored kernel's image kept as the base of its next
dump, which then writes only the pages whose content the base does not hold
(docs/incremental.md, *Through the checkpoint agent*).

A kept base lives in `<state>/bases/<uid>/<kernel_id>/` (root's, 0700 / 0600, beside
the image store, on the same file system): an image there is only ever the base of a
running kernel, never one the agent restores, so that everything the store's
`images/` holds stays what it was, a dumped kernel. A restore asked to keep its image
(`keep_base`) renames it there once the kernel runs (a lazy restore: once all its memory
is in), and its pages are indexed in the background (incremental.PageIndex, unless the
image is a delta, whose dump saved its index). The next dump waits for that index (at
most INDEX_WAIT), hard-links the base into its temporary directory as `base/`
(CheckpointStore.link_base: no byte copied), and the capture writes only what changed;
the commit makes the delta's `parent` link and manifest name the chain, and the kept
base goes (its files live on through the links). A base goes too when its kernel exits
or is dumped whole (the new image replaces it), and the agent drops any base whose
kernel does not run (`sweep`): it is a cache, never a kernel's state.

The quota counts each file once however many links it has (imagestore.disk_bytes): a
chain and the base linked into a dump in progress are on the disk once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from ..checkpoint.crimg import PAGE_SIZE, ImageError
from ..checkpoint.dumping import tree_rss
from ..checkpoint.incremental import (
    INDEX_NAME,
    PARENT_LINK,
    DeltaResult,
    PageIndex,
    manifest_token,
)
from ..checkpoint.store import BASE_NAME, MANIFEST, CheckpointStore
from .imagecheck import ImageRefused
from .imagestore import ImageStore, chain_summary, private_dir
from .kernels import KernelRecord, KernelTable, State
from .protocol import AgentError

_log = logging.getLogger("jupyter_cedana.agent")

#: A dump on a chain that would hold more than this share of the kernel's memory with one
#: more delta the size of its last one writes a whole image instead (as a root server's).
CHAIN_LIMIT = 1.2
#: Seconds a dump waits for its base's page index, made in the background after a restore.
INDEX_WAIT = 60.0
#: States of a kernel whose base is worth keeping.
_LIVE = (State.running, State.dumping, State.restoring)


def check_chain(images: Path) -> None:
    """Refuse (ImageRefused) a chain whose layers are not as the agent writes them: each
    layer holds regular files, plus, when its manifest names a base, `base/` (a real
    directory) and CRIU's `parent` link pointing at exactly `base`. CRIU follows `parent`
    as root and reads the pages it finds there: a link anywhere else is never followed."""
    where = images
    depth = 0
    while True:
        try:
            manifest = json.loads((where / MANIFEST).read_text())
        except (OSError, ValueError):
            return  # damaged, not planted: the checksum pass fails it, keeping the image
        has_base = isinstance(manifest, dict) and bool(manifest.get("base"))
        for entry in os.scandir(where):
            if entry.name == PARENT_LINK and has_base:
                if not entry.is_symlink() or os.readlink(entry.path) != BASE_NAME:
                    raise ImageRefused(f"layer {depth}'s parent link does not name {BASE_NAME}")
            elif entry.name == BASE_NAME and has_base:
                if not entry.is_dir(follow_symlinks=False):
                    raise ImageRefused(f"layer {depth}'s base is not a directory")
            elif not entry.is_file(follow_symlinks=False):
                raise ImageRefused(f"layer {depth} holds {entry.name!r}, not a regular file")
        if not has_base:
            return
        if not os.path.lexists(where / PARENT_LINK):
            raise ImageRefused(f"layer {depth} names a base but has no parent link")
        where = where / BASE_NAME
        depth += 1


class KeptBases:
    """The kept bases of a uid's running kernels, and what a dump takes of them."""

    def __init__(self, images: ImageStore, kernels: KernelTable):
        self.images = images
        self.kernels = kernels
        self.root = images.state_dir / "bases"
        # (uid, kernel id) -> the background index of a base just kept.
        self._indexing: dict[tuple[int, str], asyncio.Future[None]] = {}
        self._deleting: set[asyncio.Future[Any]] = set()
        kernels.on_change(self._changed)

    def for_uid(self, uid: int) -> CheckpointStore:
        private_dir(self.root)
        return CheckpointStore(private_dir(self.root / str(int(uid))))

    def uid_dir(self, uid: int) -> Path:
        return self.root / str(int(uid))

    def path(self, uid: int, kid: str) -> Path:
        return self.uid_dir(uid) / kid

    def has(self, uid: int, kid: str) -> bool:
        return (self.path(uid, kid) / MANIFEST).is_file()

    # -- keeping and dropping -------------------------------------------------------------

    def keep(self, uid: int, kid: str) -> bool:
        """The image a kernel was just restored from becomes its base (renamed: no byte
        copied), indexed in the background. False when it cannot be (then it is
        removed, as without keep_base)."""
        try:
            image = self.images.for_uid(uid).path(kid)
            dest = self.for_uid(uid).path(kid)
            self.drop(uid, kid)
            os.rename(image, dest)
        except (OSError, AgentError) as e:
            _log.warning("kernel %s: its image is not kept as a base: %s", kid, e)
            with contextlib.suppress(OSError):
                self.images.for_uid(uid).remove_image(kid)
            return False
        _fsync_dir(image.parent)
        _fsync_dir(dest.parent)
        self._start_index(uid, kid)
        self._update(uid, kid)
        return True

    def _start_index(self, uid: int, kid: str) -> asyncio.Future[None] | None:
        """Index the kernel's base in the background, unless it has its index or is
        being indexed: the task, None when there is nothing to wait for."""
        key = (uid, kid)
        task = self._indexing.get(key)
        if task is None and not (self.path(uid, kid) / INDEX_NAME).exists():
            task = asyncio.ensure_future(asyncio.to_thread(_index, self.path(uid, kid)))
            self._indexing[key] = task
            task.add_done_callback(lambda t: self._forget_index(key, t))
        return task

    def _forget_index(self, key: tuple[int, str], task: asyncio.Future[None]) -> None:
        if self._indexing.get(key) is task:
            del self._indexing[key]

    def drop(self, uid: int, kid: str) -> None:
        """The kernel's base goes: renamed away at once, deleted in the background."""
        if not self.uid_dir(uid).is_dir():
            return
        doomed = self.for_uid(uid).detach_image(kid)
        if doomed is None:
            return
        try:
            job = asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, doomed, True)
        except RuntimeError:  # in a worker thread (after a commit): deleted there, now
            shutil.rmtree(doomed, ignore_errors=True)
            return
        self._deleting.add(job)
        job.add_done_callback(self._deleting.discard)

    def _changed(self, record: KernelRecord) -> None:
        """Every change of a record's state: a kernel that exited, or was dumped (its base
        is in the new image, or replaced by it), keeps no base."""
        if record.state in (State.exited, State.dumped):
            self.drop(record.uid, record.kernel_id)
        self._update(record.uid, record.kernel_id, record)

    def _update(self, uid: int, kid: str, record: KernelRecord | None = None) -> None:
        """What `list` shows of the kernel's bytes on disk: its image's chain when
        dumped, its kept base when running."""
        record = record or self.kernels.get(uid, kid)
        if record is None:
            return
        if record.state == State.dumped:
            where = self.images.root / str(int(uid)) / kid
        else:
            where = self.path(uid, kid)
        summary = chain_summary(where) if where.parent.is_dir() else None
        record.held_bytes = summary["held_bytes"] if summary else None

    def sweep(self, uid: int) -> None:
        """Drop the bases of this uid's kernels that do not run (their records refused,
        or an agent stopped before it could drop them)."""
        base = self.uid_dir(uid)
        if not base.is_dir():
            return
        for kid in CheckpointStore(base).kernel_ids():
            record = self.kernels.get(uid, kid)
            if record is None or record.state not in _LIVE:
                self.drop(uid, kid)

    # -- a dump on a base -----------------------------------------------------------------

    async def base_for(self, uid: int, kid: str, tmp: Path, pid: int) -> PageIndex | None:
        """The kernel's base linked into `tmp`/base with the index of its pages, for the
        dump to write only what changed; None (a whole dump) when there is none, its
        index could not be made, or the chain is long enough to be replaced."""
        if not self.has(uid, kid):
            return None
        await self.ready(uid, kid)
        return await asyncio.to_thread(self._link, uid, kid, tmp, pid)

    async def ready(self, uid: int, kid: str) -> None:
        """Wait (at most INDEX_WAIT) for the index of the kernel's base if it is being
        made, or make it if it never was (the agent restarted first): called before the
        dump freezes the kernel, which runs meanwhile."""
        if not self.has(uid, kid):
            return
        task = self._start_index(uid, kid)
        if task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), INDEX_WAIT)

    def _link(self, uid: int, kid: str, tmp: Path, pid: int) -> PageIndex | None:
        bases = self.for_uid(uid)
        try:
            top = bases.read_manifest(kid)
            held = int(top.get("held_bytes") or top["total_bytes"])
            next_delta = int(top["total_bytes"]) if top.get("base") else 0
        except Exception as e:
            _log.warning("kernel %s: dumped whole, its base unreadable: %s", kid, e)
            return None
        if held + next_delta > CHAIN_LIMIT * tree_rss(pid):
            _log.info("kernel %s: dumped whole, its chain holding %d bytes", kid, held)
            return None
        try:
            check_chain(bases.path(kid))
            linked = bases.link_base(kid, tmp)
            if linked is None:
                return None
            index = PageIndex.load(linked)
            # Only the newest image's index is ever read again.
            (linked / INDEX_NAME).unlink()
            return index
        except (OSError, ImageError, ImageRefused) as e:
            _log.warning("kernel %s: dumped whole, its base unusable: %s", kid, e)
            shutil.rmtree(tmp / BASE_NAME, ignore_errors=True)
            return None

    def committed(self, uid: int, kid: str, delta: DeltaResult | None, manifest: Any) -> None:
        """After a dump (in a thread: a delta's index is built here): the index is saved
        in the image (the next base is then indexed already), and the base the delta was
        made on goes. Never fails: the image is committed, the kernel gone."""
        try:
            self._committed(uid, kid, delta, manifest)
        except (OSError, AgentError, ImageError) as e:
            _log.warning("kernel %s: after its dump: %s", kid, e)

    def _committed(self, uid: int, kid: str, delta: DeltaResult | None, manifest: Any) -> None:
        if delta is not None:
            index = delta.index
            images = self.images.root / str(int(uid)) / kid
            index.directory = images
            index.image = manifest_token(manifest)
            with contextlib.suppress(OSError):
                index.save()
                os.chmod(images / INDEX_NAME, 0o600)
        self.drop(uid, kid)

    def listing(self, uid: int) -> list[dict[str, Any]]:
        """The `images` op's `bases`: each running kernel's kept base and its bytes."""
        base = self.uid_dir(uid)
        if not base.is_dir():
            return []
        out = []
        for kid in CheckpointStore(base).kernel_ids():
            summary = chain_summary(base / kid)
            if summary is not None:
                out.append({"kernel_id": kid, **summary})
        return out


def _index(images: Path) -> None:
    """The page index of a kept base, saved in it; one that cannot be made (the base
    dropped meanwhile, a damaged image) leaves the next dump whole."""
    with contextlib.suppress(OSError, ImageError):
        if (images / MANIFEST).is_file() and not (images / INDEX_NAME).exists():
            PageIndex.of_image(images).save()
            os.chmod(images / INDEX_NAME, 0o600)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def delta_summary(delta: DeltaResult | None) -> dict[str, Any]:
    """What a delta holds, for its manifest and the dump's reply."""
    if delta is None:
        return {}
    return {
        "delta": {
            "pages": delta.pages,
            "written_bytes": delta.written * PAGE_SIZE,
            "in_parent_bytes": delta.in_parent * PAGE_SIZE,
            "copied_bytes": delta.copied * PAGE_SIZE,
        }
    }
