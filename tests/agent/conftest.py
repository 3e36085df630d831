"""A real agent, started as root on a private socket and state directory, clients that
run as the test users (cedana-test, cedana-test2) through runuser, and the test users'
jupyter servers on it (servers_on_agent.py)."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pytest

from tests.userserver import NONROOT_BIN, cmdline, end_process

from .servers_on_agent import UserServer, start_user_server, stop_user_server

# A venv the test users can run (the root one may live where they cannot read).
USER_PYTHON = str(NONROOT_BIN / "python")
USERS = ("cedana-test", "cedana-test2")

P = ParamSpec("P")
T = TypeVar("T")


def _users_ready() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the agent runs as root)"
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            return f"needs the test user {user}"
    if not os.access(USER_PYTHON, os.X_OK) or not shutil.which("runuser"):
        return f"needs {USER_PYTHON} and runuser"
    return None


@dataclass
class Agent:
    """A running agent process and where it listens."""

    proc: subprocess.Popen[str]
    base: Path
    socket_path: Path
    state_dir: Path
    limits: dict[str, float]

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(str(self.socket_path))
        return s

    def run_as(
        self, user: str, op: str, args: dict[str, Any] | None = None, timeout: float = 60
    ) -> dict[str, Any]:
        """One request from a process of `user`: the agent's reply as a dict."""
        out = subprocess.run(
            [
                "runuser",
                "-u",
                user,
                "--",
                USER_PYTHON,
                "-m",
                "jupyter_cedana.agent.client",
                "--socket",
                str(self.socket_path),
                op,
                json.dumps(args or {}),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
        )
        assert out.stdout.strip(), f"no reply (rc {out.returncode}): {out.stderr}"
        reply: dict[str, Any] = json.loads(out.stdout)
        return reply

    def user_dir(self, user: str) -> Path:
        """A directory of `user`'s own, inside the test's base directory."""
        entry = pwd.getpwnam(user)
        path = self.base / f"home-{user}"
        path.mkdir(exist_ok=True)
        os.chown(path, entry.pw_uid, entry.pw_gid)
        os.chmod(path, 0o700)
        return path


def request_frame(op: str, args: dict[str, Any] | None = None, rid: int = 1, **extra: Any) -> bytes:
    body = json.dumps({"v": 1, "id": rid, "op": op, "args": args or {}, **extra}).encode()
    return struct.pack(">I", len(body)) + body


def read_reply(sock: socket.socket, timeout: float = 30) -> dict[str, Any] | None:
    """The next frame from the agent, or None when it closed the connection."""
    sock.settimeout(timeout)
    header = _recv_exactly(sock, 4)
    if header is None:
        return None
    (length,) = struct.unpack(">I", header)
    body = _recv_exactly(sock, length)
    assert body is not None, "connection closed inside a reply"
    reply: dict[str, Any] = json.loads(body)
    return reply


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            assert not data, "connection closed inside a frame"
            return None
        data += chunk
    return data


def is_open(sock: socket.socket) -> bool:
    """Whether the agent still holds the connection (nothing to read, no end of stream)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return True
    return sock.recv(1, socket.MSG_PEEK) != b""


LIMITS = {"frame-timeout": 2.0, "idle-timeout": 20.0, "max-connections-per-uid": 4}


def start_agent(
    base: Path, *extra: str, state_dir: Path | None = None, kernels_on_stop: str = "kill"
) -> subprocess.Popen[str]:
    """An agent on `base`'s socket and state directory. Its kernels end when it is stopped
    with SIGTERM (`kernels_on_stop`), so that no test leaves kernels behind; a restart
    test kills it with SIGKILL, which leaves them running."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_cedana.agent",
            "--socket",
            str(base / "run" / "agent.sock"),
            "--state-dir",
            str(state_dir or base / "state"),
            "--kernels-on-stop",
            kernels_on_stop,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def wait_listening(proc: subprocess.Popen[str], timeout: float = 60) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1)
        if ready:
            line = proc.stdout.readline()
            if "listening on" in line:
                return
            if not line:
                break
    proc.kill()
    _, err = proc.communicate()
    raise AssertionError(f"the agent did not start: {err}")


def write_checkpoint_config(state: Path, config: dict[str, Any]) -> None:
    """Root's checkpoint configuration of the agent: `<state>/checkpoint.json`, 0600."""
    state.mkdir(mode=0o700, exist_ok=True)
    (state / "checkpoint.json").write_text(json.dumps(config))
    os.chmod(state / "checkpoint.json", 0o600)


def run_agent(base: Path, *extra: str) -> Agent:
    """An agent with the tests' LIMITS (and `extra` options) on `base`'s socket and state
    directory, once it listens."""
    limits = [
        arg
        for k, v in LIMITS.items()
        for arg in (f"--{k}", str(v if k.endswith("timeout") else int(v)))
    ]
    proc = start_agent(base, *limits, *extra)
    wait_listening(proc)
    return Agent(proc, base, base / "run" / "agent.sock", base / "state", LIMITS)


def stop_agent(agent: Agent, timeout: float = 30) -> None:
    """SIGTERM (its kernels end with it: --kernels-on-stop kill), SIGKILL after `timeout`."""
    end_process(agent.proc, signal.SIGTERM, timeout)


@pytest.fixture
def agent_base() -> Iterator[Path]:
    reason = _users_ready()
    if reason is not None:
        pytest.skip(reason)
    # Not pytest's tmp_path: its parents are 0700, so the test users could not reach the
    # socket. Root's own, 0755, as the agent requires.
    base = Path(tempfile.mkdtemp(prefix="cedana-agent-"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def agent(agent_base: Path) -> Iterator[Agent]:
    running = run_agent(agent_base)
    yield running
    stop_agent(running)
    with contextlib.suppress(Exception):
        assert running.proc.stderr is not None
        err = running.proc.stderr.read()
        if "Traceback" in err:
            print(err, file=sys.stderr)


@pytest.fixture
def live_agent(agent: Agent) -> Iterator[Agent]:
    """The agent, its log read as it comes (a full stderr pipe would stall it) and its
    tail printed after the test (pytest shows it when the test fails)."""
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


@contextlib.contextmanager
def ended_after(make: Callable[P, T], end: Callable[[T], None]) -> Iterator[Callable[P, T]]:
    """`make`, remembering what it made; each of those ended (`end`), in order, when the
    block ends: a factory fixture's body."""
    made: list[T] = []

    def remembered(*args: P.args, **kwargs: P.kwargs) -> T:
        made.append(make(*args, **kwargs))
        return made[-1]

    try:
        yield remembered
    finally:
        for thing in made:
            end(thing)


@pytest.fixture
def user_servers(agent_base: Path) -> Iterator[Callable[..., UserServer]]:
    """start(user, socket=None): a server of `user` (servers_on_agent.py) on the agent's
    socket (or `socket`); stopped after the test, their logs' tails printed."""

    def start(user: str, agent_socket: Path | None = None) -> UserServer:
        path = agent_socket or agent_base / "run" / "agent.sock"
        return start_user_server(agent_base, user, path)

    def stop(server: UserServer) -> None:
        stop_user_server(server)
        print(f"---- {server.user}'s server log (last lines) ----\n{server.log_tail()}")

    with ended_after(start, stop) as started:
        yield started
    # Whatever a failed test left of the servers' kernels (their files are under the base).
    for entry in os.listdir("/proc"):
        if entry.isdigit() and str(agent_base) in cmdline(int(entry)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
