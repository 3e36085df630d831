"""A jupyter server of an ordinary user, configured with `--CheckpointAgent.socket`, whose
kernels live under the checkpoint agent: launched, interrupted, suspended, resumed and shut
down through it.

Real parts: the agent runs as root (tests/agent/conftest.py); the server runs as
cedana-test with the users' virtualenv, no supplementary group and no capability, so
that the agent is its only way to checkpoint (a `criu` first on its PATH records any run);
real ipykernel; cells go through the server's kernel websocket as a notebook's do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import textwrap
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from jupyter_cedana.checkpoint.proctree import process_tree, stat_fields

from .conftest import USER_PYTHON, Agent

pytestmark = [pytest.mark.criu, pytest.mark.root]

USER, OTHER = "cedana-test", "cedana-test2"
NONROOT_BIN = Path(USER_PYTHON).parent
WAIT = 120.0
BIG_MB = 200

STATUS_FIELDS = ("Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")
# Run in the kernel: what its own /proc says of it.
PROBE = textwrap.dedent(
    f"""
    import json
    _f = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()
              if ':\\t' in l)
    print(json.dumps({{k: _f[k].strip() for k in {STATUS_FIELDS!r}}}))
    """
)


def status_fields(text: str) -> dict[str, str]:
    fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return {k: fields[k].strip() for k in STATUS_FIELDS}


def assert_confined(fields: dict[str, str], uid: int, where: str) -> None:
    """The user's uid (real, effective, saved, filesystem), no capability, no_new_privs."""
    assert fields["Uid"].split() == [str(uid)] * 4, (where, fields)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, (where, cap, fields)
    assert fields["NoNewPrivs"] == "1", (where, fields)


def status_line(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    return ""


def host_status(pid: int) -> dict[str, str]:
    return status_fields(Path(f"/proc/{pid}/status").read_text())


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        fields = stat_fields(pid)
        if len(fields) < 2:
            break
        pid = int(fields[1])
        chain.append(pid)
    return chain


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@pytest.fixture
def live_agent(agent: Agent) -> Iterator[Agent]:
    """The conftest's agent, its log read as it comes (a full stderr pipe would stall it)
    and its tail printed after the test (pytest shows it when the test fails)."""
    tail: deque[str] = deque(maxlen=150)
    stream = agent.proc.stderr
    assert stream is not None

    def drain() -> None:
        with contextlib.suppress(Exception):
            for line in iter(stream.readline, ""):
                tail.append(line)

    threading.Thread(target=drain, daemon=True).start()
    yield agent
    print("---- agent log (last lines) ----\n" + "".join(tail))


# -- a jupyter server of a test user -----------------------------------------------------------


@dataclass
class Reply:
    status: str
    stdout: str
    ename: str | None
    traceback: str


@dataclass
class UserServer:
    user: str
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    base: Path
    log: Path
    criu_marker: Path
    kernels: list[str] = field(default_factory=list)

    def criu_runs(self) -> list[str]:
        """Every `criu` this server (or anything it started) ran from its PATH."""
        if not self.criu_marker.exists():
            return []
        return self.criu_marker.read_text().splitlines()

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        if method == "POST" and data is None:
            data = b"{}"
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=WAIT) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw) if raw else None
            except ValueError:
                return e.code, raw.decode(errors="replace")

    def start_kernel(self) -> str:
        status, k = self.api("POST", "api/kernels", {"name": "python3"})
        assert status == 201, (status, k, self.log_errors())
        self.kernels.append(k["id"])
        return str(k["id"])

    def view(self, kid: str) -> dict[str, Any]:
        status, k = self.api("GET", f"api/cedana/kernels/{kid}")
        assert status == 200, (status, k)
        return dict(k)

    def suspend(self, kid: str) -> dict[str, Any]:
        """Suspend and wait for it (the REST call's own wait), then read the state back."""
        status, k = self.api("POST", f"api/cedana/kernels/{kid}/suspend")
        assert status == 200, (status, k, self.log_tail())
        assert eventually(lambda: self.view(kid)["state"] == "suspended", 30), self.view(kid)
        return self.view(kid)

    async def _socket(self, kid: str) -> WebSocketClientConnection:
        url = self.url.replace("http://", "ws://") + f"api/kernels/{kid}/channels"
        url += f"?session_id={uuid.uuid4().hex}"
        req = HTTPRequest(
            url, headers={"Authorization": f"token {self.token}"}, connect_timeout=WAIT
        )
        return await websocket_connect(req)

    def run(self, kid: str, code: str, timeout: float = WAIT) -> Reply:
        async def go() -> Reply:
            ws = await self._socket(kid)
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

    def log_errors(self, lines: int = 6) -> list[str]:
        """The server log's last error lines: a failed assertion's message stays short."""
        text = self.log.read_text(errors="replace").splitlines()
        return [ln for ln in text if ln.startswith("[E") or "Error" in ln][-lines:]

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


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


