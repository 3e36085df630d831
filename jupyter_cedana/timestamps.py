"""Times as the REST API, the events and the status page show them, and the clocks that
measure how long a kernel has been suspended.

The wall clock (time.time) can jump: NTP or an admin sets it, and a machine may boot with
it wrong and have it set forward minutes later. Retention deletes images, so it measures
on CLOCK_BOOTTIME, which counts every second since boot (sleep included) and is never
set, and keeps with each suspend time the boot it was taken in (/proc/sys/kernel/random/
boot_id). Only across a reboot is the wall clock the sole measure; policy.suspended_for
says how much of it is believed.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any, Protocol, overload

BOOT_ID = "/proc/sys/kernel/random/boot_id"


@overload
def iso(ts: float) -> str: ...
@overload
def iso(ts: None) -> None: ...
def iso(ts: float | None) -> str | None:
    """Epoch seconds as ISO 8601 text in UTC (None stays None)."""
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).isoformat()


class Clock(Protocol):
    def wall(self) -> float: ...
    def boottime(self) -> float | None: ...
    def boot_id(self) -> str | None: ...


class SuspendClock:
    """The machine's clocks (tests pass their own Clock)."""

    _boot: str | None = None

    def wall(self) -> float:
        return time.time()

    def boottime(self) -> float | None:
        try:
            return time.clock_gettime(time.CLOCK_BOOTTIME)
        except (AttributeError, OSError):
            return None

    def boot_id(self) -> str | None:
        if SuspendClock._boot is None:
            try:
                with open(BOOT_ID) as f:
                    SuspendClock._boot = f.read().strip() or None
            except OSError:
                return None
        return SuspendClock._boot


CLOCK = SuspendClock()


@dataclass(frozen=True)
class Stamp:
    """A moment on the wall clock and, where known, on the boot clock of its boot."""

    wall: float
    boot_id: str | None = None
    boottime: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"wall": self.wall, "boot_id": self.boot_id, "boottime": self.boottime}

    @classmethod
    def from_json(cls, data: Any) -> Stamp | None:
        """A stamp as to_json wrote it; None for anything else."""
        if not isinstance(data, dict):
            return None
        try:
            wall = float(data["wall"])
            boottime = data.get("boottime")
            boot_id = data.get("boot_id")
            return cls(
                wall,
                str(boot_id) if boot_id else None,
                float(boottime) if boottime is not None else None,
            )
        except (KeyError, TypeError, ValueError):
            return None


def stamp(clock: Clock = CLOCK) -> Stamp:
    """Now, on every clock."""
    return Stamp(clock.wall(), clock.boot_id(), clock.boottime())
