"""Lazy restore with real kernels and real CRIU: the kernel runs before its memory is read,
pages are checked as they are served, and every fault mid-transfer leaves a clear state.

Mid-transfer is held deterministically: the page server's background transfer pauses
while a file exists (a wrapper adds --pause-file); page faults are still served.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import jupyter_cedana
from jupyter_cedana.checkpoint import crimg, lazy, readahead
from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.server.kernel.provisioner import KernelState
from jupyter_cedana.timestamps import iso
from tests.conftest import (
    alive,
    exited,
    kernel_pids,
    run,
    stand_in_server,
    start_kernel,
    stop_kernel,
    wait_iopub,
)

pytestmark = pytest.mark.criu

PAGES = Path(jupyter_cedana.__file__).parent / "bin" / "cedana-pages"
# 32 MiB of known values: far more than the pages the first cells after a resume touch.
FILL = "import numpy as np\na = np.arange(4 << 20, dtype=np.int64) * 3\nprint(a.ctypes.data)"
SUM = "print(int(a.sum()))"
EXPECTED_SUM = str(3 * ((4 << 20) - 1) * (4 << 20) // 2)


def hold_transfer(prov: Any, tmp_path: Path, hold_events: Path | None = None) -> Path:
    """Make the next restores' page server hold its background transfer while the
    returned file exists (and leave the kernel's events unread while `hold_events` does)."""
    hold = tmp_path / "hold-transfer"
    wrapper = tmp_path / "cedana-pages"
    more = f" --hold-events-file {hold_events}" if hold_events else ""
    wrapper.write_text(f'#!/bin/sh\nexec {PAGES} --pause-file {hold}{more} "$@"\n')
    wrapper.chmod(0o755)
    prov.engine.pages_path = str(wrapper)
    hold.touch()
    return hold


def transfer_state(prov: Any) -> str:
    """What a failed assertion about a held transfer reports: the kernel's state and the
    page server's log (which says which process went, and why)."""
    log = prov.engine.store.work_dir(prov.kernel_id_str) / "pages.log"
    text = log.read_text() if log.exists() else "(none)"
    loading = prov.memory_loading
    return f"state {prov.state} ({prov.reason}), loading {loading}, pages.log: {text[-1500:]}"


async def took(kc: Any, msg_id: str, timeout: float = 60) -> None:
    """Wait until the kernel has begun to run the cell `msg_id` (its execute_input)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = await kc.get_iopub_msg(timeout=max(0.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
            return


async def received(channel: Any) -> list[dict[str, Any]]:
    """The messages a channel has received so far (without waiting for more)."""
    msgs = []
    while await channel.msg_ready():
        msgs.append(await channel.get_msg())
    return msgs


def page_servers(kernel_id: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"cedana-pages") and any(kernel_id.encode() in c for c in cmd):
            found.append(int(entry))
    return found


def held_userfaultfds() -> int:
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == "anon_inode:[userfaultfd]"
    return count


def lazy_page_in(images: Path, lo: int, hi: int) -> tuple[str, int]:
    """A page of [lo, hi) that is restored lazily (CRIU restores a few runs itself, the
    pages of a thread's stack and at times others), as far into [lo, hi) as possible:
    its page file and offset there."""
    runs = [
        r
        for pid in crimg.pids(images)
        for r in crimg.pagemap(images, pid)
        if r.lazy and r.present and r.vaddr < hi and r.end > lo
    ]
    lazy = sum(min(r.end, hi) - max(r.vaddr, lo) for r in runs)
    assert lazy >= (hi - lo) // 2, f"most of {lo:#x}-{hi:#x} is not restored lazily: {runs}"
    r = runs[len(runs) // 2]
    vaddr = max(r.vaddr, lo) + (min(r.end, hi) - max(r.vaddr, lo)) // 2
    return r.pages_file, r.offset + (vaddr - r.vaddr)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x5A]))


async def suspended_with_array(kernel: Any) -> tuple[Any, Path, int]:
    kc = kernel.test_client
    _, out = await run(kc, FILL)
    address = int(out.strip())
    prov = kernel.provisioner
    await prov.suspend()
    return prov, prov.engine.store.path(prov.kernel_id_str), address


async def test_kernel_runs_while_its_memory_is_still_on_disk(kernel, tmp_path: Path) -> None:
    prov, image, _ = await suspended_with_array(kernel)
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()
    assert prov.state == KernelState.running
    assert image.exists(), transfer_state(prov)  # the image stays until every page is in
    kc = kernel.test_client
    await wait_iopub(kc)
    _, out = await run(kc, "print('alive', 6 * 7)")
    assert out.strip() == "alive 42"
    # Touching all of it pulls it in through page faults, checked chunk by chunk.
    _, out = await run(kc, SUM)
    assert out.strip() == EXPECTED_SUM
    assert image.exists() and page_servers(prov.kernel_id_str)
    hold.unlink()
    await prov.memory_loaded()
    assert prov.state == KernelState.running
    assert not image.exists() and not page_servers(prov.kernel_id_str)
    assert held_userfaultfds() == 0
    _, out = await run(kc, SUM)
    assert out.strip() == EXPECTED_SUM


@pytest.mark.parametrize("copiers", [1, 8])
async def test_copiers_side_by_side_place_every_page(kernel, tmp_path: Path, copiers: int) -> None:
    """The background transfer's copiers (CheckpointEngine.lazy_copy_threads) each copy
    their own blocks into the kernel, while its cells fault pages in: every value is
    back, whatever their number."""
    kc = kernel.test_client
    prov = kernel.provisioner
    big = "b = np.arange(24 << 20, dtype=np.int64) * 7\nprint(b.ctypes.data)"  # 192 MiB
    _, out = await run(kc, FILL + "\n" + big)
    await prov.suspend()
    prov.engine.lazy_copy_threads = copiers
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()
    (server,) = page_servers(prov.kernel_id_str)
    cmd = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
    assert cmd[cmd.index(b"--copiers") + 1] == str(copiers).encode()
    await wait_iopub(kc)
    hold.unlink()
    # A cell reads both arrays while the copiers bring in the rest.
    _, out = await run(kc, "print(int(a.sum()), int(b[::512].sum()), int(b[-1]))")
    n = 24 << 20
    assert out.split() == [
        EXPECTED_SUM,
        str(7 * 512 * (n // 512) * (n // 512 - 1) // 2),
        str(7 * (n - 1)),
    ]
    await prov.memory_loaded()
    assert prov.state == KernelState.running
    _, out = await run(kc, "print(bool((b == np.arange(24 << 20) * 7).all()), int(a.sum()))")
    assert out.split() == ["True", EXPECTED_SUM]
    log = (prov.engine.store.work_dir(prov.kernel_id_str) / "pages.log").read_text()
    loaded = re.search(r"cedana-pages: (\d+) bytes in", log)
    assert loaded is not None and int(loaded[1]) >= 192 << 20, log


async def test_restores_at_once_share_the_copiers(
    kernel, engine_config: Any, tmp_path: Path
) -> None:
    """The first restore's page server takes the copier budget, one started while it
    loads gets a single copier, and once the first is done the budget is free again."""
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = await start_kernel(engine_config, other_dir)
    try:
        kms = [kernel, other]
        for km in kms:
            await suspended_with_array(km)
            km.provisioner.engine.lazy_copy_threads = 3
        hold = hold_transfer(kernel.provisioner, tmp_path)

        def copiers_of(km: Any) -> int:
            (server,) = page_servers(km.provisioner.kernel_id_str)
            cmd = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
            return int(cmd[cmd.index(b"--copiers") + 1])

        for km in kms:
            await km.provisioner.resume()
        assert [copiers_of(km) for km in kms] == [3, 1]
        assert lazy.PageServer.copiers_busy == 4
        hold.unlink()
        for km in kms:
            await km.provisioner.memory_loaded()
        assert lazy.PageServer.copiers_busy == 0
        await other.provisioner.suspend()
        hold.touch()
        await other.provisioner.resume()
        assert copiers_of(other) == 3
        hold.unlink()
        await other.provisioner.memory_loaded()
        # A cell sent before the client's IOPub socket reconnects loses its idle status.
        await wait_iopub(other.test_client)
        _, out = await run(other.test_client, SUM)
        assert out.strip() == EXPECTED_SUM
    finally:
        await stop_kernel(other)


def test_page_server_refuses_a_bad_number_of_copiers(tmp_path: Path) -> None:
    import subprocess

    for bad in ("0", "9", "x"):
        p = subprocess.run(
            [str(PAGES), "--images", str(tmp_path), "--map", str(tmp_path / "m"), "--copiers", bad],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert p.returncode == 2 and "--copiers 1-8" in p.stderr, (bad, p.stderr)


def private_file_maps(pids: set[int]) -> dict[str, list[tuple[int, int]]]:
    """path -> [(file offset, length)] of the private file mappings of running `pids`."""
    maps: dict[str, list[tuple[int, int]]] = {}
    for pid in pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[1].endswith("p") and fields[5].startswith("/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                maps.setdefault(fields[5], []).append((int(fields[2], 16), hi - lo))
    return maps


async def test_read_ahead_asks_for_the_library_pages_criu_copies(kernel, tmp_path: Path) -> None:
    """What is read ahead at a resume: the file bytes behind the pages CRIU restores
    itself, each in a private mapping of that file in the kernel as it ran, the libraries'
    written data among them."""
    await run(kernel.test_client, "import numpy")
    maps = private_file_maps(kernel_pids(kernel))
    prov = kernel.provisioner
    await prov.suspend()
    store, kid = prov.engine.store, prov.kernel_id_str
    the_plan = lazy.plan(store, kid, store.read_manifest(kid), tmp_path)
    wanted = the_plan.read_ahead
    # Pages of private file mappings are never lazy: a whole restore copies the same ones.
    assert readahead.of_image(store.path(kid)) == wanted
    assert any("/numpy" in path and path.endswith(".so") for path in wanted), wanted
    assert any("libc.so" in path for path in wanted), wanted
    for path, pieces in wanted.items():
        for off, length in pieces:
            for page in range(off, off + length, crimg.PAGE_SIZE):
                assert any(o <= page < o + n for o, n in maps.get(path, [])), (path, page)
    assert readahead.read_ahead(wanted) == sum(n for p in wanted.values() for _, n in p)
    await prov.resume()
    await wait_iopub(kernel.test_client)
    _, out = await run(kernel.test_client, "print(numpy.arange(4).sum())")
    assert out.strip() == "6"


def test_read_ahead_skips_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo, regular, link = tmp_path / "fifo", tmp_path / "regular", tmp_path / "link"
    os.mkfifo(fifo)
    regular.write_bytes(b"x" * 8192)
    link.symlink_to(regular)
    wanted = {str(p): [(0, 4096)] for p in (fifo, link, tmp_path / "gone")}
    assert readahead.read_ahead({**wanted, str(regular): [(0, 8192)]}) == 8192


async def test_small_images_are_restored_whole(kernel, tmp_path: Path) -> None:
    """Below lazy_restore_min_bytes (as this kernel is, by default) an image is read
    whole before the kernel runs, and goes at once; at 0, every image lazily."""
    prov, image, _ = await suspended_with_array(kernel)
    size = prov.engine.store.read_manifest(prov.kernel_id_str)["total_bytes"]
    assert size < CheckpointEngine.lazy_restore_min_bytes.default_value
    prov.engine.lazy_restore_min_bytes = size + 1
    hold = hold_transfer(prov, tmp_path)  # a page server would hold the image
    await prov.resume()
    assert prov.last_resume_breakdown and prov.last_resume_breakdown["lazy"] is False
    assert not image.exists() and not page_servers(prov.kernel_id_str)
    kc = kernel.test_client
    await wait_iopub(kc)
    _, out = await run(kc, SUM)
    assert out.strip() == EXPECTED_SUM

    prov.engine.lazy_restore_min_bytes = 0
    await prov.suspend()
    await prov.resume()
    assert prov.last_resume_breakdown and prov.last_resume_breakdown["lazy"] is True
    assert image.exists() and page_servers(prov.kernel_id_str)
    hold.unlink()
    await prov.memory_loaded()
    assert not image.exists()


async def test_a_corrupt_page_is_never_given_to_the_kernel(kernel, tmp_path: Path) -> None:
    """A byte flipped deep in the page file: the chunk is refused when the kernel touches
    it; the kernel is killed (it must not run on with missing or wrong memory), state
    failed with the reason, image kept; mended, the image resumes."""
    prov, image, address = await suspended_with_array(kernel)
    name, offset = lazy_page_in(image, address + (16 << 20), address + (32 << 20))
    pages = image / name
    assert offset > (pages.stat().st_size // 8)  # deep in the file, not in its first chunks
    flip_byte(pages, offset)
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()  # only what CRIU reads itself is checked before the kernel runs
    assert prov.state == KernelState.running
    kc = kernel.test_client
    await wait_iopub(kc)
    _, out = await run(kc, "print('alive')")
    assert out.strip() == "alive"
    pids = kernel_pids(kernel)
    resumed_at = prov.resumed_at
    cell = kc.execute(SUM)  # needs the damaged chunk
    await took(kc, cell)
    await prov.memory_loaded()
    assert prov.state == KernelState.failed
    assert f"checksum mismatch in {name} at offset" in (prov.reason or "")
    # It ran on its own since its resume: that is lost, the image goes back further.
    assert prov.work_lost_after == resumed_at is not None
    assert f"after its resume at {iso(resumed_at)} is lost" in (prov.reason or ""), prov.reason
    assert image.exists() and not page_servers(prov.kernel_id_str)
    assert await exited(pids) == []
    assert held_userfaultfds() == 0
    # Stopped at the damaged page: nothing of the cell after the kernel took it, no reply
    # (the server answers in the kernel's place: tests/test_failed_lazy_restore.py).
    after = await received(kc.iopub_channel) + await received(kc.shell_channel)
    assert [m["msg_type"] for m in after if m["parent_header"].get("msg_id") == cell] == []

    flip_byte(pages, offset)  # mended
    hold.unlink()
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kc)
    _, out = await run(kc, SUM)
    assert out.strip() == EXPECTED_SUM


EVENTS_SETUP = r"""
import ctypes, hashlib, mmap, os
import numpy as np
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = libc.mremap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                        ctypes.c_void_p]
N = 16 << 20
RW, PRIVATE_ANON = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
moved = libc.mmap(None, N, RW, PRIVATE_ANON, -1, 0)
ctypes.memmove(moved, os.urandom(N), N)
moved_hash = hashlib.sha256(ctypes.string_at(moved, N)).hexdigest()
# Above glibc's largest mmap threshold (32 MiB): a mapping of its own.
big = np.arange(5 << 20, dtype=np.int64) * 3
gone = np.arange(5 << 20, dtype=np.int64)
priv = mmap.mmap(-1, 8 << 20, flags=PRIVATE_ANON)
priv.write(b"\x07" * (8 << 20))
"""
EVENTS_WHILE_LOADING = r"""
# mremap to another place: the pages still on disk move with the mapping.
target = libc.mmap(None, N, RW, PRIVATE_ANON, -1, 0)
moved = libc.mremap(moved, N, N, 1 | 2, target)  # MREMAP_MAYMOVE | MREMAP_FIXED
assert moved == target
del gone  # munmap of pages still on disk
priv.madvise(mmap.MADV_DONTNEED)  # empties pages still on disk: they must read as zeros
r, w = os.pipe()
child = os.fork()  # the child reads pages still on disk through its own userfaultfd
if child == 0:
    os.write(w, str(int(big.sum())).encode())
    os._exit(0)
os.close(w)
got = os.read(r, 100).decode()
os.waitpid(child, 0)
print(got, priv[0], priv[len(priv) - 1])
"""
EVENTS_CHECK = (
    "print(hashlib.sha256(ctypes.string_at(moved, N)).hexdigest() == moved_hash,"
    " priv[0], priv[4 << 20], int(big.sum()))"
)


async def test_fork_mremap_munmap_madvise_while_memory_loads(kernel, tmp_path: Path) -> None:
    """The kernel changes its memory map while pages are still on disk: a fork's child
    gets them too, moved pages arrive where they moved, unmapped ones are not copied, and
    emptied ones stay empty (never refilled with their old content)."""
    kc = kernel.test_client
    prov = kernel.provisioner
    reply, out = await run(kc, EVENTS_SETUP)
    assert reply["status"] == "ok", out
    total = 3 * ((5 << 20) - 1) * (5 << 20) // 2
    await prov.suspend()
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()
    await wait_iopub(kc)
    # The events below are only seen while pages are still on disk (this failed once,
    # with no events in the log: which of these did not hold was not known).
    assert prov.last_resume_breakdown and prov.last_resume_breakdown["lazy"] is True
    assert page_servers(prov.kernel_id_str), (
        f"page server gone before the cell: {transfer_state(prov)}"
    )
    reply, out = await run(kc, EVENTS_WHILE_LOADING)
    assert reply["status"] == "ok", out
    assert out.split() == [str(total), "0", "0"]
    hold.unlink()
    await prov.memory_loaded()
    assert prov.state == KernelState.running
    log = (prov.engine.store.work_dir(prov.kernel_id_str) / "pages.log").read_text()
    events = {k: int(n) for n, k in re.findall(r"(\d+) (fork|remap|remove|unmap)", log)}
    assert all(events.get(k, 0) >= 1 for k in ("fork", "remap", "remove", "unmap")), log
    _, out = await run(kc, EVENTS_CHECK)
    assert out.split() == ["True", "0", "0", str(total)]


# Called from a thread started after the restore: its stack, this code and libc's are
# none of them memory the page server serves, so nothing from the byte to the munmap waits
# on a page (with the kernel's events held, such a wait would never end).
UNMAP_ON_BYTE_C = r"""
#include <stddef.h>
#include <sys/mman.h>
#include <unistd.h>
int unmap_on_byte(int ready, int go, void *addr, size_t len)
{
	char c = 'r';
	if (write(ready, &c, 1) != 1 || read(go, &c, 1) != 1)
		return -1;
	return munmap(addr, len);
}
"""
REGION = r"""
import ctypes, mmap
import numpy as np
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
R = 16 << 20
region = libc.mmap(None, R, mmap.PROT_READ | mmap.PROT_WRITE,
                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
ctypes.memset(region, 0x5A, R)
a = np.arange(4 << 20, dtype=np.int64) * 3
print(region)
"""
ARM = r"""
import os, threading
lib = ctypes.CDLL({so!r})
lib.unmap_on_byte.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
ready, go = os.open({ready!r}, os.O_RDWR), os.open({go!r}, os.O_RDWR)
result = []
trigger = threading.Thread(target=lambda: result.append(lib.unmap_on_byte(ready, go, region, R)))
trigger.start()
"""


def waiting_on_an_event(pids: set[int]) -> bool:
    """Whether a thread of `pids` sits in munmap waiting for its event to be read."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                nr = (task / "syscall").read_text().split()[0]
                if nr == "11" and "userfaultfd" in (task / "wchan").read_text():
                    return True
    return False


async def test_copies_refused_while_an_unmap_waits_do_not_fail_the_restore(
    kernel, tmp_path: Path
) -> None:
    """While a munmap's event is unread (and after, until the unmapping thread runs again)
    the kernel refuses every copy into the process (EAGAIN). On a loaded machine that can
    last long: the page server waits for it instead of failing the kernel after a thousand
    refusals (a tenth of a second of its copiers' retries)."""
    so = tmp_path / "unmap_on_byte.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(so), "-x", "c", "-"],
        input=UNMAP_ON_BYTE_C,
        text=True,
        check=True,
    )
    ready, go = tmp_path / "ready", tmp_path / "go"
    os.mkfifo(ready)
    os.mkfifo(go)
    kc = kernel.test_client
    prov = kernel.provisioner
    reply, out = await run(kc, REGION)
    assert reply["status"] == "ok", out
    region = int(out.strip())
    await prov.suspend()
    events = tmp_path / "hold-events"
    hold = hold_transfer(prov, tmp_path, hold_events=events)
    await prov.resume()
    await wait_iopub(kc)
    reply, out = await run(kc, ARM.format(so=str(so), ready=str(ready), go=str(go)))
    assert reply["status"] == "ok", out
    fd = os.open(ready, os.O_RDONLY)
    try:
        assert await asyncio.to_thread(os.read, fd, 1) == b"r"  # blocked on `go` now
    finally:
        os.close(fd)
    events.touch()
    fd = os.open(go, os.O_WRONLY)
    os.write(fd, b"g")
    os.close(fd)
    pids = kernel_pids(kernel)
    deadline = time.monotonic() + 30
    while not waiting_on_an_event(pids):
        assert time.monotonic() < deadline, "the munmap never waited for its event"
        await asyncio.sleep(0.01)
    hold.unlink()  # the copiers go on, and every copy into the kernel is refused
    log = prov.engine.store.work_dir(prov.kernel_id_str) / "pages.log"
    deadline = time.monotonic() + 60
    while "1000 copies refused in a row" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        assert page_servers(prov.kernel_id_str), log.read_text()
        await asyncio.sleep(0.05)
    # A thousand refusals, where the page server used to give up (at the one that logs
    # this): now it waits on, and the transfer ends once the event is read.
    events.unlink()
    await prov.memory_loaded()
    assert prov.state == KernelState.running, prov.reason
    _, out = await run(kc, "trigger.join(); print(result[0], int(a.sum()))")
    assert out.split() == ["0", EXPECTED_SUM]
    assert re.search(r"[1-9]\d* unmap", log.read_text()), log.read_text()
    assert region > 0


async def test_page_server_killed_mid_transfer(kernel, tmp_path: Path) -> None:
    prov, image, _ = await suspended_with_array(kernel)
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()
    pids = kernel_pids(kernel)
    servers = page_servers(prov.kernel_id_str)
    assert len(servers) == 1
    os.kill(servers[0], signal.SIGKILL)
    await prov.memory_loaded()
    assert prov.state == KernelState.failed
    assert "killed by SIGKILL" in (prov.reason or "") and "not loaded" in (prov.reason or "")
    assert image.exists()
    assert await exited(pids) == []
    assert held_userfaultfds() == 0
    hold.unlink()
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kernel.test_client)
    _, out = await run(kernel.test_client, SUM)
    assert out.strip() == EXPECTED_SUM


