"""The agent's socket server: who is calling (SO_PEERCRED), limits, and the op registry.

Identity comes from the kernel, never from the request: the uid, gid and pid of the
peer's socket are read once at accept, and every handler gets them as a `Caller`. A
request field named uid, pid or anything alike is just an argument the handler ignores.

Every connection is served by its own task (connection.py), and everything it waits for
is bounded (a frame's bytes, an idle connection, a client that does not read its
replies), so a bad client holds its own connection and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import protocol
from .connection import Connection, error_reply, linger_close
from .kernels import KernelRecord, KernelTable, State
from .protocol import AgentError

log = logging.getLogger("jupyter_cedana.agent")

Progress = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[["Caller", dict[str, Any], Progress], Awaitable[dict[str, Any]]]

FRAME_INTERVAL = 0.2  # seconds between the frames of a worker thread's progress

__all__ = ["AgentError", "Caller", "Handler", "Limits", "Progress", "ProgressFrames", "Service"]


class ProgressFrames:
    """An op's progress frames, from a plain callable (what the engine calls from the
    event loop, several times a second): a task of its own sends them, so that a client
    slow to read delays its frames and never the op, and an update not sent yet is
    replaced by a newer one. `close` sends what is left, before the op's reply."""

    def __init__(self, send: Progress):
        self._send = send
        self._pending: dict[str, Any] | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    def __call__(self, update: dict[str, Any]) -> None:
        self._pending = update
        self._wake.set()

    def throttled(self, phase: str) -> Callable[[int, int], None]:
        """A (done, total) callback for a worker thread: a frame at most every
        FRAME_INTERVAL seconds (and the last), handed to the event loop."""
        loop = asyncio.get_running_loop()
        last = 0.0

        def update(done: int, total: int) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= FRAME_INTERVAL or done >= total:
                last = now
                loop.call_soon_threadsafe(self, {"phase": phase, "done": done, "total": total})

        return update

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            update, self._pending = self._pending, None
            if update is not None:
                try:
                    await self._send(update)
                except Exception:
                    log.debug("a progress frame was not sent", exc_info=True)
                    return  # the client is gone: the op goes on without it
            if self._closing and self._pending is None:
                return

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        try:
            await self._task
        finally:
            self._task.cancel()


