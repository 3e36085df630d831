"""Suspend of a kernel: GPU offload, CRIU dump into the store, the durable commit of
the image with the kernel's record, and the rollbacks when any step fails (resumer.py:
the way back).

The record (parkrecords.py: what the next server needs to adopt the kernel) is written
before the image is committed, while the kernel is still frozen: a record that cannot be
written fails the suspend and the kernel runs on, so no image is ever committed that a
server killed right after could not give back.

Composed into CedanaProvisioner (as `suspender`), whose process, pid and ports it acts on
through handle.KernelHandle; every state change goes through the transition machine
(transitions.py).
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
    InsufficientStorage,
    NotCheckpointable,
    SuspendFailed,
)
from ...gpu.cuda import CudaStateLeft
from .compactor import compactor_for
from .handle import KernelHandle
from .kernel_tree import continue_tree, kill_tree
from .ports import kernel_ports
from .transitions import KernelState

# A kernel's chain of incremental images may hold up to this times its memory on disk.
CHAIN_LIMIT = 1.2


class Suspender:
    """A kernel's suspend, run by its provisioner under the kernel's transition lock."""

    def __init__(self, kernel: KernelHandle):
        self.kernel = kernel

    async def suspend(self, tier: str) -> dict[str, Any]:
        """Checkpoint the kernel (process tree and GPU memory) and free its resources."""
        k = self.kernel
        await k.memory_loaded()
        if k.state == KernelState.suspended and (k.tier == tier or tier == "offload"):
            raise Conflict(f"Kernel {k.kernel_id} is already suspended ({k.tier})")
        if k.state == KernelState.failed:
            raise Conflict(f"Kernel {k.kernel_id} failed to resume ({k.reason}); resume it first")
        if k.state == KernelState.running and not k.process_alive():
            raise Conflict(f"Kernel {k.kernel_id} is not running")
        previous = k.state
        # Shown at once (a 202 says `suspending`); clients' messages are held from now on.
        k.machine.set_state(KernelState.suspending)
        try:
            if previous == KernelState.running:
                await k.machine.before_suspend()  # e.g. the reply cache learns what the kernel is
            if tier == "offload":
                return await self._offload()
            return await self._dump(from_offload=previous == KernelState.suspended)
        except BaseException as e:
            if k.state == KernelState.suspending:
                # A refusal (Conflict) is the caller's answer, not the kernel's condition.
                reason = None if isinstance(e, Conflict) else getattr(e, "message", None) or str(e)
                k.machine.set_state(previous, reason=reason)
            raise

    async def _offload(self) -> dict[str, Any]:
        k = self.kernel
        if k.remote is not None:
            return await self._offload_at_agent()
        gpu = await k.engine.cuda_checkpointer()
        if gpu is None:
            why = k.engine.cuda_status()[1] if k.engine.gpu else "CheckpointEngine.gpu is off"
            raise Conflict(f"GPU offload is unavailable: {why or 'no CUDA checkpoint support'}")
        t0 = time.monotonic()
        try:
            result = await gpu.offload(process_tree(k.pid or 0), progress=k.gpu_memory.progress)
            if not result:
                raise Conflict(f"Kernel {k.kernel_id} holds no GPU memory: nothing to offload")
        except CudaStateLeft as e:
            k.gpu_memory.left(e)
            raise
        except BaseException as e:
            k.machine.set_state(KernelState.running, reason=getattr(e, "message", None) or str(e))
            raise
        k.gpu_memory.state = dict(result)
        k.tier = "offload"
        k.suspended_at = time.time()
        k.last_suspend_seconds = time.monotonic() - t0
        k.gpu_memory_freed = int((k.gpu_memory.state or {}).get("bytes_freed", 0))
        k.checkpoint_bytes = 0
        k.machine.set_state(KernelState.suspended)
        return k.summary()

    async def _offload_at_agent(self) -> dict[str, Any]:
        """The agent checkpoints the kernel's GPU memory into its host memory, the process
        kept (its offload op); on failure the kernel runs on, as here."""
        k = self.kernel
        assert k.remote is not None
        t0 = time.monotonic()
        try:
            reply = await k.remote.offload(k.machine.progress_from("offload"))
        except BaseException as e:
            k.machine.set_state(KernelState.running, reason=getattr(e, "message", None) or str(e))
            raise
        k.gpu_memory.state = dict(reply.get("gpu") or {})
        k.tier = "offload"
        k.suspended_at = time.time()
        k.last_suspend_seconds = time.monotonic() - t0
        k.gpu_memory_freed = int(reply.get("gpu_memory_freed") or 0)
        k.checkpoint_bytes = 0
        k.machine.set_state(KernelState.suspended)
        return k.summary()

    def _refuse_unsaved_gpu_memory(self, pids: set[int]) -> None:
        """Without CUDA checkpointing, a kernel holding GPU memory must not be dumped: the
        image would lack its GPU memory (preflight: e.g. a driver older than r570)."""
        k = self.kernel
        monitor = k.engine.gpu_monitor()
        if monitor is not None and monitor.available and monitor.usage(pids):
            raise NotCheckpointable(
                "The kernel holds GPU memory but CUDA checkpointing is unavailable: "
                f"{k.engine.cuda_status()[1]}"
            )

    async def _dump(self, from_offload: bool) -> dict[str, Any]:
        k = self.kernel
        if k.remote is not None:
            return await self._dump_at_agent()
        engine = k.engine
        engine.require()
        store = engine.store
        kid = k.kernel_id_str
        t0 = time.monotonic()
        pids = process_tree(k.pid or 0)
        gpu_state = k.gpu_memory.state if from_offload else None
        gpu = await k.engine.cuda_checkpointer()
        if not from_offload and gpu is not None:
            try:
                gpu_state = await gpu.offload(pids, progress=k.gpu_memory.progress) or None
            except CudaStateLeft as e:
                k.gpu_memory.left(e)
                raise
        elif not from_offload:
            self._refuse_unsaved_gpu_memory(pids)
        tmp = None
        try:
            tmp = store.begin(kid)  # a full disk fails here, after the offload: undo it
            base = await asyncio.to_thread(self._base_for, tmp) if engine.keep_base else None
            dumped = await engine.dump(k.pid or 0, tmp, progress=k.machine.set_progress, base=base)
            if k.image_guard is not None:
                k.image_guard(kid, dir_bytes(tmp))
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
        k = self.kernel
        assert k.remote is not None
        t0 = time.monotonic()
        # The agent checkpoints the kernel's GPU memory itself before CRIU runs (its
        # gpu_ops.py), or refuses; its frames name the same GPU phases as here.

        dumped = await k.remote.dump(k.machine.progress_from("dump"))
        # Nothing to cancel from here: the image is the agent's and the process is gone.
        k.process = None
        k.pid = None
        k.tier = "disk"
        k.suspended_at = time.time()
        k.last_suspend_seconds = time.monotonic() - t0
        k.checkpoint_bytes = int(dumped.get("bytes") or 0)
        # What the agent's offload freed, as a root server reports it; the GPU state
        # itself stays in the agent's manifest, which its restore reads.
        k.gpu_memory.state = dict(dumped["gpu"]) if dumped.get("gpu") else None
        k.gpu_memory_freed = int(dumped.get("gpu_memory_freed") or 0)
        k.port_hold.reserve(k.connection_info)
        k.machine.set_state(KernelState.suspended)
        k.log.info(
            "Suspended kernel %s through the checkpoint agent in %.2f s (%d bytes)",
            k.kernel_id,
            k.last_suspend_seconds,
            k.checkpoint_bytes,
        )
        return k.summary()

    def _base_for(self, tmp: Any) -> PageIndex | None:
        """The kernel's kept image, linked into `tmp`, with the index of its pages, for
        the dump to write only what changed; None (a whole image) when there is none, or
        its index is not made yet (it is made while the kernel runs after its resume)."""
        k = self.kernel
        store = k.engine.store
        kid = k.kernel_id_str
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
        if held + next_delta > CHAIN_LIMIT * tree_rss(k.pid or 0):
            k.log.info("Kernel %s: suspended whole, its chain holding %d bytes", kid, held)
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
            k.log.warning("Kernel %s: suspended whole, its base unusable: %s", kid, e)
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
        k = self.kernel
        if tmp is not None:
            k.engine.store.discard(tmp)
        continue_tree(pids | process_tree(k.pid or 0))
        if gpu_state is not None and gpu is not None:
            left = await k.gpu_memory.undo_offload(gpu, gpu_state)
            if left is not None:
                raise SuspendFailed(
                    f"Suspend of kernel {k.kernel_id_str} failed: {error}; {left}"
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
        k = self.kernel
        engine = k.engine
        store = engine.store
        kid = k.kernel_id_str
        t_dumped = time.monotonic()
        committed = False
        try:
            k.machine.set_progress("verify", None, None)
            pid, ports, spec = k.pid or 0, kernel_ports(k.connection_info), k.spec_name()
            suspended_at = time.time()
            record = await k.records.build(suspended_at)

            def commit() -> dict[str, Any]:
                nonlocal committed
                # In a thread, /proc and image reads included: the kernel is frozen.
                try:  # before the checksums: the page maps may change
                    marked = mark_lazy(tmp)
                except (OSError, ImageError, IndexError) as e:
                    # CRIU's own marks still make a working image (a lazy restore that
                    # may read more before the kernel runs): no reason to fail the suspend.
                    k.log.warning("Kernel %s: lazy marks left as CRIU wrote them: %s", kid, e)
                    marked = 0
                try:
                    k.records.hold(record)
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
                k.records.drop()  # no image was committed: a record would promise one
            await self._undo_dump(e, tmp, pids, gpu, gpu_state if not from_offload else None)
            k.log.error("%s", getattr(e, "message", None) or e)
            if isinstance(e, SuspendFailed):
                raise
            raise SuspendFailed(f"Suspend of kernel {kid} failed: {e}") from e
        # The image is safe on disk: only now does the kernel's memory go.
        t_commit = time.monotonic()
        kill_tree(k.pid or 0, k.engine.pidns)
        if k.process is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(k.process.wait, 10)
            k.process = None
        t_killed = time.monotonic()
        k.last_suspend_breakdown = {
            **manifest["timings"],
            "before_dump_s": t_dumped - dumped.seconds - t0,  # GPU offload, dump queue
            "commit_s": t_commit - t_dumped,
            "kill_s": t_killed - t_commit,
            # From CRIU's start (it freezes the tree at once) until the tree is gone.
            "frozen_s": dumped.seconds + t_killed - t_dumped,
        }
        k.port_hold.reserve(k.connection_info)
        if dumped.delta is not None:  # the next suspend's base, unless the image goes
            k.background(
                asyncio.to_thread(_save_index, dumped.delta.index, store.path(kid), manifest)
            )
        k.gpu_memory.state = gpu_state
        k.tier = "disk"
        k.suspended_at = suspended_at
        k.last_suspend_seconds = time.monotonic() - t0
        # What the checkpoint holds on disk: an incremental image with its bases.
        k.checkpoint_bytes = int(manifest.get("held_bytes") or manifest["total_bytes"])
        k.gpu_memory_freed = int((gpu_state or {}).get("bytes_freed", 0))
        k.machine.set_state(KernelState.suspended)
        if dumped.delta is not None:  # a longer chain: compacted in the background if due
            compactor_for(store).schedule(k)
        k.log.info(
            "Suspended kernel %s: %.1f MB in %.2f s",
            kid,
            k.checkpoint_bytes / 1e6,
            k.last_suspend_seconds,
        )
        return k.summary()


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
