"""When each kernel's retention began (SuspendPolicy.retention: how long a suspended or
failed kernel is kept before it is shut down), on the boot clock where it can be, so
that a wall clock set forward ends no kernel's retention early."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

from ..checkpoint.store import CheckpointStore
from ..errors import CedanaError
from ..timestamps import Stamp, stamp
from .kernel.provisioner import CedanaProvisioner, KernelState

__all__ = ["RetentionClock"]


class RetentionClock:
    """The start of each kernel's retention, as this server saw it or its image says."""

    def __init__(self, store: Callable[[], CheckpointStore]):
        self._store = store
        # When each kernel's retention began, on the boot clock: (the provisioner's
        # suspended_at it goes with, or None for a failure without one, and the stamp).
        self._since: dict[str, tuple[float | None, Stamp]] = {}

    def since(self, kernel_id: str, prov: CedanaProvisioner) -> Stamp | float | None:
        """When the kernel's retention began: its suspend, or for a failed kernel that
        has none, its failure; on the boot clock where this server saw it or the image's
        manifest says, else on the wall clock alone (policy.suspended_for)."""
        seen = self._since.get(kernel_id)
        if prov.suspended_at:
            if seen is not None and seen[0] == prov.suspended_at:
                return seen[1]
            if prov.tier == "disk":
                with contextlib.suppress(CedanaError, OSError, ValueError):
                    made = self._store().read_manifest(kernel_id).get("created_clock")
                    found = Stamp.from_json(made)
                    if found is not None:
                        self._since[kernel_id] = (prov.suspended_at, found)
                        return found
            return float(prov.suspended_at)
        if prov.state == KernelState.failed and seen is not None and seen[0] is None:
            return seen[1]
        return None

    def note(self, prov: CedanaProvisioner) -> None:
        """A kernel changed state: a suspend or a failure starts its retention now, on
        the boot clock; running again ends it."""
        kid = str(prov.kernel_id)
        seen = self._since.get(kid)
        if prov.state == KernelState.suspended and prov.suspended_at:
            if seen is None or seen[0] != prov.suspended_at:
                self._since[kid] = (prov.suspended_at, stamp())
        elif prov.state == KernelState.failed:
            if prov.suspended_at is None and (seen is None or seen[0] is not None):
                self._since[kid] = (None, stamp())
        elif prov.state == KernelState.running:
            self._since.pop(kid, None)

    def forget_except(self, kernel_ids: Iterable[str]) -> None:
        """Drop what is kept of kernels that are gone."""
        for gone in set(self._since) - set(kernel_ids):
            self._since.pop(gone, None)
