"""A jupyter server of a test user on the checkpoint agent (tests/userserver.py's, with
`--CheckpointAgent.socket` and a tripwire `criu` first on its PATH), cells run through
its kernel websocket as a notebook's are, and the agent's view of the user's kernels.
The fixtures that start them (`live_agent`, `user_servers`) are in conftest.py."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from jupyter_cedana.checkpoint.proctree import process_tree, stat_fields
from tests.userserver import WAIT, JupyterServer, cmdline, start_as_user, stop_server

if TYPE_CHECKING:  # conftest imports this module
    from .conftest import Agent

USER, OTHER = "cedana-test", "cedana-test2"


def alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def eventually(check: Callable[[], Any], timeout: float = WAIT) -> bool:
    """Poll `check` until it holds or `timeout` passes; the caller asserts with details."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def still_alive(pids: set[int]) -> list[str]:
    return [f"{p}: {cmdline(p)}" for p in sorted(pids) if alive(p)]


# -- the agent, as the user sees it -----------------------------------------------------------


def agent_kernels(agent: Agent, user: str) -> list[dict[str, Any]]:
    reply = agent.run_as(user, "list")
    assert reply["ok"], reply
    kernels: list[dict[str, Any]] = reply["result"]["kernels"]
    return kernels


def agent_images(agent: Agent, user: str) -> list[dict[str, Any]]:
    reply = agent.run_as(user, "images")
    assert reply["ok"], reply
    images: list[dict[str, Any]] = reply["result"]["images"]
    return images


def at_agent(agent: Agent, user: str, kid: str) -> dict[str, Any]:
    kernels = agent_kernels(agent, user)
    found = [k for k in kernels if k.get("kernel_id") == kid]
    assert found, f"kernel {kid} is not in the agent's list for {user}: {kernels}"
    return found[0]


def kernel_tasks(agent: Agent, user: str, kid: str) -> tuple[int, set[int]]:
    """The kernel's init (host pid, from the agent) and the tasks below it."""
    entry = at_agent(agent, user, kid)
    assert entry["state"] == "running", entry
    init = int(entry["pid"])
    tasks = process_tree(init) - {init}
    assert tasks, f"nothing runs below the kernel's init {init}"
    return init, tasks


# -- a jupyter server of a test user -----------------------------------------------------------


@dataclass
class Reply:
    status: str
    stdout: str
    ename: str | None
    traceback: str


@dataclass
class UserServer(JupyterServer):
    criu_marker: Path

    def criu_runs(self) -> list[str]:
        """Every `criu` this server (or anything it started) ran from its PATH."""
        if not self.criu_marker.exists():
            return []
        return self.criu_marker.read_text().splitlines()

    def suspend(self, kid: str) -> dict[str, Any]:
        """Suspend and wait for it (the REST call's own wait), then read the state back."""
        status, k = self.api("POST", f"api/cedana/kernels/{kid}/suspend")
        assert status == 200, (status, k, self.log_tail())
        assert eventually(lambda: self.kernel(kid)["state"] == "suspended", 30), self.kernel(kid)
        return self.kernel(kid)

    async def channels(self, kid: str) -> WebSocketClientConnection:
        """The kernel's websocket, as a notebook opens it."""
        url = self.url.replace("http://", "ws://") + f"api/kernels/{kid}/channels"
        url += f"?session_id={uuid.uuid4().hex}"
        req = HTTPRequest(
            url, headers={"Authorization": f"token {self.token}"}, connect_timeout=WAIT
        )
        return await websocket_connect(req)

    def run(self, kid: str, code: str, timeout: float = WAIT) -> Reply:
        async def go() -> Reply:
            ws = await self.channels(kid)
            try:
                cell = Cell(ws)
                return await cell.collect(cell.execute(code), timeout)
            finally:
                ws.close()

        return asyncio.run(go())

    def output(self, kid: str, code: str) -> str:
        """What a cell printed; it must succeed."""
        reply = self.run(kid, code)
        assert reply.status == "ok", (reply, self.log_tail())
        return reply.stdout


class Cell:
    """Execute requests on a kernel websocket, in the default JSON protocol."""

    def __init__(self, ws: WebSocketClientConnection):
        self.ws = ws
        self.session = Session()

    def execute(self, code: str) -> str:
        msg = self.session.msg("execute_request", {"code": code, "silent": False})
        msg["channel"] = "shell"
        self.ws.write_message(json.dumps(msg, default=json_default))
        return str(msg["header"]["msg_id"])

    async def next_for(self, msg_id: str, deadline: float) -> dict[str, Any]:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no answer to {msg_id} in time"
            raw = await asyncio.wait_for(self.ws.read_message(), left)
            assert raw is not None, "the kernel websocket closed"
            msg: dict[str, Any] = json.loads(raw)
            if (msg.get("parent_header") or {}).get("msg_id") == msg_id:
                return msg

    async def until_printed(self, msg_id: str, text: str, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        printed = ""
        while text not in printed:
            msg = await self.next_for(msg_id, deadline)
            if msg["msg_type"] == "stream":
                printed += msg["content"]["text"]
            assert msg["msg_type"] != "execute_reply", f"the cell ended first: {msg['content']}"

    async def collect(self, msg_id: str, timeout: float = WAIT) -> Reply:
        deadline = time.monotonic() + timeout
        reply: dict[str, Any] | None = None
        idle = False
        stdout, traceback = "", ""
        while reply is None or not idle:
            msg = await self.next_for(msg_id, deadline)
            kind = msg["msg_type"]
            if kind == "stream":
                stdout += msg["content"]["text"]
            elif kind == "error":
                traceback = "\n".join(msg["content"]["traceback"])
            elif kind == "execute_reply":
                reply = msg["content"]
            elif kind == "status":
                idle |= msg["content"]["execution_state"] == "idle"
        return Reply(reply["status"], stdout, reply.get("ename"), traceback)


def start_user_server(base: Path, user: str, agent_socket: Path, *options: str) -> UserServer:
    """`user`'s server on the agent at `agent_socket`, on base/server-<user> (the same
    directories each time: a server started again finds the last one's kernels), with
    more command-line `options`."""
    entry = pwd.getpwnam(user)
    home = base / f"server-{user}"
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    # First on the PATH: a `criu` that only records that it ran. A server on the agent
    # runs no CRIU of its own.
    tripwire = home / "tripwire"
    tripwire.mkdir(mode=0o755, exist_ok=True)
    marker = home / "criu-ran"
    (tripwire / "criu").write_text(f'#!/bin/sh\necho "criu $*" >> {marker}\nexit 1\n')
    (tripwire / "criu").chmod(0o755)
    return start_as_user(
        UserServer,
        home,
        user,
        # The tests decide when kernels are suspended.
        "--SuspendPolicy.idle_timeout=0",
        f"--CheckpointAgent.socket={agent_socket}",
        *options,
        log=base / f"server-{user}.log",
        path_first=[tripwire],
        criu_marker=marker,
    )


def stop_user_server(server: UserServer) -> None:
    stop_server(server, signal.SIGTERM)
