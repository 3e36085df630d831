# The server fixtures of test_server.py are imported, and test parameters name them.
# ruff: noqa: F811
"""Compaction in a real jupyter server (SuspendLimits.compact_chain_deltas): a suspend
that commits a delta on a chain past the limit has it folded in the background; the
REST view, the budget and the disk then count the whole image alone, and the next cell
resumes the kernel from it with its state."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import AGENT_SOCKET
from tests.test_incremental_budget import (
    ARRAY,
    CELL,
    KERNEL,
    idle_kernel,
    indexed,
    keep_base_config,
)
from tests.test_server import api, connect, manager, new_kernel, started  # noqa: F401

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(bool(AGENT_SOCKET), reason="incremental images are made in-process"),
]

STATE = "print(int(a.sum() % 1000003))"


@pytest.fixture
def jp_server_config(checkpoint_root: Path) -> dict[str, Any]:
    # By count only: a chain with two deltas is folded.
    limits = {"compact_chain_deltas": 1, "compact_chain_ratio": 0.0}
    return keep_base_config(checkpoint_root, SuspendLimits=limits)


async def test_a_chain_past_the_limit_is_folded_and_counted_whole(
    api, new_kernel, connect, jp_serverapp, checkpoint_root: Path
) -> None:
    mgr = manager(jp_serverapp)
    kid, client = await idle_kernel(new_kernel, connect, ARRAY)
    image = checkpoint_root / kid
    layers = []
    for i in range(3):
        # From the second on, the cell resumes the kernel (the gate holds it meanwhile).
        assert (await client.run(CELL.format(n=1000 * (i + 1))))["reply"]["status"] == "ok"
        if i:
            await indexed(image)  # the kept image, indexed: the next suspend is a delta
        expected = (await client.run(STATE))["stdout"]
        assert (await api("POST", "kernels", kid, "suspend"))[0] == 200
        _, view = await api("GET", "kernels", kid, spec=KERNEL)
        layers.append(view["checkpoint_disk"]["layers"])
    # Whole, then a delta (one: within the limit), then a second delta: past it.
    assert layers == [1, 2, 3]
    deadline = time.monotonic() + 120
    while True:  # folded in the background, the kernel suspended meanwhile
        _, view = await api("GET", "kernels", kid, spec=KERNEL)
        if view["checkpoint_disk"]["layers"] == 1:
            break
        assert time.monotonic() < deadline, "the chain was never compacted"
        await asyncio.sleep(0.1)
    await mgr.compactor().idle()  # then what the kernel holds is known
    _, view = await api("GET", "kernels", kid, spec=KERNEL)
    assert view["state"] == "suspended"
    disk = view["checkpoint_disk"]
    assert disk["base_bytes"] == 0 and view["checkpoint_bytes"] == disk["image_bytes"]
    on_disk = sum(
        p.stat().st_size
        for p in image.rglob("*")
        if p.is_file() and p.name not in ("manifest.json", "page-index.bin")
    )
    assert on_disk == disk["image_bytes"]
    _, st = await api("GET", "status", spec="/status")
    assert st["budget"]["used"] == disk["image_bytes"]
    assert st["budget"]["reserved"] == 0  # the compaction's reservation ended with it
    # The next cell resumes the kernel (the gate holds it meanwhile), from the folded image.
    assert (await client.run(STATE))["stdout"] == expected
    _, view = await api("GET", "kernels", kid, spec=KERNEL)
    assert view["state"] == "running" and view["checkpoint_disk"]["kept_base"] is True
