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
import math
import os
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from traitlets import Bool, Float, Unicode
from traitlets.config import SingletonConfigurable

from ...agent import protocol
from ...agent.client import AgentClient
from ...agent.protocol import AgentError
from ...checkpoint.engine import CheckpointEngine, EngineInfo
from ...errors import (
    EngineUnavailable,
)
from ..agent_start import DEFAULT_STATE_DIR, AgentStartFailed, ensure_agent
from .agent_kernel import PROBE_TIMEOUT, AgentKernel, ask

T = TypeVar("T")


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
        "Off by default for now: the agent does all a root server's own CRIU does (GPU "
        "memory included), but the in-process path has run far longer. A systemd unit "
        "(docs/agent.md) remains the way to run the agent in production.",
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
        #: What the agent said it can do beyond its ops (its `hello`'s `features`):
        #: "gpu" when it checkpoints the kernels' GPU memory with their dumps.
        self.features: frozenset[str] = frozenset()
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
                hello = ask(self.socket, "hello", {}, PROBE_TIMEOUT)
            except (OSError, AgentError) as e:
                return self._remember(self._no_answer(e))
            return self._remember(self._heard(hello))
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
        return self._remember(self._heard(hello))

    def _heard(self, hello: dict[str, Any]) -> str | None:
        features = hello.get("features")
        self.features = (
            frozenset(f for f in features if isinstance(f, str))
            if isinstance(features, list)
            else frozenset()
        )
        return _ops_reason(hello)

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
