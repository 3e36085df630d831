"""Suspend and resume real ipykernel kernels with real CRIU."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import _ShutdownStatus

from jupyter_cedana.checkpoint import crimg, criucache
from jupyter_cedana.checkpoint.proctree import process_tree
from jupyter_cedana.checkpoint.store import ROOT_MARKER
from jupyter_cedana.errors import CheckpointCorrupt, Conflict, ResumeFailed, SuspendFailed
from jupyter_cedana.server.kernel.ports import kernel_ports
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import (
    AGENT_SOCKET,
    agent_kernel,
    exited,
    has_image,
    kernel_pids,
    run,
    start_kernel,
    stop_kernel,
    wait_iopub,
)

pytestmark = pytest.mark.criu

# What a checkpoint root holds besides images: kernel logs, the inits' working
# directories (with CRIU's restore logs) and the store's marker.
BOOKKEEPING = (".logs", ".work", ".parked", ROOT_MARKER)

STATE_SETUP = r"""
import os, sys, threading, time, json
import numpy as np
import collections, decimal  # imported modules must survive
i = 12345678901234
s = "héllo wörld" * 3
arr = np.arange(1_000_000, dtype=np.float64) * 1.5
counter = [0]
def tick():
    while True:
        counter[0] += 1
        time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
f = open("data.txt", "w+"); f.write("0123456789" * 10); f.flush(); f.seek(37)
os.environ["CEDANA_SET_IN_KERNEL"] = "yes"
time.sleep(0.2)
before = counter[0]
print("ready", before)
"""

STATE_CHECK = r"""
time.sleep(0.3)
print(json.dumps({
    "i": i, "s": s, "arr_sum": float(arr.sum()), "arr_4": float(arr[4]),
    "counting": counter[0] > before,
    "cwd": os.getcwd(), "env": os.environ.get("CEDANA_TEST_VAR"),
    "env_set": os.environ.get("CEDANA_SET_IN_KERNEL"), "pos": f.tell(), "read": f.read(5),
    "modules": all(m in sys.modules for m in ("collections", "decimal", "numpy")),
    "ppid_ok": os.getppid() > 0,
}))
"""


@pytest.mark.in_process
async def test_criu_writing_the_image_itself_keeps_state_too(kernel) -> None:
    """CheckpointEngine.stream_dump = False: CRIU writes the files through the page cache
    and they are hashed as they grow (integrity.FollowingHasher), instead of capture.py."""
    kc = kernel.test_client
    prov = kernel.provisioner
    prov.engine.stream_dump = False
    reply, out = await run(kc, STATE_SETUP)
    assert reply["status"] == "ok", out
    await prov.suspend()
    manifest = prov.engine.store.read_manifest(kernel.kernel_id)
    assert any("chunks" in m for m in manifest["files"].values())
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kc)
    reply, out = await run(kc, STATE_CHECK)
    got = json.loads(out.strip().splitlines()[-1])
    assert (got["i"], got["arr_sum"], got["counting"]) == (
        12345678901234,
        float(sum(range(1_000_000)) * 1.5),
        True,
    )


async def test_suspend_resume_keeps_state(kernel, checkpoint_root: Path) -> None:
    kc = kernel.test_client
    reply, out = await run(kc, STATE_SETUP)
    assert reply["status"] == "ok", out
    count_before = reply["execution_count"]
    prov = kernel.provisioner
    pids_before = kernel_pids(kernel)
    assert len(pids_before) >= 2  # cedana-init and the kernel

    result = await prov.suspend()
    assert result["state"] == "suspended" and result["tier"] == "disk"
    assert prov.state == KernelState.suspended
    # Every process of the kernel is gone, yet Jupyter sees it alive.
    assert await exited(pids_before) == []
    assert await prov.poll() is None
    assert await kernel.is_alive()

    if AGENT_SOCKET:
        # The image is root's, at the agent: what the agent says of it.
        at_agent = await agent_kernel(kernel.kernel_id)
        assert at_agent is not None and at_agent["state"] == "dumped", at_agent
        assert at_agent["image"]["bytes"] == result["checkpoint_bytes"] > 8_000_000
        await prov.resume()
        assert prov.state == KernelState.running
        await until_no_image(kernel.kernel_id)  # deleted after a successful resume
        assert prov.pid not in pids_before  # a new host PID: the agent's PID namespace
    else:
        await inspect_image_and_resume(kernel, checkpoint_root, result, pids_before)
    await wait_iopub(kc)
    reply, out = await run(kc, STATE_CHECK)
    assert reply["status"] == "ok", out
    assert reply["execution_count"] == count_before + 1
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {
        "i": 12345678901234,
        "s": "héllo wörld" * 3,
        "arr_sum": float(sum(range(1_000_000)) * 1.5),
        "arr_4": 6.0,
        "counting": True,
        "cwd": str(Path(kernel.provisioner.cwd)),
        "env": "hello",
        "env_set": "yes",
        "pos": 37,
        "read": "78901",
        "modules": True,
        "ppid_ok": True,
    }


async def inspect_image_and_resume(
    kernel: Any, checkpoint_root: Path, result: dict[str, Any], pids_before: set[int]
) -> None:
    """The image in the checkpoint root, then the resume (the server's own CRIU)."""
    prov = kernel.provisioner
    image = checkpoint_root / kernel.kernel_id
    assert stat.S_IMODE(checkpoint_root.stat().st_mode) == 0o700
    assert stat.S_IMODE(image.stat().st_mode) == 0o700
    files = list(image.iterdir())
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    manifest = json.loads((image / "manifest.json").read_text())
    assert manifest["kernel_id"] == kernel.kernel_id
    assert manifest["kernel_name"] == "python3"
    assert manifest["criu_version"].startswith("4.")
    assert manifest["total_bytes"] == result["checkpoint_bytes"] > 8_000_000  # arr alone
    # Page files are checked by chunk (a table beside each), the rest whole.
    assert all(("crc32" in m) != ("chunks" in m) for m in manifest["files"].values())
    assert any("chunks" in m for m in manifest["files"].values())
    assert manifest["timings"]["dump_s"] > 0

    await prov.resume()
    assert prov.state == KernelState.running
    await prov.memory_loaded()  # a lazy restore loads it while the kernel runs
    assert not image.exists()  # deleted after a successful resume by default
    if prov.engine.pidns:
        assert prov.pid not in pids_before  # a new host PID, in a new PID namespace
    else:
        assert prov.pid in pids_before  # without one, every task gets its old PID back


async def until_no_image(kernel_id: str, timeout: float = 120) -> None:
    """Until the agent has no image of the kernel: a lazily restored kernel's goes once
    its memory is in, which the agent does not announce."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (found := await agent_kernel(kernel_id)) is not None and found["image"] is not None:
        assert loop.time() < deadline, found
        await asyncio.sleep(0.1)


def init_cwd(km: Any) -> str:
    """The working directory of the kernel's init: the root task CRIU dumps."""
    return os.readlink(f"/proc/{km.provisioner.pid}/cwd")


@pytest.fixture(params=["bind", "tmpfs"])
def read_only_dir(tmp_path: Path, request: Any) -> Iterator[Path]:
    """A read-only directory: a read-only bind mount of one holding a file, or an empty
    read-only tmpfs."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    if request.param == "bind":
        src = tmp_path / "src"
        src.mkdir()
        (src / "input.txt").write_text("data")
        subprocess.run(["mount", "--bind", str(src), str(ro)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
    else:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


@pytest.mark.root
async def test_kernel_in_a_read_only_directory_suspends_and_resumes(
    engine_config, checkpoint_root: Path, read_only_dir: Path
) -> None:
    """CRIU makes the mount point of a /proc in the working directory of the init it
    dumps: the init works in a private directory under the checkpoint root, never in the
    kernel's, so a kernel started in a read-only directory (a read-only export, a
    root-squashed home) is suspended and resumed."""
    km = await start_kernel(engine_config, read_only_dir)
    try:
        kc = km.test_client
        _reply, out = await run(
            kc,
            "import os; x = 41; listing = sorted(os.listdir('.'))\n"
            "try:\n    open('probe', 'w')\nexcept OSError as e:\n    print(e.errno)",
        )
        assert out.strip() == str(errno.EROFS), out
        private = checkpoint_root / ".work" / km.kernel_id
        assert init_cwd(km) == str(private)
        assert stat.S_IMODE(private.stat().st_mode) == 0o700

        await km.provisioner.suspend()
        assert km.provisioner.state == KernelState.suspended
        await km.provisioner.resume()
        await wait_iopub(kc)
        _, out = await run(kc, "print(x + 1, os.getcwd(), listing)")
        want = sorted(os.listdir(read_only_dir))
        assert out.strip() == f"42 {read_only_dir} {want}"
        assert init_cwd(km) == str(private)  # CRIU restored it there
    finally:
        await stop_kernel(km)
    assert not private.exists()  # removed with the kernel


@pytest.mark.in_process
async def test_criu_keeps_its_probe_of_the_linux_kernel_where_it_can(kernel) -> None:
    """criucache: CRIU keeps its probe in /run where that is a tmpfs; where it is not,
    the reason is named."""
    prov = kernel.provisioner
    await prov.suspend()
    await prov.resume()
    problem = prov.engine.criu_cache_problem()
    if criucache.fs_type("/run") != "tmpfs":
        assert problem and problem.startswith("/run is ") and "not a tmpfs" in problem
    elif problem is None:
        assert Path("/run/criu.kdat").stat().st_size > 0
    else:  # not ours to remove: a root CRIU's cache file, left half-written
        assert "interrupted CRIU run" in problem


async def test_suspend_twice_and_resume_twice(kernel) -> None:
    """Round trips repeat, and a kernel can be suspended again after a resume."""
    kc = kernel.test_client
    await run(kc, "n = 1")
    for k in range(2):
        await kernel.provisioner.suspend()
        await kernel.provisioner.resume()
        await wait_iopub(kc)
        _reply, out = await run(kc, "n += 1; print(n)")
        assert out.strip() == str(k + 2)


async def test_concurrent_requests_share_one_transition(kernel, checkpoint_root: Path) -> None:
    prov = kernel.provisioner
    a, b = await asyncio.gather(prov.suspend(), prov.suspend())
    assert a == b and a["state"] == "suspended"
    with pytest.raises(Conflict, match="already suspended"):
        await prov.suspend()
    a, b = await asyncio.gather(prov.resume(), prov.resume())
    assert a == b and a["state"] == "running"
    with pytest.raises(Conflict, match="running, not suspended"):
        await prov.resume()


async def test_interrupt_refused_while_suspended_and_works_after(kernel) -> None:
    kc = kernel.test_client
    prov = kernel.provisioner
    await prov.suspend()
    with pytest.raises(Conflict, match="suspended"):
        await kernel.interrupt_kernel()
    await prov.resume()
    await wait_iopub(kc)
    msg_id = kc.execute("import time; print('started', flush=True); time.sleep(600)")
    # Interrupt once the cell runs (an interrupt that lands before it is a no-op).
    while True:
        msg = await kc.get_iopub_msg(timeout=60)
        if msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == msg_id:
            break
    await kernel.interrupt_kernel()
    reply = await kc.get_shell_msg(timeout=20)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = await kc.get_shell_msg(timeout=20)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"


# A python3 kernel held before ipykernel starts, with Python's SIGINT handler (if any)
# already installed: it says so by creating argv[1], then waits until argv[2] exists.
HELD_KERNEL = """
import os, runpy, sys, time
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
sys.argv = ["ipykernel_launcher", *sys.argv[3:]]
runpy.run_module("ipykernel_launcher", run_name="__main__")
"""


async def test_an_interrupt_while_the_kernel_starts_does_not_kill_it(
    engine_config, tmp_path: Path
) -> None:
    """An interrupt that reaches a kernel still starting, before ipykernel ignores SIGINT
    itself, used to kill it (Python's default handler: KeyboardInterrupt), as it does
    under jupyter_client's own provisioner. The kernel is held at that point here: the
    interrupt is lost, the kernel starts, and a running cell is still interrupted."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_client.provisioning import KernelProvisionerFactory

    started, release = tmp_path / "started", tmp_path / "release"
    spec = tmp_path / "kernels" / "held"
    spec.mkdir(parents=True)
    argv = [
        sys.executable,
        "-c",
        HELD_KERNEL,
        str(started),
        str(release),
        "-f",
        "{connection_file}",
    ]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "held", "language": "python"})
    )
    KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
    km = AsyncKernelManager(
        kernel_name="held",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]),
        config=engine_config,
    )
    await km.start_kernel(cwd=str(tmp_path))
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not started.exists():
            assert loop.time() < deadline and await km.is_alive(), "the held kernel did not start"
            await asyncio.sleep(0.01)
        await km.interrupt_kernel()
        release.touch()
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=60)
            assert await km.is_alive()
            msg_id = kc.execute("import time; print('started', flush=True); time.sleep(600)")
            while True:
                msg = await kc.get_iopub_msg(timeout=60)
                if msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == msg_id:
                    break
            await km.interrupt_kernel()
            reply = await kc.get_shell_msg(timeout=20)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = await kc.get_shell_msg(timeout=20)
            assert reply["content"]["ename"] == "KeyboardInterrupt"
            assert await km.is_alive()
        finally:
            kc.stop_channels()
    finally:
        await km.shutdown_kernel(now=True)


