"""ipykernel for a kernel in its own PID namespace, run by the kernel's own Python.

The kernel sees the host's /proc while its PIDs are the namespace's: psutil.Process()
(PID 2 in the namespace) is the host's kthreadd there, and ipykernel's shutdown, which
signals "children in its process group", takes every kernel thread of the host for a
child, finds the kernel's own threads under those numbers and sends itself SIGTERM
before its shutdown_reply is out. This finds the kernel's real children through the host
view of /proc/self and signals them by their namespace PIDs.

Standalone on purpose (the kernel may run in another environment, without
jupyter_cedana): the provisioner puts this directory on the kernel's PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from ipykernel.ipkernel import IPythonKernel

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str]:
    text = (PROC / str(pid) / "stat").read_text()
    return text[text.rfind(")") + 2 :].split()  # state, ppid, pgrp, ...


def _namespace_pid(host_pid: int) -> int:
    for line in (PROC / str(host_pid) / "status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return host_pid


class _Child:
    """What ipykernel's _signal_children needs of a psutil.Process."""

    def __init__(self, pid: int):
        self.pid = pid

    def send_signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<child pid={self.pid}>"


def process_group_children() -> list[_Child]:
    """Descendants of this process in its process group, with their namespace PIDs."""
    me = int(os.readlink(PROC / "self"))  # our PID as this /proc numbers it
    parents: dict[int, list[int]] = {}
    for entry in os.listdir(PROC):
        if entry.isdigit():
            try:
                parents.setdefault(int(_stat_fields(int(entry))[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    group = _stat_fields(me)[2]
    found: list[_Child] = []
    todo = list(parents.get(me, []))
    while todo:
        pid = todo.pop()
        todo.extend(parents.get(pid, []))
        try:
            if _stat_fields(pid)[2] == group:
                found.append(_Child(_namespace_pid(pid)))
        except (OSError, IndexError, ValueError):
            continue
    return found


class PidNamespaceIPythonKernel(IPythonKernel):
    def _process_children(self):  # type: ignore[no-untyped-def]
        return process_group_children()