def start_user_server(base: Path, user: str, agent_socket: Path) -> UserServer:
    entry = pwd.getpwnam(user)
    home = base / f"server-{user}"
    home.mkdir(mode=0o700, exist_ok=True)  # a server started again uses the same dirs
    dirs = {name: home / name for name in ("runtime", "root", "config", "data", "checkpoints")}
    for d in (home, *dirs.values()):
        d.mkdir(mode=0o700, exist_ok=True)
        os.chown(d, entry.pw_uid, entry.pw_gid)
    # First on the PATH: a `criu` that only records that it ran. A server on the agent
    # runs no CRIU of its own.
    tripwire = home / "tripwire"
    tripwire.mkdir(mode=0o755, exist_ok=True)
    marker = home / "criu-ran"
    (tripwire / "criu").write_text(f'#!/bin/sh\necho "criu $*" >> {marker}\nexit 1\n')
    (tripwire / "criu").chmod(0o755)
    token = secrets.token_hex(16)
    port = free_port()
    env = {
        "HOME": entry.pw_dir,
        "USER": user,
        "PATH": f"{tripwire}:{NONROOT_BIN}:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
    }
    cmd = [
        str(NONROOT_BIN / "jupyter"),
        "server",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        "--ServerApp.open_browser=False",
        f"--ServerApp.root_dir={dirs['root']}",
        f"--CedanaApp.checkpoint_root={dirs['checkpoints']}",
        # The tests decide when kernels are suspended.
        "--SuspendPolicy.idle_timeout=0",
        f"--CheckpointAgent.socket={agent_socket}",
    ]
    log = base / f"server-{user}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            user=entry.pw_uid,
            group=entry.pw_gid,
            # No supplementary group: nothing privileged is within its reach.
            extra_groups=[],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=dirs["root"],
        )
    server = UserServer(user, proc, f"http://127.0.0.1:{port}/", token, base, log, marker)
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"{user}'s server exited ({proc.returncode}):\n{server.log_tail()}"
            )
        with contextlib.suppress(OSError):
            if server.api("GET", "api/cedana/status")[0] == 200:
                return server
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise AssertionError(f"{user}'s server did not answer:\n{server.log_tail()}")


def stop_user_server(server: UserServer) -> None:
    if server.proc.poll() is None:
        with contextlib.suppress(OSError):
            server.api("POST", "api/shutdown")
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()


@pytest.fixture
def user_servers(agent_base: Path) -> Iterator[Callable[..., UserServer]]:
    """start(user, socket=None): a server of `user` on the agent's socket (or `socket`)."""
    started: list[UserServer] = []

    def start(user: str, agent_socket: Path | None = None) -> UserServer:
        path = agent_socket or agent_base / "run" / "agent.sock"
        server = start_user_server(agent_base, user, path)
        started.append(server)
        return server

    yield start
    for server in started:
        stop_user_server(server)
        print(f"---- {server.user}'s server log (last lines) ----\n{server.log_tail()}")
    # Whatever a failed test left of the servers' kernels (their files are under the base).
    for entry in os.listdir("/proc"):
        if entry.isdigit() and str(agent_base) in cmdline(int(entry)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)


def kernel_tasks(agent: Agent, user: str, kid: str) -> tuple[int, set[int]]:
    """The kernel's init (host pid, from the agent) and the tasks below it."""
    entry = at_agent(agent, user, kid)
    assert entry["state"] == "running", entry
    init = int(entry["pid"])
    tasks = process_tree(init) - {init}
    assert tasks, f"nothing runs below the kernel's init {init}"
    return init, tasks


