"""Resume of a kernel: the restore of its image (whole, or lazily with pages served as
they are touched: lazy_memory.py), its GPU memory, checksums verified alongside, and
the rollback when any step fails; a kernel offloaded to host memory, or at the
checkpoint agent, is resumed here too.

Composed into CedanaProvisioner (as `resumer`), whose process, pid and ports it acts on
through handle.KernelHandle; every state change goes through the transition machine
(transitions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import subprocess
import threading
import time
from typing import Any

from ...checkpoint import lazy, readahead
from ...checkpoint.engine import kill_restore
from ...checkpoint.integrity import is_page_file
from ...checkpoint.pids import check_free
from ...checkpoint.proctree import process_tree
from ...errors import CedanaError, CheckpointCorrupt, Conflict, InsufficientGpuMemory, ResumeFailed
from ...gpu.cuda import CudaStateLeft
from .compactor import compactor_for
from .handle import KernelHandle
from .kernel_tree import continue_restored, gone, kill_tree
from .lazy_memory import LazyMemory
from .transitions import KernelState


class Resumer:
    """A kernel's resume, run by its provisioner under the kernel's transition lock."""

    def __init__(self, kernel: KernelHandle, memory: LazyMemory):
        self.kernel = kernel
        self.memory = memory  # a lazy restore's memory, coming in after the resume

    async def resume(self) -> dict[str, Any]:
        """Restore a suspended kernel; on failure the image is kept and a retry may work."""
        k = self.kernel
        if k.state == KernelState.running:
            raise Conflict(f"Kernel {k.kernel_id} is running, not suspended")
        if k.tier == "offload" and k.state in (KernelState.suspended, KernelState.failed):
            return await self._resume_offload()
        if k.state == KernelState.failed and k.gpu_memory.lost:
            raise Conflict(f"Kernel {k.kernel_id} cannot be resumed: {k.reason}; restart it")
        if k.remote is not None:
            return await self._resume_at_agent()
        engine = k.engine
        engine.require()
        store = engine.store
        kid = k.kernel_id_str
        previous = k.state
        k.machine.set_state(KernelState.resuming)
        t0 = time.monotonic()
        k.last_memory_in_at = None
        # A compaction of the chain (compactor.py) stops short of its exchange or ends
        # it first: CRIU must never read a chain that is being replaced. Milliseconds.
        await compactor_for(store).cancel(kid)
        try:
            manifest = store.check_sizes(kid)
            check_free(manifest.get("task_ids"))
            gpu_state = manifest.get("gpu") or k.gpu_memory.state
            gpu, plan = await self._admit(gpu_state)
        except InsufficientGpuMemory as e:
            # Nothing was touched: the kernel stays suspended and a later resume may fit.
            k.machine.set_state(previous, reason=e.message)
            raise
        except BaseException as e:
            self._fail_resume(kid, previous, e)
            raise self._as_resume_error(kid, e) from e
        # CRIU restores (leaving the tree stopped) while the checksums are verified: both
        # read the same pages, so a cold image is read from disk once, not twice. A lazy
        # restore checks what CRIU reads before it starts; the pages, as they are served.
        loop = asyncio.get_running_loop()
        k.machine.set_progress("restore", 0, int(manifest["total_bytes"]) or None)

        abandoned = threading.Event()

        def verified(done: int, total: int) -> None:
            if abandoned.is_set():  # the restore failed or was cancelled: stop reading
                raise ResumeFailed("checksum verification abandoned")
            loop.call_soon_threadsafe(k.machine.set_progress, "restore", done, total)

        verify: asyncio.Future[Any] = loop.create_future()
        verify.set_result(None)
        pages: lazy.PageServer | None = None
        proc: subprocess.Popen[bytes] | None = None
        restored: asyncio.Future[int] | None = None
        pid: int | None = None
        try:
            images = store.path(kid)
            work = store.work_dir(kid)
            pidfile = work / "restored.pid"
            pidfile.unlink(missing_ok=True)
            # The first time, this runs `criu check`: not on the event loop.
            lazy_off = await asyncio.to_thread(engine.lazy_unsupported)
            if self._restores_lazily(manifest, gpu_state, lazy_off, engine.lazy_restore_min_bytes):
                lazy_plan = await asyncio.to_thread(
                    lazy.check_before_restore,
                    store,
                    kid,
                    manifest,
                    work,
                    engine.restore_read_ahead,
                )
                pages = lazy.PageServer(
                    engine.pages_binary(),
                    images,
                    work,
                    pidfile,
                    lazy_plan,
                    k.log,
                    copiers=engine.lazy_copy_threads,
                )
                await pages.start(verified)
            else:
                if engine.restore_read_ahead:
                    readahead.start(functools.partial(readahead.of_image, images))
                verify = asyncio.ensure_future(asyncio.to_thread(store.verify, kid, verified))
            t_checked = time.monotonic()
            k.port_hold.release()
            proc = engine.start_restore(images, work, pidfile, lazy=pages is not None)
            restored = asyncio.ensure_future(engine.wait_restored(proc, work, pidfile))
            # A checksum mismatch stops the restore at once, whatever CRIU is doing.
            await asyncio.wait({restored, verify}, return_when=asyncio.FIRST_EXCEPTION)
            if verify.done() and verify.exception() is not None:
                restored.cancel()
                with contextlib.suppress(BaseException):
                    await restored
                await verify
            pid = await restored
            await verify
            t_restored = time.monotonic()
            before, after = k.gpu_memory.restore_step(gpu, gpu_state, pid, plan)
            await continue_restored(pid, k.log, before=before)
            if after is not None:
                await after()
        except BaseException as caught:
            # Whatever was restored must not run on: its image or its GPU memory is wrong.
            err: BaseException = caught
            abandoned.set()
            if restored is not None and not restored.done():
                restored.cancel()  # it polls for a PID that will not come
            restored_pids = process_tree(pid) if pid is not None else set()
            if proc is not None:  # a tree restored but not yet reported is CRIU's child
                restored_pids |= process_tree(proc.pid) - {proc.pid}
            if pid is not None:
                kill_tree(pid, k.engine.pidns)
            if proc is not None:
                await asyncio.to_thread(kill_restore, proc)
            await gone(restored_pids)
            if pages is not None:
                await pages.stop()
            pending: set[asyncio.Future[Any]] = {verify}
            if restored is not None:
                pending.add(restored)
            await asyncio.wait(pending)
            if restored is not None and not restored.cancelled():
                restored.exception()  # seen: the error to report is `caught`
            damaged = None if verify.cancelled() else verify.exception()
            if isinstance(damaged, CheckpointCorrupt):
                err = damaged  # explains a CRIU failure better than CRIU does
            k.port_hold.reserve(k.connection_info)
            self._fail_resume(kid, previous, err)
            raise self._as_resume_error(kid, err) from caught
        assert proc is not None and pid is not None
        k.process = proc
        k.pid = pid
        k.gpu_memory.state = None
        k.last_resume_seconds = time.monotonic() - t0
        k.last_resume_breakdown = {
            "lazy": pages is not None,
            "check_s": t_checked - t0,  # sizes, admission, what a lazy restore checks first
            "restore_s": t_restored - t_checked,  # CRIU (and a whole restore's checksums)
            "continue_s": time.monotonic() - t_restored,
            "copiers": pages.copiers if pages is not None else 0,  # its share of the budget
        }
        if pages is not None:
            # The image (and the record) stays until every page is in.
            self.memory.start(pages, proc, pid)
        else:
            self.memory.image_superseded()
        k.tier = None
        k.suspended_at = None
        k.resumed_at = time.time()
        k.image_taken_at = manifest.get("created")
        k.machine.set_state(KernelState.running, reason=self.memory.rolled_back())
        if pages is None:
            k.work_lost_after = None  # told (the state's reason); nothing can fail
        k.log.info("Resumed kernel %s in %.2f s (pid %s)", kid, k.last_resume_seconds, pid)
        return k.summary()

    async def _resume_at_agent(self) -> dict[str, Any]:
        """The agent restores the kernel from its image (lazily where it can: the
        kernel runs while its memory comes in); a failure keeps the image there."""
        k = self.kernel
        assert k.remote is not None
        kid = k.kernel_id_str
        previous = k.state
        k.machine.set_state(KernelState.resuming)
        k.machine.set_progress("restore", None, k.checkpoint_bytes or None)
        t0 = time.monotonic()
        k.port_hold.release()

        # The agent's phases, its GPU restore's ("gpu-restore") among them.
        progress = k.machine.progress_from("restore")

        try:
            pid = await k.remote.restore(lazy=k.engine.lazy_restore, progress=progress)
        except BaseException as e:
            k.port_hold.reserve(k.connection_info)
            self._fail_resume(kid, previous, e)
            raise self._as_resume_error(kid, e) from e
        k.process = k.remote
        k.pid = pid
        k.gpu_memory.state = None  # back in the GPU (the agent restored it before it ran)
        k.last_resume_seconds = time.monotonic() - t0
        k.tier = None
        k.image_taken_at = k.suspended_at or k.image_taken_at
        k.suspended_at = None
        k.resumed_at = time.time()
        k.machine.set_state(KernelState.running, reason=self.memory.rolled_back())
        k.work_lost_after = None  # told (the state's reason)
        k.log.info(
            "Resumed kernel %s through the checkpoint agent in %.2f s (pid %s)",
            kid,
            k.last_resume_seconds,
            pid,
        )
        return k.summary()

    @staticmethod
    def _restores_lazily(
        manifest: dict[str, Any], gpu_state: Any, lazy_off: str | None, min_bytes: int
    ) -> bool:
        # GPU checkpoints: the CUDA restore reads the process's memory right away, and
        # has not been checked against pages served by userfaultfd.
        page_files = [m for n, m in manifest["files"].items() if is_page_file(n)]
        chunked = bool(page_files) and all("chunks" in m for m in page_files)
        # An incremental image's size is its chain's: a small delta on a large base is large.
        held = manifest.get("held_bytes") or manifest.get("total_bytes")
        big = int(held or 0) >= min_bytes
        return chunked and big and not gpu_state and lazy_off is None

    async def _admit(self, gpu_state: dict[str, Any] | None) -> tuple[Any, Any]:
        """Restore admission, before anything is restored: the checkpointed GPU memory
        must fit on a GPU of the same model (a restore that runs out can hang for good)."""
        k = self.kernel
        if not gpu_state:
            return None, True
        gpu = await k.engine.cuda_checkpointer()
        if gpu is None:
            raise ResumeFailed(
                "This checkpoint holds GPU memory, but GPU checkpointing is unavailable here: "
                f"{k.engine.cuda_status()[1]}"
            )
        return gpu, await gpu.admit(gpu_state)

    def _fail_resume(self, kid: str, previous: KernelState, e: BaseException) -> None:
        k = self.kernel
        reason = getattr(e, "message", None) or str(e) or type(e).__name__
        if isinstance(e, asyncio.CancelledError):
            k.machine.set_state(previous, reason=reason)
        else:
            k.machine.set_state(KernelState.failed, reason=reason)
        k.log.error("Resume of kernel %s failed: %s", kid, reason)

    @staticmethod
    def _as_resume_error(kid: str, e: BaseException) -> BaseException:
        if isinstance(e, CedanaError | asyncio.CancelledError):
            return e
        return ResumeFailed(f"Resume of kernel {kid} failed: {e}")

    async def _resume_offload(self) -> dict[str, Any]:
        k = self.kernel
        if k.remote is not None:
            return await self._reload_at_agent()
        gpu = await k.engine.cuda_checkpointer()
        previous = k.state
        k.machine.set_state(KernelState.resuming)
        t0 = time.monotonic()
        try:
            if gpu is None:
                raise ResumeFailed("GPU checkpoint support went away")
            await gpu.restore(k.gpu_memory.state, None, progress=k.gpu_memory.progress)
        except CudaStateLeft as e:
            k.gpu_memory.left(e)
            raise
        except BaseException as e:
            k.machine.set_state(previous, reason=getattr(e, "message", None) or str(e))
            raise
        return _reloaded(k, t0)

    async def _reload_at_agent(self) -> dict[str, Any]:
        """The agent puts the offloaded kernel's GPU memory back (free GPU memory checked
        first); on failure it stays offloaded there, and here."""
        k = self.kernel
        assert k.remote is not None
        previous = k.state
        k.machine.set_state(KernelState.resuming)
        t0 = time.monotonic()
        try:
            await k.remote.reload(k.machine.progress_from("gpu-restore"))
        except BaseException as e:
            k.machine.set_state(previous, reason=getattr(e, "message", None) or str(e))
            raise
        return _reloaded(k, t0)


def _reloaded(k: KernelHandle, t0: float) -> dict[str, Any]:
    """An offloaded kernel's GPU memory is back (here or at the agent): it runs again."""
    k.gpu_memory.state = None
    k.tier = None
    k.suspended_at = None
    k.last_resume_seconds = time.monotonic() - t0
    k.machine.set_state(KernelState.running)
    return k.summary()
