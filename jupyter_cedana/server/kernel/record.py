"""The park record a kernel holds (parkrecords.py: what the next server needs to adopt
it), locked for as long as this server owns the kernel: from before its image is
committed until the image goes (resumed, shut down); for a kernel at the checkpoint
agent, for as long as the server holds it."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from traitlets import TraitError

from ...checkpoint.parkrecords import RECORD_FORMAT, HeldRecord, server_facts
from ...checkpoint.store import CheckpointStore

Builder = Callable[[float | None], Awaitable[dict[str, Any]]]


class RecordHolder:
    """One kernel's record: written, rewritten, handed over or removed."""

    def __init__(
        self, store: Callable[[], CheckpointStore], build: Builder, log: Any, kernel_id: Any
    ):
        self._store = store
        self._build = build
        self.log = log
        self.kernel_id = kernel_id
        self._record: HeldRecord | None = None
        # The kernel was shut down: no record of it may be written again (until a launch
        # or an adoption makes it a kernel again).
        self.closed = False

    async def build(self, suspended_at: float | None = None) -> dict[str, Any]:
        """The record's content as of now (the provisioner knows it)."""
        return await self._build(suspended_at)

    @property
    def held(self) -> HeldRecord | None:
        return self._record if self._record is not None and self._record.held else None

    def hold(self, record: dict[str, Any]) -> HeldRecord:
        """Write the kernel's record (or new content for it) and keep its lock; on
        failure (e.g. ENOSPC) the previous record, if any, stays as it was."""
        held = self.held
        if held is not None:
            held.replace(record)
            return held
        self._record = HeldRecord.create(self._store(), record)
        return self._record

    def take(self, held: HeldRecord) -> None:
        """Adoption: this kernel's record, locked by the adopting server, is this one's."""
        if self._record is not None and self._record is not held:
            self._record.release()
        self._record = held

    def release(self) -> None:
        """Parked: the record stays for the next server, which takes its lock."""
        if self._record is not None:
            self._record.release()
            self._record = None

    def note_resumed_lazily(self) -> None:
        """The kernel runs while its memory comes in from the image, which stays (with
        its record) until then: if the server dies meanwhile, the next one brings back
        the image, and must say that what the kernel did since this resume is lost."""
        held = self.held
        if held is None:
            return
        try:
            record = json.loads(held.path.read_text())
            record["resumed_at"] = time.time()
            held.replace(record)  # on the event loop: no transition can interleave
        except (OSError, ValueError) as e:
            self.log.warning(
                "Kernel %s: could not note its resume in its record: %s", self.kernel_id, e
            )

    async def keep_at_agent(self) -> None:
        """A kernel at the checkpoint agent: hold its record as of now, unless closed.
        A failure is logged, and the kernel runs on."""
        if self.closed:
            return
        try:
            self.hold(await self.build())
        except Exception as e:
            self.log.warning(
                "Kernel %s: its record could not be written (%s): a server killed now "
                "would not find it at the checkpoint agent again",
                self.kernel_id,
                e,
            )

    def close(self) -> None:
        """The kernel is shut down: its record goes, and no other is written."""
        self.closed = True
        self.drop()

    def drop(self) -> None:
        """The image is gone or superseded (resumed, shut down): so is the record."""
        if self._record is not None:
            try:
                self._record.remove()
            except OSError as e:
                self.log.warning("Kernel %s: could not remove its record: %s", self.kernel_id, e)
            self._record = None


async def adoption_record(
    km: Any,
    connection_info: dict[str, Any],
    provisioner: dict[str, Any],
    *,
    kernel_id: str,
    kernel_name: str | None,
    cwd: Any,
    at_agent: bool,
    suspended_at: float | None,
) -> dict[str, Any]:
    """What the next server needs to adopt a kernel (parkrecords.py): its manager `km`'s
    facts, its connection info (the key as text), and what its provisioner saves
    (get_provisioner_info)."""
    provisioner = dict(provisioner)
    provisioner.pop("connection_info", None)  # saved once, with the key as text
    if suspended_at is not None:
        provisioner["cedana_suspended_at"] = suspended_at
    last = None
    with contextlib.suppress(TraitError):  # unset while the kernel is being launched
        last = getattr(km, "last_activity", None)
    facts = await server_facts(kernel_id)
    return {
        "format": RECORD_FORMAT,
        "kernel_id": kernel_id,
        "kernel_name": kernel_name,
        "connection_info": connection_info,
        "provisioner": {"name": "cedana-provisioner", **provisioner},
        "last_activity": last.isoformat() if isinstance(last, dt.datetime) else None,
        "execution_state": getattr(km, "execution_state", None),
        "cwd": str(cwd) if cwd else None,
        "parked_at": time.time(),
        # Its kernel (running, or its image) is at the checkpoint agent, not here.
        "agent": at_agent,
        **facts,
    }
