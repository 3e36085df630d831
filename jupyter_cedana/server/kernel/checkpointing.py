"""Suspend of a kernel: GPU offload, CRIU dump into the store, the durable commit of
the image with the kernel's record, and the rollbacks when any step fails (restoring.py:
the way back).

The record (parkrecords.py: what the next server needs to adopt the kernel) is written
before the image is committed, while the kernel is still frozen: a record that cannot be
written fails the suspend and the kernel runs on, so no image is ever committed that a
server killed right after could not give back.

Mixed into CedanaProvisioner, whose process, pid and ports it acts on; every state
change goes through the transition machine (transitions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Awaitable
from typing import Any

from ...checkpoint.crimg import ImageError, dump_breakdown, mark_lazy
from ...checkpoint.dumping import DumpResult, dir_bytes, tree_rss
from ...checkpoint.incremental import INDEX_NAME, PageIndex, manifest_token
from ...checkpoint.pids import task_ids
from ...checkpoint.proctree import process_tree
from ...checkpoint.store import BASE_NAME
from ...errors import (
    CedanaError,
    Conflict,
    EngineUnavailable,
    InsufficientStorage,
    NotCheckpointable,
    SuspendFailed,
)
from ...gpu.cuda import CudaStateLeft
from .compactor import compactor_for
from .ports import kernel_ports
from .restoring import Restoring
from .transitions import KernelState

# A kernel's chain of incremental images may hold up to this times its memory on disk.
CHAIN_LIMIT = 1.2


class Checkpointing(Restoring):
    """suspend() of the provisioner's kernel."""

    async def suspend(self, tier: str = "disk") -> dict[str, Any]:
        """Checkpoint the kernel (process tree and GPU memory) and free its resources."""
        if tier not in ("disk", "offload"):
            raise ValueError(f"unknown tier {tier!r}")
        if self.not_checkpointable:
            raise EngineUnavailable(
                f"Kernel {self.kernel_id} cannot be suspended: the checkpoint agent did "
                f"not start it ({self.not_checkpointable})"
            )
        self._refuse_while_shutting_down()
        return await self.machine.once(f"suspend-{tier}", lambda: self._suspend(tier))

    async def _suspend(self, tier: str) -> dict[str, Any]:
        await self.memory_loaded()
        if self.state == KernelState.suspended and (self.tier == tier or tier == "offload"):
            raise Conflict(f"Kernel {self.kernel_id} is already suspended ({self.tier})")
        if self.state == KernelState.failed:
            raise Conflict(
                f"Kernel {self.kernel_id} failed to resume ({self.reason}); resume it first"
            )
        if self.state == KernelState.running and not self.process_alive():
            raise Conflict(f"Kernel {self.kernel_id} is not running")
        previous = self.state
        # Shown at once (a 202 says `suspending`); clients' messages are held from now on.
        self.machine.set_state(KernelState.suspending)
        try:
            if previous == KernelState.running:
                await (
                    self.machine.before_suspend()
                )  # e.g. the reply cache learns what the kernel is
            if tier == "offload":
                return await self._offload()
            return await self._dump(from_offload=previous == KernelState.suspended)
        except BaseException as e:
            if self.state == KernelState.suspending:
                # A refusal (Conflict) is the caller's answer, not the kernel's condition.
                reason = None if isinstance(e, Conflict) else getattr(e, "message", None) or str(e)
                self.machine.set_state(previous, reason=reason)
            raise

    async def _offload(self) -> dict[str, Any]:
        gpu = await self._gpu()
        if gpu is None:
            why = self.engine.cuda_status()[1] if self.engine.gpu else "CheckpointEngine.gpu is off"
            raise Conflict(f"GPU offload is unavailable: {why or 'no CUDA checkpoint support'}")
        t0 = time.monotonic()
        try:
            result = await gpu.offload(
                process_tree(self.pid or 0), progress=self.gpu_memory.progress
            )
            if not result:
                raise Conflict(f"Kernel {self.kernel_id} holds no GPU memory: nothing to offload")
        except CudaStateLeft as e:
            self.gpu_memory.left(e)
            raise
        except BaseException as e:
            self.machine.set_state(
                KernelState.running, reason=getattr(e, "message", None) or str(e)
            )
            raise
        self.gpu_memory.state = dict(result)
        self.tier = "offload"
        self.suspended_at = time.time()
        self.last_suspend_seconds = time.monotonic() - t0
        self.gpu_memory_freed = int((self.gpu_memory.state or {}).get("bytes_freed", 0))
        self.checkpoint_bytes = 0
        self.machine.set_state(KernelState.suspended)
        return self.summary()

    def _refuse_unsaved_gpu_memory(self, pids: set[int]) -> None:
        """Without CUDA checkpointing, a kernel holding GPU memory must not be dumped: the
        image would lack its GPU memory (preflight: e.g. a driver older than r570)."""
        monitor = self.engine.gpu_monitor()
        if monitor is not None and monitor.available and monitor.usage(pids):
            raise NotCheckpointable(
                "The kernel holds GPU memory but CUDA checkpointing is unavailable: "
                f"{self.engine.cuda_status()[1]}"
            )

    async def _dump(self, from_offload: bool) -> dict[str, Any]:
        if self.remote is not None:
            return await self._dump_at_agent()
        engine = self.engine
        engine.require()
        store = engine.store
        kid = self.kernel_id_str
        t0 = time.monotonic()
        pids = process_tree(self.pid or 0)
        gpu_state = self.gpu_memory.state if from_offload else None
        gpu = await self._gpu()
        if not from_offload and gpu is not None:
            try:
                gpu_state = await gpu.offload(pids, progress=self.gpu_memory.progress) or None
            except CudaStateLeft as e:
                self.gpu_memory.left(e)
                raise
        elif not from_offload:
            self._refuse_unsaved_gpu_memory(pids)
        tmp = None
        try:
            tmp = store.begin(kid)  # a full disk fails here, after the offload: undo it
            base = await asyncio.to_thread(self._base_for, tmp) if engine.keep_base else None
            dumped = await engine.dump(
                self.pid or 0, tmp, progress=self.machine.set_progress, base=base
            )
            if self.image_guard is not None:
                self.image_guard(kid, dir_bytes(tmp))
        except BaseException as e:
            await self._undo_dump(e, tmp, pids, gpu, gpu_state if not from_offload else None)
            if isinstance(e, SuspendFailed | InsufficientStorage | asyncio.CancelledError):
                raise
            raise SuspendFailed(f"Suspend of kernel {kid} failed: {e}") from e
        # From here on the suspend completes (or fails) as a whole: a cancellation that
        # arrives meanwhile takes effect after it, on a suspended kernel.
        return await _uncancellable(
            self._commit_dump(tmp, pids, gpu, gpu_state, from_offload, dumped, t0)
        )

    async def _dump_at_agent(self) -> dict[str, Any]:
        """The agent checkpoints the kernel into its own store and ends its process once
        the image is durable; on failure the kernel runs on, as here."""
        assert self.remote is not None
        t0 = time.monotonic()
        monitor = self.engine.gpu_monitor()
        if monitor is not None and monitor.available and monitor.usage(process_tree(self.pid or 0)):
            # The image would lack the GPU's memory: the agent has no CUDA checkpointing.
            raise NotCheckpointable(
                "The kernel holds GPU memory, and GPU checkpoints through the checkpoint "
                "agent are not supported yet"
            )

        def progress(update: dict[str, Any]) -> None:
            done, total = update.get("done"), update.get("total")
            self.machine.set_progress(
                str(update.get("phase") or "dump"),
                done if isinstance(done, int) else None,
                total if isinstance(total, int) else None,
            )

        dumped = await self.remote.dump(progress)
        # Nothing to cancel from here: the image is the agent's and the process is gone.
        self.process = None
        self.pid = None
        self.tier = "disk"
        self.suspended_at = time.time()
        self.last_suspend_seconds = time.monotonic() - t0
        self.checkpoint_bytes = int(dumped.get("bytes") or 0)
        self.port_hold.reserve(self.connection_info)
        self.machine.set_state(KernelState.suspended)
        self.log.info(
            "Suspended kernel %s through the checkpoint agent in %.2f s (%d bytes)",
            self.kernel_id,
            self.last_suspend_seconds,
            self.checkpoint_bytes,
        )
        return self.summary()

    def _base_for(self, tmp: Any) -> PageIndex | None:
        """The kernel's kept image, linked into `tmp`, with the index of its pages, for
        the dump to write only what changed; None (a whole image) when there is none, or
        its index is not made yet (it is made while the kernel runs after its resume)."""
        store = self.engine.store
        kid = self.kernel_id_str
        if not (store.path(kid) / INDEX_NAME).exists():
            return None
        # A chain that would hold more than this share of the kernel's memory with one
        # more delta the size of its last one is replaced by a whole image now; chains
        # below it are folded in the background once suspended (compactor.py).
        try:
            top = store.read_manifest(kid)
            held = int(top.get("held_bytes") or top["total_bytes"])
            next_delta = int(top["total_bytes"]) if top.get("base") else 0
        except (CedanaError, KeyError, TypeError, ValueError):
            return None
        if held + next_delta > CHAIN_LIMIT * tree_rss(self.pid or 0):
            self.log.info("Kernel %s: suspended whole, its chain holding %d bytes", kid, held)
            return None
        try:
            linked = store.link_base(kid, tmp)
            if linked is None:
                return None
            index = PageIndex.load(linked)
            # Only the newest image's index is ever read: the bases' would only hold disk.
            (linked / INDEX_NAME).unlink()
            return index
        except (OSError, ImageError) as e:
            self.log.warning("Kernel %s: suspended whole, its base unusable: %s", kid, e)
            shutil.rmtree(tmp / BASE_NAME, ignore_errors=True)
            return None

    async def _undo_dump(
        self,
        error: BaseException,
        tmp: Any,
        pids: set[int],
        gpu: Any,
        gpu_state: dict[str, Any] | None,
    ) -> None:
        """Let the kernel run on as before a failed, timed-out or cancelled dump. CRIU
        leaves the tree stopped after a dump, and also when it is killed mid-dump."""
        if tmp is not None:
            self.engine.store.discard(tmp)
        self._continue(pids | process_tree(self.pid or 0))
        if gpu_state is not None and gpu is not None:
            left = await self.gpu_memory.undo_offload(gpu, gpu_state)
            if left is not None:
                raise SuspendFailed(
                    f"Suspend of kernel {self.kernel_id_str} failed: {error}; {left}"
                ) from error

    async def _commit_dump(
        self,
        tmp: Any,
        pids: set[int],
        gpu: Any,
        gpu_state: dict[str, Any] | None,
        from_offload: bool,
        dumped: DumpResult,
        t0: float,
    ) -> dict[str, Any]:
        engine = self.engine
        store = engine.store
        kid = self.kernel_id_str
        t_dumped = time.monotonic()
        committed = False
        try:
            self.machine.set_progress("verify", None, None)
            pid, ports, spec = self.pid or 0, kernel_ports(self.connection_info), self._spec_name()
            suspended_at = time.time()
            record = await self.records.build(suspended_at)

            def commit() -> dict[str, Any]:
                nonlocal committed
                # In a thread, /proc and image reads included: the kernel is frozen.
                try:  # before the checksums: the page maps may change
                    marked = mark_lazy(tmp)
                except (OSError, ImageError, IndexError) as e:
                    # CRIU's own marks still make a working image (a lazy restore that
                    # may read more before the kernel runs): no reason to fail the suspend.
                    self.log.warning("Kernel %s: lazy marks left as CRIU wrote them: %s", kid, e)
                    marked = 0
                try:
                    self.records.hold(record)
                except OSError as e:
                    raise SuspendFailed(
                        f"Suspend of kernel {kid} failed: its record (what a server started "
                        f"after a crash needs to give the kernel back) could not be written: "
                        f"{e}; the kernel keeps running"
                    ) from e
                manifest = store.commit(
                    kid,
                    tmp,
                    {
                        "kernel_name": spec,
                        "criu_version": engine.probe().criu_version,
                        "pidns": engine.pidns,
                        "task_ids": [] if engine.pidns else task_ids(pid),
                        "ports": ports,
                        "gpu": gpu_state,
                        "timings": {"dump_s": dumped.seconds, **dump_breakdown(tmp)},
                        "zero_bytes": dumped.zero_bytes,
                        "pages_marked_lazy": marked,
                        **_delta_summary(dumped),
                    },
                    dumped.sums,
                    delta=dumped.delta is not None,
                )
                committed = True
                return manifest

            manifest = await asyncio.to_thread(commit)
        except BaseException as e:
            if not committed:
                self.records.drop()  # no image was committed: a record would promise one
            await self._undo_dump(e, tmp, pids, gpu, gpu_state if not from_offload else None)
            self.log.error("%s", getattr(e, "message", None) or e)
            if isinstance(e, SuspendFailed):
                raise
            raise SuspendFailed(f"Suspend of kernel {kid} failed: {e}") from e
        # The image is safe on disk: only now does the kernel's memory go.
        t_commit = time.monotonic()
        self._kill_tree(self.pid or 0)
        if self.process is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.process.wait, 10)
            self.process = None
        t_killed = time.monotonic()
        self.last_suspend_breakdown = {
            **manifest["timings"],
            "before_dump_s": t_dumped - dumped.seconds - t0,  # GPU offload, dump queue
            "commit_s": t_commit - t_dumped,
            "kill_s": t_killed - t_commit,
            # From CRIU's start (it freezes the tree at once) until the tree is gone.
            "frozen_s": dumped.seconds + t_killed - t_dumped,
        }
        self.port_hold.reserve(self.connection_info)
        if dumped.delta is not None:  # the next suspend's base, unless the image goes
            self._background(
                asyncio.to_thread(_save_index, dumped.delta.index, store.path(kid), manifest)
            )
        self.gpu_memory.state = gpu_state
        self.tier = "disk"
        self.suspended_at = suspended_at
        self.last_suspend_seconds = time.monotonic() - t0
        # What the checkpoint holds on disk: an incremental image with its bases.
        self.checkpoint_bytes = int(manifest.get("held_bytes") or manifest["total_bytes"])
        self.gpu_memory_freed = int((gpu_state or {}).get("bytes_freed", 0))
        self.machine.set_state(KernelState.suspended)
        if dumped.delta is not None:  # a longer chain: compacted in the background if due
            compactor_for(store).schedule(self)
        self.log.info(
            "Suspended kernel %s: %.1f MB in %.2f s",
            kid,
            self.checkpoint_bytes / 1e6,
            self.last_suspend_seconds,
        )
        return self.summary()

    def _spec_name(self) -> str | None:
        return getattr(self.parent, "kernel_name", None)


def _delta_summary(dumped: DumpResult) -> dict[str, Any]:
    d = dumped.delta
    if d is None:
        return {}
    page = 4096
    return {
        "delta": {
            "pages": d.pages,
            "written_bytes": d.written * page,
            "in_parent_bytes": d.in_parent * page,
            "copied_bytes": d.copied * page,
        }
    }


def _save_index(index: PageIndex, images: Any, manifest: dict[str, Any]) -> None:
    """Saved where the image now is (it was dumped under a temporary name), naming the
    image it is of (an image that replaced it meanwhile will not take it)."""
    index.directory = images
    index.image = manifest_token(manifest)
    with contextlib.suppress(OSError):  # gone meanwhile: no base for the next dump
        index.save()


async def _uncancellable(work: Awaitable[Any]) -> Any:
    """Run `work` to its end even if the caller is cancelled meanwhile; the cancellation
    is raised once it has ended."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            raise task.exception() from None  # type: ignore[misc]
        raise
