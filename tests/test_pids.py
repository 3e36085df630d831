"""Kernels of a root server without a PID namespace (`CheckpointEngine.use_pid_namespace`
off): the image records their task ids, and a restore whose PIDs are taken fails before
CRIU runs, keeping the image."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from traitlets.config import Config

from jupyter_cedana.checkpoint.pids import check_free, task_ids
from jupyter_cedana.errors import ResumeFailed
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import kernel_pids, run, wait_iopub

pytestmark = [pytest.mark.criu, pytest.mark.root]

LAST_PID = "/proc/sys/kernel/ns_last_pid"


@pytest.fixture
def engine_config(checkpoint_root: Path) -> Config:
    c = Config()
    c.CheckpointEngine.checkpoint_root = str(checkpoint_root)
    c.CheckpointEngine.use_pid_namespace = False
    return c


def take_pid(pid: int, attempts: int = 200) -> subprocess.Popen[bytes]:
    """A process holding exactly `pid` (other processes on a busy machine may fork between
    the cursor write and ours: try again)."""
    for _ in range(attempts):
        # The same lock CRIU takes around its use of the cursor.
        with open(LAST_PID, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(str(pid - 1))
            f.flush()
            p = subprocess.Popen(["sleep", "600"])
        if p.pid == pid:
            # Popen returns once exec has closed its error pipe, which the kernel does
            # just before it renames the task: wait for the name the test looks for.
            comm = Path(f"/proc/{pid}/comm")
            while comm.read_text().strip() != "sleep":
                os.sched_yield()
            return p
        p.kill()
        p.wait()
    pytest.fail(f"could not take PID {pid}")


@pytest.fixture
def squatters() -> Iterator[list[subprocess.Popen[bytes]]]:
    held: list[subprocess.Popen[bytes]] = []
    yield held
    for p in held:
        p.kill()
        p.wait()


async def test_restore_refused_while_its_pids_are_taken(
    kernel, checkpoint_root: Path, squatters
) -> None:
    prov = kernel.provisioner
    kc = kernel.test_client
    code = "import threading, time\nv = 'kept'\n"
    code += "threading.Thread(target=time.sleep, args=(9999,), daemon=True).start()"
    await run(kc, code)
    procs = kernel_pids(kernel)
    ids = task_ids(prov.pid)
    threads = set(ids) - procs
    assert threads
    await prov.suspend()
    image = checkpoint_root / kernel.kernel_id
    manifest = json.loads((image / "manifest.json").read_text())
    # Every process and thread of the kernel, recorded while CRIU held it stopped.
    assert set(manifest["task_ids"]) >= set(ids)
    check_free(manifest["task_ids"])  # nothing holds them now

    thread = max(threads)  # a thread's id, not a process's
    squatters.append(take_pid(thread))
    with pytest.raises(ResumeFailed, match=rf"in use by other processes: {thread} \(sleep"):
        await prov.resume()
    assert prov.state == KernelState.failed
    assert "PIDs this kernel needs back" in (prov.reason or "")
    assert (image / "manifest.json").exists()

    for p in squatters:
        p.kill()
        p.wait()
    squatters.clear()
    await prov.resume()
    assert prov.state == KernelState.running
    assert prov.pid in procs  # the same PIDs back
    await wait_iopub(kc)
    _, out = await run(kc, "print(v)")
    assert out.strip() == "kept"


def test_check_free_names_the_holder() -> None:
    with pytest.raises(ResumeFailed, match=rf"{os.getpid()} \("):
        check_free([os.getpid()])
    check_free([])
    check_free(None)
