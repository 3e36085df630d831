"""Slots, the checkpoint budget and the backoff of failed suspends, without a server."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint.store import CheckpointStore
from jupyter_cedana.errors import (
    Conflict,
    InsufficientStorage,
    NotCheckpointable,
    SuspendFailed,
)
from jupyter_cedana.server.backoff import SuspendBackoff, not_checkpointable
from jupyter_cedana.server.limits import Budget, Slots, estimate_image_bytes

# -- slots ---------------------------------------------------------------------------------


async def test_slots_let_limit_run_and_queue_the_rest_in_order() -> None:
    limit = [1]
    slots = Slots(lambda: limit[0])
    await slots.acquire("a")
    started: list[str] = []

    async def take(key: str) -> None:
        await slots.acquire(key)
        started.append(key)

    b = asyncio.ensure_future(take("b"))
    c = asyncio.ensure_future(take("c"))
    await asyncio.sleep(0)
    assert slots.waiting == ["b", "c"] and slots.position("c") == 2
    assert slots.waiting_since("b") is not None
    slots.release("a")
    await b
    assert started == ["b"] and slots.position("c") == 1
    limit[0] = 2  # a larger limit lets the next one in at the next release
    slots.release("b")
    await c
    assert started == ["b", "c"] and slots.waiting == []
    assert not slots.would_wait()  # c holds one of two
    slots.release("c")


async def test_a_cancelled_waiter_leaves_the_line_and_passes_its_slot_on() -> None:
    slots = Slots(lambda: 1)
    await slots.acquire("a")
    b = asyncio.ensure_future(slots.acquire("b"))
    c = asyncio.ensure_future(slots.acquire("c"))
    await asyncio.sleep(0)
    b.cancel()
    await asyncio.sleep(0)
    assert slots.waiting == ["c"]
    # Granted, then cancelled before it ran: the slot goes to the next in line.
    d = asyncio.ensure_future(slots.acquire("d"))
    await asyncio.sleep(0)
    slots.release("a")
    c.cancel()
    with pytest.raises(asyncio.CancelledError):
        await c
    await asyncio.wait_for(d, 5)
    assert slots.waiting == []
    slots.release("d")
    await slots.acquire("e")  # nothing is held any more: no wait


def test_no_limit_never_waits() -> None:
    assert not Slots(lambda: 0).would_wait()


# -- budget --------------------------------------------------------------------------------


def image(store: CheckpointStore, kid: str, size: int) -> int:
    """An image of `size` bytes of pages; returns what it takes on disk (its checksum
    table included), which is what the budget counts."""
    tmp = store.begin(kid)
    (tmp / "pages-1.img").write_bytes(b"x" * size)
    return int(store.commit(kid, tmp, {})["total_bytes"])


def budget(store: CheckpointStore, limit: int, owners: set[str], min_free: int = 0) -> Budget:
    return Budget(lambda: store, lambda: limit, lambda: min_free, lambda: owners)


def test_reservations_cannot_overshoot_the_budget(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    used = image(store, "mine", 3000)
    image(store, "orphan", 50_000)  # nobody owns it: it does not count
    b = budget(store, 10_000, {"mine", "a", "b"})
    b.reserve("a", 5000)
    with pytest.raises(InsufficientStorage, match="Checkpoint budget exceeded") as info:
        b.reserve("b", 5000)
    assert "4.9 KiB reserved by dumps under way" in info.value.message, info.value.message
    assert "max_checkpoint_bytes=10000" in info.value.message
    assert info.value.status == 507
    snap = b.snapshot()
    assert 3000 < used < 3100
    assert snap["used"] == used and snap["reserved"] == 5000
    assert snap["available"] == 10_000 - used - 5000
    assert snap["orphaned_images"] == 1 and snap["orphaned_kernel_ids"] == ["orphan"]
    b.release("a")  # the dump failed: its reservation is free again
    b.reserve("b", 5000)
    assert b.reserved == 5000


def test_an_image_larger_than_its_reservation_must_still_fit(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    b = budget(store, 10_000, {"a", "b"})
    b.reserve("a", 2000)
    b.reserve("b", 2000)
    b.check_image("a", 7000)  # grows into what is left
    assert b.reserved == 9000
    with pytest.raises(InsufficientStorage, match="discarded"):
        b.check_image("b", 3001)


def test_the_replaced_image_of_the_same_kernel_does_not_count_twice(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    image(store, "a", 6000)
    b = budget(store, 10_000, {"a"})
    b.reserve("a", 8000)  # the new image replaces the old one


def test_free_space_is_checked_before_a_dump(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    b = budget(store, 0, set(), min_free=0)
    free = b.free_bytes()
    with pytest.raises(InsufficientStorage, match="Not enough free space"):
        b.reserve("a", free + (1 << 30))
    margin = Budget(lambda: store, lambda: 0, lambda: free, lambda: set())
    with pytest.raises(InsufficientStorage, match="min_free_disk_bytes"):
        margin.reserve("a", 1 << 20)
    b.reserve("a", 1 << 20)


def test_estimate_counts_memory_and_gpu_memory() -> None:
    import os

    mine = estimate_image_bytes(os.getpid())
    assert mine > 10 << 20  # this interpreter's resident memory
    assert estimate_image_bytes(os.getpid(), gpu_bytes=5 << 30) >= mine + (5 << 30)


# -- backoff -------------------------------------------------------------------------------

# Failure messages as CheckpointEngine.dump words them from CRIU 4.2's log.
GHOST = "CRIU dump failed (exit 1): Can't dump ghost file /work/x of 2101248 size, increase limit"
EXTERNAL = (
    "CRIU dump failed (exit 1): External socket is used. Consider using --ext-unix-sk option."
)


@pytest.mark.parametrize(
    "error, permanent",
    [
        (SuspendFailed(GHOST), True),
        (SuspendFailed(EXTERNAL), True),
        (NotCheckpointable("holds GPU memory but CUDA checkpointing is unavailable"), True),
        (SuspendFailed("CRIU dump failed (exit 1): no space left on the checkpoint disk"), False),
        (SuspendFailed("CRIU dump took longer than 600 s"), False),
        (InsufficientStorage("Checkpoint budget exceeded"), False),
        (Conflict("GPU offload is unavailable"), False),
    ],
)
def test_classification(error: Exception, permanent: bool) -> None:
    assert (not_checkpointable(error) is not None) is permanent


def test_failures_back_off_exponentially_up_to_the_cap() -> None:
    backoff = SuspendBackoff(retry_delay=10.0, max_retry_delay=25.0)
    activity = dt.datetime.now(dt.UTC)
    delays = []
    for _ in range(4):
        before = time.time()
        setback = backoff.failed("k", SuspendFailed("disk full"), activity)
        after = time.time()
        delays.append((setback.retry_at - after, setback.retry_at - before))
    for (low, high), expected in zip(delays, [10, 20, 25, 25], strict=True):
        assert low <= expected <= high
    blocking = backoff.blocking("k", activity)
    assert blocking is not None and blocking.failures == 4
    assert "failed 4 times (disk full)" in blocking.describe()
    assert blocking.to_json()["not_checkpointable"] is False
    backoff.succeeded("k")
    assert backoff.blocking("k", activity) is None


def test_not_checkpointable_waits_for_activity_or_the_cap() -> None:
    backoff = SuspendBackoff(retry_delay=1.0, max_retry_delay=3600.0)
    activity = dt.datetime.now(dt.UTC)
    before = time.time()
    setback = backoff.failed("k", SuspendFailed(GHOST), activity)
    assert setback.retry_at >= before + 3600
    assert "Not checkpointable" in setback.describe()
    assert "deleted file" in setback.describe()
    assert backoff.blocking("k", activity) is setback
    # The user runs a cell: the kernel may have let go of what CRIU refused.
    assert backoff.blocking("k", activity + dt.timedelta(seconds=1)) is None
    assert backoff.blocking("k", activity) is None  # forgotten for good


def test_a_due_retry_is_allowed_and_a_new_failure_waits_longer() -> None:
    backoff = SuspendBackoff(retry_delay=0.0, max_retry_delay=0.0)
    backoff.failed("k", SuspendFailed("x"), None)
    assert backoff.blocking("k", None) is None  # due at once
    assert backoff.failed("k", SuspendFailed("x"), None).failures == 2
    backoff.forget_except({"other"})
    assert backoff.failed("k", SuspendFailed("x"), None).failures == 1


def test_a_refusal_names_what_holds_the_space_and_how_to_free_it(tmp_path: Path) -> None:
    """A suspend refused for the budget or the disk says which images take the space
    (the largest first), and the command that shows and removes the leftovers."""
    store = CheckpointStore(tmp_path)
    big = image(store, "parked-big", 6000)
    small = image(store, "parked-small", 2000)
    image(store, "orphan", 9000)
    b = budget(store, 10_000, {"parked-big", "parked-small", "new"})
    with pytest.raises(InsufficientStorage) as info:
        b.reserve("new", 4000)
    message = info.value.message
    assert f"parked-big ({big / 1024:.1f} KiB)" in message, message
    assert f"parked-small ({small / 1024:.1f} KiB)" in message, message
    assert message.index("parked-big") < message.index("parked-small")
    assert "jupyter cedana gc --dry-run" in message
    assert "orphan" not in message  # it does not count against the budget

    disk = budget(store, 0, {"parked-big"}, min_free=0)
    with pytest.raises(InsufficientStorage, match="Not enough free space") as info:
        disk.reserve("new", disk.free_bytes() + (1 << 30))
    message = info.value.message
    assert "parked-big" in message and "orphan" in message, message
    assert "jupyter cedana gc --dry-run" in message
