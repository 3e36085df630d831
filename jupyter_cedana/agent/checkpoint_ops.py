"""The agent's checkpoint ops: `dump`, `restore`, `discard`, `images` (and, from
port_ops.py, `free_ports`).

A kernel is found only through the agent's records under the caller's uid
(kernels.KernelTable), and an image only in the caller's directory of the agent's store:
no request names a pid or a path, so a caller can dump or restore nothing but what the
agent launched or restored for that same uid. Every image is checked before CRIU reads
it (imagecheck.verify_owner), and every restored kernel after CRIU has restored it
(/proc/PID/status: the caller's ids, no capabilities, no_new_privs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from ..checkpoint import lazy as lazy_pages
from ..checkpoint import portremap
from ..checkpoint.crimg import ImageError, mark_lazy
from ..checkpoint.engine import kill_restore
from ..checkpoint.integrity import is_page_file
from ..checkpoint.proctree import process_tree
from ..checkpoint.store import CheckpointStore
from ..errors import CedanaError
from .compaction_ops import AgentCompactor
from .criu import AgentEngine, CriuSettings, UnsafeSetup, load_settings
from .gpu_ops import AgentGpu, as_agent_error, gpu_summary
from .imagecheck import ImageRefused, verify_owner
from .imagestore import DEFAULT_QUOTA, ImageStore, kernel_id_arg, manifest_meta
from .kept_bases import KeptBases, check_chain, delta_summary
from .kernels import KernelRecord, State
from .offload_ops import OffloadOps
from .port_ops import PortOps
from .protocol import AgentError
from .restored import Keeper, check_running_as, stopped_tree
from .service import Caller, Progress, ProgressFrames, Service, user_groups

#: The engine's progress phases as the agent's frames name them.
_PHASES = {"dump": "dumping"}
#: Seconds between progress frames of a restore's checksum pass.
_log = logging.getLogger("jupyter_cedana.agent")


class CheckpointOps:
    def __init__(self, service: Service, settings: CriuSettings, quota_bytes: int):
        self.kernels = service.kernels
        self.engine = AgentEngine(settings)
        self.gpu = AgentGpu(settings)
        self.store = ImageStore(settings.state_dir, quota_bytes)
        self.bases = KeptBases(self.store, self.kernels)
        self.compactor = AgentCompactor(
            self.store, self.kernels, settings.compact_chain_ratio, settings.compact_chain_deltas
        )
        # (uid, kernel id) -> a lazily restored kernel's memory coming in.
        self._loading: dict[tuple[int, str], asyncio.Future[None]] = {}

    def register(self, service: Service) -> None:
        service.register("dump", self.op_dump)
        service.register("restore", self.op_restore)
        service.register("discard", self.op_discard)
        service.register("images", self.op_images)

    def _image_of(self, caller: Caller, kid: str) -> KernelRecord | None:
        """The caller's image of kernel `kid` is there, and no kernel runs from it: its
        record (None for an image from before the agent restarted)."""
        record = self.kernels.get(caller.uid, kid)
        if record is not None and record.state != State.dumped:
            raise AgentError("conflict", f"kernel {kid} is {record.state.value}, not dumped")
        if not self.store.for_uid(caller.uid).exists(kid):
            raise AgentError("not_found", f"no image of kernel {kid}")
        return record

    def dumped_record(self, caller: Caller, kid: str) -> KernelRecord:
        """The caller's record of a dumped kernel `kid`, made for an image from before
        the agent restarted (which has none), so that an op on the image holds its lock."""
        store = self.store.for_uid(caller.uid)
        record = self._image_of(caller, kid)
        if record is None:
            meta = None
            with contextlib.suppress(CedanaError):
                meta = manifest_meta(store.read_manifest(kid))
            record = KernelRecord(
                uid=caller.uid,
                kernel_id=kid,
                gid=caller.gid,
                groups=user_groups(caller.uid, caller.gid),
                init_pid=0,
                process=None,
                state=State.dumped,
                meta=meta,
            )
            self.kernels.reserve(record)
        return record

    def _require(self) -> None:
        try:
            self.engine.require()
        except UnsafeSetup as e:
            raise AgentError("refused", e.message) from e
        except CedanaError as e:
            raise AgentError("failed", e.message) from e

    def _ensure_kdat(self) -> None:
        try:
            self.engine.ensure_kdat_cache()
        except (OSError, subprocess.SubprocessError, CedanaError) as e:
            raise AgentError("failed", f"CRIU's kernel-feature cache cannot be written: {e}") from e

    async def op_dump(
        self, caller: Caller, args: dict[str, Any], progress: Progress
    ) -> dict[str, Any]:
        frames = ProgressFrames(progress)
        try:
            return await self._dump(caller, args, frames)
        finally:
            await frames.close()

    async def _dump(
        self, caller: Caller, args: dict[str, Any], frames: ProgressFrames
    ) -> dict[str, Any]:
        kid = kernel_id_arg(args)
        record = self.kernels.lookup(caller.uid, kid)
        async with record.lock:
            if record.state != State.running or record.init_pid <= 0:
                raise AgentError("conflict", f"kernel {kid} is {record.state.value}, not running")
            if (caller.uid, kid) in self._loading:
                # Its memory is still coming in from the last image.
                raise AgentError("busy", f"kernel {kid} is still loading its memory; try later")
            self._require()
            if record.uid != 0:
                await asyncio.to_thread(self._ensure_kdat)
            store = self.store.for_uid(caller.uid)
            self.bases.sweep(caller.uid)
            await self.bases.ready(caller.uid, kid)  # its base's index, if it has one
            record.state = State.dumping
            pid = record.init_pid
            tmp = store.begin(kid)

            def dumping(phase: str, done: int | None, total: int | None) -> None:
                # The engine's "dump" is the image growing; `total` is the tree's RSS.
                frames({"phase": _PHASES.get(phase, phase), "done": done, "total": total})

            gpu: dict[str, Any] = {}
            try:
                # The GPU memory into host memory first: CRIU dumps it with the rest.
                offloaded = await self.gpu.offload(process_tree(pid), frames)
                gpu = dict(offloaded) if offloaded else {}  # empty: a CPU-only kernel
                # A kept base (restore's keep_base) makes the image a delta on it.
                base = await self.bases.base_for(caller.uid, kid, tmp, pid)
                dumped = await self.engine.dump(
                    pid, tmp, progress=dumping, owner=(record.uid, record.gid), base=base
                )
                size = await self.compactor.check_quota(caller.uid, kid, tmp)
                frames({"phase": "committing", "done": size, "total": size})

                def commit() -> dict[str, Any]:
                    with contextlib.suppress(OSError, ImageError, IndexError):
                        mark_lazy(tmp)
                    return store.commit(
                        kid,
                        tmp,
                        {
                            "uid": caller.uid,
                            "pidns": True,
                            "timings": {"dump_s": dumped.seconds},
                            # For a record lost later: `list` and a restore take it here.
                            "meta": record.meta,
                            **delta_summary(dumped.delta),
                            # What a restore needs to put the GPU memory back.
                            **({"gpu": gpu} if gpu else {}),
                        },
                        dumped.sums,
                        delta=dumped.delta is not None,
                    )

                manifest = await asyncio.to_thread(commit)
            except BaseException as e:
                store.discard(tmp)
                for p in process_tree(pid):  # CRIU leaves the tree stopped
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGCONT)
                left = await self.gpu.put_back(gpu) if gpu else None
                if left:  # it runs, but its CUDA calls block until its memory is back
                    record.note = f"its GPU memory was not put back after a failed dump: {left}"
                record.state = State.running
                if isinstance(e, AgentError):
                    raise AgentError(e.code, f"{e.message}; {left}" if left else e.message) from e
                if isinstance(e, CedanaError):
                    raise as_agent_error(e, left) from e
                raise
            # The image is durable: only now does the kernel's memory go.
            process = record.process
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if process is not None:
                await process.wait()
            self.kernels.mark_dumped(caller.uid, kid)
            # A delta's index, made once the kernel is no longer frozen, before a restore.
            await asyncio.to_thread(self.bases.committed, caller.uid, kid, dumped.delta, manifest)
            if dumped.delta is not None:  # folded in the background once past the ratio
                self.compactor.schedule(caller.uid, kid)
        return {
            "kernel_id": kid,
            "bytes": int(manifest["total_bytes"]),
            "held_bytes": int(manifest["held_bytes"]),
            "seconds": dumped.seconds,
            **({"delta": manifest["delta"]} if "delta" in manifest else {}),
            # The server shows what the kernel's GPU gave up, as for a root server.
            **(
                {"gpu": gpu_summary(gpu), "gpu_memory_freed": int(gpu.get("bytes_freed") or 0)}
                if gpu
                else {}
            ),
        }

    async def op_restore(
        self, caller: Caller, args: dict[str, Any], progress: Progress
    ) -> dict[str, Any]:
        frames = ProgressFrames(progress)
        try:
            return await self._restore_op(caller, args, frames)
        finally:
            await frames.close()

    async def _restore_op(
        self, caller: Caller, args: dict[str, Any], frames: ProgressFrames
    ) -> dict[str, Any]:
        kid = kernel_id_arg(args)
        lazy = args.get("lazy", False)
        keep = args.get("keep_base", False)
        if not isinstance(lazy, bool) or not isinstance(keep, bool):
            raise AgentError("bad_request", "lazy and keep_base must be true or false")
        store = self.store.for_uid(caller.uid)
        record = self.dumped_record(caller, kid)
        self._require()
        groups = user_groups(caller.uid, caller.gid)
        async with record.lock:
            if record.state != State.dumped:
                raise AgentError("conflict", f"kernel {kid} is {record.state.value}, not dumped")
            await self.compactor.cancel(caller.uid, kid)  # its chain, or the folded image
            images = store.path(kid)
            manifest: dict[str, Any] | None = None
            frames({"phase": "verifying", "done": None, "total": None})
            gpu: dict[str, Any] = {}
            try:
                gpu = dict((await asyncio.to_thread(store.read_manifest, kid)).get("gpu") or {})
                # A GPU kernel is restored whole: its restore thread reads its host memory.
                lazy = lazy and not gpu
                # A port rewrite (free_ports) cut short by the agent's death is completed
                # or undone, so the checksums below hold.
                await asyncio.to_thread(portremap.finish, store, kid)
                # A chain's layers: CRIU follows their parent links as root.
                await asyncio.to_thread(check_chain, images)
                if lazy and await asyncio.to_thread(self.engine.lazy_unsupported) is None:
                    manifest = await asyncio.to_thread(store.check_sizes, kid)
                    if not _chunked(manifest):
                        manifest = None  # an image without chunk tables goes whole
                if manifest is not None:
                    # What CRIU reads itself; the pages are checked as they are served.
                    await asyncio.to_thread(store.verify_small_files, kid, manifest)
                else:
                    await asyncio.to_thread(store.verify, kid, frames.throttled("verifying"))
                await asyncio.to_thread(
                    verify_owner,
                    images,
                    caller.uid,
                    caller.gid,
                    groups,
                    self.engine.init_binary(),
                )
                plan = await self.gpu.admit(gpu)  # before CRIU: no GPU room, nothing touched
            except ImageRefused as e:
                kept = self.store.refuse(caller.uid, kid, str(e))
                self.kernels.remove(caller.uid, kid)
                raise AgentError(
                    "refused",
                    f"the image of kernel {kid} is refused: {e}; it is kept for the "
                    f"administrator at {kept}",
                ) from e
            except CedanaError as e:
                raise as_agent_error(e) from e
            record.state = State.restoring
            frames({"phase": "restoring", "done": None, "total": None})
            work = store.work_dir(kid)
            (work / "restored.pid").unlink(missing_ok=True)
            pages: lazy_pages.PageServer | None = None
            try:
                if manifest is not None:
                    pages = await self._page_server(store, kid, manifest, work, images)
                gpu_step = None
                if gpu:

                    async def gpu_step(tasks: set[int]) -> dict[str, Any]:
                        return await self.gpu.restore(gpu, tasks, plan, frames)

                pid, keeper, restored = await self._restore(
                    work, images, caller.uid, caller.gid, pages, gpu_step
                )
            except BaseException as e:
                record.state = State.dumped
                if isinstance(e, CedanaError):  # a damaged chunk CRIU would read first
                    raise AgentError("failed", e.message) from e
                raise
            self.kernels.mark_restored(
                caller.uid, kid, pid, cast(asyncio.subprocess.Process, Keeper(keeper))
            )
            if pages is None:
                self._superseded(store, caller.uid, kid, keep)
            else:
                # The image stays until every page is in.
                key = (caller.uid, kid)
                task = asyncio.ensure_future(
                    self._load_memory(pages, store, caller.uid, kid, pid, keep)
                )
                self._loading[key] = task
                task.add_done_callback(lambda t: self._loading.pop(key, None))
        return {
            "kernel_id": kid,
            "pid": pid,
            "lazy": pages is not None,
            "keep_base": keep,
            **(
                {"gpu": restored, "gpu_memory_restored": int(gpu.get("memory_bytes") or 0)}
                if gpu
                else {}
            ),
        }

    def _superseded(self, store: CheckpointStore, uid: int, kid: str, keep: bool) -> None:
        """The restored kernel runs on its own memory: its image goes, or is kept as the
        base of its next dump (kept_bases.py)."""
        if not keep or not self.bases.keep(uid, kid):
            with contextlib.suppress(OSError):
                store.remove_image(kid)

    async def _page_server(
        self,
        store: CheckpointStore,
        kid: str,
        manifest: dict[str, Any],
        work: Path,
        images: Path,
    ) -> lazy_pages.PageServer:
        plan = await asyncio.to_thread(
            lazy_pages.check_before_restore, store, kid, manifest, work, True
        )
        pages = lazy_pages.PageServer(
            self.engine.pages_binary(),
            images,
            work,
            work / "restored.pid",
            plan,
            _log,
            copiers=self.engine.lazy_copy_threads,
        )
        await pages.start()
        return pages

    async def _load_memory(
        self,
        pages: lazy_pages.PageServer,
        store: CheckpointStore,
        uid: int,
        kid: str,
        pid: int,
        keep: bool = False,
    ) -> None:
        """A lazily restored kernel's memory coming in; then its image goes. If it cannot
        all come in, the kernel is killed (it must not run on with missing memory) and
        is dumped again: its image is kept, and `poll` says why (`note`)."""
        try:
            await asyncio.shield(pages.done)
        except lazy_pages.KernelExited:
            await pages.stop()
            return
        except BaseException as e:
            record = self.kernels.get(uid, kid)
            ours = record is not None and record.init_pid == pid
            if ours and record is not None:
                cause = getattr(e, "message", None) or str(e) or type(e).__name__
                record.note = (
                    f"its memory could not all be restored ({cause.rstrip('.')}): it was "
                    "stopped, and its image is kept for the next restore"
                )
                record.state = State.dumped  # first: its exit is not the kernel's end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await pages.stop()
            if ours:
                self.kernels.mark_dumped(uid, kid)
            _log.error("Kernel %s killed, its image kept: %s", kid, e)
            return
        await pages.stop()
        record = self.kernels.get(uid, kid)
        running = record is not None and record.state == State.running and record.init_pid == pid
        self._superseded(store, uid, kid, keep and running)

    async def _restore(
        self,
        work: Path,
        images: Path,
        uid: int,
        gid: int,
        pages: lazy_pages.PageServer | None,
        gpu_step: Callable[[set[int]], Awaitable[dict[str, Any]]] | None = None,
    ) -> tuple[int, subprocess.Popen[bytes], dict[str, Any]]:
        pidfile = work / "restored.pid"
        proc = self.engine.start_restore(images, work, pidfile, lazy=pages is not None)
        pid = 0
        restored: dict[str, Any] = {}
        try:
            pid = await self.engine.wait_restored(proc, work, pidfile)
            tasks = await stopped_tree(pid)
            if uid != 0:
                # CRIU set the ids and capabilities from the image: see they are right,
                # the init's as well (it is the user's too).
                for task in tasks:
                    check_running_as(task, uid, gid)
            if gpu_step is not None:  # while the tree is stopped, as in-process
                restored = await gpu_step(tasks)
            for task in tasks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(task, signal.SIGCONT)
        except BaseException as e:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(kill_restore, proc)
            if pages is not None:
                await pages.stop()
            if isinstance(e, ImageRefused):
                raise AgentError("refused", str(e)) from e
            if isinstance(e, CedanaError):
                raise AgentError("failed", e.message) from e
            raise
        return pid, proc, restored

    async def op_discard(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        kid = kernel_id_arg(args)
        record = self._image_of(caller, kid)
        await self.compactor.cancel(caller.uid, kid)
        self.store.for_uid(caller.uid).remove(kid)
        self.bases.drop(caller.uid, kid)
        if record is not None:
            self.kernels.remove(caller.uid, kid)
        return {"kernel_id": kid}

    async def op_images(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        self.bases.sweep(caller.uid)
        return {
            "images": self.store.images(caller.uid),
            "bases": self.bases.listing(caller.uid),
            "refused": self.store.refused(caller.uid),
            "quota_bytes": self.store.quota_bytes,
            "used_bytes": self.store.usage(caller.uid),
        }


def _chunked(manifest: dict[str, Any]) -> bool:
    pages = [m for n, m in manifest["files"].items() if is_page_file(n)]
    return bool(pages) and all("chunks" in m for m in pages)


def register(service: Service) -> None:
    settings, quota = load_settings(service.state_dir, DEFAULT_QUOTA)
    # CRIU inherits the agent's working directory during a restore: root's "/".
    os.chdir("/")
    ops = CheckpointOps(service, settings, quota)
    try:
        # A dump of a user's kernel needs it (criu.py); a cache from before a kernel
        # upgrade would describe another kernel, so it is made anew at every start.
        ops.engine.install_kdat_cache()
    except (OSError, subprocess.SubprocessError, CedanaError) as e:
        _log.warning(
            "CRIU's kernel-feature cache was not written (%s): dumps of "
            "non-root callers' kernels may fail",
            e,
        )
    ops.compactor.sweep_all()  # what a fold cut short by the agent's death left
    ops.register(service)
    PortOps(ops.store, ops.dumped_record, ops.compactor.cancel).register(service)
    OffloadOps(ops.kernels, ops.gpu).register(service)  # the offload tier shares its GPU
