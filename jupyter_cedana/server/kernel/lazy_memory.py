"""A lazily restored kernel's memory coming in from its image (the resume returns while
it does), what happens when it cannot all come in (the kernel is killed and `failed`, its
image kept, and what it did since its resume is lost), and the image going once the
kernel runs on its own memory.

Composed into the provisioner (as `lazy_memory`: its memory_loaded() and memory_loading
are this one's) and shared with its Resumer (resumer.py), which starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from typing import Any

from ...checkpoint import lazy
from ...checkpoint.crimg import ImageError
from ...checkpoint.incremental import INDEX_NAME, PageIndex
from ...checkpoint.proctree import process_tree
from ...checkpoint.store import MANIFEST
from ...timestamps import iso
from .handle import KernelHandle
from .kernel_tree import gone, kill_tree
from .transitions import KernelState


class LazyMemory:
    def __init__(self, kernel: KernelHandle):
        self.kernel = kernel
        self.loading: asyncio.Future[None] | None = None  # the pages coming in, if any

    def start(self, pages: lazy.PageServer, proc: subprocess.Popen[bytes], pid: int) -> None:
        """A lazily restored kernel runs: its image (and its record) stays until every
        page is in."""
        self.loading = asyncio.ensure_future(self._load(pages, proc, pid))
        self.kernel.records.note_resumed_lazily()

    def image_superseded(self) -> None:
        """The resumed kernel runs on its own memory: its record goes (a server started
        after a crash must not bring back the older state in the image), and so does the
        image unless CheckpointEngine.keep_image_after_resume."""
        k = self.kernel
        k.records.drop()
        if k.engine.keep_base:
            # Indexed while the kernel runs, so that its next suspend need not read it.
            images = k.engine.store.path(k.kernel_id_str)
            k.background(asyncio.to_thread(_index_image, images))
        elif not k.engine.keep_image_after_resume:
            self._discard_image_later()

    def _discard_image_later(self) -> None:
        k = self.kernel
        # The kernel runs already; gigabytes of deletion need not delay its first output.
        doomed = k.engine.store.detach_image(k.kernel_id_str)
        if doomed is not None:
            k.background(asyncio.to_thread(shutil.rmtree, doomed, True))
        k.checkpoint_bytes = 0

    async def _load(self, pages: lazy.PageServer, proc: subprocess.Popen[bytes], pid: int) -> None:
        """Wait for a lazily restored kernel's memory to be in; then the image goes. If
        it cannot all come in, the kernel is killed (it must not run on with wrong or
        missing memory) and goes to `failed`, keeping its image."""
        k = self.kernel
        kid = k.kernel_id_str
        try:
            seconds = await asyncio.shield(pages.done)
        except lazy.KernelExited:
            await pages.stop()  # shut down or crashed meanwhile: nothing to load into
            return
        except BaseException as e:
            restored = process_tree(pid)
            kill_tree(pid, k.engine.pidns)
            await gone(restored)
            await pages.stop()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(proc.wait, 10)
            if k.process is proc:
                k.process = None
            k.port_hold.reserve(k.connection_info)
            cause = getattr(e, "message", None) or str(e) or type(e).__name__
            k.log.error("Kernel %s killed, its image kept: %s", kid, cause)
            if k.state == KernelState.running:
                k.work_lost_after = k.work_lost_after or k.resumed_at
                k.machine.set_state(KernelState.failed, reason=self.lost(cause))
            return
        finally:
            self.loading = None
        k.last_memory_in_at = pages.started + seconds
        k.work_lost_after = None
        await pages.stop()
        k.log.info(
            "Kernel %s: all %.1f MB of its memory in, %.2f s after the page server started",
            kid,
            pages.bytes_done / 1e6,
            seconds,
        )
        self.image_superseded()

    def lost(self, cause: str) -> str:
        """The reason of a kernel whose lazy restore failed after it ran."""
        k = self.kernel
        return (
            "The kernel failed while its memory was being restored, and was stopped: "
            f"{cause.rstrip('.')}. What it did after its resume at "
            f"{iso(k.work_lost_after)} is lost; its checkpoint taken at "
            f"{iso(k.image_taken_at)} is kept, and the next resume goes back to it."
        )

    def rolled_back(self) -> str | None:
        """The reason of a kernel resumed from the image a failed lazy restore kept."""
        k = self.kernel
        if k.work_lost_after is None:
            return None
        return (
            f"Resumed from its checkpoint taken at {iso(k.image_taken_at)}: what it "
            f"did after its resume at {iso(k.work_lost_after)} was lost (its memory "
            "could not all be restored then)."
        )

    async def loaded(self) -> None:
        """Returns once a lazily restored kernel's memory is all in (at once otherwise).
        A suspend waits for it: the image being loaded goes away then, and a new dump
        must not go with it."""
        if self.loading is not None:
            await asyncio.shield(self.loading)

    def failed_at_agent(self, cause: str) -> None:
        """The agent stopped the kernel, its memory not all restored, and kept its image:
        as a failed lazy restore here, the kernel is `failed` and the next cell resumes
        it from that image."""
        k = self.kernel
        k.process = None
        k.pid = None
        k.port_hold.reserve(k.connection_info)
        k.work_lost_after = k.work_lost_after or k.resumed_at
        k.log.error("Kernel %s killed by the checkpoint agent: %s", k.kernel_id, cause)
        k.machine.set_state(KernelState.failed, reason=self.lost(cause))


def _index_image(images: Any) -> None:
    """The index of a kept image's pages (incremental.py), saved in it; an image that
    went meanwhile, or cannot be read, leaves the next suspend whole."""
    with contextlib.suppress(OSError, ImageError):
        if (images / MANIFEST).is_file() and not (images / INDEX_NAME).exists():
            PageIndex.of_image(images).save()
