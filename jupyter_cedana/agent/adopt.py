"""A starting agent owns again the kernels its predecessor recorded (records.py).

For each record that checks out (the others are kept aside by RecordStore.load):

- running: re-owned if its init still lives (same pid, same start time, same boot) and
  is what the agent launched: cedana-init, PID 1 of a namespace of its own, working in
  this kernel's private directory, its tasks running as the record's uid. Watched with a
  pidfd from then on; its exit status, if it ends, is not known (another process is its
  parent). An init that is gone makes the kernel exited, status unknown; one that is
  there but is not ours makes the record refused (kept aside, never acted on).
- dumped: restorable while its image is in the store; without one it is reported.
- dumping (the agent stopped in the middle of a dump): once nothing traces the tree any
  more (a CRIU still running finishes first), the dump counts if its image was
  committed (the tree is then ended, as the dump would have), else the kernel runs on
  (CRIU leaves it stopped: it is continued) and the partial image is removed.
- restoring (stopped in the middle of a launch or a restore): whatever was started in
  the kernel's directory is ended; the image, if any, stays restorable.
- exited: kept for `poll` and `release`.

After a reboot (another boot id) no recorded process exists any more: running kernels
are reported exited ("the machine restarted"), images stay restorable.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import select
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from ..checkpoint.proctree import process_tree
from .imagestore import ImageStore
from .kernels import Adopted, KernelRecord, KernelTable, State
from .records import Proc, boot_id, start_time

log = logging.getLogger("jupyter_cedana.agent")
#: How long a CRIU left running by the previous agent may keep tracing a tree.
TRACE_WAIT = 120.0
REBOOTED = "the machine restarted while it ran"


class NotOurs(Exception):
    """A recorded pid that is alive but is not the kernel the record says."""


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (ln.partition(":") for ln in f)}


def check_identity(record: KernelRecord, init: Proc, init_binary: str) -> None:
    """Raise NotOurs unless `init` is this kernel's init as the agent launched it."""
    pid = init.pid
    try:
        exe = os.path.realpath(f"/proc/{pid}/exe")
        cwd = os.readlink(f"/proc/{pid}/cwd")
        nspid = _status(pid).get("NSpid", "").split()
    except OSError as e:
        raise NotOurs(f"pid {pid} cannot be inspected: {e.strerror}") from None
    if exe != os.path.realpath(init_binary):
        raise NotOurs(f"pid {pid} runs {exe}, not {init_binary}")
    if cwd != record.work_dir:
        raise NotOurs(f"pid {pid} works in {cwd}, not the kernel's {record.work_dir}")
    if len(nspid) < 2 or nspid[-1] != "1":
        raise NotOurs(f"pid {pid} is not the init of a PID namespace of its own")
    if record.uid != 0:
        for task in process_tree(pid) - {pid}:
            with contextlib.suppress(OSError):
                uids = _status(task)["Uid"].split()
                if any(int(u) != record.uid for u in uids):
                    raise NotOurs(f"task {task} under pid {pid} runs as uid {uids[0]}")
    if not init.alive():
        raise NotOurs(f"pid {pid} changed while it was inspected")


