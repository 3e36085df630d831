"""How much host memory a process may still take before the OOM killer acts: the
machine's MemAvailable, and the limit of every cgroup above the process (cgroup v2
memory.max - memory.current; v1 memory.limit_in_bytes - memory.usage_in_bytes).

The GPU offload moves a kernel's device memory into that kernel's host memory, so it
must fit there first (see CudaCheckpointer.host_memory_headroom_bytes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_UNLIMITED = 1 << 62  # v1 reports "no limit" as a huge page-rounded number


@dataclass
class HostRoom:
    bytes: int  # what the process may still allocate: the tightest of the limits below
    source: str  # which limit that is, in words


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes, or None when /proc/meminfo does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mounts(mountinfo: Path) -> tuple[Path | None, Path | None]:
    """Mount points of the cgroup v2 hierarchy and of the v1 memory controller."""
    v2 = v1 = None
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, extra = left.split(), right.split()
        if len(fields) < 5 or not extra:
            continue
        if extra[0] == "cgroup2" and v2 is None:
            v2 = Path(fields[4])
        elif extra[0] == "cgroup" and "memory" in extra[-1].split(",") and v1 is None:
            v1 = Path(fields[4])
    return v2, v1


def _cgroup_paths(pid: int, proc: Path) -> tuple[str | None, str | None]:
    """The process's cgroup path in the v2 hierarchy and in the v1 memory hierarchy."""
    v2 = v1 = None
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _limits(root: Path, rel: str, max_name: str, cur_name: str) -> list[tuple[int, str]]:
    """(room, description) for the cgroup at `rel` and each of its ancestors with a limit."""
    out = []
    parts = [p for p in rel.split("/") if p]
    for depth in range(len(parts), -1, -1):
        d = root.joinpath(*parts[:depth])
        limit, used = _read_int(d / max_name), _read_int(d / cur_name)
        if limit is None or used is None or limit >= _UNLIMITED:
            continue
        name = "/" + "/".join(parts[:depth])
        out.append(
            (
                max(0, limit - used),
                f"cgroup {name} ({max_name} {limit / 2**30:.2f} GiB, "
                f"{used / 2**30:.2f} GiB in use)",
            )
        )
    return out


def host_room(
    pid: int | None = None,
    proc: Path = Path("/proc"),
    cgroup_root: Path | None = None,
    meminfo: Path | None = None,
) -> HostRoom | None:
    """The room host memory has for `pid` (default: this process), or None when nothing
    says (no meminfo, no limits). `cgroup_root` replaces the mount points found in
    /proc/self/mountinfo (a directory laid out like the v2 hierarchy), `meminfo` the
    /proc/meminfo read for MemAvailable."""
    pid = os.getpid() if pid is None else pid
    candidates: list[tuple[int, str]] = []
    avail = mem_available(meminfo or proc / "meminfo")
    if avail is not None:
        candidates.append((avail, "MemAvailable of the machine"))
    v2_rel, v1_rel = _cgroup_paths(pid, proc)
    v2_mount: Path | None
    v1_mount: Path | None
    if cgroup_root is not None:
        v2_mount, v1_mount = cgroup_root, None
    else:
        v2_mount, v1_mount = _mounts(proc / "self" / "mountinfo")
    if v2_mount is not None and v2_rel is not None:
        candidates += _limits(v2_mount, v2_rel, "memory.max", "memory.current")
    if v1_mount is not None and v1_rel is not None:
        candidates += _limits(v1_mount, v1_rel, "memory.limit_in_bytes", "memory.usage_in_bytes")
    if not candidates:
        return None
    room, source = min(candidates)
    return HostRoom(room, source)
