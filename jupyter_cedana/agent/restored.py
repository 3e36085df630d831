"""What the agent holds of a kernel it restored: the keeper that stands for it, and the
checks of the restored tree before it runs (CRIU set each task's ids and capabilities
from the image: /proc/PID/status must show the caller's ids, no capabilities in any set,
and no_new_privs)."""

from __future__ import annotations

import asyncio
import subprocess

from ..checkpoint.proctree import group_stopped, process_tree
from .imagecheck import ImageRefused


class Keeper:
    """cedana-init's keeper (a Popen) as the record's asyncio-style process."""

    stdout = None
    stderr = None

    def __init__(self, proc: subprocess.Popen[bytes]):
        self._proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    async def wait(self) -> int:
        return await asyncio.to_thread(self._proc.wait)


def proc_creds(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in (
                "Uid",
                "Gid",
                "CapInh",
                "CapPrm",
                "CapEff",
                "CapBnd",
                "CapAmb",
                "NoNewPrivs",
            ):
                out[key] = value.strip()
    return out


def check_running_as(pid: int, uid: int, gid: int) -> None:
    """Raise unless `pid` runs as uid/gid everywhere, with no capabilities (bounding set
    included), no_new_privs."""
    c = proc_creds(pid)
    ids_ok = c["Uid"].split() == [str(uid)] * 4 and c["Gid"].split() == [str(gid)] * 4
    caps = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
    caps_ok = all(int(c[k], 16) == 0 for k in caps)
    if not (ids_ok and caps_ok and c.get("NoNewPrivs") == "1"):
        raise ImageRefused(f"restored task {pid} runs with {c}")


async def stopped_tree(root: int, timeout: float = 10.0) -> set[int]:
    """The restored tree once CRIU has let go of it (every task stopped)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        pids = process_tree(root)
        if pids and all(group_stopped(p) for p in pids):
            return pids
        if loop.time() > deadline:
            return pids
        await asyncio.sleep(0.005)
