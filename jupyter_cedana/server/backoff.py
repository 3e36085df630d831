"""Automatic suspends that fail back off: the policy waits longer after each failure
(exponentially, capped), and a kernel that cannot be checkpointed at all (a refusal that
will not go away by itself) waits for the cap or until the kernel runs code again, instead
of being frozen and dumped at every check. Manual suspends always try.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass
from typing import Any

from traitlets import Float
from traitlets.config import LoggingConfigurable

from ..errors import CedanaError, NotCheckpointable
from ..timestamps import iso

# CRIU refusals that depend on what the kernel holds, not on the moment: retrying before
# the kernel changes gives the same answer (criu/*.c, 4.2).
_PERMANENT = [
    (re.compile(r"Can't dump ghost file"), "it holds a deleted file larger than ghost_limit"),
    (
        re.compile(
            r"External socket is used|half of stream unix connection|name-less external "
            r"socket|Unix socket \d+ (?:without|with unreachable) peer"
        ),
        "it holds a socket connected to a process outside the kernel",
    ),
    (
        re.compile(r"Unsupported (?:type|proto|socket family)|Unknown pair family"),
        "it holds a socket of a kind CRIU cannot checkpoint",
    ),
    (re.compile(r"Can't dump file \d+ of that type"), "it holds a file CRIU cannot checkpoint"),
    (re.compile(r"Unsupported mapping found"), "it maps memory CRIU cannot checkpoint"),
    (re.compile(r"The path \[.*\] is not supported"), "it holds a path CRIU cannot checkpoint"),
]


def not_checkpointable(error: BaseException) -> str | None:
    """Why this kernel cannot be checkpointed as it is, when `error` says so; None for a
    failure that may go away by itself (disk full, timeout, budget, a busy driver)."""
    if isinstance(error, NotCheckpointable):
        return error.message
    message = error.message if isinstance(error, CedanaError) else str(error)
    for pattern, why in _PERMANENT:
        if pattern.search(message):
            return why
    return None


class SuspendBackoff(LoggingConfigurable):
    """When the policy tries again to suspend a kernel whose suspend failed."""

    retry_delay = Float(
        60.0,
        help="Seconds the policy waits before it tries again to suspend a kernel whose "
        "suspend failed; the wait doubles after each further failure, up to "
        "max_retry_delay. Running code in the kernel ends the wait.",
    ).tag(config=True)

    max_retry_delay = Float(
        3600.0,
        help="Longest wait between two automatic suspends of a kernel that keep failing. "
        "A kernel that cannot be checkpointed as it is (e.g. it holds a socket to another "
        "process, or a deleted file over CheckpointEngine.ghost_limit) waits this long, or "
        "until it runs code again, before it is tried again. Manual suspends always try.",
    ).tag(config=True)

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._setbacks: dict[str, Setback] = {}

    def failed(self, kernel_id: str, error: BaseException, activity: dt.datetime | None) -> Setback:
        """Record a failed suspend of a kernel whose last activity was `activity`."""
        now = time.time()
        previous = self._setbacks.get(kernel_id)
        failures = previous.failures + 1 if previous is not None else 1
        why = not_checkpointable(error)
        if why is not None:
            delay = self.max_retry_delay
        else:
            delay = min(self.retry_delay * 2 ** (failures - 1), self.max_retry_delay)
        message = error.message if isinstance(error, CedanaError) else str(error)
        setback = Setback(
            failures=failures,
            reason=message,
            not_checkpointable=why,
            retry_at=now + max(0.0, delay),
            activity=activity,
        )
        self._setbacks[kernel_id] = setback
        return setback

    def succeeded(self, kernel_id: str) -> None:
        self._setbacks.pop(kernel_id, None)

    def forget_except(self, kernel_ids: set[str]) -> None:
        for kid in set(self._setbacks) - kernel_ids:
            del self._setbacks[kid]

    def blocking(self, kernel_id: str, activity: dt.datetime | None) -> Setback | None:
        """The setback that keeps the policy from suspending this kernel now, if any.
        Activity since the failure (the user ran code) ends it: what the kernel holds may
        have changed."""
        setback = self._setbacks.get(kernel_id)
        if setback is None:
            return None
        if activity is not None and (setback.activity is None or activity > setback.activity):
            del self._setbacks[kernel_id]
            return None
        if time.time() >= setback.retry_at:
            return None  # due again; the record stays, so the next failure waits longer
        return setback


@dataclass
class Setback:
    failures: int
    reason: str
    not_checkpointable: str | None  # why, when it will not go away by itself
    retry_at: float
    activity: dt.datetime | None

    def describe(self) -> str:
        left = _duration(self.retry_at - time.time())
        if self.not_checkpointable:
            return (
                f"Not checkpointable: {self.not_checkpointable} ({self.reason}). Automatic "
                f"suspend waits until the kernel runs code again, or {left}"
            )
        times = "once" if self.failures == 1 else f"{self.failures} times"
        return f"Automatic suspend failed {times} ({self.reason}); next try {left}"

    def to_json(self) -> dict[str, Any]:
        return {
            "failures": self.failures,
            "reason": self.reason,
            "not_checkpointable": self.not_checkpointable is not None,
            "retry_at": iso(self.retry_at),
        }


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 90:
        return f"in {s} s"
    if s < 5400:
        return f"in {round(s / 60)} min"
    return f"in {s / 3600:.1f} h"
