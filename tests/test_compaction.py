"""Compaction of a suspended kernel's chain of incremental images (checkpoint/compaction.py,
docs/incremental.md): a real kernel suspended three times with CheckpointEngine.keep_base
(a whole image and two deltas), its chain folded into one whole image which takes the
chain's place; restored from it, whole and lazily, with its state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint import compaction
from jupyter_cedana.checkpoint.incremental import INDEX_NAME, PageIndex
from jupyter_cedana.checkpoint.store import BASE_NAME
from jupyter_cedana.errors import CheckpointCorrupt
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import AGENT_SOCKET, run, wait_iopub
from tests.test_incremental_kernel import (
    CELL,
    SETUP,
    flip_byte,
    in_base,
    kept_and_indexed,
    state_of,
)

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(bool(AGENT_SOCKET), reason="incremental images are made in-process"),
]


async def suspended_chain(kernel, image: Path, deltas: int = 2) -> str:
    """The kernel suspended `deltas` + 1 times (a whole image, then deltas on it), cells
    changing its array between; returns the state it was suspended with."""
    prov = kernel.provisioner
    prov.engine.keep_base = True
    kc = kernel.test_client
    reply, _ = await run(kc, SETUP)
    assert reply["status"] == "ok"
    for i in range(deltas + 1):
        await run(kc, CELL.format(i=i))
        expected = await state_of(kc)
        await prov.suspend()
        if i == deltas:
            await kept_and_indexed(image)  # saved after a delta's commit, in the background
            break
        await prov.resume()
        await prov.memory_loaded()
        await wait_iopub(kc)
        await kept_and_indexed(image)
    assert prov.state == KernelState.suspended
    return expected


def files_of(image: Path) -> dict[str, tuple[int, int]]:
    """Every file of an image with its inode and size: what is there, unchanged."""
    return {
        str(p.relative_to(image)): (p.stat().st_ino, p.stat().st_size)
        for p in image.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def leftovers(root: Path, kernel_id: str) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(f".{kernel_id}."))


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "whole"])
async def test_a_folded_chain_restores_the_kernel(
    kernel, checkpoint_root: Path, lazy: bool
) -> None:
    """Three layers folded into one whole image: no base left, every file checked by the
    store's own verify, the disk held equal to the image, the page index carried over;
    the kernel restored from it (whole or lazily) with its state; its next suspend a
    delta on the folded image again."""
    prov = kernel.provisioner
    store = prov.engine.store
    kid = kernel.kernel_id
    image = checkpoint_root / kid
    expected = await suspended_chain(kernel, image)
    before = store.read_manifest(kid)
    chain = compaction.chain_of(store, kid)
    assert chain is not None and chain.layers == 3
    assert chain.held_bytes == before["held_bytes"] > chain.memory_bytes > 64 << 20

    result = await asyncio.to_thread(compaction.compact, store, kid)

    assert result is not None and result.layers == 3
    manifest = store.verify(kid)  # sizes, and the CRC of every chunk and file
    assert "base" not in manifest and not (image / BASE_NAME).exists()
    assert not (image / "parent").exists()
    assert manifest["held_bytes"] == manifest["total_bytes"] == result.held_after
    assert result.held_after < before["held_bytes"]
    # The same checkpoint: its time (retention, the page index's name for it) kept.
    assert manifest["created"] == before["created"]
    assert manifest["created_clock"] == before["created_clock"]
    assert manifest["compacted"]["layers"] == 3
    on_disk = sum(
        size
        for name, (_, size) in files_of(image).items()
        if name not in ("manifest.json", INDEX_NAME)
    )
    assert on_disk == manifest["total_bytes"]
    assert PageIndex.load(image).pages * 4096 == chain.memory_bytes
    assert compaction.chain_of(store, kid).layers == 1  # type: ignore[union-attr]
    assert leftovers(checkpoint_root, kid) == []

    prov.engine.lazy_restore_min_bytes = 0 if lazy else 1 << 50
    await prov.resume()
    assert prov.last_resume_breakdown and prov.last_resume_breakdown["lazy"] is lazy
    await prov.memory_loaded()
    await wait_iopub(kernel.test_client)
    assert await state_of(kernel.test_client) == expected

    # Kept as the base of the next suspend, its index the one carried over.
    await run(kernel.test_client, CELL.format(i=7))
    expected = await state_of(kernel.test_client)
    await prov.suspend()
    assert store.read_manifest(kid)["base"] == BASE_NAME
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kernel.test_client)
    assert await state_of(kernel.test_client) == expected


async def test_a_damaged_chunk_fails_the_compaction_and_keeps_the_chain(
    kernel, checkpoint_root: Path
) -> None:
    """A byte flipped in a page of the base that the newest image holds only there: the
    compaction fails naming the file and chunk, the chain is as it was (same files,
    same inodes), nothing of the compaction is left; with the byte put back, the chain
    restores the kernel's state."""
    prov = kernel.provisioner
    store = prov.engine.store
    kid = kernel.kernel_id
    image = checkpoint_root / kid
    expected = await suspended_chain(kernel, image, deltas=1)
    pages, offset = in_base(image)
    flip_byte(pages, offset)
    before = files_of(image)

    with pytest.raises(CheckpointCorrupt) as info:
        await asyncio.to_thread(compaction.compact, store, kid)

    assert f"checksum mismatch in {BASE_NAME}/{pages.name} at offset" in info.value.message
    assert files_of(image) == before
    assert leftovers(checkpoint_root, kid) == []
    flip_byte(pages, offset)
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kernel.test_client)
    assert await state_of(kernel.test_client) == expected
