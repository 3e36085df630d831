"""Kernel PIDs without a PID namespace (a root server with
`CheckpointEngine.use_pid_namespace` off).

CRIU restores every task under the PID and thread id it had, and without a namespace of
its own a kernel shares the host's (or the pod's) PID numbers with everything else. So
at dump time the image records the kernel's task ids (`task_ids`), and before CRIU runs a
restore checks that none is taken (`check_free`), failing with the culprits named
instead of CRIU's "File exists" from deep inside its restorer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from ..errors import ResumeFailed
from .proctree import process_tree

PROC = Path("/proc")


def task_ids(root: int) -> list[int]:
    """Every PID and thread id of the tree under `root`, read while CRIU holds it stopped
    (after a dump with --leave-stopped), so nothing forks or starts a thread meanwhile."""
    ids: set[int] = set()
    for pid in process_tree(root):
        ids.add(pid)
        with contextlib.suppress(OSError):
            ids.update(int(t) for t in os.listdir(PROC / str(pid) / "task"))
    return sorted(ids)


def _holder(tid: int) -> str:
    """Who holds a task id: "1234 (python3, uid 1000)"; /proc/TID resolves thread ids too."""
    try:
        comm = (PROC / str(tid) / "comm").read_text().strip()
        uid = (PROC / str(tid)).stat().st_uid
    except OSError:
        return str(tid)
    return f"{tid} ({comm}, uid {uid})"


def check_free(ids: Iterable[int] | None) -> None:
    """Raise ResumeFailed when any task id the image needs is in use (the image is kept:
    a resume once they have exited succeeds)."""
    taken = [tid for tid in ids or () if (PROC / str(tid)).exists()]
    if not taken:
        return
    shown = ", ".join(_holder(t) for t in taken[:5])
    more = f" and {len(taken) - 5} more" if len(taken) > 5 else ""
    raise ResumeFailed(
        f"PIDs this kernel needs back are in use by other processes: {shown}{more}. "
        "Without a PID namespace (CheckpointEngine.use_pid_namespace is off) a restore "
        "needs its old PIDs and thread ids free; the image is kept, resume again once "
        "they have exited (docs/deployment.md: Root and non-root)."
    )
