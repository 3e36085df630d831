"""A real agent, started as root on a private socket and state directory, and clients
that run as the test users (cedana-test, cedana-test2) through runuser."""

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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# A venv the test users can run (the root one may live where they cannot read).
USER_PYTHON = str(REPO / ".venv-nonroot" / "bin" / "python")
USERS = ("cedana-test", "cedana-test2")


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


LIMITS = {"frame-timeout": 2.0, "idle-timeout": 20.0, "max-connections-per-uid": 4}


@pytest.fixture
def agent(agent_base: Path) -> Iterator[Agent]:
    extra = [
        arg
        for k, v in LIMITS.items()
        for arg in (f"--{k}", str(v if k.endswith("timeout") else int(v)))
    ]
    proc = start_agent(agent_base, *extra)
    wait_listening(proc)
    running = Agent(
        proc, agent_base, agent_base / "run" / "agent.sock", agent_base / "state", LIMITS
    )
    yield running
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(Exception):
        assert proc.stderr is not None
        err = proc.stderr.read()
        if "Traceback" in err:
            print(err, file=sys.stderr)
