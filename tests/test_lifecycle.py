"""Restart, shutdown, cancellation and timeouts while a suspend or resume is in flight,
each held at an exact point by the criu wrapper (tests/criu_hold.py); and what every
kernel client relies on at start and shutdown (the peer suites in scripts/conformance.sh
run the full check)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from jupyter_cedana.checkpoint.proctree import process_tree
from jupyter_cedana.checkpoint.store import ROOT_MARKER
from jupyter_cedana.errors import Conflict, SuspendFailed
from jupyter_cedana.server.kernel.ports import kernel_ports
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import kernel_pids, run, wait_iopub

pytestmark = pytest.mark.criu


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if proc_state(p) not in ("gone", "Z", "X")}


async def gone(pids: set[int], timeout: float = 60) -> set[int]:
    """The processes of `pids` still there after they were killed (SIGKILL is not
    synchronous: a dying tree needs a moment); empty when all are gone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while alive(pids) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return alive(pids)


def image_dirs(root: Path) -> list[str]:
    """Images and temporaries (dumps in progress, deletions) under the checkpoint root,
    and the records of suspended kernels."""
    records = (
        sorted(p.name for p in (root / ".parked").glob("*")) if (root / ".parked").is_dir() else []
    )
    bookkeeping = (".logs", ".work", ".parked", ROOT_MARKER)
    return sorted(p.name for p in root.iterdir() if p.name not in bookkeeping) + records


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def fresh_namespace(km: Any) -> bool:
    kc = km.test_client
    await kc.wait_for_ready(timeout=60)
    await wait_iopub(kc)
    _reply, out = await run(kc, "print('x' in dir())")
    return out.strip() == "False"


def restored_root(checkpoint_root: Path, kernel_id: str) -> int:
    """The PID CRIU wrote for a restore held at restore/after."""
    return int((checkpoint_root / ".work" / kernel_id / "restored.pid.held").read_text())


async def held_suspend(km: Any, hold: Any, point: str) -> asyncio.Future[Any]:
    """A suspend of `km`, held by criu_hold at dump/POINT."""
    hold.attach(km.provisioner.engine)
    hold.arm("dump", point)
    task = asyncio.ensure_future(km.provisioner.suspend())
    await hold.wait_reached("dump", point)
    return task


async def held_resume(
    km: Any, hold: Any, checkpoint_root: Path, point: str = "after"
) -> tuple[asyncio.Future[Any], set[int]]:
    """Suspend `km`, then a resume held at restore/POINT, and the restored tree's
    processes when there is one (not yet continued: CRIU leaves it stopped)."""
    prov = km.provisioner
    hold.attach(prov.engine)
    await prov.suspend()
    hold.arm("restore", point)
    task = asyncio.ensure_future(prov.resume())
    await hold.wait_reached("restore", point)
    if point == "before":
        return task, set()
    restored = process_tree(restored_root(checkpoint_root, km.kernel_id))
    assert restored
    return task, restored


# -- restart or shutdown while a suspend is in flight --------------------------------------


@pytest.mark.parametrize("point", ["before", "after"])
async def test_restart_during_dump_runs_a_fresh_kernel(
    kernel, criu_hold, checkpoint_root: Path, point: str
) -> None:
    prov = kernel.provisioner
    await run(kernel.test_client, "x = 1")
    old = kernel_pids(kernel)
    suspend = await held_suspend(kernel, criu_hold, point)
    joiner = asyncio.ensure_future(prov.suspend())
    assert prov.state == KernelState.suspending

    await kernel.restart_kernel()
    for task in (suspend, joiner):
        with pytest.raises(Conflict, match="restarting"):
            await task
    assert prov.state == KernelState.running
    assert await gone(old) == set()
    assert not kernel_pids(kernel) & old
    assert image_dirs(checkpoint_root) == []
    assert await fresh_namespace(kernel)
    # The kernel works on as a kernel: it can be suspended again.
    assert (await prov.suspend())["state"] == "suspended"


