"""Resume of a kernel: the restore of its image (whole, or lazily with pages served as
they are touched), its GPU memory, checksums verified alongside, and the rollback when
any step fails; and what suspend and resume share (checkpointing.py builds on it).

Mixed into CedanaProvisioner, whose process, pid and ports it acts on; every state
change goes through the transition machine (transitions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...checkpoint import lazy, readahead
from ...checkpoint.crimg import ImageError
from ...checkpoint.engine import CheckpointEngine, kill_restore
from ...checkpoint.incremental import INDEX_NAME, PageIndex
from ...checkpoint.integrity import is_page_file
from ...checkpoint.pids import check_free
from ...checkpoint.proctree import process_tree, stat_fields
from ...checkpoint.store import MANIFEST
from ...errors import CedanaError, CheckpointCorrupt, Conflict, InsufficientGpuMemory, ResumeFailed
from ...gpu.cuda import CudaStateLeft
from ...timestamps import iso
from .checkpoint_agent import AgentKernel
from .compactor import compactor_for
from .gpu_steps import GpuMemory
from .ports import PortHold
from .record import RecordHolder
from .transitions import KernelState, TransitionMachine


class Restoring:
    """resume() of the provisioner's kernel, and the parts suspend() shares."""

    kernel_id: Any
    log: Any
    pid: int | None
    process: Any
    parent: Any
    machine: TransitionMachine  # the kernel's state and transitions (the provisioner's)
    state: KernelState
    tier: str | None
    reason: str | None
    gpu_memory: GpuMemory  # its GPU memory between the steps of a suspend or resume
    suspended_at: float | None = None
    last_suspend_seconds: float | None = None
    # Where the last suspend's time went (seconds), for benchmarks and logs.
    last_suspend_breakdown: dict[str, float] | None = None
    last_resume_breakdown: dict[str, Any] | None = None
    last_resume_seconds: float | None = None
    # time.monotonic() when the last lazily restored kernel's memory was all in.
    last_memory_in_at: float | None = None
    # time.time() of the last resume, and when the image it came from was taken.
    resumed_at: float | None = None
    image_taken_at: float | None = None
    # time.time() after which what the kernel did is lost: a lazy restore failed after
    # it ran, and it goes back to the image. Kept until a resume has all its memory in.
    work_lost_after: float | None = None
    checkpoint_bytes: int = 0
    gpu_memory_freed: int = 0
    _chores: set[asyncio.Future[Any]]
    # (kernel id, image bytes) -> None, or raises to refuse a dumped image before it is
    # committed (the checkpoint budget; set by the suspend manager).
    image_guard: Callable[[str, int], None] | None = None
    _loading: asyncio.Future[None] | None = None  # a lazy restore's pages coming in
    remote: AgentKernel | None = None  # the kernel at the checkpoint agent, if one is used
    port_hold: PortHold  # the kernel's ports while it has no process
    records: RecordHolder  # its park record
    # Why nothing can checkpoint this kernel (it was launched without the agent), if so.
    not_checkpointable: str | None = None
    connection_info: Any

    @functools.cached_property
    def engine(self) -> CheckpointEngine:
        # Taken once: a kernel's images stay in the root it started with, even if the
        # process-wide engine is replaced later (tests do; parking reads the first one).
        return CheckpointEngine.instance(parent=self.parent)

    @property
    def kernel_id_str(self) -> str:
        return str(self.kernel_id)

    def process_alive(self) -> bool:
        """Whether the kernel's process runs, as last seen (for a kernel at the agent, as
        the last poll learned: a suspend must not wait on the agent before it shows)."""
        return bool(self.pid) and self.process is not None and self.process.poll() is None

    async def resume(self) -> dict[str, Any]:
        """Restore a suspended kernel; on failure the image is kept and a retry may work."""
        self._refuse_while_shutting_down()
        return await self.machine.once("resume", self._resume)

    def _refuse_while_shutting_down(self) -> None:
        # A shutdown or restart aborts the transition in flight; none may start after it.
        if getattr(self.parent, "shutting_down", False):
            raise Conflict(
                f"Kernel {self.kernel_id} is not running: it is shutting down or restarting"
            )

    async def _gpu(self) -> Any:
        """The CUDA checkpointer when GPU checkpointing is possible here, else None."""
        return await self.engine.cuda_checkpointer()

    @staticmethod
    def _continue(pids: set[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    async def _continue_restored(
        self,
        root: int,
        timeout: float = 10.0,
        before: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """CRIU writes the pidfile while the restored tasks are still ptrace-stopped and
        stops them for good (SIGSTOP) only as it detaches: a SIGCONT sent before that is
        overtaken. Wait for the group stop of every task, run `before` (the GPU restore),
        continue, and make sure."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = process_tree(root)
            if pids and all(_proc_state(p) == "T" for p in pids):
                break
            await asyncio.sleep(0.002)
        else:
            self.log.warning("Restored kernel %s did not report stopped; continuing it", root)
        if before is not None:
            await before()
        # Every task was seen stopped, so CRIU has let go and no stop is still on its
        # way: the first look may be early (the kernel's first output waits for it).
        settle = time.monotonic() + 1.0
        delay = 0.001
        while True:
            self._continue(process_tree(root))
            await asyncio.sleep(delay)
            if time.monotonic() > settle or not any(
                _proc_state(p) == "T" for p in process_tree(root)
            ):
                break
            delay = min(delay * 2, 0.02)

    def _kill_tree(self, root: int) -> None:
        """SIGKILL a kernel tree: its PID-namespace init takes the namespace with it;
        without a namespace every process is killed, children first."""
        if not root:
            return
        targets = [root] if self.engine.pidns else sorted(process_tree(root), reverse=True)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def _resume(self) -> dict[str, Any]:
        if self.state == KernelState.running:
            raise Conflict(f"Kernel {self.kernel_id} is running, not suspended")
        if self.tier == "offload" and self.state in (KernelState.suspended, KernelState.failed):
            return await self._resume_offload()
        if self.state == KernelState.failed and self.gpu_memory.lost:
            raise Conflict(f"Kernel {self.kernel_id} cannot be resumed: {self.reason}; restart it")
        if self.remote is not None:
            return await self._resume_at_agent()
        engine = self.engine
        engine.require()
        store = engine.store
        kid = self.kernel_id_str
        previous = self.state
        self.machine.set_state(KernelState.resuming)
        t0 = time.monotonic()
        self.last_memory_in_at = None
        # A compaction of the chain (compactor.py) stops short of its exchange or ends
        # it first: CRIU must never read a chain that is being replaced. Milliseconds.
        await compactor_for(store).cancel(kid)
        try:
            manifest = store.check_sizes(kid)
            check_free(manifest.get("task_ids"))
            gpu_state = manifest.get("gpu") or self.gpu_memory.state
            gpu, plan = await self._admit(gpu_state)
        except InsufficientGpuMemory as e:
            # Nothing was touched: the kernel stays suspended and a later resume may fit.
            self.machine.set_state(previous, reason=e.message)
            raise
        except BaseException as e:
            self._fail_resume(kid, previous, e)
            raise self._as_resume_error(kid, e) from e
        # CRIU restores (leaving the tree stopped) while the checksums are verified: both
        # read the same pages, so a cold image is read from disk once, not twice. A lazy
        # restore checks what CRIU reads before it starts; the pages, as they are served.
        loop = asyncio.get_running_loop()
        self.machine.set_progress("restore", 0, int(manifest["total_bytes"]) or None)

        abandoned = threading.Event()

        def verified(done: int, total: int) -> None:
            if abandoned.is_set():  # the restore failed or was cancelled: stop reading
                raise ResumeFailed("checksum verification abandoned")
            loop.call_soon_threadsafe(self.machine.set_progress, "restore", done, total)

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
                    self.log,
                    copiers=engine.lazy_copy_threads,
                )
                await pages.start(verified)
            else:
                if engine.restore_read_ahead:
                    readahead.start(functools.partial(readahead.of_image, images))
                verify = asyncio.ensure_future(asyncio.to_thread(store.verify, kid, verified))
            t_checked = time.monotonic()
            self.port_hold.release()
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
            before, after = self.gpu_memory.restore_step(gpu, gpu_state, pid, plan)
            await self._continue_restored(pid, before=before)
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
                self._kill_tree(pid)
            if proc is not None:
                await asyncio.to_thread(kill_restore, proc)
            await _gone(restored_pids)
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
            self.port_hold.reserve(self.connection_info)
            self._fail_resume(kid, previous, err)
            raise self._as_resume_error(kid, err) from caught
        assert proc is not None and pid is not None
        self.process = proc
        self.pid = pid
        self.gpu_memory.state = None
        self.last_resume_seconds = time.monotonic() - t0
        self.last_resume_breakdown = {
            "lazy": pages is not None,
            "check_s": t_checked - t0,  # sizes, admission, what a lazy restore checks first
            "restore_s": t_restored - t_checked,  # CRIU (and a whole restore's checksums)
            "continue_s": time.monotonic() - t_restored,
            "copiers": pages.copiers if pages is not None else 0,  # its share of the budget
        }
        if pages is not None:
            # The image (and the record) stays until every page is in.
            self._loading = asyncio.ensure_future(self._load_memory(pages, proc, pid))
            self.records.note_resumed_lazily()
        else:
            self._image_superseded()
        self.tier = None
        self.suspended_at = None
        self.resumed_at = time.time()
        self.image_taken_at = manifest.get("created")
        self.machine.set_state(KernelState.running, reason=self._rolled_back())
        if pages is None:
            self.work_lost_after = None  # told (the state's reason); nothing can fail
        self.log.info("Resumed kernel %s in %.2f s (pid %s)", kid, self.last_resume_seconds, pid)
        return self.summary()

    async def _resume_at_agent(self) -> dict[str, Any]:
        """The agent restores the kernel from its image (lazily where it can: the
        kernel runs while its memory comes in); a failure keeps the image there."""
        assert self.remote is not None
        kid = self.kernel_id_str
        previous = self.state
        self.machine.set_state(KernelState.resuming)
        self.machine.set_progress("restore", None, self.checkpoint_bytes or None)
        t0 = time.monotonic()
        self.port_hold.release()
        try:
            pid = await self.remote.restore(lazy=self.engine.lazy_restore)
        except BaseException as e:
            self.port_hold.reserve(self.connection_info)
            self._fail_resume(kid, previous, e)
            raise self._as_resume_error(kid, e) from e
        self.process = self.remote
        self.pid = pid
        self.last_resume_seconds = time.monotonic() - t0
        self.tier = None
        self.image_taken_at = self.suspended_at or self.image_taken_at
        self.suspended_at = None
        self.resumed_at = time.time()
        self.machine.set_state(KernelState.running, reason=self._rolled_back())
        self.work_lost_after = None  # told (the state's reason)
        self.log.info(
            "Resumed kernel %s through the checkpoint agent in %.2f s (pid %s)",
            kid,
            self.last_resume_seconds,
            pid,
        )
        return self.summary()

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

    def _image_superseded(self) -> None:
        """The resumed kernel runs on its own memory: its record goes (a server started
        after a crash must not bring back the older state in the image), and so does the
        image unless CheckpointEngine.keep_image_after_resume."""
        self.records.drop()
        if self.engine.keep_base:
            # Indexed while the kernel runs, so that its next suspend need not read it.
            images = self.engine.store.path(self.kernel_id_str)
            self._background(asyncio.to_thread(_index_image, images))
        elif not self.engine.keep_image_after_resume:
            self._discard_image_later()

    def _discard_image_later(self) -> None:
        # The kernel runs already; gigabytes of deletion need not delay its first output.
        doomed = self.engine.store.detach_image(self.kernel_id_str)
        if doomed is not None:
            self._background(asyncio.to_thread(shutil.rmtree, doomed, True))
        self.checkpoint_bytes = 0

    async def _load_memory(
        self, pages: lazy.PageServer, proc: subprocess.Popen[bytes], pid: int
    ) -> None:
        """Wait for a lazily restored kernel's memory to be in; then the image goes. If
        it cannot all come in, the kernel is killed (it must not run on with wrong or
        missing memory) and goes to `failed`, keeping its image."""
        kid = self.kernel_id_str
        try:
            seconds = await asyncio.shield(pages.done)
        except lazy.KernelExited:
            await pages.stop()  # shut down or crashed meanwhile: nothing to load into
            return
        except BaseException as e:
            restored = process_tree(pid)
            self._kill_tree(pid)
            await _gone(restored)
            await pages.stop()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(proc.wait, 10)
            if self.process is proc:
                self.process = None
            self.port_hold.reserve(self.connection_info)
            cause = getattr(e, "message", None) or str(e) or type(e).__name__
            self.log.error("Kernel %s killed, its image kept: %s", kid, cause)
            if self.state == KernelState.running:
                self.work_lost_after = self.work_lost_after or self.resumed_at
                self.machine.set_state(KernelState.failed, reason=self._lost(cause))
            return
        finally:
            self._loading = None
        self.last_memory_in_at = pages.started + seconds
        self.work_lost_after = None
        await pages.stop()
        self.log.info(
            "Kernel %s: all %.1f MB of its memory in, %.2f s after the page server started",
            kid,
            pages.bytes_done / 1e6,
            seconds,
        )
        self._image_superseded()

    def _lost(self, cause: str) -> str:
        return (
            "The kernel failed while its memory was being restored, and was stopped: "
            f"{cause.rstrip('.')}. What it did after its resume at "
            f"{iso(self.work_lost_after)} is lost; its checkpoint taken at "
            f"{iso(self.image_taken_at)} is kept, and the next resume goes back to it."
        )

    def _rolled_back(self) -> str | None:
        if self.work_lost_after is None:
            return None
        return (
            f"Resumed from its checkpoint taken at {iso(self.image_taken_at)}: what it "
            f"did after its resume at {iso(self.work_lost_after)} was lost (its memory "
            "could not all be restored then)."
        )

    async def memory_loaded(self) -> None:
        """Returns once a lazily restored kernel's memory is all in (at once otherwise).
        A suspend waits for it: the image being loaded goes away then, and a new dump
        must not go with it."""
        if self._loading is not None:
            await asyncio.shield(self._loading)

    def _background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _admit(self, gpu_state: dict[str, Any] | None) -> tuple[Any, Any]:
        """Restore admission, before anything is restored: the checkpointed GPU memory
        must fit on a GPU of the same model (a restore that runs out can hang for good)."""
        if not gpu_state:
            return None, True
        gpu = await self._gpu()
        if gpu is None:
            raise ResumeFailed(
                "This checkpoint holds GPU memory, but GPU checkpointing is unavailable here: "
                f"{self.engine.cuda_status()[1]}"
            )
        return gpu, await gpu.admit(gpu_state)

    def _fail_resume(self, kid: str, previous: KernelState, e: BaseException) -> None:
        reason = getattr(e, "message", None) or str(e) or type(e).__name__
        if isinstance(e, asyncio.CancelledError):
            self.machine.set_state(previous, reason=reason)
        else:
            self.machine.set_state(KernelState.failed, reason=reason)
        self.log.error("Resume of kernel %s failed: %s", kid, reason)

    @staticmethod
    def _as_resume_error(kid: str, e: BaseException) -> BaseException:
        if isinstance(e, CedanaError | asyncio.CancelledError):
            return e
        return ResumeFailed(f"Resume of kernel {kid} failed: {e}")

    async def _resume_offload(self) -> dict[str, Any]:
        gpu = await self._gpu()
        previous = self.state
        self.machine.set_state(KernelState.resuming)
        t0 = time.monotonic()
        try:
            if gpu is None:
                raise ResumeFailed("GPU checkpoint support went away")
            await gpu.restore(self.gpu_memory.state, None, progress=self.gpu_memory.progress)
        except CudaStateLeft as e:
            self.gpu_memory.left(e)
            raise
        except BaseException as e:
            self.machine.set_state(previous, reason=getattr(e, "message", None) or str(e))
            raise
        self.gpu_memory.state = None
        self.tier = None
        self.suspended_at = None
        self.last_resume_seconds = time.monotonic() - t0
        self.machine.set_state(KernelState.running)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "tier": self.tier,
            "checkpoint_bytes": self.checkpoint_bytes,
            "last_suspend_seconds": self.last_suspend_seconds,
            "last_resume_seconds": self.last_resume_seconds,
            "gpu_memory_freed": self.gpu_memory_freed,
            "reason": self.reason,
        }


def _index_image(images: Any) -> None:
    """The index of a kept image's pages (incremental.py), saved in it; an image that
    went meanwhile, or cannot be read, leaves the next suspend whole."""
    with contextlib.suppress(OSError, ImageError):
        if (images / MANIFEST).is_file() and not (images / INDEX_NAME).exists():
            PageIndex.of_image(images).save()


def _proc_state(pid: int) -> str:
    fields = stat_fields(pid)
    return fields[0] if fields else "?"


async def _gone(pids: set[int], timeout: float = 5.0) -> None:
    """Wait until killed processes have really exited (SIGKILL is not synchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_proc_state(p) not in ("?", "Z", "X") for p in pids):
        await asyncio.sleep(0.01)
