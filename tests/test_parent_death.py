"""Kernels end with the process that started them, restored ones too (a jupyter server
killed with SIGKILL must not leave kernels running, as stock ipykernel would not)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import alive, stand_in_server

pytestmark = pytest.mark.criu

SERVER = r"""
import asyncio, json, os, sys
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import KernelProvisionerFactory
from traitlets.config import Config
from jupyter_cedana.checkpoint.proctree import process_tree

async def main():
    KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
    c = Config()
    c.CheckpointEngine.checkpoint_root = sys.argv[1]
    plain, restored = AsyncKernelManager(config=c), AsyncKernelManager(config=c)
    for km in (plain, restored):
        await km.start_kernel()
    await restored.provisioner.suspend()
    await restored.provisioner.resume()
    pids = sorted(process_tree(plain.provisioner.pid) | process_tree(restored.provisioner.pid))
    keepers = [plain.provisioner.process.pid, restored.provisioner.process.pid]
    print(json.dumps({"pids": pids, "keepers": keepers}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_kernels_end_when_their_server_is_killed(tmp_path: Path) -> None:
    server, started = stand_in_server(SERVER, str(tmp_path / "checkpoints"))
    try:
        pids = started["pids"] + started["keepers"]
        assert len(started["pids"]) >= 4 and all(alive(p) for p in pids)
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        assert [p for p in pids if alive(p)] == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


INIT = Path(__file__).resolve().parent.parent / "jupyter_cedana" / "bin" / "cedana-init"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("keeper", [False, True])
def test_a_starter_that_died_before_the_watcher_looked_counts_as_dead(
    tmp_path: Path, keeper: bool
) -> None:
    # The server died before cedana-init armed its parent-death signal: by then getppid()
    # names whoever it was handed to, so only the starter's own pid can tell. The pid of a
    # process already gone stands for that server, deterministically.
    mode = ["--keeper", str(tmp_path / "pidfile")] if keeper else []
    proc = subprocess.run(
        [
            str(INIT),
            *mode,
            "--die-with-parent",
            "--parent-pid",
            str(_dead_pid()),
            "--",
            "sleep",
            "300",
        ],
        timeout=60,
    )
    assert proc.returncode != 0


def test_a_live_starter_named_by_pid_is_not_taken_for_dead() -> None:
    proc = subprocess.run(
        [
            str(INIT),
            "--die-with-parent",
            "--parent-pid",
            str(os.getpid()),
            "--",
            "sh",
            "-c",
            "exit 7",
        ],
        timeout=60,
    )
    assert proc.returncode == 7


def test_a_page_server_whose_server_died_before_it_looked_exits() -> None:
    # A lazy restore's page server started by a server killed at that moment would wait
    # in accept() forever (seen in the chaos run). With the server's pid it knows.
    pages = INIT.parent / "cedana-pages"
    gone = subprocess.run([str(pages), "--parent-pid", str(_dead_pid())], timeout=60)
    assert gone.returncode == 1
    # Its parent alive: it goes on (to its usage message here, with no image given).
    alive_parent = subprocess.run(
        [str(pages), "--parent-pid", str(os.getpid())], capture_output=True, timeout=60
    )
    assert alive_parent.returncode == 2 and b"usage" in alive_parent.stderr