@dataclass(frozen=True)
class Caller:
    """The peer of a connection, as the kernel reports it (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    #: Supplementary groups from the group database for the uid's name, not from the
    #: peer: a kernel launched for the caller gets exactly these.
    groups: tuple[int, ...]

    @classmethod
    def from_socket(cls, sock: socket.socket) -> Caller:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        return cls(pid=pid, uid=uid, gid=gid, groups=user_groups(uid, gid))


def user_groups(uid: int, gid: int) -> tuple[int, ...]:
    """The uid's primary group first, then its supplementary groups, from the databases.

    A uid with no passwd entry (a container's arbitrary uid) gets its peer gid alone.
    """
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return (gid,)
    groups = os.getgrouplist(entry.pw_name, entry.pw_gid)
    return (entry.pw_gid, *sorted(set(groups) - {entry.pw_gid}))


@dataclass
class Limits:
    max_request: int = protocol.MAX_REQUEST
    max_response: int = protocol.MAX_RESPONSE
    #: Seconds a frame may take from its first byte to its last.
    frame_timeout: float = 10.0
    #: Seconds a connection with no request in flight may stay silent.
    idle_timeout: float = 600.0
    #: Seconds a reply may wait for a client that does not read.
    write_timeout: float = 10.0
    max_connections: int = 256
    max_connections_per_uid: int = 16
    #: Requests one connection may have in flight; more wait (the client's own queue).
    max_inflight: int = 8
    max_kernels_per_uid: int = 64
    #: Seconds a uid's running kernels may go without any connection of that uid before
    #: the agent suspends (dumps) them: nothing runs on unowned for ever.
    orphan_grace: float = 3600.0


class UnsafeDirectory(RuntimeError):
    pass


def check_private_dir(path: Path, *, create_mode: int) -> None:
    """Creates `path` if missing; refuses it unless it and every parent are root's own.

    A directory a non-root user can write lets that user swap the socket (and answer
    in the agent's name) or plant records and images: the agent refuses to start.
    Sticky world-writable parents (/tmp) are allowed: nobody else can rename our entry.
    """
    path = Path(os.path.abspath(path))
    if not path.exists():
        check_private_dir(path.parent, create_mode=0o755)
        path.mkdir(mode=create_mode)
        os.chown(path, 0, 0)
        os.chmod(path, create_mode)
    for p in (path, *path.parents):
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeDirectory(f"{p} is a symbolic link")
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        sticky_parent = p != path and st.st_mode & stat.S_ISVTX
        if st.st_uid != 0 or (writable and not sticky_parent):
            raise UnsafeDirectory(
                f"{p} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}: "
                "the agent's directories must be owned by root and writable by root only"
            )


def check_root_file(path: Path) -> None:
    """Refuses a program the agent runs as root unless only root can change it (the file
    and every directory above it): one a user could replace would run as root."""
    path = Path(os.path.abspath(path))
    try:
        st = path.stat()
    except OSError as e:
        raise UnsafeDirectory(f"{path}: {e.strerror}") from None
    if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_ISUID | stat.S_ISGID):
        raise UnsafeDirectory(
            f"{path} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}: "
            "a program the agent runs must be owned by root and writable by root only"
        )
    check_private_dir(path.parent, create_mode=0o755)


class Service:
    """The agent: a Unix socket server with an op registry and the kernel records."""

    def __init__(
        self, socket_path: str | Path, state_dir: str | Path, limits: Limits | None = None
    ):
        self.socket_path = Path(socket_path)
        self.state_dir = Path(state_dir)
        self.limits = limits or Limits()
        self.kernels = KernelTable(
            max_per_uid=self.limits.max_kernels_per_uid, state_dir=self.state_dir
        )
        #: The kernels' init (cedana-init): what an adopted kernel's init must run.
        self.init_binary: str | None = None
        self._alone_since: dict[int, float] = {}  # uid -> when its last connection went
        self._orphans_tried: set[tuple[int, str]] = set()
        self._chores: set[asyncio.Task[Any]] = set()
        self._ops: dict[str, Handler] = {}
        self.cancellable: set[str] = set()
        self._server: asyncio.Server | None = None
        self._connections: dict[int, int] = {}  # uid -> open connections
        self._conn_tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._lingering = 0

    # -- registry -------------------------------------------------------------------------

    def register(self, name: str, handler: Handler, *, cancel_on_disconnect: bool = False) -> None:
        """Adds an op. By default a request in flight when its client disconnects runs to
        its end (a dump or launch cut in the middle is worse than a late one); ops that
        only wait or read (`wait`) say `cancel_on_disconnect`, so that a client cannot
        leave waits behind it by reconnecting."""
        if name in self._ops:
            raise ValueError(f"op {name!r} is registered already")
        self._ops[name] = handler
        if cancel_on_disconnect:
            self.cancellable.add(name)

    @property
    def ops(self) -> list[str]:
        return sorted(self._ops)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if os.geteuid() != 0:
            raise UnsafeDirectory("the agent runs as root (it launches kernels as their users)")
        check_private_dir(self.socket_path.parent, create_mode=0o755)
        check_private_dir(self.state_dir, create_mode=0o700)
        await self._clear_stale_socket()
        if self.init_binary is not None:
            from .adopt import Adopter  # needs the image store, not every Service does

            await Adopter(self.kernels, self.state_dir, self.init_binary).run()
        now = time.monotonic()
        for record in self.kernels.all():
            self._alone_since.setdefault(record.uid, now)
        for chore in (self._keep_output_small(), self._suspend_orphans()):
            self._chores.add(asyncio.get_running_loop().create_task(chore))
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.socket_path), limit=self.limits.max_request + 8
        )
        # Anyone may connect: the peer's credentials say who it is and what it may touch.
        os.chmod(self.socket_path, 0o666)
        log.info("agent listening on %s (ops: %s)", self.socket_path, ", ".join(self.ops))

    async def _clear_stale_socket(self) -> None:
        try:
            st = self.socket_path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise UnsafeDirectory(f"{self.socket_path} exists and is not a socket")
        try:
            _, writer = await asyncio.open_unix_connection(str(self.socket_path))
        except OSError:
            self.socket_path.unlink()  # left by an agent that died
            return
        writer.close()
        raise UnsafeDirectory(f"an agent is serving {self.socket_path} already")

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def close(self, *, kill_kernels: bool = True) -> None:
        """Stops serving. `kill_kernels=False` leaves the kernels running, their records
        on disk, for the next agent to own again."""
        for chore in self._chores:
            chore.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        # Aborting the transports ends each connection's loop; cancelling its task would
        # leave asyncio's stream callback to log the cancellation as an error.
        for writer in list(self._writers):
            writer.transport.abort()
        if self._conn_tasks:
            await asyncio.wait(set(self._conn_tasks), timeout=5)
        for record in self.kernels.all():
            await record.close(kill=kill_kernels)

    # -- chores ---------------------------------------------------------------------------

    async def _keep_output_small(self) -> None:
        while True:
            await asyncio.sleep(OUTPUT_CHECK_SECONDS)
            for record in self.kernels.all():
                enforce = getattr(record.log, "enforce_limit", None)
                if enforce is not None:
                    try:
                        enforce()
                    except OSError as e:
                        log.warning("output of kernel %s: %s", record.kernel_id, e)

    async def _suspend_orphans(self) -> None:
        """Dumps the running kernels of a uid that has had no connection for
        `orphan_grace` seconds; one that cannot be dumped runs on, and says why."""
        grace = self.limits.orphan_grace
        while True:
            await asyncio.sleep(min(grace / 4, 5.0))
            now = time.monotonic()
            for record in self.kernels.all():
                key = (record.uid, record.kernel_id)
                since = self._alone_since.get(record.uid)
                if record.state != State.running or since is None or now - since < grace:
                    continue
                if key in self._orphans_tried:
                    continue
                self._orphans_tried.add(key)
                await self._suspend(record, now - since)

    async def _suspend(self, record: KernelRecord, alone: float) -> None:
        dump = self._ops.get("dump")
        why = f"no client of uid {record.uid} for {alone:.0f} s"
        if dump is None:
            record.note = f"orphaned ({why}); not suspended: this agent cannot dump"
        else:
            caller = Caller(pid=0, uid=record.uid, gid=record.gid, groups=record.groups)

            async def progress(_: dict[str, Any]) -> None:
                pass

            try:
                await dump(caller, {"kernel_id": record.kernel_id}, progress)
                record.note = f"suspended: {why}"
            except AgentError as e:
                record.note = f"orphaned ({why}); not suspended: {e.message}"
            except Exception as e:
                log.exception("suspending orphaned kernel %s failed", record.kernel_id)
                record.note = f"orphaned ({why}); not suspended: {e}"
        log.warning("kernel %s of uid %d: %s", record.kernel_id, record.uid, record.note)
        record.save()

    # -- connections ----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conn_tasks.add(task)
        sock = writer.get_extra_info("socket")
        try:
            caller = Caller.from_socket(sock)
        except OSError:
            writer.close()
            self._conn_tasks.discard(task)
            return
        refusal = self._admit(caller)
        if refusal is not None:
            with contextlib.suppress(Exception):
                writer.write(protocol.encode(error_reply(None, refusal), self.limits.max_response))
                # Lingering holds a descriptor: under a flood, refuse without it, so that
                # refused connections cannot use up the agent's descriptors.
                if self._lingering < MAX_LINGERING:
                    self._lingering += 1
                    try:
                        await linger_close(reader, writer)
                    finally:
                        self._lingering -= 1
            writer.close()
            self._conn_tasks.discard(task)
            return
        self._connections[caller.uid] = self._connections.get(caller.uid, 0) + 1
        if self._alone_since.pop(caller.uid, None) is not None:
            self._orphans_tried = {k for k in self._orphans_tried if k[0] != caller.uid}
        self._writers.add(writer)
        try:
            await Connection(self, caller, reader, writer).run()
        except Exception:
            log.exception("connection of uid %d failed", caller.uid)
        finally:
            self._connections[caller.uid] -= 1
            if not self._connections[caller.uid]:
                del self._connections[caller.uid]
                self._alone_since[caller.uid] = time.monotonic()
            self._writers.discard(writer)
            writer.close()
            self._conn_tasks.discard(task)

    def _admit(self, caller: Caller) -> AgentError | None:
        if sum(self._connections.values()) >= self.limits.max_connections:
            return AgentError("busy", "the agent has too many connections; try again later")
        if self._connections.get(caller.uid, 0) >= self.limits.max_connections_per_uid:
            return AgentError(
                "busy",
                f"uid {caller.uid} has {self.limits.max_connections_per_uid} connections open "
                "already, the most allowed",
            )
        return None

    async def dispatch(
        self, caller: Caller, request: dict[str, Any], progress: Progress
    ) -> dict[str, Any]:
        op = request.get("op")
        if request.get("v") != protocol.VERSION:
            raise AgentError(
                "unsupported_version",
                f"protocol version {request.get('v')!r} is not supported (this agent: "
                f"{protocol.VERSION})",
            )
        if not isinstance(op, str) or op not in self._ops:
            raise AgentError("unknown_op", f"unknown op {op!r}; known: {', '.join(self.ops)}")
        args = request.get("args", {})
        if not isinstance(args, dict):
            raise AgentError("bad_request", "args must be a JSON object")
        return await self._ops[op](caller, args, progress)


OUTPUT_CHECK_SECONDS = 1.0
LINGER_SECONDS = 1.0
MAX_LINGERING = 64