async def test_image_removed_mid_transfer_loads_on(kernel, tmp_path: Path) -> None:
    """The page server holds the page files open: removing the image does not take the
    memory away from the kernel."""
    prov, image, _ = await suspended_with_array(kernel)
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()
    prov.engine.store.remove_image(prov.kernel_id_str)
    assert not image.exists()
    hold.unlink()
    await prov.memory_loaded()
    assert prov.state == KernelState.running
    await wait_iopub(kernel.test_client)
    _, out = await run(kernel.test_client, SUM)
    assert out.strip() == EXPECTED_SUM


async def test_page_file_cut_short_mid_transfer(kernel, tmp_path: Path) -> None:
    """The disk losing the rest of the page file (truncated) while pages are loading."""
    prov, image, _ = await suspended_with_array(kernel)
    pages = max(image.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()
    pids = kernel_pids(kernel)
    os.truncate(pages, pages.stat().st_size // 2)
    hold.unlink()
    await prov.memory_loaded()
    assert prov.state == KernelState.failed
    assert f"{pages.name} is truncated" in (prov.reason or "")
    assert image.exists()
    assert await exited(pids) == []


async def test_shutdown_mid_transfer_leaves_nothing(kernel, tmp_path: Path) -> None:
    prov, image, _ = await suspended_with_array(kernel)
    hold_transfer(prov, tmp_path)
    await prov.resume()
    pids = kernel_pids(kernel)
    kid = prov.kernel_id_str
    assert page_servers(kid)
    await kernel.shutdown_kernel(now=True)
    await prov.memory_loaded()
    assert await exited(pids) == []
    assert not page_servers(kid) and not image.exists()
    assert held_userfaultfds() == 0


async def test_suspend_waits_for_the_memory_to_be_in(kernel, tmp_path: Path) -> None:
    prov, image, _ = await suspended_with_array(kernel)
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()
    asked = asyncio.Event()
    loaded = prov.memory_loaded
    loading_when_frozen: list[bool] = []

    async def memory_loaded() -> None:
        asked.set()
        await loaded()

    def on_change(p: Any, what: str) -> None:
        if what == "state" and p.state == KernelState.suspending:
            loading_when_frozen.append(bool(page_servers(p.kernel_id_str)))

    prov.memory_loaded = memory_loaded  # type: ignore[method-assign]
    prov.add_listener(on_change)
    suspend = asyncio.ensure_future(prov.suspend())
    await asyncio.wait_for(asked.wait(), 60)  # the suspend has begun, the transfer is held
    hold.unlink()
    await suspend
    # It began to freeze the kernel only once every page was in.
    assert loading_when_frozen == [False], transfer_state(prov)
    assert prov.state == KernelState.suspended and image.exists()
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kernel.test_client)
    _, out = await run(kernel.test_client, SUM)
    assert out.strip() == EXPECTED_SUM


async def test_restored_whole_where_lazy_is_unsupported(kernel, tmp_path: Path) -> None:
    """A CRIU whose check says userfaultfd cannot be used: the eager path, automatically."""
    criu = prov_criu = kernel.provisioner.engine.probe().criu_path
    wrapper = tmp_path / "criu"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = check ] || [ "$2" = check ]; then\n'
        '  echo "uffd-noncoop is not supported"; exit 1\nfi\n'
        f'exec {criu} "$@"\n'
    )
    wrapper.chmod(0o755)
    prov = kernel.provisioner
    prov.engine.criu_path = str(wrapper)
    prov.engine.probe(refresh=True)
    assert prov_criu != str(wrapper)
    assert "not supported" in (prov.engine.lazy_unsupported() or "")
    _, image, _ = await suspended_with_array(kernel)
    await prov.resume()
    assert not image.exists()  # whole restore: gone at once
    assert not page_servers(prov.kernel_id_str)
    await wait_iopub(kernel.test_client)
    _, out = await run(kernel.test_client, SUM)
    assert out.strip() == EXPECTED_SUM


