"""Process trees and per-process facts from /proc (Linux only).

Used by the provisioner (which processes make up a kernel) and the GPU monitor
(which of them hold a GPU, and under which PIDs other namespaces know them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PROC = Path("/proc")


def _children_from_task_files(pid: int) -> list[int] | None:
    """Children of `pid` from /proc/PID/task/*/children, or None if unsupported.

    That file needs CONFIG_PROC_CHILDREN; it lists children per thread, so read
    every thread (a child forked by a non-main thread is listed only there).
    """
    task_dir = PROC / str(pid) / "task"
    try:
        tids = os.listdir(task_dir)
    except FileNotFoundError:
        return []
    except OSError:
        return None
    kids: list[int] = []
    for tid in tids:
        try:
            text = (task_dir / tid / "children").read_text()
        except FileNotFoundError:
            # either the thread exited or the kernel lacks CONFIG_PROC_CHILDREN
            if not (task_dir / tid).exists():
                continue
            return None
        except OSError:
            return None
        kids.extend(int(x) for x in text.split())
    return kids


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name, from field 3 (the state) on;
    empty if the process is gone. The name may hold spaces and parens: split after the
    last ')'."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2 :].split()


def group_stopped(pid: int) -> bool:
    """Every thread of process `pid` is in its group stop (state T). A process's own
    /proc/PID/stat is its main thread's: after CRIU lets a restored tree go (SIGSTOP), its
    other threads may still be on their way to the stop, and a thread seized for the GPU
    restore (cedana-cuda's thaw) before its stop would stop again after it."""
    try:
        tids = os.listdir(PROC / str(pid) / "task")
    except OSError:
        return False
    for tid in tids:
        try:
            stat = (PROC / str(pid) / "task" / tid / "stat").read_text()
        except OSError:
            continue  # a thread that exited meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()
        if not fields or fields[0] != "T":
            return False
    return bool(tids)


def _ppid_map() -> dict[int, list[int]]:
    """parent pid -> children, by scanning every /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir(PROC):
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def process_tree(pid: int) -> set[int]:
    """`pid` and all its descendants; empty if `pid` does not exist."""
    if not (PROC / str(pid)).exists():
        return set()
    tree = {pid}
    todo = [pid]
    ppid_map: dict[int, list[int]] | None = None
    while todo:
        p = todo.pop()
        kids = None if ppid_map is not None else _children_from_task_files(p)
        if kids is None:
            if ppid_map is None:
                ppid_map = _ppid_map()
            kids = ppid_map.get(p, [])
        for k in kids:
            if k not in tree:
                tree.add(k)
                todo.append(k)
    return tree


def nspids(pid: int) -> list[int]:
    """The `NSpid:` line of /proc/PID/status: the pid in this namespace, then in each
    nested one down to the process's own (e.g. [48213, 1] for PID 1 of a container)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return [pid]


def open_device_files(pid: int, prefix: str = "/dev/nvidia") -> set[str]:
    """Paths starting with `prefix` that `pid` has open (needs ptrace-read access)."""
    found: set[str] = set()
    fd_dir = PROC / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target.startswith(prefix):
            found.add(target)
    return found


_MINOR = re.compile(r"(\d+)$")


def gpu_minor(path: str, prefix: str = "/dev/nvidia") -> int | None:
    """Minor number of a per-GPU device file (/dev/nvidia3 -> 3); None for nvidiactl,
    nvidia-uvm and the like, which every CUDA process opens whatever GPU it uses."""
    rest = path[len(prefix) :] if path.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None
