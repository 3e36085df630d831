"""One client's connection to the agent: frames in, replies and progress out, every wait
bounded (a frame's bytes, an idle connection, a client that does not read its replies),
so that a bad client holds its own connection and nothing else. What a request does is
the service's (service.py): the connection hands it the caller, as the service
identified it at accept, with every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol

from . import protocol
from .protocol import AgentError, FrameError

log = logging.getLogger("jupyter_cedana.agent")

__all__ = ["Connection", "ConnectionLimits", "Dispatcher", "Peer", "error_reply", "linger_close"]

LINGER_SECONDS = 1.0


class ConnectionLimits(Protocol):
    """The bounds a connection keeps (service.Limits)."""

    max_request: int
    max_response: int
    frame_timeout: float
    idle_timeout: float
    write_timeout: float
    max_inflight: int


class Peer(Protocol):
    """Who is at the other end (service.Caller): only its uid is the connection's business,
    for the log."""

    @property
    def uid(self) -> int: ...


class Dispatcher(Protocol):
    """What a connection needs of the service that accepted it (service.Service)."""

    @property
    def limits(self) -> ConnectionLimits: ...

    @property
    def cancellable(self) -> Collection[str]: ...

    async def dispatch(
        self,
        caller: Any,
        request: dict[str, Any],
        progress: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> dict[str, Any]: ...


async def linger_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Ends our side after a last error reply, and reads (and drops) what the client still
    sends for a moment: closing outright would make the client's write in flight fail
    with EPIPE, and its reader drop the reply that says why."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.drain(), LINGER_SECONDS)
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(LINGER_SECONDS):
            while await reader.read(65536):
                pass


def error_reply(request_id: int | None, error: AgentError) -> dict[str, Any]:
    """The reply that refuses a request (or, with no id, the connection)."""
    return {"id": request_id, "ok": False, "error": error.to_json()}


class Connection:
    """One client's connection: its requests read as frames and run side by side (at
    most `max_inflight`), each reply or progress frame written whole."""

    def __init__(
        self,
        service: Dispatcher,
        caller: Peer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ):
        self.service = service
        self.limits = service.limits
        self.caller = caller
        self.reader = reader
        self.writer = writer
        self._write_lock = asyncio.Lock()
        self._inflight: dict[asyncio.Task[Any], Any] = {}  # task -> its op
        self._slots = asyncio.Semaphore(self.limits.max_inflight)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._inflight.pop(task, None)

    async def send(self, obj: dict[str, Any]) -> None:
        try:
            frame = protocol.encode(obj, self.limits.max_response)
        except AgentError as e:
            frame = protocol.encode(error_reply(obj.get("id"), e), self.limits.max_response)
        async with self._write_lock:
            self.writer.write(frame)
            try:
                await asyncio.wait_for(self.writer.drain(), self.limits.write_timeout)
            except TimeoutError:
                # A client that does not read its replies: cut it off.
                self.writer.transport.abort()
                raise ConnectionResetError("client does not read its replies") from None

    async def _next_frame(self) -> dict[str, Any] | None:
        """The next request; None when the client closed or stayed idle too long."""
        read = asyncio.ensure_future(
            protocol.read_frame(self.reader, self.limits.max_request, self.limits.frame_timeout)
        )
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=self.limits.idle_timeout)
                if done:
                    return read.result()
                if not self._inflight:
                    await self.send(
                        error_reply(
                            None,
                            AgentError(
                                "timeout", f"idle for {self.limits.idle_timeout:g} s: closed"
                            ),
                        )
                    )
                    return None
        finally:
            read.cancel()

    async def run(self) -> None:
        try:
            while True:
                try:
                    request = await self._next_frame()
                except FrameError as e:
                    await self.send(error_reply(None, e))
                    await linger_close(self.reader, self.writer)
                    return
                if request is None:
                    return
                request_id = request.get("id")
                if not isinstance(request_id, int) or isinstance(request_id, bool):
                    await self.send(
                        error_reply(
                            None, AgentError("bad_request", "request id must be an integer")
                        )
                    )
                    await linger_close(self.reader, self.writer)
                    return
                await self._slots.acquire()
                task = asyncio.ensure_future(self._handle(request_id, request))
                self._inflight[task] = request.get("op")
                task.add_done_callback(self._forget)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            # The client is gone: its requests' results have nobody to go to. Ops that
            # change a kernel finish anyway (a half-done dump is worse than a late one).
            for task, op in list(self._inflight.items()):
                if op in self.service.cancellable:
                    task.cancel()
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)

    async def _handle(self, request_id: int, request: dict[str, Any]) -> None:
        async def progress(update: dict[str, Any]) -> None:
            with contextlib.suppress(ConnectionError):
                await self.send({"id": request_id, "progress": update})

        try:
            result = await self.service.dispatch(self.caller, request, progress)
            reply: dict[str, Any] = {"id": request_id, "ok": True, "result": result}
        except AgentError as e:
            reply = error_reply(request_id, e)
        except Exception:
            log.exception("op %r of uid %d failed", request.get("op"), self.caller.uid)
            reply = error_reply(
                request_id, AgentError("failed", "internal error in the agent (see its log)")
            )
        finally:
            self._slots.release()
        with contextlib.suppress(ConnectionError):
            await self.send(reply)
