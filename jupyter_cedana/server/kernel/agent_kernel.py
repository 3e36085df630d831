"""One kernel at the checkpoint agent, as the provisioner holds it: shaped like the
`Popen` of a local kernel, its ops the agent's (docs/agent.md). The connection to the
agent (`checkpoint_agent.CheckpointAgent`) is what it is given, seen through `AgentLink`."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from ...agent import protocol
from ...agent.client import EXIT_UNKNOWN, AgentClient, ProgressCallback
from ...agent.protocol import AgentError
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

#: Seconds `hello` may take before the agent is said not to answer.
PROBE_TIMEOUT = 2.0
#: Seconds one `wait` request of `AgentKernel.wait` asks for (the agent caps it too).
_WAIT_STEP = 60.0


class AgentLink(Protocol):
    """What a kernel uses of the server's connection to the agent."""

    socket: str

    @property
    def keep_base(self) -> bool: ...

    def unreachable(self, why: str, e: BaseException) -> EngineUnavailable: ...

    async def call(self, request: Callable[[AgentClient], Awaitable[T]]) -> T: ...


def ask(path: str, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
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

    def __init__(self, agent: AgentLink, kernel_id: str):
        self.agent = agent
        self.kernel_id = kernel_id
        self.pid = 0
        self.returncode: int | None = None
        self.has_image = False  # dumped, or a failed restore kept its image
        # Why the agent stopped the kernel and dumped it back (its memory could not all
        # be restored): the server then says the resume failed.
        self.restore_failed: str | None = None
        # Its GPU memory is in its host memory at the agent (the offload tier), the
        # process kept: a discard ends it instead of removing an image.
        self.offloaded = False

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
                reply = ask(self.agent.socket, "wait", args, step + PROBE_TIMEOUT)
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
        self.offloaded = False
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

    async def offload(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        """The offload tier at the agent: the reply (`gpu`, `gpu_memory_freed`)."""
        try:
            reply = await self.agent.call(lambda c: c.offload(self.kernel_id, progress))
        except AgentError as e:
            raise _as_cedana(e, "offload", SuspendFailed) from e
        self.offloaded = True
        return reply

    async def reload(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        """Its GPU memory back; on failure it stays offloaded, and the error says why."""
        try:
            reply = await self.agent.call(lambda c: c.reload(self.kernel_id, progress))
        except AgentError as e:
            raise _as_cedana(e, "reload", ResumeFailed) from e
        self.offloaded = False
        return reply

    async def free_ports(self) -> dict[str, Any]:
        """Before a dumped kernel is adopted: its listening ports taken meanwhile are
        moved to free ones in its image (AgentClient.free_ports)."""
        return await self._op(lambda c: c.free_ports(self.kernel_id), "free the ports of")

    async def discard(self) -> None:
        """Forget its image (a suspended kernel shut down); an offloaded one has none, its
        process is ended, as in-process."""
        with contextlib.suppress(AgentError):
            if self.offloaded:
                await self.agent.call(lambda c: c.signal(self.kernel_id, signal.SIGKILL))
            else:
                await self.agent.call(lambda c: c.discard(self.kernel_id))
        self.offloaded = False
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