def test_a_probe_that_could_not_run_is_asked_again(tmp_path: Path) -> None:
    """`criu check` that cannot run at all (here: a wrapper whose interpreter is gone)
    says nothing about userfaultfd: that restore goes whole, and the next one asks again
    instead of every restore of the server's life going whole."""
    engine = CheckpointEngine(checkpoint_root=str(tmp_path / "root"))
    criu = engine.probe().criu_path
    wrapper = tmp_path / "criu"
    wrapper.write_text(f'#!/bin/sh\nexec {criu} "$@"\n')
    wrapper.chmod(0o755)
    engine.criu_path = str(wrapper)
    assert engine.probe(refresh=True).available
    wrapper.write_text(f'#!{tmp_path}/gone/sh\nexec {criu} "$@"\n')
    assert "criu check failed" in (engine.lazy_unsupported() or "")
    wrapper.write_text(f'#!/bin/sh\nexec {criu} "$@"\n')
    assert engine.lazy_unsupported() is None


SERVER = r"""
import asyncio, json, os, sys
from pathlib import Path
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import KernelProvisionerFactory
from traitlets.config import Config
from jupyter_cedana.checkpoint.proctree import process_tree

async def main():
    KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
    c = Config()
    c.CheckpointEngine.checkpoint_root = sys.argv[1]
    c.CheckpointEngine.pages_path = sys.argv[2]
    c.CheckpointEngine.lazy_restore_min_bytes = 0
    km = AsyncKernelManager(config=c)
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    await kc.execute_interactive("import numpy as np; a = np.arange(4 << 20) * 3", timeout=60)
    await km.provisioner.suspend()
    await km.provisioner.resume()
    print(json.dumps({"pids": sorted(process_tree(km.provisioner.pid)),
                      "keeper": km.provisioner.process.pid,
                      "image": str(km.provisioner.engine.store.path(km.kernel_id))}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_server_killed_mid_transfer_keeps_the_image(tmp_path: Path) -> None:
    """The server dies mid-transfer: the kernel dies with it (as any kernel does), the page
    server ends, and the image stays for adoption or gc."""
    hold = tmp_path / "hold-transfer"
    hold.touch()
    wrapper = tmp_path / "cedana-pages"
    wrapper.write_text(f'#!/bin/sh\nexec {PAGES} --pause-file {hold} "$@"\n')
    wrapper.chmod(0o755)
    server, started = stand_in_server(SERVER, str(tmp_path / "checkpoints"), str(wrapper))
    try:
        kid = Path(started["image"]).name
        servers = page_servers(kid)
        assert len(servers) == 1
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        watched = started["pids"] + [started["keeper"]] + servers
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(alive(p) for p in watched):
            time.sleep(0.1)
        assert not [p for p in watched if alive(p)]
        assert Path(started["image"]).is_dir()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
