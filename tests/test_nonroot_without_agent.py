"""A jupyter server of an ordinary user with no checkpoint agent configured: it runs no
CRIU and holds no capability, so it says checkpointing is unavailable and names the fix
(CheckpointAgent.socket), and its kernels run as the stock provisioner runs them: no
cedana-init, the server's child, as the user.

Real parts: the server runs as cedana-test (scripts/setup.sh --test) from the users'
virtualenv, started from root; real ipykernel, reached over its own ZMQ channels."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking import BlockingKernelClient

from jupyter_cedana.checkpoint.proctree import process_tree, stat_fields

pytestmark = [pytest.mark.root]

REPO = Path(__file__).resolve().parent.parent
NONROOT_BIN = REPO / ".venv-nonroot" / "bin"
USER = "cedana-test"
WAIT = 120.0
FIX = "CheckpointAgent.socket"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    runtime: Path
    log: Path

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
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
            return e.code, json.loads(raw) if raw else None

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
def server() -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("starts a server as another user: needs root")
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        pytest.fail(f"no user {USER}: run scripts/setup.sh --test")
    if not (NONROOT_BIN / "jupyter").exists():
        pytest.fail(f"no {NONROOT_BIN}: run scripts/setup.sh --test")
    base = Path(tempfile.mkdtemp(prefix="cedana-no-agent-"))
    base.chmod(0o755)  # pytest's tmp_path lies under a 0700 directory
    dirs = {n: base / n for n in ("runtime", "root", "config", "data", "checkpoints")}
    for d in dirs.values():
        d.mkdir(mode=0o700)
        os.chown(d, entry.pw_uid, entry.pw_gid)
    token = secrets.token_hex(16)
    port = free_port()
    env = {
        "HOME": entry.pw_dir,
        "USER": USER,
        "PATH": f"{NONROOT_BIN}:/usr/bin:/bin",
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
    ]
    log = base / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            user=entry.pw_uid,
            group=entry.pw_gid,
            extra_groups=[],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=dirs["root"],
        )
    srv = Server(proc, f"http://127.0.0.1:{port}/", token, dirs["runtime"], log)
    try:
        deadline = time.monotonic() + WAIT
        while True:
            assert proc.poll() is None, f"the server exited:\n{srv.log_tail()}"
            assert time.monotonic() < deadline, f"the server never answered:\n{srv.log_tail()}"
            try:
                if srv.call("GET", "api/status")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        yield srv
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def kernel_process(srv: Server, kid: str) -> int:
    """The pid of the kernel whose connection file names `kid`."""
    for pid in process_tree(srv.proc.pid):
        if f"kernel-{kid}.json" in cmdline(pid):
            return pid
    raise AssertionError(f"no process of kernel {kid} below the server")


def run_cell(srv: Server, kid: str, code: str) -> str:
    kc = BlockingKernelClient(connection_file=str(srv.runtime / f"kernel-{kid}.json"))
    kc.load_connection_file()
    # No heartbeat: a beat missed on a loaded machine would read as a dead kernel.
    kc.start_channels(hb=False)
    try:
        kc.wait_for_ready(timeout=WAIT)
        out: list[str] = []
        reply = kc.execute_interactive(
            code,
            timeout=WAIT,
            output_hook=lambda m: out.append(m["content"].get("text", "")),
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)
    finally:
        kc.stop_channels()


def test_a_server_without_agent_runs_stock_kernels_and_says_why_it_cannot_checkpoint(
    server: Server,
) -> None:
    uid = pwd.getpwnam(USER).pw_uid

    code, status = server.call("GET", "api/cedana/status")
    assert code == 200, status
    assert status["available"] is False, status
    assert "not root" in status["reason"] and FIX in status["reason"], status
    assert status["root"] is False

    code, kernel = server.call("POST", "api/kernels", {"name": "python3"})
    assert code == 201, (kernel, server.log_tail())
    kid = kernel["id"]
    pid = kernel_process(server, kid)
    # As the stock provisioner starts it: the server's own child, no cedana-init.
    assert int(stat_fields(pid)[1]) == server.proc.pid
    assert not any("cedana-init" in cmdline(p) for p in process_tree(server.proc.pid))
    assert Path(f"/proc/{pid}").stat().st_uid == uid
    assert run_cell(server, kid, "import os; x = 41; print(os.geteuid())").strip() == str(uid)

    code, err = server.call("POST", f"api/cedana/kernels/{kid}/suspend", {})
    assert code == 503, err
    assert err["code"] == "engine_unavailable", err
    assert "not root" in err["message"] and FIX in err["message"], err

    # The refused suspend left the kernel as it was.
    assert run_cell(server, kid, "print(x + 1)").strip() == "42"
    code, view = server.call("GET", f"api/cedana/kernels/{kid}")
    assert code == 200 and view["state"] == "running", view

    code, _ = server.call("DELETE", f"api/kernels/{kid}")
    assert code == 204
    deadline = time.monotonic() + WAIT
    while Path(f"/proc/{pid}").exists() and stat_fields(pid)[:1] not in (["Z"], ["X"]):
        assert time.monotonic() < deadline, f"kernel {pid} outlived its shutdown"
        time.sleep(0.1)