@pytest.mark.parametrize("point", ["before", "after"])
async def test_shutdown_during_dump_leaves_nothing(
    kernel, criu_hold, checkpoint_root: Path, point: str
) -> None:
    old = kernel_pids(kernel)
    ports = kernel_ports(kernel.provisioner.connection_info)
    suspend = await held_suspend(kernel, criu_hold, point)

    await kernel.shutdown_kernel()
    with pytest.raises(Conflict, match="shutting down"):
        await suspend
    assert await gone(old) == set()
    assert_nothing_left(kernel, checkpoint_root, ports)
    with pytest.raises(Conflict):
        await kernel.provisioner.suspend()


def assert_nothing_left(km: Any, checkpoint_root: Path, ports: list[int]) -> None:
    assert image_dirs(checkpoint_root) == []
    assert list((checkpoint_root / ".logs").iterdir()) == []
    assert not (checkpoint_root / ".work" / km.kernel_id).exists()
    assert all(port_free(p) for p in ports)


# -- restart or shutdown while a resume is in flight ---------------------------------------


async def test_restart_during_restore_runs_a_fresh_kernel(
    kernel, criu_hold, checkpoint_root: Path
) -> None:
    await run(kernel.test_client, "x = 1")
    resume, restored = await held_resume(kernel, criu_hold, checkpoint_root)

    await kernel.restart_kernel()
    with pytest.raises(Conflict, match="restarting"):
        await resume
    assert kernel.provisioner.state == KernelState.running
    assert await gone(restored) == set()
    assert image_dirs(checkpoint_root) == []
    assert await fresh_namespace(kernel)


@pytest.mark.parametrize("point", ["before", "after"])
async def test_shutdown_during_restore_leaves_nothing(
    kernel, criu_hold, checkpoint_root: Path, point: str
) -> None:
    ports = kernel_ports(kernel.provisioner.connection_info)
    resume, restored = await held_resume(kernel, criu_hold, checkpoint_root, point)

    await kernel.shutdown_kernel()
    with pytest.raises(Conflict, match="shutting down"):
        await resume
    assert await gone(restored) == set()
    assert_nothing_left(kernel, checkpoint_root, ports)
    assert not await kernel.is_alive()


# -- dumps that time out or are cancelled: the kernel runs on ------------------------------


async def assert_runs_on(km: Any, pids: set[int], checkpoint_root: Path) -> None:
    """Running as before the suspend was tried, with no task left stopped, and it works."""
    assert km.provisioner.state == KernelState.running
    assert kernel_pids(km) == pids
    assert {p: proc_state(p) for p in pids if proc_state(p) == "T"} == {}
    assert image_dirs(checkpoint_root) == []
    _reply, out = await run(km.test_client, "print(y * 6)")
    assert out.strip() == "42"


async def test_dump_timeout_leaves_kernel_running(kernel, criu_hold, checkpoint_root) -> None:
    """CRIU has stopped the tree and is killed for taking too long: the tree is continued
    before the kernel is reported running again."""
    await run(kernel.test_client, "y = 7")
    pids = kernel_pids(kernel)
    suspend = await held_suspend(kernel, criu_hold, "after")
    kernel.provisioner.engine.dump_timeout = 0  # read as the engine waits: it fires now
    with pytest.raises(SuspendFailed, match="longer than"):
        await suspend
    await assert_runs_on(kernel, pids, checkpoint_root)


@pytest.mark.parametrize("point", ["before", "after"])
async def test_cancelled_dump_leaves_kernel_running(
    kernel, criu_hold, checkpoint_root, point: str
) -> None:
    await run(kernel.test_client, "y = 7")
    pids = kernel_pids(kernel)
    suspend = await held_suspend(kernel, criu_hold, point)
    suspend.cancel()
    with pytest.raises(asyncio.CancelledError):
        await suspend
    await assert_runs_on(kernel, pids, checkpoint_root)


async def test_cancelled_restore_keeps_the_kernel_suspended(
    kernel, criu_hold, checkpoint_root
) -> None:
    prov = kernel.provisioner
    await run(kernel.test_client, "w = 'kept'")
    resume, restored = await held_resume(kernel, criu_hold, checkpoint_root)
    resume.cancel()
    with pytest.raises(asyncio.CancelledError):
        await resume
    assert prov.state == KernelState.suspended
    assert await gone(restored) == set()
    assert (checkpoint_root / kernel.kernel_id / "manifest.json").exists()
    await prov.resume()
    await wait_iopub(kernel.test_client)
    _reply, out = await run(kernel.test_client, "print(w)")
    assert out.strip() == "kept"


