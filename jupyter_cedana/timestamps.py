"""Times as the REST API, the events and the status page show them."""

from __future__ import annotations

import datetime as dt
from typing import overload


@overload
def iso(ts: float) -> str: ...
@overload
def iso(ts: None) -> None: ...
def iso(ts: float | None) -> str | None:
    """Epoch seconds as ISO 8601 text in UTC (None stays None)."""
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc).isoformat()
