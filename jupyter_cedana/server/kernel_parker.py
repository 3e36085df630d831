"""Parking one kernel of a stopping server (parking.py runs these steps for all of its
kernels, a few at a time, within KernelParking.deadline): a running or GPU-offloaded
kernel is dumped into a committed image, its record brought up to date, and the kernel
taken out of the server; a kernel being restored when the deadline comes goes back to
the checkpoint it was restored from.

Once a kernel's image is committed its process is gone and the image is its only copy:
from there on nothing cancels its parking, and nothing deletes the image because its
record could not be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from ..checkpoint.dumping import tree_rss
from ..errors import Conflict, SuspendFailed
from ..timestamps import iso
from .kernel.provisioner import CedanaProvisioner, KernelState
from .limits import estimate_image_bytes, gpu_bytes

__all__ = ["GIVEN_BACK", "IMAGE_KEPT", "KernelParker"]

# What a parking returns, besides "parked", when the kernel is out of the server all the
# same: its image kept without a record (no server can adopt it), or the kernel back at
# the checkpoint it was being restored from.
IMAGE_KEPT = "image kept, no record"
GIVEN_BACK = "parked at its checkpoint"


class KernelParker:
    """Parks the kernels of one server's SuspendManager as it stops, one call per kernel."""

    def __init__(self, manager: Any, log: Any):
        self.manager = manager
        self.mkm = manager.kernel_manager
        self.store = manager.engine.store
        self.log = log

    async def park(
        self,
        kid: str,
        km: Any,
        prov: CedanaProvisioner,
        slots: asyncio.Semaphore,
        recording: set[str],
    ) -> str:
        """Park one kernel: "parked" or IMAGE_KEPT. Until its image is committed a
        failure or a cancel leaves it running as it was; then it joins `recording`."""
        t0 = time.monotonic()
        try:
            if not self.on_disk(kid, prov):
                async with slots:
                    await self._to_disk(kid, km, prov)
        except asyncio.CancelledError:
            if not self.on_disk(kid, prov):
                raise
            # The deadline came just as the image was committed: park it all the same.
        # The kernel's only copy is its image now: no cancelling from here on.
        recording.add(kid)
        kept = await self._update_record(kid, prov)
        self._detach(kid, km, prov)
        if not kept:
            return IMAGE_KEPT
        self.log.info(
            "jupyter-cedana: parked kernel %s (%.1f MB image) in %.2f s",
            kid,
            prov.checkpoint_bytes / 1e6,
            time.monotonic() - t0,
        )
        return "parked"

    async def give_back(self, kid: str, km: Any, prov: CedanaProvisioner, late: str) -> str | None:
        """A kernel being restored from its image when the deadline came: its image and
        record are complete, so it is parked as it was at that checkpoint, rather than
        shut down with its image deleted. A whole restore is abandoned (the kernel has
        not run since its suspend: nothing is lost); a kernel whose memory was still
        coming in (a lazy restore) is stopped, and what it did since its resume is lost.
        The outcome, or None when the kernel has no complete image to go back to."""
        if prov.transition_in_flight == "resume" and self.store.exists(kid):
            await prov.abort_transition("the server is stopping")  # back to suspended
            if not self.on_disk(kid, prov):
                return None
            self.log.info("jupyter-cedana: kernel %s: its restore was abandoned: %s", kid, late)
            return await self.park(kid, km, prov, asyncio.Semaphore(1), set())
        loading = prov.memory_loading
        if loading is None or prov.records.held is None or not self.store.exists(kid):
            return None
        resumed = prov.resumed_at
        # The load kills the kernel and keeps its image (state failed), with this reason.
        loading.cancel("the server stopped before its memory was all in")
        with contextlib.suppress(BaseException):
            await loading
        if not self.on_disk(kid, prov):
            return None
        taken = self.store.read_manifest(kid).get("created")
        try:
            record = await prov.record()
            # The next server says what was lost (adoption.py: _rolled_back).
            record["resumed_at"] = resumed
            await asyncio.to_thread(prov.records.hold, record)
        except Exception as e:
            self.log.warning(
                "jupyter-cedana: kernel %s: its record could not be brought up to date (%s); "
                "it is parked with the record written when it was resumed",
                kid,
                e,
            )
        self._detach(kid, km, prov)
        what = (
            f"{GIVEN_BACK} ({late} while its memory was coming in from its image): it was "
            f"stopped, and its image and record are kept; the next server gives it back as "
            f"it was at its checkpoint taken at {iso(taken)}, and what it did after its "
            f"resume at {iso(resumed)} is lost"
        )
        self.log.warning("jupyter-cedana: kernel %s %s", kid, what)
        return what

    async def _update_record(self, kid: str, prov: CedanaProvisioner) -> bool:
        """Bring the record of a kernel on disk up to date (sessions, replies, last
        activity); False when it has no record and none could be written (its image is
        kept all the same). Never a reason to delete the image."""
        try:
            record = await prov.record()
            await asyncio.to_thread(prov.records.hold, record)
            return True
        except Exception as e:
            error = e
        image = self.store.path(kid)
        if prov.records.held is not None:
            self.log.warning(
                "jupyter-cedana: kernel %s: its record could not be brought up to date (%s); "
                "it is parked with the record written when it was suspended (sessions and "
                "replies as they were then)",
                kid,
                error,
            )
            return True
        why = (
            f"its image is kept at {image}, but its record could not be written ({error}): "
            "no server can adopt it; free space on the checkpoint disk and see "
            "'jupyter cedana gc' for the image"
        )
        self.log.error("jupyter-cedana: kernel %s not parked: %s", kid, why)
        prov.note_reason(why)
        return False

    def dump_cost(self, kid: str, prov: CedanaProvisioner) -> int:
        """Bytes a kernel's parking must write: none for an image already on disk."""
        if self.on_disk(kid, prov):
            return 0
        return tree_rss(prov.pid) if prov.pid else 0

    def on_disk(self, kid: str, prov: CedanaProvisioner) -> bool:
        """Whether the kernel's whole state is in a committed image, with no process (a
        failed resume keeps its image: it is parked as it is)."""
        at_rest = (prov.state == KernelState.suspended and prov.tier == "disk") or (
            prov.state == KernelState.failed
        )
        image = prov.holds_image if prov.remote is not None else self.store.exists(kid)
        return at_rest and prov.transition_in_flight is None and image

    async def _to_disk(self, kid: str, km: Any, prov: CedanaProvisioner) -> None:
        """Dump a running or GPU-offloaded kernel into a committed image, its disk
        reserved first in the checkpoint budget as the policy's suspends do (a suspend in
        flight reserved its own)."""
        manager = self.manager
        manager.provisioner_of(km)  # the budget's check of the image before its commit
        reserve = prov.transition_in_flight is None
        if reserve:
            pid = prov.pid or 0
            manager.budget.reserve(
                kid, estimate_image_bytes(pid, gpu_bytes(pid, manager.gpu_monitor, 0))
            )
        try:
            await prov.suspend("disk")  # waits for a transition in flight first
        except Conflict:
            if not self.on_disk(kid, prov):
                raise
        finally:
            if reserve:
                manager.budget.release(kid)
        if not self.on_disk(kid, prov):
            raise SuspendFailed(f"kernel {kid} has no image after its suspend ({prov.state})")

    def _detach(self, kid: str, km: Any, prov: CedanaProvisioner) -> None:
        """Take a parked kernel out of the server, so that the shutdown of the remaining
        kernels neither restarts, kills nor deletes anything of it."""
        mkm = self.mkm
        km.stop_restarter()
        for step in (mkm.stop_watching_activity, mkm.stop_buffering):
            with contextlib.suppress(Exception):
                step(kid)
        mkm.remove_kernel(kid)
        with contextlib.suppress(Exception):
            km.cleanup_connection_file()
        prov.port_hold.release()
        prov.records.release()  # for the next server to take