# -- what every kernel client relies on ----------------------------------------------------


def _pid_in_namespace(pid: int) -> int:
    """The PID a process has in its own (innermost) PID namespace."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("NSpid:")).split()[-1])


async def test_shutdown_request_is_answered_and_ends_the_kernels_children(kernel) -> None:
    """ipykernel ends its children before it exits; in a PID namespace it must find the
    real ones (not the host's kernel threads, nor its own threads) and still reply."""
    kc = kernel.test_client
    reply, out = await run(
        kc, "import subprocess; child = subprocess.Popen(['sleep', '1000']); print(child.pid)"
    )
    assert reply["status"] == "ok", out
    # By the PID it printed, in the kernel's PID namespace (a child's /proc cmdline is set
    # late in its exec, so it may not say "sleep" yet).
    sleeper = {p for p in kernel_pids(kernel) if _pid_in_namespace(p) == int(out)}
    assert len(sleeper) == 1
    answer = await kc.shutdown(reply=True, timeout=60)
    assert answer["msg_type"] == "shutdown_reply" and answer["content"]["status"] == "ok"
    assert await gone(sleeper) == set()
    assert await asyncio.wait_for(kernel.provisioner.wait(), 60) is not None


async def test_options_the_client_passed_are_not_repeated(engine_config) -> None:
    """nbclient and papermill pass --HistoryManager.hist_file=:memory: themselves; IPython
    refuses an option given twice."""
    km = AsyncKernelManager(kernel_name="python3", config=engine_config)
    await km.start_kernel(extra_arguments=["--HistoryManager.hist_file=:memory:"])
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        _reply, out = await run(kc, "print(get_ipython().history_manager.hist_file)")
        assert out.strip() == ":memory:"
        argv = Path(f"/proc/{max(kernel_pids(km))}/cmdline").read_text().split("\0")
        assert argv.count("--HistoryManager.hist_file=:memory:") == 1
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


@pytest.mark.parametrize("argv0", ["no_such_kernel_executable", "/nonexistent/kernel"])
async def test_missing_kernel_executable_raises_at_start(
    engine_config, tmp_path: Path, argv0: str
) -> None:
    spec_dir = tmp_path / "kernels" / "bad"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps({"argv": [argv0, "-f", "{connection_file}"], "display_name": "bad"})
    )
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    km = AsyncKernelManager(kernel_name="bad", kernel_spec_manager=ksm, config=engine_config)
    with pytest.raises(FileNotFoundError):
        await km.start_kernel(env={**os.environ})


async def test_a_kernel_that_dies_leaves_its_last_output_in_the_server_log(
    engine_config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its stdout and stderr go to a file of ours (CRIU needs one): when it dies unasked,
    the end of it is logged, as the stock provisioner's terminal would have shown it."""
    spec_dir = tmp_path / "kernels" / "dies"
    spec_dir.mkdir(parents=True)
    code = "import sys; print('first words'); sys.exit('ImportError: no module named foo')"
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-c", code, "{connection_file}"],
                "display_name": "x",
                "metadata": {"kernel_provisioner": {"provisioner_name": "cedana-provisioner"}},
            }
        )
    )
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    km = AsyncKernelManager(kernel_name="dies", kernel_spec_manager=ksm, config=engine_config)
    await km.start_kernel(env={**os.environ})
    kc = km.client()
    kc.start_channels()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="died"):
            await kc.wait_for_ready(timeout=60)
        told = [r.getMessage() for r in caplog.records if "exited with status 1" in r.getMessage()]
        assert len(told) == 1, caplog.text
        assert "first words" in told[0] and "no module named foo" in told[0]
        assert not await km.is_alive()
        assert len([r for r in caplog.records if "exited with status" in r.getMessage()]) == 1
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
