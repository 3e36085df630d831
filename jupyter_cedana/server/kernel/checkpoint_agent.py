"""The server's side of the checkpoint agent (docs/agent.md): with
`CheckpointAgent.socket` set, every kernel is launched, checkpointed and restored by the
agent, the one privileged process; the server runs no CRIU and holds no capability.

A kernel launched there is the agent's child, not the server's: the provisioner holds an
`AgentKernel`, shaped like the `Popen` of a local kernel (pid, poll, wait, returncode),
plus the agent's ops on that kernel. One connection to the agent serves every kernel of
the server; it is opened again after the agent restarts (the agent keeps its kernels).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from traitlets import Float, Unicode
from traitlets.config import SingletonConfigurable

from ...agent import protocol
from ...agent.client import EXIT_UNKNOWN, AgentClient, ProgressCallback
from ...agent.protocol import AgentError
from ...checkpoint.engine import CheckpointEngine, EngineInfo
from ...errors import (
    CedanaError,
    Conflict,
    EngineUnavailable,
    NotCheckpointable,
    NotFound,
    ResumeFailed,
    SuspendFailed,
)

T = TypeVar("T")

# What the agent's codes mean to a REST client (errors.py); `failed` is the caller's.
_STATUS = {"not_found": NotFound, "conflict": Conflict, "busy": Conflict}


class CheckpointAgent(SingletonConfigurable):
    """Where the server finds the checkpoint agent, and its one connection to it."""

    socket = Unicode(
        "",
        help="Unix socket of the checkpoint agent (jupyter-cedana-agent, e.g. "
        f"{protocol.DEFAULT_SOCKET}). Set: every kernel is launched, suspended and resumed "
        "by the agent, as the server's user with no capabilities, and this server runs no "
        "CRIU itself; the kernels outlive the server. Empty: the server checkpoints its "
        "kernels itself, which needs root.",
    ).tag(config=True)

    probe_ttl = Float(
        5.0,
        help="Seconds an answer of the agent (reachable or not) is trusted by /status and "
        "the sidebar before it is asked again.",
    ).tag(config=True)

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        # A connection belongs to the event loop that opened it: one per loop (a server
        # has one; jupyter_client's blocking managers and test harnesses run others), and
        # none inherited across a fork.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AgentClient] = (
            weakref.WeakKeyDictionary()
        )
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._pid = os.getpid()
        self._probed: tuple[float, EngineInfo] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.socket)

    # -- reachability ---------------------------------------------------------------------

    def probe(self) -> EngineInfo:
        """Whether the agent answers and checkpoints (`hello` lists `dump`), as the engine
        says of a local CRIU; cached for `probe_ttl`. Blocking, but short: the agent
        answers `hello` without work, and a missing socket fails at once."""
        now = time.monotonic()
        if self._probed is not None and now - self._probed[0] < self.probe_ttl:
            return self._probed[1]
        try:
            hello = _hello(self.socket, timeout=2.0)
            ops = hello.get("ops") or []
            reason = None if "dump" in ops and "restore" in ops else "it does not checkpoint"
        except (OSError, ValueError, AgentError) as e:
            reason = f"no checkpoint agent answers at {self.socket}: {e}"
        info = EngineInfo(reason is None, reason and _unavailable(reason), None, None, True)
        self._probed = (now, info)
        return info

    async def client(self) -> AgentClient:
        if self._pid != os.getpid():
            self._clients.clear()
            self._locks.clear()
            self._pid = os.getpid()
        for old in [lp for lp in self._clients if lp.is_closed()]:
            # A loop gone (a test's, a thread's): its connection would hold the agent's
            # count of this user's connections for nothing.
            self._clients.pop(old).abandon()
            self._locks.pop(old, None)
        loop = asyncio.get_running_loop()
        lock = self._locks.setdefault(loop, asyncio.Lock())
        async with lock:
            client = self._clients.get(loop)
            if client is None or client.closed:
                try:
                    client = self._clients[loop] = await AgentClient.connect(self.socket)
                except OSError as e:
                    self._probed = None
                    raise EngineUnavailable(
                        _unavailable(f"no checkpoint agent answers at {self.socket}: {e}")
                    ) from e
            return client

    async def call(self, request: Callable[[AgentClient], Awaitable[T]]) -> T:
        """One request. A connection found closed is opened again first; a request is
        never sent twice (a dump cut off may have happened)."""
        client = await self.client()
        try:
            return await request(client)
        except (ConnectionError, OSError) as e:
            self._probed = None
            raise EngineUnavailable(
                _unavailable(f"the checkpoint agent at {self.socket} went away: {e}")
            ) from e

    async def find(self, kernel_id: str) -> dict[str, Any] | None:
        """What the agent holds of this uid's kernel: its `list` entry (`state`, `pid`,
        `returncode`, `meta`), `{"state": "dumped"}` for an image it has no record of, or
        None. `bytes` is the image's size, where it has one."""
        kernels = await self.call(lambda c: c.list())
        found = next((k for k in kernels if k.get("kernel_id") == kernel_id), None)
        images = (await self.call(lambda c: c.images())).get("images") or []
        image = next((i for i in images if i.get("kernel_id") == kernel_id), None)
        if found is None and image is None:
            return None
        out = dict(found or {"kernel_id": kernel_id, "state": "dumped"})
        if image is not None:
            out["bytes"] = int(image.get("bytes") or 0)
            out["created"] = image.get("created")
        return out

    async def close(self) -> None:
        """Close this event loop's connection, if any."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    def kernel(self, kernel_id: str) -> AgentKernel:
        return AgentKernel(self, kernel_id)


def _unavailable(why: str) -> str:
    return f"Checkpointing is unavailable: {why}"


def _hello(path: str, timeout: float) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(protocol.encode({"v": protocol.VERSION, "id": 1, "op": "hello"}, 4096))
        header = _read_exact(s, 4)
        (size,) = struct.unpack(">I", header)
        if size > protocol.MAX_RESPONSE:
            raise ValueError(f"a reply of {size} bytes")
        reply = json.loads(_read_exact(s, size))
    if not isinstance(reply, dict):
        raise ValueError("a reply that is not an object")
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise AgentError(error.get("code", "failed"), error.get("message", ""))
    result = reply.get("result")
    return result if isinstance(result, dict) else {}


def _read_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the agent closed the connection")
        data += chunk
    return data


class AgentKernel:
    """One kernel at the agent, shaped like the `Popen` of a local kernel: `pid` is its
    init's, `poll()` and `wait()` give the exit status last learned (`refresh()` asks).
    While it is checkpointed it has no process, and `poll()` is None."""

    def __init__(self, agent: CheckpointAgent, kernel_id: str):
        self.agent = agent
        self.kernel_id = kernel_id
        self.pid = 0
        self.returncode: int | None = None
        self.has_image = False  # dumped, or a failed restore kept its image
        # Why the agent stopped the kernel and dumped it back (its memory could not all
        # be restored): the server then says the resume failed.
        self.restore_failed: str | None = None

    # -- Popen-shaped ---------------------------------------------------------------------

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode

    async def refresh(self) -> int | None:
        """Ask the agent whether the kernel exited. An agent that does not answer (it is
        restarting, and keeps its kernels) says nothing: the kernel is taken as alive."""
        if self.returncode is not None or not self.pid:
            return self.returncode
        try:
            status = await self.agent.call(lambda c: c.status(self.kernel_id))
        except EngineUnavailable:
            return None
        except AgentError as e:
            if e.code != "not_found":
                return None
            self.returncode = EXIT_UNKNOWN  # the agent no longer knows it: it is gone
            return self.returncode
        if status.get("state") == "dumped":
            self.restore_failed = str(status.get("note") or "it was stopped by the agent")
            self.has_image = True
            self.pid = 0
            return None
        code = status.get("returncode")
        if isinstance(code, int):
            self.returncode = code
        elif status.get("state") == "exited":
            self.returncode = EXIT_UNKNOWN
        return self.returncode

    # -- the agent's ops ------------------------------------------------------------------

    async def launch(self, argv: list[str], env: dict[str, str], cwd: str, **options: Any) -> int:
        reply = await self._op(
            lambda c: c.launch(self.kernel_id, argv, env, cwd, **options), "launch"
        )
        self.pid = int(reply["pid"])
        self.returncode = None
        return self.pid

    async def signal(self, signum: int) -> None:
        if not self.pid or self.returncode is not None:
            return
        try:
            await self.agent.call(lambda c: c.signal(self.kernel_id, signum))
        except AgentError as e:
            if e.code != "conflict":  # it is being checkpointed: the transition decides
                raise _as_cedana(e, "signal") from e

    async def dump(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        try:
            reply = await self.agent.call(lambda c: c.dump(self.kernel_id, progress))
        except AgentError as e:
            raise _as_cedana(e, "suspend", SuspendFailed) from e
        self.has_image = True
        self.pid = 0
        return reply

    async def restore(self, lazy: bool, progress: ProgressCallback | None = None) -> int:
        try:
            reply = await self.agent.call(lambda c: c.restore(self.kernel_id, lazy, progress))
        except AgentError as e:
            raise _as_cedana(e, "resume", ResumeFailed) from e
        self.has_image = False
        self.restore_failed = None
        self.pid = int(reply["pid"])
        self.returncode = None
        return self.pid

    async def discard(self) -> None:
        """Forget its image (a suspended kernel shut down)."""
        with contextlib.suppress(AgentError):
            await self.agent.call(lambda c: c.discard(self.kernel_id))
        self.has_image = False

    async def release(self, timeout: float = 10.0) -> None:
        """The kernel is ending: once it has exited, the agent forgets it, so that its id
        can be launched again (a restart)."""
        if not self.pid:
            return
        with contextlib.suppress(AgentError, EngineUnavailable):
            await self.agent.call(lambda c: c.wait(self.kernel_id, timeout))
            await self.agent.call(lambda c: c.release(self.kernel_id))
        self.pid = 0

    async def output_tail(self, nbytes: int = 4096) -> str:
        try:
            return await self.agent.call(lambda c: c.log(self.kernel_id, nbytes))
        except (AgentError, EngineUnavailable) as e:
            return f"(the agent did not give it: {e})"

    async def _op(self, request: Callable[[AgentClient], Awaitable[T]], what: str) -> T:
        try:
            return await self.agent.call(request)
        except AgentError as e:
            raise _as_cedana(e, what) from e


def _as_cedana(e: AgentError, what: str, failed: type[CedanaError] = CedanaError) -> CedanaError:
    if e.code == "refused":
        return NotCheckpointable(f"The checkpoint agent refused to {what}: {e.message}")
    kind = _STATUS.get(e.code, failed)
    return kind(f"The checkpoint agent could not {what} the kernel: {e.message}")


def agent_for(parent: Any) -> CheckpointAgent | None:
    """The configured agent (None: the server checkpoints its kernels itself); the
    engine's availability is then the agent's."""
    agent = CheckpointAgent.instance(parent=parent)
    if not agent.enabled:
        return None
    CheckpointEngine.instance(parent=parent).probe_through = agent.probe
    return agent
