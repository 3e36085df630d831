"""Kernel PIDs without a PID namespace (servers not running as root).

CRIU restores every task under the PID and thread id it had, and without a namespace of
its own a kernel shares the host's (or the pod's) PID numbers with everything else. So:

- at dump time the image records the kernel's task ids (`task_ids`), and before CRIU
  runs a restore checks that none is taken (`check_free`), failing with the culprits
  named instead of CRIU's "File exists" from deep inside its restorer;
- kernels are started above a PID base (`KernelPids`), away from the low PIDs that a
  freshly started server and its threads take in a new pod or after a reboot, so a
  parked kernel can be restored there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from traitlets import Integer, Unicode
from traitlets.config import LoggingConfigurable

from .errors import ResumeFailed
from .proctree import process_tree

PROC = Path("/proc")
# Where scripts/grant-criu-caps.sh installs the helper that may write ns_last_pid.
GRANTED_HELPER = "/usr/local/lib/cedana/cedana-pidbase"
# The kernel never hands out PIDs below this after wrapping around (RESERVED_PIDS).
RESERVED_PIDS = 300


def pid_max() -> int:
    try:
        return int((PROC / "sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32768


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
        "Without a PID namespace (the server is not root) a restore needs its old PIDs "
        "and thread ids free; the image is kept, resume again once they have exited "
        "(docs/deployment.md: Root and non-root)."
    )


class KernelPids(LoggingConfigurable):
    """Where new kernels' PIDs start when kernels share the server's PID namespace."""

    pid_base = Integer(
        -1,
        help="Without a PID namespace, start each kernel above this PID (the PID cursor "
        "is raised to it when below, through cedana-pidbase), away from the low PIDs a "
        "freshly started server takes, so a kernel parked in another pod or before a "
        "reboot can be restored under its old PIDs. -1: half of kernel.pid_max; 0: off.",
    ).tag(config=True)

    helper_path = Unicode(
        "",
        help="cedana-pidbase carrying cap_checkpoint_restore (scripts/grant-criu-caps.sh). "
        f"Empty: {GRANTED_HELPER} when present.",
    ).tag(config=True)

    def base(self) -> int:
        if self.pid_base >= 0:
            return self.pid_base
        half = pid_max() // 2
        return half if half > RESERVED_PIDS else 0

    def helper(self) -> str | None:
        path = self.helper_path or GRANTED_HELPER
        return path if os.access(path, os.X_OK) else None

    def launch_args(self) -> list[str]:
        """cedana-init options that start the kernel above the base (none when off or when
        the helper is missing: kernels then take ordinary PIDs)."""
        base, helper = self.base(), self.helper()
        if not base:
            return []
        if helper is None:
            self.log.debug("no cedana-pidbase at %s: kernels take ordinary PIDs", GRANTED_HELPER)
            return []
        return ["--pid-base", str(base), "--pid-helper", helper]
