"""A root server's own checkpoint agent (`CheckpointAgent.start_agent`, docs/agent.md):
where no agent answers on the configured socket, the server starts the package's agent
entry point, detached, and waits until it answers; later servers find it and use it.

The agent is started as a program, never imported: the server must not hold the agent's
privileged code. It runs from a fixed argv and a fixed environment (nothing of the
server's environment, which a user may have set, reaches a root process that runs CRIU),
in a session of its own and, under systemd, a scope of its own (a SIGKILL of the server,
of its process group, or the stop of its unit leaves it running), its output appended to
`agent.log` in its state directory.

Two servers starting together start one agent: the start is serialised by an flock on a
root-owned file next to the socket, and whoever gets the lock asks the socket again
first. Next to it, `<socket>.started` says which process started the agent and where its
log is, so that every server's status can say where its agent came from.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..agent import protocol
from ..checkpoint.proctree import stat_fields

#: The agent's own default state directory (jupyter-cedana-agent --state-dir).
DEFAULT_STATE_DIR = "/var/lib/jupyter-cedana-agent"
LOG_NAME = "agent.log"
#: The agent's environment: a root process that runs CRIU takes nothing from the server's.
AGENT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
_HELLO_TIMEOUT = 2.0
_POLL = 0.1


class AgentStartFailed(RuntimeError):
    """No agent answers and this server could not start one; the message says why."""


def argv(socket_path: str, state_dir: str) -> list[str]:
    """The agent's command line. `-I`: no PYTHON* variable, user site or working directory
    steers which code the root process imports."""
    return [
        sys.executable,
        "-I",
        "-m",
        "jupyter_cedana.agent",
        "--socket",
        socket_path,
        "--state-dir",
        state_dir,
    ]


def command(socket_path: str, state_dir: str) -> list[str]:
    """What is run: `argv()`, under systemd in a transient scope of its own. A session of
    its own takes the agent out of the server's process group, not out of its control
    group, which systemd kills whole when the server's unit stops (KillMode=control-group,
    the default) or, with KillUserProcesses, when the user who ran it logs out."""
    run = shutil.which("systemd-run", path=AGENT_ENV["PATH"])
    if run is None or not os.path.isdir("/run/systemd/system"):  # sd_booted()
        return argv(socket_path, state_dir)
    unit = f"jupyter-cedana-agent-{os.getpid()}-{int(time.time())}"
    return [
        run,
        "--scope",
        "--quiet",
        "--collect",
        f"--unit={unit}",
        "--",
        *argv(socket_path, state_dir),
    ]


def agent_pid(socket_path: str, timeout: float = _HELLO_TIMEOUT) -> int | None:
    """The pid of the agent that answers `hello` on the socket (its SO_PEERCRED), or None
    when none answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(socket_path)
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _ = struct.unpack("3i", creds)
            request = {"v": protocol.VERSION, "id": 1, "op": "hello", "args": {}}
            s.sendall(protocol.encode(request, protocol.MAX_REQUEST))
            frame = protocol.recv_frame(s, protocol.MAX_RESPONSE)
    except (OSError, ValueError, protocol.AgentError):
        return None
    # Only root's agent is an agent: a user's process on a stale socket path is not.
    if frame is None or uid != 0 or not frame.get("ok"):
        return None
    return int(pid)


def _start_time(pid: int) -> str | None:
    fields = stat_fields(pid)
    return fields[19] if len(fields) > 19 else None


def _marker(socket_path: str) -> Path:
    return Path(socket_path + ".started")


def started_agent(socket_path: str) -> dict[str, Any] | None:
    """Where the agent on this socket came from, if a server started it and it still runs:
    `pid` (the agent's), `started_by` (the server's pid), `by_this_server`, `log`,
    `state_dir`, `started_at` (Unix time). None: it was started otherwise (a systemd
    unit, by hand), or it is gone."""
    try:
        st = os.lstat(_marker(socket_path))
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            return None
        record = json.loads(_marker(socket_path).read_text())
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # The agent that was started, not a process that took its pid later.
    if _start_time(pid) != record.get("start_time"):
        return None
    return {
        "pid": pid,
        "started_by": record.get("started_by"),
        "by_this_server": record.get("started_by") == os.getpid(),
        "log": record.get("log"),
        "state_dir": record.get("state_dir"),
        "started_at": record.get("started_at"),
    }


