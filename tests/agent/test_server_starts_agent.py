"""A root server with `CheckpointAgent.start_agent` on starts the checkpoint agent itself
where none answers (jupyter_cedana/server/agent_start.py), and runs its kernels through
it: real root servers, a real agent, real CRIU. Every agent here is on a private socket
and state directory, and is ended by its pid after the test."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.server.agent_start import AGENT_ENV, agent_pid
from tests.userserver import (
    SERVER_DIRS,
    cmdline,
    jupyter_env,
    launch,
    start_as_user,
    stop_server,
    wait_answering,
)

from .servers_on_agent import USER, UserServer, alive, eventually

pytestmark = [pytest.mark.criu, pytest.mark.root]

BIN = Path(sys.executable).parent


@pytest.fixture
def base() -> Iterator[Path]:
    """Root's own directory, 0755 (the agent refuses a socket directory others can write,
    and the test user's server must reach the socket); every process that names it is
    killed afterwards (a started agent keeps its kernels when stopped)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    path = Path(tempfile.mkdtemp(prefix="cedana-start-"))
    os.chmod(path, 0o755)
    yield path
    marker = path / "run" / "agent.sock.started"
    with contextlib.suppress(OSError, ValueError, KeyError):
        os.kill(int(json.loads(marker.read_text())["pid"]), signal.SIGKILL)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and str(path) in cmdline(int(entry)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


def sock(base: Path) -> Path:
    return base / "run" / "agent.sock"


def launch_root_server(base: Path, name: str, *args: str, start: bool = True) -> UserServer:
    """A root server on base/<name>, with a `criu` first on its PATH that records that it
    ran (a server on the agent runs none), not yet waited for."""
    home = base / name
    dirs = {d: home / d for d in SERVER_DIRS}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    tripwire = home / "tripwire"
    tripwire.mkdir(exist_ok=True)
    marker = home / "criu-ran"
    (tripwire / "criu").write_text(f'#!/bin/sh\necho "criu $*" >> {marker}\nexit 1\n')
    (tripwire / "criu").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "JPY_"))}
    env.update(jupyter_env(dirs), PATH=f"{tripwire}:{BIN}:{env.get('PATH', '')}")
    # A variable of the server's that must not reach the root agent.
    env["CEDANA_TEST_LEAK"] = "1"
    return launch(
        UserServer,
        BIN / "jupyter",
        dirs,
        "--allow-root",
        "--SuspendPolicy.idle_timeout=0",
        f"--CheckpointAgent.start_agent={start}",
        f"--CheckpointAgent.socket={sock(base)}",
        f"--CheckpointAgent.state_dir={base / 'state'}",
        *args,
        env=env,
        log=base / f"{name}.log",
        criu_marker=marker,
    )


@pytest.fixture
def servers(base: Path) -> Iterator[Callable[..., UserServer]]:
    """start(name, *args, wait=True): a root server with start_agent on; each one stopped
    after the test, its log's tail printed."""
    made: list[UserServer] = []

    def start(name: str, *args: str, wait: bool = True, **kw: Any) -> UserServer:
        made.append(launch_root_server(base, name, *args, **kw))
        return wait_answering(made[-1]) if wait else made[-1]

    yield start
    for server in made:
        stop_server(server, signal.SIGTERM)
        print(f"---- {server.log} (last lines) ----\n{server.log_tail(3000)}")


def status(server: UserServer) -> dict[str, Any]:
    code, st = server.api("GET", "api/cedana/status")
    assert code == 200, (code, st)
    return dict(st)


def agent_request(base: Path, op: str) -> dict[str, Any]:
    """One request to the agent as root, the uid of the servers here."""
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_cedana.agent.client", "--socket", str(sock(base)), op],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    reply: dict[str, Any] = json.loads(out.stdout)
    assert reply["ok"], reply
    return dict(reply["result"])


def listed(base: Path) -> dict[str, str]:
    return {k["kernel_id"]: k["state"] for k in agent_request(base, "list")["kernels"]}


def agents_on(base: Path) -> list[int]:
    """The agent processes on this test's socket."""
    return [
        int(e)
        for e in os.listdir("/proc")
        if e.isdigit() and f"jupyter_cedana.agent --socket {sock(base)}" in cmdline(int(e))
    ]


