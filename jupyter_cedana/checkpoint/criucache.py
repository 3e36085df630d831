"""Where CRIU keeps what it learns about the running Linux kernel.

Every CRIU run first probes the kernel's features (memfd, userfaultfd, TCP repair, mount
and network namespaces...): about 30 ms of every dump and every restore on our machines.
CRIU keeps the answers between runs only in a file on a tmpfs, so that they are gone
after a reboot: /run/criu.kdat for the root CRIU that a root server runs. Where /run is
not a tmpfs (many containers), every run probes again; CRIU 4.2 then also leaves its
temporary file behind, and says nothing more.

Only the host can mend that (a tmpfs on /run; docs/deployment.md), so the server says so
once at start and in /status.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT_DIR = "/run"
CACHE = "criu.kdat"
STALE_TMP_S = 60.0  # CRIU writes the file in microseconds


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str, str] | None:
    """The mount that holds `path`: (mount point, file system type, source); None if
    unknown."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    found: tuple[str, str, str] | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = _unescape(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        # Later lines are mounts on top of earlier ones at the same point.
        if inside and (found is None or len(point) >= len(found[0])):
            found = (point, tail[0], tail[1])
    return found


def fs_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The file system type of the mount that holds `path` (None if unknown)."""
    found = mount_of(path, mountinfo)
    return found[1] if found else None


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def problem(where: str = ROOT_DIR) -> str | None:
    """Why CRIU probes the kernel again on every run, keeping its probe in `where` (None:
    it keeps it)."""
    kind = fs_type(where)
    if kind != "tmpfs":
        return f"{where} is {kind or 'of an unknown file system'}, not a tmpfs"
    # CRIU writes the cache as NAME.tmp and renames it; a CRIU killed in between leaves
    # the .tmp, and every later CRIU, finding it, leaves the cache unwritten (it takes
    # the file for another CRIU's, writing at the same moment).
    cache, tmp = os.path.join(where, CACHE), os.path.join(where, CACHE + ".tmp")
    try:
        age = time.time() - os.stat(tmp).st_mtime
    except OSError:
        return None
    if age > STALE_TMP_S and not os.path.exists(cache):
        return f"{tmp}, left by an interrupted CRIU run, keeps CRIU from writing {cache}"
    return None
