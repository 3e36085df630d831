"""Loaded by the Python of a kernel that runs in its own PID namespace (the provisioner
puts this directory first on the kernel's PYTHONPATH); standalone, since the kernel may
run in another environment, without jupyter_cedana.

The kernel sees the host's /proc while its PIDs are the namespace's: psutil.Process()
(PID 2 in the namespace) is the host's kthreadd there. ipykernel ends "its children in
its process group" at shutdown: it takes every kernel thread of the host for a child,
finds its own threads under those numbers and sends itself SIGTERM before its
shutdown_reply is out. Every ipykernel-based kernel (IPython, wrapper kernels) gets
Kernel._process_children replaced by one that finds the real children through the host
view of /proc/self and signals them by their namespace PIDs.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

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


def _process_children(self: Any) -> list[_Child]:
    return process_group_children()


class _PatchOnImport:
    """Replaces Kernel._process_children once ipykernel.kernelbase is imported (only a
    kernel imports it; every other Python process pays nothing)."""

    TARGET = "ipykernel.kernelbase"

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module.Kernel._process_children = _process_children

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _chain_site_customization() -> None:
    """Run the sitecustomize this one shadows (Debian's Python ships one)."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


sys.meta_path.insert(0, _PatchOnImport())
_chain_site_customization()
