"""A compaction against the kernel's resume and against kills (server/kernel/compactor.py,
checkpoint/compaction.py): held at each named step (JUPYTER_CEDANA_COMPACTION_HOLDS), a
resume cancels it, or finds it exchanged; a process doing it, killed at each step,
leaves the chain or the folded image, which restores the kernel, and a leftover that
`jupyter cedana gc` proves its own and removes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint import compaction, store_gc
from jupyter_cedana.checkpoint.store import BASE_NAME
from jupyter_cedana.server.kernel.compactor import compactor_for
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import AGENT_SOCKET, wait_iopub
from tests.test_compaction import files_of, leftovers, suspended_chain
from tests.test_incremental_kernel import state_of

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(bool(AGENT_SOCKET), reason="incremental images are made in-process"),
]


@pytest.fixture
def holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "holds"
    where.mkdir()
    monkeypatch.setenv(compaction.HOLD_ENV, str(where))
    return where


async def reached(holds: Path, step: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (holds / f"reached-{step}").exists():
        assert time.monotonic() < deadline, f"the compaction never reached {step}"
        await asyncio.sleep(0.01)


async def resumed_state(kernel) -> str:
    prov = kernel.provisioner
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kernel.test_client)
    return await state_of(kernel.test_client)


@pytest.mark.parametrize("step", ["folding", "folded"])
async def test_a_resume_cancels_a_compaction_before_its_exchange(
    kernel, checkpoint_root: Path, holds: Path, step: str
) -> None:
    """The compaction held mid-fold, or folded and not exchanged: a resume cancels it
    and restores from the chain (the image still has its base), with the kernel's state;
    the temporary image is gone, and no compaction is left running."""
    prov = kernel.provisioner
    store = prov.engine.store
    kid = kernel.kernel_id
    image = checkpoint_root / kid
    expected = await suspended_chain(kernel, image)
    compactor = compactor_for(store)
    compactor.max_deltas = 1
    (holds / f"arm-{step}").touch()
    compactor.schedule(prov)
    await reached(holds, step)
    assert any(name.endswith(".locked") for name in leftovers(checkpoint_root, kid))
    chain = files_of(image)

    assert await resumed_state(kernel) == expected

    assert prov.state == KernelState.running
    assert (image / BASE_NAME / "manifest.json").exists()  # resumed from the chain
    assert files_of(image) == chain
    assert compactor.done == []
    await compactor.stop()
    assert leftovers(checkpoint_root, kid) == []
    assert not (holds / f"release-{step}").exists()


async def test_a_resume_after_the_exchange_reads_the_folded_image(
    kernel, checkpoint_root: Path, holds: Path
) -> None:
    """Held after the exchange, before the chain is deleted: a resume does not wait for
    it and restores from the folded image; released, the chain goes, nothing is left."""
    prov = kernel.provisioner
    store = prov.engine.store
    kid = kernel.kernel_id
    image = checkpoint_root / kid
    expected = await suspended_chain(kernel, image)
    held = store.read_manifest(kid)["held_bytes"]
    compactor = compactor_for(store)
    compactor.ratio = 1.0  # the chain holds more than the memory it restores
    (holds / "arm-exchanged").touch()
    compactor.schedule(prov)
    await reached(holds, "exchanged")
    assert not (image / BASE_NAME).exists()

    assert await resumed_state(kernel) == expected
    assert prov.last_resume_breakdown is not None

    (holds / "release-exchanged").touch()
    await compactor.stop()
    assert leftovers(checkpoint_root, kid) == []
    assert [kid for kid, _ in compactor.done] == [kid]
    assert compactor.done[0][1].held_after < held


async def test_a_compaction_in_the_background_updates_what_the_kernel_holds(
    kernel, checkpoint_root: Path
) -> None:
    """Unheld, scheduled as a suspend that commits a delta schedules it: the chain is
    folded, the kernel's checkpoint_bytes (the REST view) what the folded image holds."""
    prov = kernel.provisioner
    store = prov.engine.store
    kid = kernel.kernel_id
    compactor = compactor_for(store)
    compactor.max_deltas = 1
    expected = await suspended_chain(kernel, checkpoint_root / kid)
    deadline = time.monotonic() + 120
    while not compactor.done:  # scheduled by the last suspend (checkpointing.py)
        assert time.monotonic() < deadline, "the chain was never compacted"
        await asyncio.sleep(0.05)
    manifest = store.read_manifest(kid)
    assert "base" not in manifest
    assert prov.checkpoint_bytes == manifest["held_bytes"] == manifest["total_bytes"]
    assert await resumed_state(kernel) == expected
    await compactor.stop()


CHILD = """
import sys
from jupyter_cedana.checkpoint import compaction
from jupyter_cedana.checkpoint.store import CheckpointStore
compaction.polite()
compaction.compact(CheckpointStore(sys.argv[1]), sys.argv[2])
"""


@pytest.mark.parametrize("step", ["folded", "exchanged"])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "whole"])
async def test_a_compaction_killed_at_a_step_leaves_a_restorable_image(
    kernel, checkpoint_root: Path, holds: Path, step: str, lazy: bool
) -> None:
    """A process compacting the chain, SIGKILLed after the fold (before the exchange) or
    after the exchange (before the chain is deleted): the kernel's image is the chain or
    the folded image, whole, and the kernel resumes from it with its state; what the kill
    left (the temporary, or the chain under the temporary's name) is one `jupyter
    cedana gc` proves its own and removes, after which nothing of it is left."""
    prov = kernel.provisioner
    store = prov.engine.store
    kid = kernel.kernel_id
    image = checkpoint_root / kid
    expected = await suspended_chain(kernel, image)
    (holds / f"arm-{step}").touch()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(checkpoint_root), kid], env=dict(os.environ)
    )
    try:
        await reached(holds, step)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    left = leftovers(checkpoint_root, kid)
    folded = step == "exchanged"
    # The fold in its temporary; or the chain, exchanged, renamed to a deletion name.
    assert len(left) == 1 and (".del-" in left[0] if folded else left[0].endswith(".locked"))
    assert (image / BASE_NAME).exists() is not folded
    assert ("base" in (checkpoint_root / left[0] / "manifest.json").read_text()) is folded

    prov.engine.lazy_restore_min_bytes = 0 if lazy else 1 << 50
    assert await resumed_state(kernel) == expected
    assert prov.last_resume_breakdown and prov.last_resume_breakdown["lazy"] is lazy

    # Ours, as gc proves it (were the kernel gone), and removed by the next look at
    # the kernel's chain (compactor.py) while the kernel is known.
    plan = store_gc.plan(store, keep=set())
    assert ("temporary", left[0]) in [(i.kind, i.path.name) for i in plan.remove]
    assert compaction.sweep(store, kid) == left
    assert leftovers(checkpoint_root, kid) == []
