"""The pieces of compaction that need no kernel: the exchange of two directories
(checkpoint/exchange.py), and how a server configures its compactor and counts a
compaction's disk in the checkpoint budget (SuspendLimits, Budget.reserve_compaction)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from traitlets.config import Config

from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.checkpoint.exchange import rename_exchange
from jupyter_cedana.server.manager import SuspendManager
from jupyter_cedana.server.policy import SuspendPolicy


def test_an_exchange_swaps_two_directories_whole(tmp_path: Path) -> None:
    old, new = tmp_path / "kernel", tmp_path / ".kernel.tmp"
    old.mkdir()
    new.mkdir()
    (old / "chain").write_text("old")
    (new / "folded").write_text("new")
    rename_exchange(new, old)
    assert [p.name for p in old.iterdir()] == ["folded"]
    assert [p.name for p in new.iterdir()] == ["chain"]
    with pytest.raises(OSError) as info:  # both must exist: nothing is replaced blindly
        rename_exchange(tmp_path / "missing", old)
    assert info.value.errno == errno.ENOENT
    assert [p.name for p in old.iterdir()] == ["folded"]


def test_the_manager_configures_the_compactor_and_the_budget_counts_it(tmp_path: Path) -> None:
    c = Config()
    c.SuspendLimits.compact_chain_ratio = 1.3
    c.SuspendLimits.compact_chain_deltas = 3
    c.SuspendLimits.min_free_disk_bytes = 0
    engine = CheckpointEngine(config=c, checkpoint_root=str(tmp_path / "ckpt"))
    engine.store.ensure_root()
    manager = SuspendManager(engine=engine, policy=SuspendPolicy(), config=c)
    compactor = manager.compactor()
    assert (compactor.ratio, compactor.max_deltas) == (1.3, 3)
    assert compactor.enabled
    budget = manager.budget
    assert compactor.reserve("k1", 1 << 20)
    assert budget.snapshot()["reserved"] == 1 << 20  # seen by the dumps of other kernels
    assert not compactor.reserve("k1", 1 << 20)  # one compaction of a kernel at a time
    budget.reserve("k1", 4096)  # the kernel's own dump is another reservation
    assert budget.snapshot()["reserved"] == (1 << 20) + 4096
    compactor.release("k1")
    assert budget.snapshot()["reserved"] == 4096
    # No room: a compaction waits rather than filling the disk.
    manager.limits.min_free_disk_bytes = budget.free_bytes()
    assert not compactor.reserve("k2", 1 << 20)
    off = Config()
    off.SuspendLimits.compact_chain_ratio = 0.0
    off.SuspendLimits.compact_chain_deltas = 0
    quiet = SuspendManager(engine=engine, policy=SuspendPolicy(), config=off).compactor()
    assert quiet is compactor and not quiet.enabled  # one compactor per checkpoint root
