"""Incremental suspends of a real kernel (CheckpointEngine.keep_base): the resumed kernel's
image is kept as the base of its next suspend, which writes what the cells changed; the
restore reads base and deltas as one image, all of it checked first."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint import crimg
from jupyter_cedana.checkpoint.incremental import INDEX_NAME, PARENT_LINK
from jupyter_cedana.checkpoint.store import BASE_NAME
from jupyter_cedana.errors import CheckpointCorrupt
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import run, wait_iopub

pytestmark = pytest.mark.criu

SETUP = """
import hashlib, numpy as np
a = np.random.default_rng(7).integers(1, 2**62, size=(64 << 20) // 8, dtype=np.int64)
notes = {}
def state():
    return hashlib.sha256(a.tobytes() + repr(sorted(notes.items())).encode()).hexdigest()
"""
# A cell changing 1 % of the array, at another place each cycle, and a little else.
CELL = "_n = a.size // 100; a[{i} * _n : ({i} + 1) * _n] += 1; notes[{i}] = 'x' * 1000"


async def kept_and_indexed(image: Path) -> None:
    """The kept image's page index is made in the background after a resume; the next
    suspend is incremental once it is there."""
    deadline = time.monotonic() + 60
    while not (image / INDEX_NAME).exists():
        assert time.monotonic() < deadline, "the kept image was never indexed"
        await asyncio.sleep(0.05)


async def state_of(kc) -> str:
    _, out = await run(kc, "print(state())")
    return out.strip()


async def test_repeat_suspends_write_what_changed(kernel, checkpoint_root: Path) -> None:
    """Five cycles of cell, suspend, resume: the first image whole, each later one a delta
    on the one before, holding a small share of the memory; the kernel's state right
    after every resume (lazily: pages in-parent served from the bases, through the
    chain); the disk held by the chain counted in the manifest as on disk."""
    prov = kernel.provisioner
    prov.engine.keep_base = True
    kc = kernel.test_client
    reply, _ = await run(kc, SETUP)
    assert reply["status"] == "ok"
    image = checkpoint_root / kernel.kernel_id
    full = 0
    for i in range(5):
        await run(kc, CELL.format(i=i))
        expected = await state_of(kc)
        await prov.suspend()
        manifest = prov.engine.store.read_manifest(kernel.kernel_id)
        if i == 0:
            assert "base" not in manifest
            full = manifest["total_bytes"]
            assert full > 64 << 20
        else:
            assert manifest["base"] == BASE_NAME
            assert (image / PARENT_LINK).resolve() == (image / BASE_NAME).resolve()
            delta = manifest["delta"]
            assert delta["in_parent_bytes"] > 60 << 20
            # 1 % of the array changed; the rest is what any cell touches in a kernel.
            assert manifest["total_bytes"] < full // 4
            # Every file of the chain, but for the manifests and the page indexes (the
            # last one may be being written: it is saved after the suspend).
            on_disk = sum(
                p.stat().st_size
                for p in image.rglob("*")
                if p.is_file() and p.name != "manifest.json" and INDEX_NAME not in p.name
            )
            assert manifest["held_bytes"] == on_disk
            # Only the newest image's page index is kept: the bases' would hold disk.
            assert not list((image / BASE_NAME).rglob(INDEX_NAME))
        # What the kernel's checkpoint holds on disk (the REST view's checkpoint_bytes).
        assert prov.checkpoint_bytes == manifest["held_bytes"]
        await prov.resume()
        assert prov.last_resume_breakdown and prov.last_resume_breakdown["lazy"] is True
        await prov.memory_loaded()
        await wait_iopub(kc)
        assert await state_of(kc) == expected
        await kept_and_indexed(image)
        assert prov.checkpoint_bytes == manifest["held_bytes"]  # kept while it runs
    # The chain is as deep as the deltas made (no compaction yet).
    assert (image / "/".join([BASE_NAME] * 4) / "manifest.json").exists()


def in_base(image: Path) -> tuple[Path, int]:
    """A page file of the base and an offset in it holding a page the image has only in
    its base (in-parent), in the array (a long run), served lazily on a lazy restore."""
    pid, longest = max(
        (
            (pid, r)
            for pid in crimg.pids(image)
            for r in crimg.pagemap(image, pid)
            if r.flags & crimg.PE_PARENT
        ),
        key=lambda pr: pr[1].pages,
    )
    vaddr = longest.vaddr + longest.pages // 2 * crimg.PAGE_SIZE
    for b in crimg.pagemap(image / BASE_NAME, pid):
        if b.present and b.vaddr <= vaddr < b.end:
            assert longest.lazy and b.pages > 16
            return image / BASE_NAME / b.pages_file, b.offset + (vaddr - b.vaddr)
    raise AssertionError("no page in the base")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("lazy", [False, True], ids=["whole", "lazy"])
async def test_a_damaged_base_fails_the_restore_and_keeps_the_image(
    kernel, checkpoint_root: Path, lazy: bool
) -> None:
    """A byte flipped in the base's page file, in a page the delta has only there: a
    whole resume is refused before the kernel runs; a lazy one refuses the page when it
    is served, and the kernel is killed; either way the error names the base's file,
    the kernel is `failed` and its image kept; with the byte put back, the resume brings
    back the state of the delta."""
    prov = kernel.provisioner
    prov.engine.keep_base = True
    kc = kernel.test_client
    await run(kc, SETUP)
    image = checkpoint_root / kernel.kernel_id
    await prov.suspend()
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kc)
    await kept_and_indexed(image)
    await run(kc, CELL.format(i=3))
    expected = await state_of(kc)
    await prov.suspend()
    assert prov.engine.store.read_manifest(kernel.kernel_id)["base"] == BASE_NAME
    pages, offset = in_base(image)
    flip_byte(pages, offset)
    prov.engine.lazy_restore = lazy
    if lazy:
        await prov.resume()  # what CRIU reads itself is checked first; the rest as served
        assert prov.last_resume_breakdown and prov.last_resume_breakdown["lazy"] is True
        await prov.memory_loaded()
        reason = prov.reason or ""
    else:
        with pytest.raises(CheckpointCorrupt) as info:
            await prov.resume()
        reason = info.value.message
    assert f"checksum mismatch in {BASE_NAME}/{pages.name}" in reason, reason
    assert prov.state == KernelState.failed
    assert (image / "manifest.json").exists() and pages.exists()
    flip_byte(pages, offset)
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kc)
    assert await state_of(kc) == expected


async def test_a_chain_past_its_limit_is_replaced_by_a_whole_image(
    kernel, checkpoint_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kernel's memory taken as the whole image's size and the limit at 1x, the
    first delta fits (the chain holds the whole image) and the next suspend, whose chain
    would hold more, writes a whole image instead: the chain is gone from disk and the
    state comes back."""
    from jupyter_cedana.server.kernel import suspender

    prov = kernel.provisioner
    prov.engine.keep_base = True
    kc = kernel.test_client
    await run(kc, SETUP)
    image = checkpoint_root / kernel.kernel_id
    store = prov.engine.store
    kinds = []
    for i in range(3):
        await run(kc, CELL.format(i=i))
        expected = await state_of(kc)
        await prov.suspend()
        manifest = store.read_manifest(kernel.kernel_id)
        if i == 0:
            whole = manifest["total_bytes"]
            monkeypatch.setattr(suspender, "CHAIN_LIMIT", 1.0)
            monkeypatch.setattr(suspender, "tree_rss", lambda pid, size=whole: size)
        kinds.append("delta" if manifest.get("base") else "whole")
        await prov.resume()
        await prov.memory_loaded()
        await wait_iopub(kc)
        assert await state_of(kc) == expected
        await kept_and_indexed(image)
    assert kinds == ["whole", "delta", "whole"]
    assert not (image / BASE_NAME).exists()
