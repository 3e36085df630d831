"""A jupyter server of an ordinary user with no checkpoint agent configured: it runs no
CRIU and holds no capability, so it says checkpointing is unavailable and names the fix
(CheckpointAgent.socket), and its kernels run as the stock provisioner runs them: no
cedana-init, the server's child, as the user.

Real parts: the server runs as cedana-test (scripts/setup.sh --test) from the users'
virtualenv, started from root; real ipykernel, reached over its own ZMQ channels."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.blocking import BlockingKernelClient

from jupyter_cedana.checkpoint.proctree import process_tree, stat_fields
from tests.userserver import NONROOT_BIN, WAIT, JupyterServer, cmdline, start_as_user, stop_server

pytestmark = [pytest.mark.root]

USER = "cedana-test"
FIX = "CheckpointAgent.socket"


@pytest.fixture
def server() -> Iterator[JupyterServer]:
    if os.geteuid() != 0:
        pytest.skip("starts a server as another user: needs root")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        pytest.fail(f"no user {USER}: run scripts/setup.sh --test")
    if not (NONROOT_BIN / "jupyter").exists():
        pytest.fail(f"no {NONROOT_BIN}: run scripts/setup.sh --test")
    base = Path(tempfile.mkdtemp(prefix="cedana-no-agent-"))
    base.chmod(0o755)  # pytest's tmp_path lies under a 0700 directory
    try:
        srv = start_as_user(JupyterServer, base, USER, log=base / "server.log")
        try:
            yield srv
        finally:
            stop_server(srv, signal.SIGTERM)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def kernel_process(srv: JupyterServer, kid: str) -> int:
    """The pid of the kernel whose connection file names `kid`."""
    for pid in process_tree(srv.proc.pid):
        if f"kernel-{kid}.json" in cmdline(pid):
            return pid
    raise AssertionError(f"no process of kernel {kid} below the server")


def run_cell(srv: JupyterServer, kid: str, code: str) -> str:
    kc = BlockingKernelClient(connection_file=str(srv.runtime_dir / f"kernel-{kid}.json"))
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
    server: JupyterServer,
) -> None:
    uid = pwd.getpwnam(USER).pw_uid

    code, status = server.api("GET", "api/cedana/status")
    assert code == 200, status
    assert status["available"] is False, status
    assert "not root" in status["reason"] and FIX in status["reason"], status
    assert status["root"] is False

    code, kernel = server.api("POST", "api/kernels", {"name": "python3"})
    assert code == 201, (kernel, server.log_tail())
    kid = kernel["id"]
    pid = kernel_process(server, kid)
    # As the stock provisioner starts it: the server's own child, no cedana-init.
    assert int(stat_fields(pid)[1]) == server.proc.pid
    assert not any("cedana-init" in cmdline(p) for p in process_tree(server.proc.pid))
    assert Path(f"/proc/{pid}").stat().st_uid == uid
    assert run_cell(server, kid, "import os; x = 41; print(os.geteuid())").strip() == str(uid)

    code, err = server.api("POST", f"api/cedana/kernels/{kid}/suspend", {})
    assert code == 503, err
    assert err["code"] == "engine_unavailable", err
    assert "not root" in err["message"] and FIX in err["message"], err

    # The refused suspend left the kernel as it was.
    assert run_cell(server, kid, "print(x + 1)").strip() == "42"
    code, view = server.api("GET", f"api/cedana/kernels/{kid}")
    assert code == 200 and view["state"] == "running", view

    code, _ = server.api("DELETE", f"api/kernels/{kid}")
    assert code == 204
    deadline = time.monotonic() + WAIT
    while Path(f"/proc/{pid}").exists() and stat_fields(pid)[:1] not in (["Z"], ["X"]):
        assert time.monotonic() < deadline, f"kernel {pid} outlived its shutdown"
        time.sleep(0.1)