def _root_dir(path: Path, mode: int) -> None:
    """`path` as a directory of root's that only root writes, made if missing (its parent
    must exist). A directory that others could write would let them plant the lock, the
    log or the marker that root then opens."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise AgentStartFailed(
            f"{path} must be a directory of root's that only root can write "
            f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)})"
        )


def _open_private(path: Path, flags: int) -> int:
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def ensure_agent(socket_path: str, state_dir: str, timeout: float) -> dict[str, Any] | None:
    """An agent answering on `socket_path`: the one there, or one started now on
    `state_dir`, waited for up to `timeout` seconds. Returns `started_agent()`'s record
    (None for an agent no server started). Raises AgentStartFailed with the reason."""
    if agent_pid(socket_path) is not None:
        return started_agent(socket_path)
    if os.geteuid() != 0:
        raise AgentStartFailed("only a server running as root starts a checkpoint agent")
    deadline = time.monotonic() + timeout
    sock_dir = Path(socket_path).parent
    try:
        _root_dir(sock_dir, 0o755)
        lock = _open_private(sock_dir / (Path(socket_path).name + ".lock"), os.O_RDWR)
    except OSError as e:
        raise AgentStartFailed(f"cannot prepare {sock_dir}: {e}") from e
    try:
        _lock(lock, deadline, socket_path)
        # Whoever held the lock before may have started one.
        if agent_pid(socket_path) is not None:
            return started_agent(socket_path)
        return _start(socket_path, state_dir, deadline)
    finally:
        os.close(lock)  # and the lock with it


def _lock(fd: int, deadline: float, socket_path: str) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise AgentStartFailed(
                    f"another process has been starting the agent at {socket_path} for too long"
                ) from None
            time.sleep(_POLL)


def _start(socket_path: str, state_dir: str, deadline: float) -> dict[str, Any]:
    state = Path(state_dir)
    try:
        _root_dir(state, 0o700)
        log_path = state / LOG_NAME
        log = _open_private(log_path, os.O_WRONLY | os.O_APPEND)
    except OSError as e:
        raise AgentStartFailed(f"cannot prepare the agent's state directory {state}: {e}") from e
    try:
        run = command(socket_path, state_dir)
        os.write(log, f"---- started by jupyter server {os.getpid()}: {run}\n".encode())
        proc = subprocess.Popen(
            run,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd="/",
            env=dict(AGENT_ENV),
            close_fds=True,
            start_new_session=True,
            umask=0o022,
        )
    except OSError as e:
        raise AgentStartFailed(f"cannot run {sys.executable}: {e}") from e
    finally:
        os.close(log)
    while (pid := agent_pid(socket_path)) is None:
        code = proc.poll()
        if code is not None:
            raise AgentStartFailed(
                f"the agent it started exited with status {code}: {_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            # A half-started agent would hold the socket path from the next try.
            proc.kill()
            proc.wait()
            raise AgentStartFailed(
                f"the agent it started did not answer in time: {_tail(log_path)}"
            )
        time.sleep(_POLL)
    record = {
        "pid": pid,
        "start_time": _start_time(pid),
        "started_by": os.getpid(),
        "log": str(log_path),
        "state_dir": str(state),
        "started_at": time.time(),
    }
    _write_marker(socket_path, record)
    found = started_agent(socket_path)
    assert found is not None
    return found


def _write_marker(socket_path: str, record: dict[str, Any]) -> None:
    marker = _marker(socket_path)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, marker)


def _tail(log_path: Path, nbytes: int = 600) -> str:
    """The end of the agent's log: why it refused to start (it says so on stderr)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
            text = f.read().decode(errors="replace").strip()
    except OSError as e:
        return f"(its log {log_path} cannot be read: {e})"
    return f"{text} (log: {log_path})" if text else f"nothing in its log {log_path}"