def inits_in(work_dir: str) -> list[int]:
    """Every namespace init working in `work_dir` (root's private directory of one
    kernel): what a launch or a restore cut short left behind."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{entry}/cwd") != work_dir:
                continue
            nspid = _status(int(entry)).get("NSpid", "").split()
            if len(nspid) >= 2 and nspid[-1] == "1":
                found.append(int(entry))
    return found


def end(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL to a namespace init, and its exit waited for (its namespace goes with it)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], timeout)  # readable once it has exited
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def _traced(pids: set[int]) -> bool:
    for pid in pids:
        with contextlib.suppress(OSError):
            if _status(pid).get("TracerPid", "0") != "0":
                return True
    return False


def _remove_partial_dumps(images: Path, kernel_id: str) -> None:
    """Dumps in progress of this kernel whose writer is gone (its lock can be taken)."""
    if not images.is_dir():
        return
    for entry in images.iterdir():
        if not entry.name.startswith(f".{kernel_id}.tmp-"):
            continue
        with contextlib.suppress(OSError):
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(entry, ignore_errors=True)
            finally:
                os.close(fd)


class Adopter:
    def __init__(self, table: KernelTable, state_dir: Path, init_binary: str):
        assert table.store is not None
        self.table = table
        self.store = table.store
        self.images = ImageStore(state_dir)
        self.kernels_dir = state_dir / "kernels"
        self.init_binary = init_binary
        self.boot = boot_id()

    def _image(self, uid: int, kernel_id: str) -> dict[str, Any] | None:
        store = self.images.for_uid(uid)
        if not store.exists(kernel_id):
            return None
        try:
            return store.read_manifest(kernel_id)
        except Exception:
            return {}  # there, unreadable: the restore's checks will say why

    async def run(self) -> None:
        for fields in self.store.load():
            try:
                await self._adopt(fields)
            except Exception:
                log.exception("kernel %s of uid %s not adopted", fields["kernel_id"], fields["uid"])

    async def _adopt(self, f: dict[str, Any]) -> None:
        uid, kid = f["uid"], f["kernel_id"]
        record = KernelRecord(
            uid=uid,
            kernel_id=kid,
            gid=f["gid"],
            groups=tuple(f["groups"]),
            init_pid=0,
            process=None,
            state=State.exited,
            returncode=f["returncode"],
            argv=f["argv"],
            cwd=f["cwd"],
            work_dir=str(self.kernels_dir / str(uid) / kid),
            note=f["note"],
            meta=f.get("meta"),
        )
        record.log = self.table.output_of(uid, kid)
        state = f["state"]
        init = Proc(**f["init"]) if f["init"] else None
        gone = "it ended while no agent was running: its exit status is unknown"
        if f["boot_id"] != self.boot and state in ("running", "dumping"):
            init, record.note = None, REBOOTED
            state = "exited" if state == "running" else state
        try:
            if state in ("running", "dumping") and init is not None and init.alive():
                check_identity(record, init, self.init_binary)
                if state == "running":
                    return self._own(record, init)
                if await self._finish_dump(record, init, f["since"]):
                    return
        except NotOurs as e:
            self.store.refuse(self.store.path(uid, kid), f"not adopted: {e}")
            return
        if state == "restoring":
            # A launch or restore cut short: what it started is nobody's.
            for pid in inits_in(record.work_dir):
                end(pid)
        image = self._image(uid, kid)
        if state in ("dumped", "dumping", "restoring") and image is not None:
            record.state = State.dumped
        elif state == "running":
            record.note = gone
        elif state == "dumping":
            record.note = "it ended in the middle of a dump, which left no image"
        elif state == "restoring":
            record.note = "the agent stopped while starting it"
        elif state == "dumped":
            record.note = "its image is missing"
        record.exited.set()
        self._add(record)

    def _add(self, record: KernelRecord) -> None:
        self.table.reserve(record)  # and written back: states and notes as now known
        log.info(
            "kernel %s of uid %d: %s%s",
            record.kernel_id,
            record.uid,
            record.state.value,
            f" ({record.note})" if record.note else "",
        )

    def _own(self, record: KernelRecord, init: Proc) -> None:
        try:
            process = Adopted(init)
        except ProcessLookupError:
            record.note = "it ended while no agent was running: its exit status is unknown"
            record.exited.set()
            return self._add(record)
        record.known_as(init)
        record.state = State.running
        record.watch(process)
        self._add(record)

    async def _finish_dump(self, record: KernelRecord, init: Proc, since: float) -> bool:
        """A dump the previous agent did not finish. True if the kernel runs on."""
        deadline = time.monotonic() + TRACE_WAIT
        while _traced(process_tree(init.pid)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        image = self._image(record.uid, record.kernel_id)
        tree = process_tree(init.pid)
        if image is not None and float(image.get("created") or 0) >= since:
            # Committed: the image is the kernel, as the dump would have left it.
            if init.alive():
                end(init.pid)
            return False
        _remove_partial_dumps(self.images.root / str(record.uid), record.kernel_id)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if start_time(init.pid) != init.start:
            return False
        self._own(record, init)
        return True
