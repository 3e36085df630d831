"""Retention with a real server, real kernels and real CRIU: a kernel whose resume failed
does not hold its image (and the disk budget) forever."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.test_server import api, jp_server_config, manager, new_kernel, started

pytestmark = pytest.mark.criu

__all__ = ["api", "jp_server_config", "new_kernel", "started"]  # fixtures used here


async def test_a_failed_kernel_is_shut_down_when_its_retention_ends(
    api: Any, new_kernel: Any, jp_serverapp: Any, checkpoint_root: Path
) -> None:
    kid = await new_kernel()
    await api("POST", "kernels", kid, "suspend")
    pages = max((checkpoint_root / kid).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    pages.write_bytes(pages.read_bytes()[:-4096])  # the resume fails: truncated
    status, _ = await api("POST", "kernels", kid, "resume")
    assert status >= 400
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "failed" and (checkpoint_root / kid / "manifest.json").exists()
    # Kept for as long as retention says (here: for good), then shut down with its image.
    await manager(jp_serverapp).check()
    assert kid in jp_serverapp.kernel_manager
    manager(jp_serverapp).policy.retention = 0.5
    deadline = time.monotonic() + 60
    while kid in jp_serverapp.kernel_manager and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert kid not in jp_serverapp.kernel_manager
    assert not (checkpoint_root / kid).exists()
