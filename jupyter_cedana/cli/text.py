"""What `jupyter cedana` prints: sizes, durations and tables for people, JSON for
machines."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from typing import Any


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.0f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*$")


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '15m', '2h' or '1d'."""
    m = _DURATION_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration (seconds, or a number with s, m, h or d)"
        )
    factor = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    return float(m.group(1)) * factor


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int = 0) -> str:
    """Left-aligned columns; the last column is cut to `width` when one is given."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)]
        line = "  ".join([*cells, str(row[-1])]).rstrip()
        if width and len(line) > width:
            line = line[: max(width - 1, 0)] + "…"
        lines.append(line)
    return "\n".join(lines)


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))
