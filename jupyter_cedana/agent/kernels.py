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
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from .protocol import AgentError

LOG_LIMIT = 64 * 1024


class State(enum.Enum):
    running = "running"
    dumping = "dumping"  # CRIU is dumping it: its exit is the dump's, not a crash
    dumped = "dumped"  # no process; an image in the store
    restoring = "restoring"
    exited = "exited"


class KernelLog:
    """The tail of a kernel's stdout and stderr, bounded in memory.

    A pipe drained here rather than a file: a regular file the kernel writes that grows
    after a dump makes CRIU refuse the restore ("has bad size").
    """

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


@dataclass(eq=False)
class KernelRecord:
    uid: int
    kernel_id: str
    gid: int
    groups: tuple[int, ...]
    #: Host pid of the namespace's PID 1 (cedana-init's init): what CRIU dumps, and
    #: where signals go (the init forwards them to the kernel's process group).
    init_pid: int
    #: The agent's child whose exit is the kernel's: cedana-init's watcher after a
    #: launch, its keeper after a restore. None while dumped.
    process: asyncio.subprocess.Process | None
    state: State = State.running
    returncode: int | None = None
    argv: list[str] = field(default_factory=list)
    cwd: str = "/"
    #: The init's private working directory (cedana-init --chdir), root-owned.
    work_dir: str = ""
    log: KernelLog = field(default_factory=KernelLog)
    #: Held by any op that changes the record's process (signal, dump, restore).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def host_pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def summary(self) -> dict[str, Any]:
        return {
            "kernel_id": self.kernel_id,
            "state": self.state.value,
            "pid": self.init_pid if self.state in (State.running, State.dumping) else None,
            "returncode": self.returncode,
        }

    def watch(self, process: asyncio.subprocess.Process) -> None:
        """Makes `process` the kernel's: its exit ends the kernel (unless being dumped)."""
        self.process = process
        self.exited.clear()
        self.returncode = None
        self._spawn(self._wait(process))
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                self._spawn(drain(stream, self.log))

    def attach_output(self, stream: asyncio.StreamReader) -> None:
        """Drains another pipe into the log (a restored kernel's inherited stdout)."""
        self._spawn(drain(stream, self.log))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait(self, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self.process is not process:
            return  # replaced meanwhile (a restore gave the kernel a new keeper)
        self.process = None
        if self.state in (State.running, State.restoring):
            self.state = State.exited
            self.returncode = code
            self.exited.set()
        # dumping: the dump op decides (dumped, or exited if the dump failed and killed it)

    def send_signal(self, signum: int) -> None:
        if self.state != State.running:
            raise AgentError(
                "conflict", f"kernel {self.kernel_id} is {self.state.value}: no process to signal"
            )
        if self.init_pid <= 0:
            raise AgentError("conflict", f"kernel {self.kernel_id} has no process yet")
        with contextlib.suppress(ProcessLookupError):  # it exited: poll() will say so
            # SIGKILL to PID 1 ends the whole namespace; others are forwarded by the init.
            os.kill(self.init_pid, signum)

    async def close(self) -> None:
        """Kills the kernel (agent shutdown, or a failed launch) and stops its tasks."""
        if self.process is not None and self.process.returncode is None:
            for pid in (self.init_pid, self.process.pid):
                if pid <= 0:
                    continue  # 0 would be the agent's own process group
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await self.process.wait()
        for task in list(self._tasks):
            task.cancel()


class KernelTable:
    """Records by (uid, kernel_id). Every lookup takes the caller's uid."""

    def __init__(self, max_per_uid: int = 64):
        self.max_per_uid = max_per_uid
        self._records: dict[tuple[int, str], KernelRecord] = {}

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

    def remove(self, uid: int, kernel_id: str) -> KernelRecord:
        record = self.lookup(uid, kernel_id)
        del self._records[(uid, kernel_id)]
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
        record.state = State.dumped
        record.process = None
        record.init_pid = 0
        return record

    def mark_restored(
        self,
        uid: int,
        kernel_id: str,
        pid: int,
        process: asyncio.subprocess.Process | None = None,
    ) -> KernelRecord:
        """After a restore: `pid` is the restored init's new host pid, `process` the
        agent's child whose exit is the kernel's (cedana-init --keeper)."""
        record = self.lookup(uid, kernel_id)
        record.init_pid = pid
        record.state = State.running
        record.returncode = None
        if process is not None:
            record.watch(process)
        return record


def _names(states: set[State]) -> str:
    return " or ".join(sorted(s.value for s in states))
