"""A real `jupyter server` in a subprocess, as the tests start one: on a free port of
127.0.0.1 with a fresh token, its own runtime, config and data directories, stdin not a
terminal (as under a spawner) and its output in a log file; waited for until the
extension answers, and stopped as a spawner stops it.

Root's servers (tests/test_cli.py and the tests built on it) run from this virtualenv;
the test users' (cedana-test, cedana-test2: scripts/setup.sh --test) from the users'
virtualenv, with the environment a spawner gives them and no supplementary group
(tests/test_nonroot_without_agent.py, tests/agent/)."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
# A virtualenv the test users can run (root's may lie where they cannot read).
NONROOT_BIN = REPO / ".venv-nonroot" / "bin"
WAIT = 120.0
# A server's own directories, by the name `launch` and `start_as_user` take them.
SERVER_DIRS = ("runtime", "root", "config", "data", "checkpoints")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cmdline(pid: int) -> str:
    """The process's command line, "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def end_process(proc: subprocess.Popen[Any], sig: int, timeout: float) -> None:
    """Send `sig` and wait `timeout` seconds for it to end, then SIGKILL; reaped either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class JupyterServer:
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    # The user it runs as (None: this process's), and the environment it was started with.
    user: str | None
    env: dict[str, str]
    runtime_dir: Path
    checkpoint_root: Path
    log: Path

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """A REST call with the token: (status, the JSON body, or the text of an error
        whose body is not JSON). A POST with no body sends `{}`."""
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
        return str(k["id"])

    def kernel(self, kid: str) -> dict[str, Any]:
        """The kernel as the extension shows it (api/cedana/kernels/<id>)."""
        status, k = self.api("GET", f"api/cedana/kernels/{kid}")
        assert status == 200, (status, k)
        return dict(k)

    def log_errors(self, lines: int = 6) -> list[str]:
        """The log's last error lines: a failed assertion's message stays short."""
        text = self.log.read_text(errors="replace").splitlines()
        return [ln for ln in text if ln.startswith("[E") or "Error" in ln][-lines:]

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


S = TypeVar("S", bound=JupyterServer)


def jupyter_env(dirs: Mapping[str, Path]) -> dict[str, str]:
    """The variables that give a server its runtime, config and data directories."""
    return {
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
    }


def launch(
    kind: type[S],
    jupyter: str | Path,
    dirs: Mapping[str, Path],
    *args: str,
    env: dict[str, str],
    log: Path,
    user: str | None = None,
    **fields: Any,
) -> S:
    """`jupyter server ARGS` with root_dir and checkpoint_root from `dirs`, in `env`, its
    output to `log`; as `user`, with the user's uid and gid and no supplementary group, so
    that nothing privileged is within its reach. Not waited for: `wait_answering`.
    `fields`: those of `kind` beyond JupyterServer's."""
    token = secrets.token_hex(16)
    port = free_port()
    argv = [
        str(jupyter),
        "server",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        "--ServerApp.open_browser=False",
        f"--ServerApp.root_dir={dirs['root']}",
        f"--CedanaApp.checkpoint_root={dirs['checkpoints']}",
        *args,
    ]
    ids: dict[str, Any] = {}
    if user is not None:
        entry = pwd.getpwnam(user)
        ids = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=dirs["root"],
            **ids,
        )
    return kind(
        proc=proc,
        url=f"http://127.0.0.1:{port}/",
        token=token,
        user=user,
        env=env,
        runtime_dir=dirs["runtime"],
        checkpoint_root=dirs["checkpoints"],
        log=log,
        **fields,
    )


def wait_answering(server: S, timeout: float = WAIT, ready: Callable[[], bool] = lambda: True) -> S:
    """Wait until the extension answers (api/cedana/status) and `ready` holds. A server
    that exits, or does not answer in time (it is killed then), fails with its log."""
    who = f"{server.user}'s server" if server.user else "the jupyter server"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"{who} exited ({server.proc.returncode}):\n{server.log_tail()}")
        if ready():
            with contextlib.suppress(OSError):
                if server.api("GET", "api/cedana/status")[0] == 200:
                    return server
        time.sleep(0.2)
    server.proc.kill()
    server.proc.wait()
    raise AssertionError(f"{who} did not answer in {timeout:g} s:\n{server.log_tail()}")


def start_as_user(
    kind: type[S],
    home: Path,
    user: str,
    *args: str,
    log: Path,
    path_first: Sequence[Path] = (),
    **fields: Any,
) -> S:
    """`user`'s server from the users' virtualenv (`path_first` before it on the PATH),
    on directories of the user's under `home` (kept where they exist: a server started
    again finds what the last one left), in the environment a spawner gives it; once it
    answers."""
    entry = pwd.getpwnam(user)
    dirs = {name: home / name for name in SERVER_DIRS}
    for d in dirs.values():
        d.mkdir(mode=0o700, exist_ok=True)
        os.chown(d, entry.pw_uid, entry.pw_gid)
    env = {
        "HOME": entry.pw_dir,
        "USER": user,
        "PATH": ":".join([*map(str, path_first), str(NONROOT_BIN), "/usr/bin", "/bin"]),
        "LANG": "C.UTF-8",
        **jupyter_env(dirs),
    }
    server = launch(
        kind, NONROOT_BIN / "jupyter", dirs, *args, env=env, log=log, user=user, **fields
    )
    return wait_answering(server)


def stop_server(server: JupyterServer, sig: int = signal.SIGINT) -> None:
    """Ask the server to shut down (api/shutdown) and wait for it; one that does not end
    gets `sig` (SIGINT: as a spawner stops it first), then SIGKILL."""
    if server.proc.poll() is None:
        with contextlib.suppress(OSError):
            server.api("POST", "api/shutdown")
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            end_process(server.proc, sig, 30)
