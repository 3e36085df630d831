"""The page maps' lazy marks: a lazy restore serves the pages CRIU marks lazy, and CRIU 4
at times marks none (a thread's stack pointer on a page boundary); the suspend then marks
them as CRIU does otherwise (crimg.mark_lazy). Real kernels, real CRIU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint import crimg
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import run, wait_iopub
from tests.test_lazy import (
    EXPECTED_SUM,
    SUM,
    hold_transfer,
    page_servers,
    suspended_with_array,
    transfer_state,
)

pytestmark = pytest.mark.criu


def strip_lazy_marks(images: Path) -> None:
    """The page maps as CRIU 4 writes them when a thread's stack pointer is page aligned."""
    for pid in crimg.pids(images):
        path = images / f"pagemap-{pid}.img"
        data = path.read_bytes()
        spans = crimg.field_spans(data, path.name)
        out = [data[: spans[1][0] - 4]]
        for lo, hi in spans[1:]:
            vaddr, pages, flags = crimg.read_pagemap_entry(data, lo, hi)
            wide = 5 in crimg.decode(data[lo:hi])
            out.append(crimg.pagemap_record(vaddr, pages, flags & ~crimg.PE_LAZY, wide))
        path.write_bytes(b"".join(out))


def runs(images: Path) -> dict[int, list[tuple[int, int, int, int]]]:
    return {
        pid: [(r.vaddr, r.pages, r.flags, r.offset) for r in crimg.pagemap(images, pid)]
        for pid in crimg.pids(images)
    }


async def test_marks_put_back_are_those_criu_makes(kernel, tmp_path: Path) -> None:
    """Where CRIU marked the pages itself, taking its marks away and marking them again
    gives back the same page map, entry for entry, offsets included."""
    _, image, _ = await suspended_with_array(kernel)
    copy = tmp_path / "image"
    shutil.copytree(image, copy)
    assert crimg.mark_lazy(copy) == 0  # nothing to do on CRIU's own marks
    strip_lazy_marks(copy)
    assert not any(flags & crimg.PE_LAZY for r in runs(copy).values() for _, _, flags, _ in r)
    marked = crimg.mark_lazy(copy)
    lazy = sum(p for r in runs(image).values() for _, p, flags, _ in r if flags & crimg.PE_LAZY)
    assert marked == lazy > (32 << 20) // crimg.PAGE_SIZE
    assert runs(copy) == runs(image)


# A thread that waits in pause() with its stack pointer on a page boundary, for good.
ALIGNED_SLEEPER_C = r"""
#include <pthread.h>
#include <stdlib.h>
static void *sleeper(void *top)
{
    __asm__ volatile("mov %0, %%rsp\n"
             "1: mov $34, %%eax\n" /* pause */
             "syscall\n"
             "jmp 1b\n"
             : : "r"(top) : "rax", "rcx", "r11", "memory");
    return NULL;
}
int start_sleeper(void)
{
    pthread_t t;
    char *stack = aligned_alloc(4096, 1 << 16);
    return stack ? pthread_create(&t, NULL, sleeper, stack + (1 << 16)) : -1;
}
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the sleeper is x86-64 assembly")
async def test_a_thread_whose_stack_pointer_is_page_aligned_keeps_the_restore_lazy(
    kernel, tmp_path: Path
) -> None:
    """CRIU 4's dump marks none of a process's pages lazy when one of its threads has its
    stack pointer on a page boundary (its is_stack() compares the offset within a page,
    not the page): a resume of such a kernel would read all its memory before it runs.
    The suspend marks them as CRIU means to."""
    so = tmp_path / "sleeper.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-pthread", "-o", str(so), "-x", "c", "-"],
        input=ALIGNED_SLEEPER_C,
        text=True,
        check=True,
    )
    kc = kernel.test_client
    reply, out = await run(kc, f"import ctypes\nprint(ctypes.CDLL({str(so)!r}).start_sleeper())")
    assert reply["status"] == "ok" and out.strip() == "0", out
    prov, image, _ = await suspended_with_array(kernel)
    assert prov.engine.store.read_manifest(prov.kernel_id_str)["pages_marked_lazy"] > 0
    # the kernel: the process with the most memory
    pid = max(crimg.pids(image), key=lambda p: sum(r.pages for r in crimg.pagemap(image, p)))
    lazy = sum(r.pages for r in crimg.pagemap(image, pid) if r.lazy)
    assert lazy * crimg.PAGE_SIZE >= 32 << 20, crimg.pagemap(image, pid)[:20]
    hold = hold_transfer(prov, tmp_path)
    await prov.resume()
    assert prov.last_resume_breakdown and prov.last_resume_breakdown["lazy"] is True
    await wait_iopub(kc)
    assert image.exists() and page_servers(prov.kernel_id_str), transfer_state(prov)
    _, out = await run(kc, SUM)
    assert out.strip() == EXPECTED_SUM
    hold.unlink()
    await prov.memory_loaded()
    assert prov.state == KernelState.running and not image.exists()
    _, out = await run(kc, SUM)
    assert out.strip() == EXPECTED_SUM