def assert_kernel_of_agent(
    agent: Agent, server: UserServer, kid: str, uid: int, restored: bool = False
) -> set[int]:
    """Every task of the kernel is the user's, confined, and none is the server's
    descendant; a launched kernel is the agent's descendant."""
    init, tasks = kernel_tasks(agent, server.user, kid)
    chain = ancestors(init)
    assert server.proc.pid not in chain, (init, chain, server.proc.pid)
    if not restored:
        assert agent.proc.pid in chain, (init, chain, agent.proc.pid)
    for pid in tasks:
        assert server.proc.pid not in ancestors(pid), (pid, cmdline(pid))
        assert_confined(host_status(pid), uid, f"host pid {pid}: {cmdline(pid)}")
    assert any("ipykernel" in cmdline(p) for p in tasks), [cmdline(p) for p in tasks]
    below_server = [cmdline(p) for p in process_tree(server.proc.pid)]
    assert not any("ipykernel" in c for c in below_server), below_server
    return tasks


# -- the cases ------------------------------------------------------------------------------


def test_kernel_runs_under_the_agent_as_the_user_without_capabilities(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    uid = pwd.getpwnam(USER).pw_uid
    server = user_servers(USER)
    # The server holds nothing privileged: no supplementary group, no capability.
    assert status_line(server.proc.pid, "Groups").split() == [], server.proc.pid
    assert int(status_line(server.proc.pid, "CapEff"), 16) == 0
    # It says where its kernels are checkpointed, and that GPU memory is not (yet).
    status, st = server.api("GET", "api/cedana/status")
    assert status == 200 and st["available"], st
    assert st["agent_socket"] == str(live_agent.socket_path), st
    assert st["gpu"]["checkpoint"] is False and st["warnings"] == [], st
    kid = server.start_kernel()
    inside = json.loads(server.output(kid, PROBE))
    assert_confined(inside, uid, "the kernel's own /proc/self/status")
    assert_kernel_of_agent(live_agent, server, kid, uid)
    assert [k["kernel_id"] for k in agent_kernels(live_agent, USER)] == [kid]


def test_state_survives_suspend_and_a_transparent_resume(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    uid = pwd.getpwnam(USER).pw_uid
    server = user_servers(USER)
    kid = server.start_kernel()
    digest = server.output(
        kid,
        "import hashlib, os\nx = 41\n"
        f"big = bytearray(os.urandom(1 << 20)) * {BIG_MB}\n"
        "print(hashlib.sha256(big).hexdigest())",
    ).strip()
    tasks = assert_kernel_of_agent(live_agent, server, kid, uid)

    view = server.suspend(kid)
    assert view["checkpoint_bytes"] >= BIG_MB << 20, view
    assert eventually(lambda: not still_alive(tasks)), still_alive(tasks)
    assert at_agent(live_agent, USER, kid)["state"] == "dumped"
    assert [i["kernel_id"] for i in agent_images(live_agent, USER)] == [kid]

    # No resume asked: the cell resumes it.
    assert server.output(kid, "print(x + 1)").strip() == "42"
    assert server.view(kid)["state"] == "running"
    assert server.output(kid, "print(hashlib.sha256(big).hexdigest())").strip() == digest
    assert_confined(json.loads(server.output(kid, PROBE)), uid, "the restored kernel's own view")
    assert_kernel_of_agent(live_agent, server, kid, uid, restored=True)
    # Every page is in (the digest read them all): the image goes.
    assert eventually(lambda: not agent_images(live_agent, USER), 60), agent_images(
        live_agent, USER
    )
    # Once stopped, the server has finished whatever it started in the background.
    stop_user_server(server)
    assert server.criu_runs() == [], server.log_errors()


def test_interrupt_through_rest_reaches_the_cell_and_the_kernel_lives(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    kid = server.start_kernel()
    server.output(kid, "y = 'still here'")
    init, _ = kernel_tasks(live_agent, USER, kid)

    async def interrupted() -> Reply:
        ws = await server._socket(kid)
        try:
            cell = Cell(ws)
            mid = cell.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(60)")
            await cell.until_printed(mid, "sleeping")
            status, body = await asyncio.to_thread(
                server.api, "POST", f"api/kernels/{kid}/interrupt"
            )
            assert status == 204, (status, body, server.log_tail())
            # Well before the sleep would end by itself.
            return await cell.collect(mid, timeout=30)
        finally:
            ws.close()

    reply = asyncio.run(interrupted())
    assert (reply.status, reply.ename) == ("error", "KeyboardInterrupt"), reply
    assert server.output(kid, "print(y)").strip() == "still here"
    assert kernel_tasks(live_agent, USER, kid)[0] == init  # the same kernel, not a restart


def test_shutdown_leaves_nothing_at_the_agent(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    running, suspended = server.start_kernel(), server.start_kernel()
    for kid in (running, suspended):
        server.output(kid, "z = 1")
    _, tasks = kernel_tasks(live_agent, USER, running)
    server.suspend(suspended)
    assert [i["kernel_id"] for i in agent_images(live_agent, USER)] == [suspended]

    for kid in (running, suspended):
        status, body = server.api("DELETE", f"api/kernels/{kid}")
        assert status == 204, (kid, status, body, server.log_tail())
    assert eventually(lambda: not still_alive(tasks)), still_alive(tasks)

    def left_at_agent() -> dict[str, Any]:
        return {
            "kernels": agent_kernels(live_agent, USER),
            "images": agent_images(live_agent, USER),
        }

    assert eventually(lambda: not any(left_at_agent().values()), 30), left_at_agent()


def test_another_users_server_cannot_reach_the_kernels(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    other = user_servers(OTHER)
    kid = server.start_kernel()
    server.output(kid, "secret = 'only mine'")

    for method, path in (
        ("GET", f"api/kernels/{kid}"),
        ("GET", f"api/cedana/kernels/{kid}"),
        ("POST", f"api/cedana/kernels/{kid}/suspend"),
        ("POST", f"api/cedana/kernels/{kid}/resume"),
    ):
        status, body = other.api(method, path)
        assert status == 404, (method, path, status, body)
    assert kid not in [k["id"] for k in other.api("GET", "api/cedana/kernels")[1]]
    # The other server's own kernel is the other user's, at the agent too.
    mine = other.start_kernel()
    assert_confined(json.loads(other.output(mine, PROBE)), pwd.getpwnam(OTHER).pw_uid, OTHER)
    assert [k["kernel_id"] for k in agent_kernels(live_agent, OTHER)] == [mine]

    # The agent, asked as the other user, does not know the kernel, running or dumped.
    for op, args in (("dump", {}), ("signal", {"signum": int(signal.SIGKILL)})):
        reply = live_agent.run_as(OTHER, op, {"kernel_id": kid, **args})
        assert reply.get("error", {}).get("code") == "not_found", (op, reply)
    server.suspend(kid)
    for op in ("restore", "discard"):
        reply = live_agent.run_as(OTHER, op, {"kernel_id": kid})
        assert reply.get("error", {}).get("code") == "not_found", (op, reply)
    assert kid not in [i["kernel_id"] for i in agent_images(live_agent, OTHER)]
    status, body = other.api("POST", f"api/cedana/kernels/{kid}/resume")
    assert status == 404, (status, body)

    assert server.view(kid)["state"] == "suspended"
    assert server.output(kid, "print(secret)").strip() == "only mine"


def test_no_agent_at_the_socket(agent_base: Path, user_servers: Callable[..., UserServer]) -> None:
    """Kernels start and run as without the agent; checkpointing says why it cannot."""
    nowhere = agent_base / "no-agent" / "agent.sock"
    server = user_servers(USER, nowhere)
    status, st = server.api("GET", "api/cedana/status")
    assert status == 200 and st["available"] is False, st
    assert str(nowhere) in (st["reason"] or ""), st

    kid = server.start_kernel()
    assert server.output(kid, "print(6 * 7)").strip() == "42"
    status, body = server.api("POST", f"api/cedana/kernels/{kid}/suspend")
    assert status in (409, 503), (status, body)
    assert str(nowhere) in body["message"], body
    assert server.view(kid)["state"] == "running"
    assert server.output(kid, "print('after')").strip() == "after"
    stop_user_server(server)
    assert server.criu_runs() == [], server.log_errors()