@pytest.mark.parametrize("flag", [True, False])
def test_cedana_init_starts_a_command_with_sigint_ignored_on_request(flag: bool) -> None:
    """What --ignore-sigint does, seen by the command it starts: SIGINT is ignored from
    the command's first instruction (exec keeps an ignored disposition)."""
    from jupyter_cedana.checkpoint.engine import CheckpointEngine

    init = CheckpointEngine.instance().init_binary()
    cmd = [init, *(["--ignore-sigint"] if flag else []), "--", "cat", "/proc/self/status"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    m = re.search(r"^SigIgn:\s*([0-9a-f]+)$", out, re.M)
    assert m is not None, out
    assert bool(int(m.group(1), 16) & (1 << (signal.SIGINT - 1))) == flag


ORPHAN = (
    "import os, subprocess; r, w = os.pipe(); "
    "subprocess.run(['sh', '-c', 'exec 3<&0; (read x <&3) & exit 0'], stdin=r); os.close(r)"
)


async def orphan_is_reaped(km, kc) -> bool:
    """Leave an orphan in the kernel's tree (a grandchild whose parent exited), let it
    exit, and wait until it is gone: only a reaper removes it; unreaped it stays a zombie."""
    before = kernel_pids(km)
    reply, out = await run(kc, ORPHAN)
    assert reply["status"] == "ok", out
    orphans = kernel_pids(km) - before
    assert len(orphans) == 1  # the orphaned `read`, waiting on the pipe
    await run(kc, "os.close(w)")  # now it exits
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while orphans & kernel_pids(km) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return not orphans & kernel_pids(km)


async def test_orphans_are_reaped(kernel) -> None:
    """A grandchild orphaned inside the kernel's namespace is reaped by cedana-init."""
    kc = kernel.test_client
    assert await orphan_is_reaped(kernel, kc)
    # ... and also after a restore
    await kernel.provisioner.suspend()
    await kernel.provisioner.resume()
    await wait_iopub(kc)
    assert await orphan_is_reaped(kernel, kc)


async def test_shutdown_of_suspended_kernel_leaves_nothing(kernel, checkpoint_root: Path) -> None:
    prov = kernel.provisioner
    ports = kernel_ports(prov.connection_info)
    await prov.suspend()
    assert await has_image(checkpoint_root, kernel.kernel_id)
    assert (checkpoint_root / ".parked" / f"{kernel.kernel_id}.json").is_file()
    # The ports stay reserved while suspended.
    with socket.socket() as s, pytest.raises(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", ports[0]))
    await kernel.shutdown_kernel()
    # Done at the shutdown request: no SIGTERM/SIGKILL grace period spent on it.
    assert kernel._shutdown_status == _ShutdownStatus.ShutdownRequest
    assert not await has_image(checkpoint_root, kernel.kernel_id)
    assert [p.name for p in checkpoint_root.iterdir() if p.name not in BOOKKEEPING] == []
    if AGENT_SOCKET:  # its image, output and working directory are the agent's
        assert await agent_kernel(kernel.kernel_id) is None
    else:
        assert not list((checkpoint_root / ".logs").iterdir())
        assert not list((checkpoint_root / ".work").iterdir())  # the init's directory too
    assert not list((checkpoint_root / ".parked").iterdir())  # its record went with it
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", ports[0]))


async def test_restart_of_suspended_kernel_starts_fresh(kernel, checkpoint_root: Path) -> None:
    kc = kernel.test_client
    await run(kc, "x = 1")
    await kernel.provisioner.suspend()
    await kernel.restart_kernel()
    assert kernel.provisioner.state == KernelState.running
    assert not await has_image(checkpoint_root, kernel.kernel_id)
    await kc.wait_for_ready(timeout=60)
    await wait_iopub(kc)
    _reply, out = await run(kc, "print('x' in dir())")
    assert out.strip() == "False"


async def test_provisioner_info_carries_suspended_state(kernel) -> None:
    prov = kernel.provisioner
    await prov.suspend()
    info = await prov.get_provisioner_info()
    assert info["cedana_state"] == "suspended" and info["cedana_tier"] == "disk"
    other = type(prov)(kernel_id=prov.kernel_id, kernel_spec=prov.kernel_spec, parent=kernel)
    other.connection_info = prov.connection_info
    prov.port_hold.release()  # hand the reservation over, as a server restart would
    await other.load_provisioner_info(info)
    assert other.state == KernelState.suspended and await other.poll() is None
    other.port_hold.release()
    prov.port_hold.reserve(prov.connection_info)


# -- faults -----------------------------------------------------------------------------


@pytest.mark.in_process  # the server's CRIU option (ghost_limit); the agent has its own
async def test_failed_dump_leaves_kernel_running(kernel, checkpoint_root: Path) -> None:
    """A deleted file held open that is larger than the ghost limit makes CRIU refuse."""
    kc = kernel.test_client
    kernel.provisioner.engine.ghost_limit = 1 << 20
    reply, out = await run(
        kc,
        "import os, tempfile; g = tempfile.NamedTemporaryFile(dir='.', delete=False); "
        "g.write(b'x' * (2 << 20)); g.flush(); os.unlink(g.name); y = 7",
    )
    assert reply["status"] == "ok", out
    pids = kernel_pids(kernel)
    with pytest.raises(SuspendFailed, match="CRIU dump failed") as info:
        await kernel.provisioner.suspend()
    assert "ghost" in info.value.message.lower()
    assert kernel.provisioner.state == KernelState.running
    assert kernel_pids(kernel) == pids
    for pid in pids:  # continued, not left stopped
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] != "T"
    assert [p for p in checkpoint_root.iterdir() if p.name not in BOOKKEEPING] == []
    reply, out = await run(kc, "print(y * 6)")
    assert out.strip() == "42"


async def test_other_kernels_writing_history_do_not_break_restore(kernel, engine_config) -> None:
    """IPython's shared history database grows while a kernel is suspended; the kernel
    must not hold it open, or CRIU refuses the restore."""
    from jupyter_client.manager import AsyncKernelManager

    other = AsyncKernelManager(kernel_name="python3", config=engine_config)
    await other.start_kernel()
    okc = other.client()
    okc.start_channels()
    try:
        await okc.wait_for_ready(timeout=60)
        await run(kernel.test_client, "h = 'mine'")
        await kernel.provisioner.suspend()
        for k in range(5):
            await run(okc, f"q{k} = {k} * 2")
        await kernel.provisioner.resume()
        await wait_iopub(kernel.test_client)
        _, out = await run(kernel.test_client, "print(h)")
        assert out.strip() == "mine"
    finally:
        okc.stop_channels()
        await other.shutdown_kernel(now=True)


@pytest.fixture
def tiny_root(tmp_path: Path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.root
async def test_disk_full_leaves_kernel_running(kernel, tiny_root: Path) -> None:
    kc = kernel.test_client
    kernel.provisioner.engine.checkpoint_root = str(tiny_root)
    reply, out = await run(kc, "import numpy as np; big = np.ones(5_000_000); z = 5")
    assert reply["status"] == "ok", out
    with pytest.raises(SuspendFailed) as info:
        await kernel.provisioner.suspend()
    # The server's end of the streamed image found the disk full (writing the pages, or a
    # page map written beside them) and closed CRIU's pipes: CRIU failed with it (what
    # its log, cut short on the same disk, says of that is left out).
    assert re.fullmatch(
        r"CRIU dump failed \(exit 1\): no space left on the checkpoint disk \(\d+ bytes free\): "
        r"writing the image failed: writing [a-z]+-\d+\.img: No space left on device",
        info.value.message,
    ), info.value.message
    assert kernel.provisioner.state == KernelState.running
    assert kernel.provisioner.reason == info.value.message
    assert [p.name for p in tiny_root.iterdir() if p.name not in BOOKKEEPING] == []
    reply, out = await run(kc, "print(z + int(big.sum()))")
    assert out.strip() == str(5_000_005)


async def test_kernel_exiting_mid_dump(kernel, checkpoint_root: Path, criu_hold) -> None:
    prov = kernel.provisioner
    criu_hold.attach(prov.engine)
    criu_hold.arm("dump", "before")
    task = asyncio.ensure_future(prov.suspend())
    await criu_hold.wait_reached("dump", "before")
    os.kill(prov.pid, signal.SIGKILL)
    await asyncio.to_thread(prov.process.wait)
    criu_hold.release("dump", "before")
    with pytest.raises(SuspendFailed):
        await task
    assert prov.state == KernelState.running
    assert [p for p in checkpoint_root.iterdir() if p.name not in BOOKKEEPING] == []
    assert await prov.poll() is not None  # dead, reported as such: the restarter may act


async def test_failed_restore_keeps_image_and_retry_works(
    kernel, checkpoint_root: Path, tmp_path: Path
) -> None:
    """A file the kernel holds open changes size while it is suspended: CRIU refuses to
    restore; once the file is back, a retry succeeds."""
    kc = kernel.test_client
    data = tmp_path / "input.csv"
    data.write_text("a,b\n1,2\n")
    reply, _ = await run(kc, f"fh = open({str(data)!r}); first = fh.readline()")
    assert reply["status"] == "ok"
    prov = kernel.provisioner
    await prov.suspend()
    data.write_text("a,b\n1,2\n3,4\n")
    with pytest.raises(ResumeFailed, match="size"):
        await prov.resume()
    assert prov.state == KernelState.failed and "size" in (prov.reason or "")
    assert await has_image(checkpoint_root, kernel.kernel_id)
    assert await prov.poll() is None  # still "alive": the image is the kernel now
    data.write_text("a,b\n1,2\n")
    await prov.resume()
    assert prov.state == KernelState.running
    await wait_iopub(kc)
    reply, out = await run(kc, "print(first.strip(), fh.readline().strip())")
    assert out.strip() == "a,b 1,2"


def restored_by_criu(image: Path) -> tuple[Path, int]:
    """A page file and an offset in it that CRIU restores itself (not lazily): a stack."""
    for pid in crimg.pids(image):
        for r in crimg.pagemap(image, pid):
            if r.present and not r.lazy:
                return image / r.pages_file, r.offset + r.pages * crimg.PAGE_SIZE // 2
    raise AssertionError("every page is restored lazily")


@pytest.mark.in_process  # it damages the image, which at the agent is root's
@pytest.mark.parametrize("lazy", [False, True], ids=["whole", "lazy"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
async def test_corrupt_image_is_detected(
    kernel, checkpoint_root: Path, damage: str, lazy: bool
) -> None:
    """Refused before the kernel runs. A lazy restore checks what CRIU reads itself
    first; its lazily loaded pages are checked as served (tests/test_lazy.py)."""
    prov = kernel.provisioner
    prov.engine.lazy_restore = lazy
    await run(kernel.test_client, "w = 99")
    await prov.suspend()
    image = checkpoint_root / kernel.kernel_id
    pages = max(image.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    if damage == "flip" and lazy:
        pages, offset = restored_by_criu(image)
    else:
        offset = pages.stat().st_size // 2
    original = pages.read_bytes()
    if damage == "flip":
        buf = bytearray(original)
        buf[offset] ^= 0xFF
        pages.write_bytes(bytes(buf))
    elif damage == "truncate":
        pages.write_bytes(original[: len(original) // 2])
    else:
        pages.unlink()
    with pytest.raises(CheckpointCorrupt) as info:
        await prov.resume()
    assert pages.name in info.value.message
    assert prov.state == KernelState.failed
    assert image.exists()
    pages.write_bytes(original)
    await prov.resume()
    await wait_iopub(kernel.test_client)
    _, out = await run(kernel.test_client, "print(w)")
    assert out.strip() == "99"


@pytest.mark.root
async def test_restore_when_old_pid_is_taken(kernel) -> None:
    prov = kernel.provisioner
    await run(kernel.test_client, "v = 'still here'")
    old = sorted(kernel_pids(kernel))
    await prov.suspend()
    squatters = []
    for pid in old:  # put other processes on the kernel's old PID numbers
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "60"])
        squatters.append(p)
    try:
        assert any(p.pid in old for p in squatters)
        await prov.resume()
        await wait_iopub(kernel.test_client)
        _, out = await run(kernel.test_client, "print(v)")
        assert out.strip() == "still here"
    finally:
        for p in squatters:
            p.kill()
            p.wait()


async def test_transitions_refused_in_wrong_state(kernel) -> None:
    prov = kernel.provisioner
    with pytest.raises(Conflict):
        await prov.resume()
    with pytest.raises(ValueError):
        await prov.suspend(tier="cloud")
    await kernel.shutdown_kernel(now=True)
    with pytest.raises(Conflict, match="not running"):
        await prov.suspend()


@pytest.mark.in_process  # the keeper of a kernel at the agent is the agent's
async def test_a_restored_kernel_costs_a_small_keeper_and_no_criu(kernel) -> None:
    """After a restore only cedana-init's keeper stands between the server and the kernel
    (CRIU detached: it exits once the tree is restored), well under 5 MB."""
    prov = kernel.provisioner
    await prov.suspend()
    await prov.resume()
    await prov.memory_loaded()
    keeper = prov.process.pid
    extra = process_tree(keeper) - process_tree(prov.pid)
    assert extra == {keeper}
    assert Path(f"/proc/{keeper}/comm").read_text().strip() == "cedana-init"
    pss_kb = next(
        int(line.split()[1])
        for line in Path(f"/proc/{keeper}/smaps_rollup").read_text().splitlines()
        if line.startswith("Pss:")
    )
    assert pss_kb < 5 * 1024
    await wait_iopub(kernel.test_client)
    _, out = await run(kernel.test_client, "print(6 * 7)")
    assert out.strip() == "42"


async def test_the_kernel_sees_its_own_processes_in_proc(kernel) -> None:
    """In its own PID namespace the kernel has that namespace's /proc (its own mount
    namespace): PID lookups find the kernel itself, before and after a suspend."""
    if not AGENT_SOCKET and not kernel.provisioner.engine.pidns:
        pytest.skip("kernels share the server's PID namespace (not root, no agent)")
    # The same process: pid, comm, ppid and start time (CPU times move between reads).
    code = (
        "import os\n"
        "who = lambda s: [s.split()[i] for i in (0, 1, 3, 21)]\n"
        "stat = open(f'/proc/{os.getpid()}/stat').read()\n"
        "print(os.getpid(), stat.split()[1], who(open('/proc/self/stat').read()) == who(stat))"
    )
    for _ in range(2):
        reply, out = await run(kernel.test_client, code)
        assert reply["status"] == "ok", out
        pid, comm, same = out.split()
        assert int(pid) > 1 and comm.startswith("(python") and same == "True", out
        await kernel.provisioner.suspend()
        await kernel.provisioner.resume()
        await wait_iopub(kernel.test_client)