def test_root_server_starts_an_agent_and_suspends_through_it(
    base: Path, servers: Callable[..., UserServer]
) -> None:
    server = servers("a")
    st = status(server)
    assert st["available"], st
    assert st["agent_socket"] == str(sock(base))
    started = st["agent_started"]
    assert started is not None and started["by_this_server"], st
    assert started["started_by"] == server.proc.pid
    pid = started["pid"]
    assert agent_pid(str(sock(base))) == pid
    # Detached: a session and process group of its own, not the server's.
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid
    assert os.getpgid(server.proc.pid) != pid
    # A fixed environment: nothing of the server's.
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert {e.decode() for e in environ if e} == {f"{k}={v}" for k, v in AGENT_ENV.items()}
    log = base / "state" / "agent.log"
    assert started["log"] == str(log) and "listening on" in log.read_text()

    kid = server.start_kernel()
    assert listed(base) == {kid: "running"}
    assert server.output(kid, "x = 6 * 7\nprint('set')") == "set\n"
    assert server.suspend(kid)["state"] == "suspended"
    assert listed(base) == {kid: "dumped"}
    images = [i["kernel_id"] for i in agent_request(base, "images")["images"]]
    assert images == [kid]
    assert (base / "state" / "images" / "0" / kid).is_dir()
    assert not (server.checkpoint_root / kid).exists()
    assert server.output(kid, "print(x)") == "42\n"
    assert listed(base) == {kid: "running"}
    assert server.criu_runs() == []

    out = subprocess.run(
        [BIN / "jupyter", "cedana", "status"],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out
    assert f"(pid {pid}, started by this server; log: {log})" in out.stdout


def test_the_agent_outlives_the_servers_sigkill_and_the_next_server_uses_it(
    base: Path, servers: Callable[..., UserServer]
) -> None:
    first = servers("a")
    pid = status(first)["agent_started"]["pid"]
    kid = first.start_kernel()
    assert first.output(kid, "y = 'kept'\nprint('set')") == "set\n"

    first.proc.kill()
    first.proc.wait()
    assert agent_pid(str(sock(base))) == pid
    assert listed(base) == {kid: "running"}

    second = servers("a")  # the same directories: it attaches to the kernel
    st = status(second)
    assert st["available"], st
    assert st["agent_started"]["pid"] == pid
    assert not st["agent_started"]["by_this_server"]
    assert st["agent_started"]["started_by"] == first.proc.pid
    assert agents_on(base) == [pid]
    assert eventually(lambda: kid in [k["id"] for k in second.api("GET", "api/kernels")[1]], 60)
    assert second.output(kid, "print(y)") == "kept\n"


def test_two_servers_starting_together_start_one_agent(
    base: Path, servers: Callable[..., UserServer]
) -> None:
    # Held here, the start lock keeps both servers at it until both are there.
    (base / "run").mkdir(mode=0o755)
    lock_path = base / "run" / "agent.sock.lock"
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        both = [servers(name, wait=False) for name in ("a", "b")]

        def waiting(server: UserServer) -> bool:
            fds = Path(f"/proc/{server.proc.pid}/fd")
            with contextlib.suppress(OSError):
                return any(os.readlink(fd) == str(lock_path) for fd in fds.iterdir())
            return False

        assert eventually(lambda: all(waiting(s) for s in both), 90), [
            s.log_tail(2000) for s in both
        ]
        assert agents_on(base) == []
    finally:
        os.close(lock)
    for server in both:
        wait_answering(server)
    pids = {status(s)["agent_started"]["pid"] for s in both}
    assert len(pids) == 1 and all(status(s)["available"] for s in both)
    assert agents_on(base) == list(pids)
    assert [status(s)["agent_started"]["by_this_server"] for s in both].count(True) == 1


def test_with_start_agent_off_no_agent_is_started(
    base: Path, servers: Callable[..., UserServer]
) -> None:
    server = servers("a", start=False)
    st = status(server)
    assert not st["available"]
    assert f"no checkpoint agent answers at {sock(base)}" in st["reason"]
    assert st["agent_started"] is None
    assert not (base / "run").exists() and not (base / "state").exists()
    assert agents_on(base) == []


def test_an_agent_that_cannot_start_leaves_checkpointing_unavailable_with_the_reason(
    base: Path, servers: Callable[..., UserServer]
) -> None:
    # A state directory the test user owns: root must not write there.
    entry = pwd.getpwnam(USER)
    (base / "state").mkdir(mode=0o700)
    os.chown(base / "state", entry.pw_uid, entry.pw_gid)
    server = servers("a")
    st = status(server)
    assert not st["available"]
    assert "this server could not start one" in st["reason"], st
    assert "must be a directory of root's" in st["reason"], st
    assert agents_on(base) == []


def test_a_server_not_running_as_root_never_starts_one(base: Path) -> None:
    entry = pwd.getpwnam(USER)
    home = base / "user"
    home.mkdir(mode=0o700)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    (base / "run").mkdir(mode=0o755)
    server = start_as_user(
        UserServer,
        home,
        USER,
        "--CheckpointAgent.start_agent=True",
        f"--CheckpointAgent.socket={sock(base)}",
        f"--CheckpointAgent.state_dir={base / 'state'}",
        log=base / "user.log",
        criu_marker=home / "criu-ran",
    )
    try:
        st = status(server)
        assert not st["available"]
        assert "starts one only in a server running as root" in st["reason"], st
        assert agents_on(base) == [] and not (base / "state").exists()
    finally:
        stop_server(server, signal.SIGTERM)
    assert not alive(server.proc.pid)
