"""The agent's own records of the kernels it launched or restored, per uid.

These records are the only way an op finds a process: a request names a kernel id, and
the id is looked up under the caller's uid. A kernel of another uid, a root process or a
pid the agent did not start is therefore not found, and the answer is the same `not_found`
as for an id that never existed, so that a caller learns nothing about other users.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from . import records
from .output import KernelOutput
from .protocol import AgentError
from .records import Proc, RecordStore

log = logging.getLogger("jupyter_cedana.agent")

LOG_LIMIT = 64 * 1024


class State(enum.Enum):
    running = "running"
    dumping = "dumping"  # CRIU is dumping it: its exit is the dump's, not a crash
    dumped = "dumped"  # no process; an image in the store
    restoring = "restoring"
    exited = "exited"


class KernelLog:
    """The tail of a kernel's stdout and stderr, bounded in memory: a table without a
    state directory (its kernels' output goes through a pipe). The agent's own table
    keeps output in files (output.KernelOutput), which outlive the agent."""

    def __init__(self, limit: int = LOG_LIMIT):
        self.limit = limit
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        while self._size > self.limit:
            first = self._chunks.popleft()
            over = self._size - self.limit
            if len(first) > over:
                self._chunks.appendleft(first[over:])
                self._size -= over
                self.dropped += over
            else:
                self._size -= len(first)
                self.dropped += len(first)

    def tail(self, nbytes: int | None = None) -> bytes:
        data = b"".join(self._chunks)
        return data if nbytes is None else data[-nbytes:] if nbytes > 0 else b""


async def drain(stream: asyncio.StreamReader, log: KernelLog) -> None:
    """Copies a kernel's output pipe into its log until the last writer closes it."""
    while chunk := await stream.read(65536):
        log.feed(chunk)


class KernelProcess(Protocol):
    """What stands for a kernel's life: the agent's child (an asyncio process, or a
    restore's keeper), or after an agent restart a process it watches with a pidfd."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


class Adopted:
    """A kernel's init from before the agent restarted: not the agent's child, so it is
    watched through a pidfd (which, unlike a pid, can never name a later process) and
    its exit status is not known."""

    stdout = None
    stderr = None
    returncode = None

    def __init__(self, proc: Proc):
        self.pid = proc.pid
        self.pidfd = os.pidfd_open(proc.pid)
        if not proc.alive():  # the pid was reused between the check and the open
            os.close(self.pidfd)
            raise ProcessLookupError(proc.pid)
        self.done = asyncio.Event()
        asyncio.get_running_loop().add_reader(self.pidfd, self._exited)

    def _exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self.pidfd)
        self.done.set()

    def send_signal(self, signum: int) -> None:
        if self.done.is_set():
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self.pidfd, signum)

    async def wait(self) -> int:
        await self.done.wait()
        return UNKNOWN_EXIT

    def close(self) -> None:
        if not self.done.is_set():
            asyncio.get_running_loop().remove_reader(self.pidfd)
        with contextlib.suppress(OSError):
            os.close(self.pidfd)


#: What an adopted kernel's wait() gives: its status went to another parent.
UNKNOWN_EXIT = -(2**31)
UNKNOWN_EXIT_NOTE = "it exited while no agent was its parent: its exit status is unknown"
_PERSISTED = frozenset({"state"})


@dataclass(eq=False)
class KernelRecord:
    uid: int
    kernel_id: str
    gid: int
    groups: tuple[int, ...]
    #: Host pid of the namespace's PID 1 (cedana-init's init): what CRIU dumps, and
    #: where signals go (the init forwards them to the kernel's process group).
    init_pid: int
    #: What the kernel's exit is the exit of: cedana-init's watcher after a launch, its
    #: keeper after a restore, the init itself once adopted. None while dumped.
    process: KernelProcess | None
    state: State = State.running
    returncode: int | None = None
    argv: list[str] = field(default_factory=list)
    cwd: str = "/"
    #: The init's private working directory (cedana-init --chdir), root-owned.
    work_dir: str = ""
    log: KernelLog | KernelOutput = field(default_factory=KernelLog)
    #: Held by any op that changes the record's process (signal, dump, restore).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    #: What the agent knows that the state does not say (an unknown exit status, a
    #: suspend of an orphan that failed, a restart of the machine).
    note: str | None = None
    #: What the launching server keeps with the kernel (its name, connection info with
    #: the key, cwd): never read by the agent, returned to the kernel's uid alone.
    meta: dict[str, Any] | None = None
    #: Bytes its images hold on disk (a dumped kernel's chain, a running one's kept base;
    #: kept_bases.py), for `list`; None: none. Not written to the record: read from disk.
    held_bytes: int | None = None
    #: The offload tier (offload_ops.py): its GPU memory's checkpointed state while it
    #: is in the kernel's host memory, the process kept (its state stays `running`).
    offloaded: dict[str, Any] | None = None
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    #: Called after every state change: the table writes the record to disk.
    _sink: Callable[[KernelRecord], None] | None = None
    _procs: dict[int, Proc] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        # The state is set last by every op (the pids before it): one write per change.
        if name in _PERSISTED and getattr(self, "_sink", None) is not None:
            self.save()

    def save(self) -> None:
        if self._sink is not None:
            self._sink(self)

    def persist_to(self, sink: Callable[[KernelRecord], None] | None) -> None:
        """Where the record goes on each change of state (None: nowhere)."""
        self._sink = sink

    def known_as(self, proc: Proc) -> None:
        """`proc` is the kernel's init, with the start time its record gave."""
        self.init_pid = proc.pid
        self._procs[proc.pid] = proc

    @property
    def host_pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def _proc(self, pid: int | None) -> Proc | None:
        """`pid` with its start time, read once per pid (while it surely is ours)."""
        if not pid or pid <= 0:
            return None
        if pid not in self._procs:
            found = Proc.of(pid)
            if found is None:
                return None
            self._procs = {p: v for p, v in self._procs.items() if p in (self.init_pid, pid)}
            self._procs[pid] = found
        return self._procs[pid]

    def to_fields(self) -> dict[str, Any]:
        """The record as written to disk (records.validate)."""
        live = self.state in (State.running, State.dumping, State.restoring)
        init = self._proc(self.init_pid) if live else None
        keeper = self._proc(self.host_pid) if live and self.host_pid != self.init_pid else None
        return {
            "version": records.VERSION,
            "uid": self.uid,
            "kernel_id": self.kernel_id,
            "gid": self.gid,
            "groups": list(self.groups),
            "state": self.state.value,
            "returncode": self.returncode,
            "note": self.note,
            "argv": list(self.argv),
            "cwd": self.cwd,
            "meta": self.meta,
            "boot_id": records.boot_id(),
            "init": init.to_json() if init else None,
            "keeper": keeper.to_json() if keeper else None,
            "since": time.time(),
        }

    def summary(self) -> dict[str, Any]:
        out = {
            "kernel_id": self.kernel_id,
            "state": self.state.value,
            "pid": self.init_pid if self.state in (State.running, State.dumping) else None,
            "returncode": self.returncode,
            "meta": self.meta,
        }
        if self.note:
            out["note"] = self.note
        if self.held_bytes is not None:
            out["held_bytes"] = self.held_bytes
        out.update(self._offload_fields())
        return out

    def _offload_fields(self) -> dict[str, Any]:
        if self.offloaded is None:
            return {}
        return {
            "offloaded": True,
            "gpu_memory_freed": int(self.offloaded.get("bytes_freed") or 0),
        }

    def status(self) -> dict[str, Any]:
        """The `poll` reply: an exited kernel whose status is unknown says so."""
        out: dict[str, Any] = {
            "returncode": self.returncode,
            "state": self.state.value,
            "meta": self.meta,
        }
        if self.state == State.exited and self.returncode is None:
            out["returncode_known"] = False
        if self.note:
            out["note"] = self.note
        out.update(self._offload_fields())
        return out

    def output_target(self) -> int:
        """What the kernel's stdout and stderr are (subprocess's `stdout=`): its output
        file's descriptor, or a pipe to the agent for a table without a state directory."""
        if isinstance(self.log, KernelOutput):
            return self.log.open_writer()
        return asyncio.subprocess.PIPE

    def watch(self, process: KernelProcess) -> None:
        """Makes `process` the kernel's: its exit ends the kernel (unless being dumped)."""
        if isinstance(self.log, KernelOutput):
            self.log.close_writer()  # the kernel has it now
        self.process = process
        self.exited.clear()
        self.returncode = None
        self._spawn(self._wait(process))
        for stream in (getattr(process, "stdout", None), getattr(process, "stderr", None)):
            if stream is not None and isinstance(self.log, KernelLog):
                self._spawn(drain(stream, self.log))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait(self, process: KernelProcess) -> None:
        code = await process.wait()
        if isinstance(process, Adopted):
            process.close()
        if self.process is not process:
            return  # replaced meanwhile (a restore gave the kernel a new keeper)
        self.process = None
        if self.state in (State.running, State.restoring):
            if code == UNKNOWN_EXIT:
                self.returncode = None
                self.note = UNKNOWN_EXIT_NOTE
            else:
                self.returncode = code
            self.state = State.exited
            self.exited.set()
        # dumping: the dump op decides (dumped, or exited if the dump failed and killed it)

    def send_signal(self, signum: int) -> None:
        if self.state != State.running:
            raise AgentError(
                "conflict", f"kernel {self.kernel_id} is {self.state.value}: no process to signal"
            )
        if self.init_pid <= 0:
            raise AgentError("conflict", f"kernel {self.kernel_id} has no process yet")
        if self.offloaded is not None and signum != signal.SIGKILL:
            # As in-process: an offloaded kernel's CUDA calls block; only ending it goes.
            raise AgentError(
                "conflict",
                f"kernel {self.kernel_id} is offloaded: it cannot receive signal "
                f"{signal.Signals(signum).name} until it is reloaded",
            )
        with contextlib.suppress(ProcessLookupError):  # it exited: poll() will say so
            # SIGKILL to PID 1 ends the whole namespace; others are forwarded by the init.
            if isinstance(self.process, Adopted):
                self.process.send_signal(signum)
            else:
                os.kill(self.init_pid, signum)

    async def close(self, kill: bool = True) -> None:
        """Kills the kernel (a stop that ends kernels, or a failed launch) and stops its
        tasks; `kill=False` only lets go of it (an agent stopping for a restart)."""
        process = self.process
        if kill and isinstance(process, Adopted):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
            await process.wait()
        elif kill and process is not None and process.returncode is None:
            for pid in (self.init_pid, process.pid):
                if pid <= 0:
                    continue  # 0 would be the agent's own process group
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await process.wait()
        if isinstance(process, Adopted):
            process.close()
        if isinstance(self.log, KernelOutput):
            self.log.close_writer()
        for task in list(self._tasks):
            task.cancel()


class KernelTable:
    """Records by (uid, kernel_id). Every lookup takes the caller's uid.

    With a state directory, every record is on disk too (records.RecordStore), written
    on each change of state, and each kernel's output is a file (output.KernelOutput)."""

    def __init__(self, max_per_uid: int = 64, state_dir: str | Path | None = None):
        self.max_per_uid = max_per_uid
        self._records: dict[tuple[int, str], KernelRecord] = {}
        self.store = RecordStore(Path(state_dir)) if state_dir is not None else None
        self.output_root = Path(state_dir) / "output" if state_dir is not None else None
        self._watchers: list[Callable[[KernelRecord], None]] = []

    def on_change(self, watcher: Callable[[KernelRecord], None]) -> None:
        """`watcher(record)` after every change of a record's state (and when it is
        added): what else the agent keeps of a kernel follows it (its kept base)."""
        self._watchers.append(watcher)

    def _changed(self, record: KernelRecord) -> None:
        if self._records.get((record.uid, record.kernel_id)) is not record:
            return
        self._save(record)
        for watcher in self._watchers:
            try:
                watcher(record)
            except Exception:
                log.exception("kernel %s: after its change to %s", record.kernel_id, record.state)

    def output_of(self, uid: int, kernel_id: str) -> KernelOutput:
        assert self.output_root is not None
        return KernelOutput(self.output_root / str(int(uid)) / f"{kernel_id}.log")

    def _save(self, record: KernelRecord) -> None:
        if self.store is None or self._records.get((record.uid, record.kernel_id)) is not record:
            return
        try:
            self.store.save(record.to_fields())
        except Exception:
            # The kernel goes on; only an agent restart would lose track of it.
            log.exception("cannot write the record of kernel %s", record.kernel_id)

    def lookup(self, uid: int, kernel_id: str) -> KernelRecord:
        record = self._records.get((uid, kernel_id))
        if record is None:
            raise AgentError("not_found", f"no kernel {kernel_id}")
        return record

    def get(self, uid: int, kernel_id: str) -> KernelRecord | None:
        return self._records.get((uid, kernel_id))

    def for_uid(self, uid: int) -> list[KernelRecord]:
        return [r for (u, _), r in self._records.items() if u == uid]

    def all(self) -> list[KernelRecord]:
        return list(self._records.values())

    def reserve(self, record: KernelRecord) -> None:
        """Adds a record; an id the uid already uses is a conflict."""
        key = (record.uid, record.kernel_id)
        if key in self._records:
            raise AgentError("conflict", f"kernel {record.kernel_id} exists already")
        if len(self.for_uid(record.uid)) >= self.max_per_uid:
            raise AgentError("busy", f"at most {self.max_per_uid} kernels per user")
        self._records[key] = record
        if self.store is not None and isinstance(record.log, KernelLog) and not record.log.tail():
            record.log = self.output_of(record.uid, record.kernel_id)
        record.persist_to(self._changed)
        record.save()

    def remove(self, uid: int, kernel_id: str) -> KernelRecord:
        record = self.lookup(uid, kernel_id)
        del self._records[(uid, kernel_id)]
        record.persist_to(None)
        if self.store is not None:
            self.store.delete(uid, kernel_id)
            if isinstance(record.log, KernelOutput):
                record.log.remove()
        return record

    def transition(self, uid: int, kernel_id: str, expect: set[State], to: State) -> KernelRecord:
        record = self.lookup(uid, kernel_id)
        if record.state not in expect:
            raise AgentError(
                "conflict", f"kernel {kernel_id} is {record.state.value}, not {_names(expect)}"
            )
        record.state = to
        return record

    def mark_dumped(self, uid: int, kernel_id: str) -> KernelRecord:
        """After a dump that ended the kernel's processes: no pid until a restore."""
        record = self.lookup(uid, kernel_id)
        if isinstance(record.process, Adopted):
            record.process.close()
        record.process = None
        record.init_pid = 0
        record.state = State.dumped
        return record

    def mark_restored(
        self,
        uid: int,
        kernel_id: str,
        pid: int,
        process: KernelProcess | None = None,
    ) -> KernelRecord:
        """After a restore: `pid` is the restored init's new host pid, `process` the
        agent's child whose exit is the kernel's (cedana-init --keeper)."""
        record = self.lookup(uid, kernel_id)
        record.init_pid = pid
        record.returncode = None
        record.note = None
        if process is not None:
            record.watch(process)
        record.state = State.running
        return record


def _names(states: set[State]) -> str:
    return " or ".join(sorted(s.value for s in states))
