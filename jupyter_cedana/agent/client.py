"""The one client of the agent: what the server side (and the tests) use.

One connection carries any number of requests at once; replies are matched by id.
Errors come back as `AgentError` with the agent's code.

    async with await AgentClient.connect() as agent:
        pid = (await agent.launch(kernel_id, argv, env, cwd))["pid"]

`python -m jupyter_cedana.agent.client OP [JSON-ARGS]` sends one request and prints the
reply as JSON (exit status 1 on an error reply).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from . import protocol
from .protocol import AgentError

#: What `poll` gives for a kernel that exited with a status the agent does not know.
EXIT_UNKNOWN = 255

ProgressCallback = Callable[[dict[str, Any]], Awaitable[None] | None]


class AgentClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._progress: dict[int, ProgressCallback] = {}
        self._closed: BaseException | None = None
        self._write_lock = asyncio.Lock()
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, path: str = protocol.DEFAULT_SOCKET) -> AgentClient:
        reader, writer = await asyncio.open_unix_connection(path, limit=protocol.MAX_RESPONSE + 8)
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        """The connection ended (the agent closed it, or went away)."""
        return self._closed is not None or self._writer.is_closing()

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await protocol.read_frame(self._reader, protocol.MAX_RESPONSE, 30.0)
                if frame is None:
                    raise ConnectionResetError("the agent closed the connection")
                rid = frame.get("id")
                if "progress" in frame:
                    callback = self._progress.get(rid) if isinstance(rid, int) else None
                    if callback is not None:
                        result = callback(frame["progress"])
                        if asyncio.iscoroutine(result):
                            await result
                    continue
                if isinstance(rid, int):
                    future = self._pending.pop(rid, None)
                    if future is None:
                        continue  # the reply to a request its caller gave up (cancelled)
                else:
                    # A reply to no request (`id: null`): the agent refused the
                    # connection (busy) or the stream (a bad frame). It closes next;
                    # everyone waiting gets it.
                    raise protocol.error_of(frame)
                if not future.done():
                    future.set_result(frame)
        except BaseException as e:  # handed to every waiter, cancellation at close included
            self._closed = e
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(
                        e
                        if isinstance(e, AgentError | ConnectionError)
                        else ConnectionResetError(str(e))
                    )
            self._pending.clear()

    async def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        if self._closed is not None:
            if isinstance(self._closed, AgentError):
                raise self._closed
            raise ConnectionResetError("the connection to the agent is closed")
        rid = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        if progress is not None:
            self._progress[rid] = progress
        try:
            frame = protocol.encode(
                {"v": protocol.VERSION, "id": rid, "op": op, "args": args or {}},
                protocol.MAX_REQUEST,
            )
            async with self._write_lock:
                self._writer.write(frame)
                # An agent that refused the connection (busy) may have closed it before
                # this write: its reason is in the reply stream, which settles the future.
                with contextlib.suppress(ConnectionError):
                    await self._writer.drain()
            reply = await future
        finally:
            self._pending.pop(rid, None)
            self._progress.pop(rid, None)
        return protocol.result_of(reply)

    # -- the ops, typed -------------------------------------------------------------------

    async def hello(self) -> dict[str, Any]:
        return await self.request("hello")

    async def launch(
        self,
        kernel_id: str,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        **options: Any,
    ) -> dict[str, Any]:
        """`options`: further launch arguments an agent understands (docs/agent.md)."""
        args = {"kernel_id": kernel_id, "argv": argv, "env": env, "cwd": cwd, **options}
        return await self.request("launch", args)

    async def list(self) -> list[dict[str, Any]]:
        kernels = (await self.request("list")).get("kernels", [])
        return kernels if isinstance(kernels, list) else []

    async def poll(self, kernel_id: str) -> int | None:
        """None while the kernel has not exited (running, or checkpointed); its exit
        status once it has, or EXIT_UNKNOWN if the agent could not learn it (it exited
        while the agent that watched it had restarted): never None for a dead kernel."""
        reply = await self.status(kernel_id)
        code = reply.get("returncode")
        if isinstance(code, int):
            return code
        return EXIT_UNKNOWN if reply.get("state") == "exited" else None

    async def status(self, kernel_id: str) -> dict[str, Any]:
        """The whole `poll` reply: `state`, `returncode`, `returncode_known`, `note`."""
        return await self.request("poll", {"kernel_id": kernel_id})

    async def signal(self, kernel_id: str, signum: int) -> None:
        await self.request("signal", {"kernel_id": kernel_id, "signum": int(signum)})

    async def wait(self, kernel_id: str, timeout: float) -> int | None:
        reply = await self.request("wait", {"kernel_id": kernel_id, "timeout": timeout})
        code = reply.get("returncode")
        return code if isinstance(code, int) else None

    async def release(self, kernel_id: str) -> None:
        await self.request("release", {"kernel_id": kernel_id})

    async def dump(
        self, kernel_id: str, progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        """Checkpoint a running kernel into the agent's store; its process ends once the
        image is durable. The result has `bytes` and `seconds`."""
        return await self.request("dump", {"kernel_id": kernel_id}, progress)

    async def restore(
        self, kernel_id: str, lazy: bool = True, progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        """Restore a dumped kernel; the result has the new `pid` and whether it came back
        `lazy` (its memory still coming in)."""
        return await self.request("restore", {"kernel_id": kernel_id, "lazy": lazy}, progress)

    async def offload(
        self, kernel_id: str, progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        """Move a running kernel's GPU memory into its host memory, its process kept: the
        result has `gpu` and `gpu_memory_freed`."""
        return await self.request("offload", {"kernel_id": kernel_id}, progress)

    async def reload(
        self, kernel_id: str, progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        """Put an offloaded kernel's GPU memory back (free GPU memory checked first); on
        failure it stays offloaded."""
        return await self.request("reload", {"kernel_id": kernel_id}, progress)

    async def discard(self, kernel_id: str) -> None:
        await self.request("discard", {"kernel_id": kernel_id})

    async def free_ports(self, kernel_id: str) -> dict[str, Any]:
        """Move the listening ports of a dumped kernel that were taken meanwhile to free
        ones, in its image: `moved` ({old: new}) and `port_map` (every port it ever had,
        to the one it has now)."""
        return await self.request("free_ports", {"kernel_id": kernel_id})

    async def images(self) -> dict[str, Any]:
        return await self.request("images")

    async def log(self, kernel_id: str, nbytes: int | None = None) -> str:
        args: dict[str, Any] = {"kernel_id": kernel_id}
        if nbytes is not None:
            args["bytes"] = nbytes
        return str((await self.request("log", args)).get("text", ""))


async def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jupyter_cedana.agent.client")
    parser.add_argument("--socket", default=protocol.DEFAULT_SOCKET)
    parser.add_argument("op")
    parser.add_argument("args", nargs="?", default="{}", help="the op's arguments, JSON")
    ns = parser.parse_args(argv)
    async with await AgentClient.connect(ns.socket) as agent:
        try:
            result = await agent.request(ns.op, json.loads(ns.args))
        except AgentError as e:
            print(json.dumps({"ok": False, "error": e.to_json()}))
            return 1
    print(json.dumps({"ok": True, "result": result}))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1:])))
