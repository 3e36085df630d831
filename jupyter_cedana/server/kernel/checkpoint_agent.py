"""The server's side of the checkpoint agent (docs/agent.md): with
`CheckpointAgent.socket` set, every kernel is launched, checkpointed and restored by the
agent, the one privileged process; the server runs no CRIU and holds no capability.

A kernel launched there is the agent's child, not the server's: the provisioner holds an
`AgentKernel`, shaped like the `Popen` of a local kernel (pid, poll, wait, returncode),
plus the agent's ops on that kernel.

Each request goes on a connection of its own, opened for it and closed once it is
answered (a local connect costs about half a millisecond). Nothing of a connection
outlives its request, so no event loop is left holding a socket or a reading task when it
closes: the server's, or one of the many that jupyter_client's blocking managers and test
harnesses make and close. An agent restarted meanwhile (it keeps its kernels) is simply
reached by the next request.

With `start_agent` on, a root server whose socket has no agent answering starts one
(agent_start.py) as the extension starts, and uses it as a non-root server would.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import subprocess
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from traitlets import Bool, Float, Unicode
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
from ..agent_start import DEFAULT_STATE_DIR, AgentStartFailed, ensure_agent

T = TypeVar("T")

# What the agent's codes mean to a REST client (errors.py); `failed` is the caller's.
_STATUS = {"not_found": NotFound, "conflict": Conflict, "busy": Conflict}

#: Seconds `hello` may take before the agent is said not to answer.
PROBE_TIMEOUT = 2.0
#: Seconds one `wait` request of `AgentKernel.wait` asks for (the agent caps it too).
_WAIT_STEP = 60.0


class CheckpointAgent(SingletonConfigurable):
    """Where the server finds the checkpoint agent, and how it asks it."""

    socket = Unicode(
        "",
        help="Unix socket of the checkpoint agent (jupyter-cedana-agent, e.g. "
        f"{protocol.DEFAULT_SOCKET}). Set: every kernel is launched, suspended and resumed "
        "by the agent, as the server's user with no capabilities, and this server runs no "
        "CRIU itself; the kernels outlive the server. Empty: the server checkpoints its "
        "kernels itself, which needs root.",
    ).tag(config=True)

    start_agent = Bool(
        False,
        help="A server running as root starts a checkpoint agent on `socket` "
        f"({protocol.DEFAULT_SOCKET} when empty) if none answers there, and then uses it "
        "for every kernel, as a non-root server does. The agent is the package's own "
        "(jupyter-cedana-agent), detached from the server: it outlives the server and "
        "later servers use it; its log is agent.log in `state_dir`. Two servers starting "
        "together start one agent. A server not running as root never starts one. "
        "Off by default while GPU kernels are checkpointed only by a server's own CRIU; "
        "it will become the default for root servers once the agent checkpoints them. A "
        "systemd unit (docs/agent.md) remains the way to run the agent in production.",
    ).tag(config=True)

    state_dir = Unicode(
        DEFAULT_STATE_DIR,
        help="The state directory (images, kernel records, agent.log) of an agent this "
        "server starts (start_agent); ignored otherwise. A directory of root's that only "
        "root writes.",
    ).tag(config=True)

    start_timeout = Float(
        30.0,
        help="Seconds a server waits for the agent it starts (start_agent) to answer, "
        "lock wait included; then checkpointing is unavailable, with the reason.",
    ).tag(config=True)

    probe_ttl = Float(
        5.0,
        help="Seconds an answer of the agent (reachable or not) is trusted by /status and "
        "the sidebar before it is asked again.",
    ).tag(config=True)

    #: Requests one event loop has at the agent at once, each on a connection of its own;
    #: more wait for one to end (the probe, one at a time, does not). Half the agent's
    #: share of a uid (its --max-connections-per-uid, 16), so that the user's CLI or a
    #: second server still get in, and a burst (every kernel shut down at once) is never
    #: answered `busy`.
    connections = 8

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        # Loop-bound, so one per event loop; none inherited across a fork.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._refreshing: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Task[EngineInfo]
        ] = weakref.WeakKeyDictionary()
        self._pid = os.getpid()
        self._probed: tuple[float, EngineInfo] | None = None
        # Loops whose server stopped: no probe is started there any more.
        self._stopped: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        #: The server's engine (serve()): its settings that the agent applies
        #: (keep_base) are read from it.
        self.engine: CheckpointEngine | None = None
        #: The agent this server found started by a server (maybe itself): started_agent().
        self.started: dict[str, Any] | None = None
        #: Why this server could not start its agent (start_agent), for the probe's reason.
        self.start_error: str | None = None
        if self.start_agent and not self.socket and os.geteuid() == 0:
            self.socket = protocol.DEFAULT_SOCKET

    @property
    def enabled(self) -> bool:
        return bool(self.socket)

    def ensure_started(self) -> None:
        """With `start_agent` on, an agent answering on the socket: the one there, or one
        this server starts now (blocking, up to `start_timeout`). A failure is kept as the
        reason checkpointing is unavailable; the server runs on."""
        if not self.start_agent or not self.enabled or os.geteuid() != 0:
            return  # a server that is not root says so in the probe's reason
        try:
            self.started = ensure_agent(self.socket, self.state_dir, self.start_timeout)
        except AgentStartFailed as e:
            self.start_error = str(e)
            self._probed = None
            self.log.error("jupyter-cedana: could not start a checkpoint agent: %s", e)
            return
        self.start_error = None
        if self.started is not None and self.started["by_this_server"]:
            self.log.info(
                "jupyter-cedana: started the checkpoint agent (pid %s) at %s; its log: %s",
                self.started["pid"],
                self.socket,
                self.started["log"],
            )

    # -- reachability ---------------------------------------------------------------------

    def probe(self) -> EngineInfo:
        """Whether the agent answers and checkpoints (`hello` lists `dump` and `restore`),
        as the engine says of a local CRIU; an answer is trusted for `probe_ttl`.

        Never waits for the agent on a running event loop (the sidebar polls /status): an
        answer older than `probe_ttl` is given once more while `refresh()` asks again in
        the background. Only with no loop running in this thread (the server's start-up)
        is the agent asked in place; before any answer, a loop is told it has none yet.
        """
        probed = self._probed
        if probed is not None and time.monotonic() - probed[0] < self.probe_ttl:
            return probed[1]
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            try:
                hello = _ask(self.socket, "hello", {}, PROBE_TIMEOUT)
            except (OSError, AgentError) as e:
                return self._remember(self._no_answer(e))
            return self._remember(_ops_reason(hello))
        if loop not in self._stopped and loop not in self._refreshing:
            task = self._refreshing[loop] = loop.create_task(self.refresh())
            task.add_done_callback(self._refreshed)
        if probed is not None:
            return probed[1]
        return _info(f"the checkpoint agent at {self.socket} has not answered yet")

    def _refreshed(self, task: asyncio.Task[EngineInfo]) -> None:
        # Only one in flight is held (a task holds its loop, which would then never go).
        loop = task.get_loop()
        if self._refreshing.get(loop) is task:
            del self._refreshing[loop]

    async def refresh(self) -> EngineInfo:
        """Ask the agent now, without blocking the event loop, and remember its answer."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                # Not behind the kernels' requests (8 dumps may hold every slot for
                # minutes): one probe at a time per loop, on a connection of its own.
                hello = await self._exchange(lambda c: c.hello())
        except EngineUnavailable:
            assert self._probed is not None  # call() remembered why: trusted from now
            self._probed = (time.monotonic(), self._probed[1])
            return self._probed[1]
        except (TimeoutError, AgentError) as e:
            return self._remember(self._no_answer(e))
        return self._remember(_ops_reason(hello))

    def _no_answer(self, e: BaseException) -> str:
        what = str(e) or f"no answer within {PROBE_TIMEOUT:g} s"
        reason = f"no checkpoint agent answers at {self.socket}: {what}"
        if self.start_error is not None:
            reason += f"; this server could not start one: {self.start_error}"
        elif self.start_agent and os.geteuid() != 0:
            reason += " (CheckpointAgent.start_agent starts one only in a server running as root)"
        return reason

    def _remember(self, reason: str | None, at: float | None = None) -> EngineInfo:
        info = _info(reason)
        self._probed = (time.monotonic() if at is None else at, info)
        return info

    def unreachable(self, why: str, e: BaseException) -> EngineUnavailable:
        """A request found no agent: probe() says so at once, and asks again when next
        called (the agent may be back by then, it restarts in a second)."""
        info = self._remember(f"{why}: {e}", at=-math.inf)
        assert info.reason is not None
        return EngineUnavailable(info.reason)

    # -- requests -------------------------------------------------------------------------

    async def call(self, request: Callable[[AgentClient], Awaitable[T]]) -> T:
        """One request, on a connection of its own. A request is never sent twice (a
        dump cut off may have happened)."""
        async with self._slots_here():
            return await self._exchange(request)

    async def _exchange(self, request: Callable[[AgentClient], Awaitable[T]]) -> T:
        try:
            client = await AgentClient.connect(self.socket)
        except OSError as e:
            raise self.unreachable(f"no checkpoint agent answers at {self.socket}", e) from e
        try:
            async with client:
                return await request(client)
        except (ConnectionError, OSError) as e:
            raise self.unreachable(f"the checkpoint agent at {self.socket} went away", e) from e

    def _slots_here(self) -> asyncio.Semaphore:
        if self._pid != os.getpid():
            self._slots.clear()
            self._refreshing.clear()
            self._pid = os.getpid()
        for closed in [lp for lp in self._slots if lp.is_closed()]:
            del self._slots[closed]  # a semaphore once waited on holds its loop
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = asyncio.Semaphore(self.connections)
        return slots

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

    def serve(self, engine: CheckpointEngine) -> None:
        """A server's extension starts: the engine's word on whether checkpointing is
        available is this agent's probe (the server runs no CRIU of its own to probe),
        refreshed in the background until `close()`. With `start_agent`, the agent is
        started first if none answers."""
        engine.probe_through = self.probe
        self.engine = engine
        self.ensure_started()

    @property
    def keep_base(self) -> bool:
        """Whether a restored kernel's image is kept at the agent as the base of its next
        dump (CheckpointEngine.keep_base of the server's engine)."""
        return self.engine is not None and bool(self.engine.keep_base)

    async def close(self) -> None:
        """The server stops: nothing more is asked in the background on this loop, and a
        probe in flight on it is ended. Requests still work (the kernels are shut down
        after this), each on its own connection as ever; another loop (a test's next) may
        probe again."""
        loop = asyncio.get_running_loop()
        self._stopped.add(loop)
        task = self._refreshing.pop(loop, None)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

    def kernel(self, kernel_id: str) -> AgentKernel:
        return AgentKernel(self, kernel_id)


def _unavailable(why: str) -> str:
    return f"Checkpointing is unavailable: {why}"


def _info(reason: str | None) -> EngineInfo:
    return EngineInfo(reason is None, reason and _unavailable(reason), None, None, True)


def _ops_reason(hello: dict[str, Any]) -> str | None:
    ops = hello.get("ops") or []
    return None if "dump" in ops and "restore" in ops else "it does not checkpoint"


def _ask(path: str, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request on a blocking connection of its own, for a caller with no event loop
    to wait on; `timeout` bounds the connect and each read."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        request = {"v": protocol.VERSION, "id": 1, "op": op, "args": args}
        s.sendall(protocol.encode(request, protocol.MAX_REQUEST))
        while True:
            frame = protocol.recv_frame(s, protocol.MAX_RESPONSE)
            if frame is None:
                raise ConnectionResetError("the agent closed the connection")
            if "progress" not in frame:
                return protocol.result_of(frame)


def _exit_status(reply: dict[str, Any]) -> int | None:
    """A `poll` or `wait` reply's exit status: None while the kernel has not exited."""
    code = reply.get("returncode")
    if isinstance(code, int):
        return code
    return EXIT_UNKNOWN if reply.get("state") == "exited" else None


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

    def wait(self, timeout: float | None = None) -> int:
        """As `Popen.wait`: the exit status, once the kernel has exited, waited for up to
        `timeout` seconds (None: for ever), else `subprocess.TimeoutExpired`. It blocks,
        as Popen's does, asking the agent on a blocking connection of its own; the
        provisioner, as jupyter_client's LocalProvisioner, calls it only once poll() has
        seen the exit, so it returns at once there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            step = _WAIT_STEP if deadline is None else deadline - time.monotonic()
            if step <= 0:
                assert timeout is not None
                raise subprocess.TimeoutExpired(f"kernel {self.kernel_id} at the agent", timeout)
            step = min(step, _WAIT_STEP)
            args = {"kernel_id": self.kernel_id, "timeout": step}
            try:
                # The socket's timeout: the agent's wait, and the time to answer it.
                reply = _ask(self.agent.socket, "wait", args, step + PROBE_TIMEOUT)
            except AgentError as e:
                if e.code != "not_found":
                    raise _as_cedana(e, "wait for") from e
                self.returncode = EXIT_UNKNOWN  # the agent no longer knows it: it is gone
            except OSError as e:
                why = f"no checkpoint agent answers at {self.agent.socket}"
                raise self.agent.unreachable(why, e) from e
            else:
                self.returncode = _exit_status(reply)
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
        self.returncode = _exit_status(status)
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
        """The agent's reply, with `bytes` what the kernel's checkpoint holds on disk (a
        delta with its bases, as a root server counts it) and `image_bytes` what this
        dump wrote."""
        try:
            reply = await self.agent.call(lambda c: c.dump(self.kernel_id, progress))
        except AgentError as e:
            raise _as_cedana(e, "suspend", SuspendFailed) from e
        self.has_image = True
        self.pid = 0
        written = int(reply.get("bytes") or 0)
        return {**reply, "bytes": int(reply.get("held_bytes") or written), "image_bytes": written}

    async def restore(self, lazy: bool, progress: ProgressCallback | None = None) -> int:
        """With the server's `keep_base` on, the agent keeps the image as the base of the
        kernel's next dump, which is then a delta on it (docs/incremental.md)."""
        args: dict[str, Any] = {"kernel_id": self.kernel_id, "lazy": lazy}
        if self.agent.keep_base:
            args["keep_base"] = True
        try:
            reply = await self.agent.call(lambda c: c.request("restore", args, progress))
        except AgentError as e:
            raise _as_cedana(e, "resume", ResumeFailed) from e
        self.has_image = False
        self.restore_failed = None
        self.pid = int(reply["pid"])
        self.returncode = None
        return self.pid

    async def free_ports(self) -> dict[str, Any]:
        """Before a dumped kernel is adopted: its listening ports taken meanwhile are
        moved to free ones in its image (AgentClient.free_ports)."""
        return await self._op(lambda c: c.free_ports(self.kernel_id), "free the ports of")

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
    """The configured agent; None: the server checkpoints its kernels itself."""
    agent = CheckpointAgent.instance(parent=parent)
    return agent if agent.enabled else None


def use_agent(parent: Any) -> CheckpointAgent | None:
    """Once, as the extension starts: the configured agent (as `agent_for`), serving the
    engine (`CheckpointAgent.serve`)."""
    agent = agent_for(parent)
    if agent is not None:
        agent.serve(CheckpointEngine.instance(parent=parent))
    return agent
