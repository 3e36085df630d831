# The server fixtures of test_server.py are imported, and test parameters name them.
# ruff: noqa: F811
"""The kept bases of running kernels (CheckpointEngine.keep_base) in the checkpoint budget
and the REST API, with a real jupyter server, real kernels and real CRIU: a base counts,
is shown split from the image, and is dropped first when a suspend needs room."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint.incremental import INDEX_NAME
from jupyter_cedana.server.limits import estimate_image_bytes
from tests.test_server import api, connect, manager, new_kernel, started  # noqa: F401

pytestmark = pytest.mark.criu

KERNEL = "/kernels/{kernel_id}"
SUSPEND = "/kernels/{kernel_id}/suspend"


def keep_base_config(checkpoint_root: Path, **more: dict[str, Any]) -> dict[str, Any]:
    """A server that keeps a resumed kernel's image as the base of its next suspend, and
    suspends only when asked (the tests hold the policy off); `more`: further sections."""
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_cedana": True}},
        "CedanaApp": {"checkpoint_root": str(checkpoint_root)},
        "CheckpointEngine": {"keep_base": True},
        "SuspendPolicy": {"idle_timeout": 0, "check_interval": 3600},
        **more,
    }


@pytest.fixture
def jp_server_config(checkpoint_root: Path) -> dict[str, Any]:
    return keep_base_config(checkpoint_root)


async def idle_kernel(new_kernel: Any, connect: Any, code: str) -> tuple[str, Any]:
    kid = await new_kernel()
    client = await connect(kid)
    reply = (await client.run(code))["reply"]
    assert reply["status"] == "ok", reply
    return kid, client


async def indexed(image: Path) -> None:
    """The kept image's page index is made in the background after a resume."""
    deadline = time.monotonic() + 60
    while not (image / INDEX_NAME).exists():
        assert time.monotonic() < deadline, "the kept image was never indexed"
        await asyncio.sleep(0.05)


def files_of(image: Path) -> dict[str, tuple[int, int, str]]:
    """Every file of an image: inode, mtime and content digest."""
    out = {}
    for p in sorted(image.rglob("*")):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out[str(p.relative_to(image))] = (
                st.st_ino,
                st.st_mtime_ns,
                hashlib.sha256(p.read_bytes()).hexdigest(),
            )
    return out


ARRAY = "import numpy as np; a = np.random.default_rng(3).integers(1, 2**62, size=(24 << 20) // 8)"
CELL = "a[:{n}] += 1"


async def test_a_base_is_shown_counted_and_dropped_first_for_room(
    api, new_kernel, connect, jp_serverapp, checkpoint_root: Path
) -> None:
    """Kernel A is suspended and resumed: it runs, its image kept as the base of its next
    suspend, shown as such (REST `checkpoint_disk`) and counted in the budget. A second
    suspend of A makes a chain of two, shown split. Kernel B is suspended. With a budget
    that holds B's image and C's estimated dump only once A's chain is gone, C's suspend
    succeeds: A's base was dropped (A's next suspend is whole), and not one file of B's
    image (a suspended kernel's) was touched."""
    mgr = manager(jp_serverapp)
    a, a_client = await idle_kernel(new_kernel, connect, ARRAY)
    b, _ = await idle_kernel(new_kernel, connect, ARRAY)
    c, _ = await idle_kernel(new_kernel, connect, ARRAY)
    image_a = checkpoint_root / a

    assert (await api("POST", "kernels", a, "suspend"))[0] == 200
    assert (await api("POST", "kernels", a, "resume"))[0] == 200
    await indexed(image_a)
    _, view = await api("GET", "kernels", a, spec=KERNEL)
    whole = view["checkpoint_disk"]
    assert whole["kept_base"] is True and whole["layers"] == 1 and whole["base_bytes"] == 0
    assert whole["image_bytes"] == view["checkpoint_bytes"] > 20 << 20
    _, st = await api("GET", "status", spec="/status")
    assert st["budget"]["base_bytes"] == st["budget"]["used"] == whole["image_bytes"]

    # A delta on the kept base: a chain of two, the base counted with it.
    assert (await a_client.run(CELL.format(n=1000)))["reply"]["status"] == "ok"
    status, view = await api("POST", "kernels", a, "suspend", spec=SUSPEND)
    assert status == 200
    assert (await api("GET", "kernels", a))[1]["checkpoint_disk"]["kept_base"] is False
    assert (await api("POST", "kernels", a, "resume"))[0] == 200
    await indexed(image_a)
    _, view = await api("GET", "kernels", a, spec=KERNEL)
    chain = view["checkpoint_disk"]
    assert chain["layers"] == 2 and chain["base_bytes"] == whole["image_bytes"]
    assert 0 < chain["image_bytes"] < whole["image_bytes"] // 4
    held = chain["image_bytes"] + chain["base_bytes"]
    assert view["checkpoint_bytes"] == held
    _, st = await api("GET", "status", spec="/status")
    assert st["budget"]["base_bytes"] == st["budget"]["used"] == held

    assert (await api("POST", "kernels", b, "suspend"))[0] == 200
    b_files = files_of(checkpoint_root / b)
    b_bytes = (await api("GET", "kernels", b))[1]["checkpoint_bytes"]
    assert b_files and b_bytes > 20 << 20

    # Room for B's image and C's dump, not for A's chain too.
    estimate = estimate_image_bytes(mgr.kernel_manager.get_kernel(c).provisioner.pid)
    mgr.policy.max_checkpoint_bytes = b_bytes + estimate + held // 2
    status, view = await api("POST", "kernels", c, "suspend", spec=SUSPEND)
    assert status == 200 and view["state"] == "suspended", view
    assert not image_a.exists()
    _, view = await api("GET", "kernels", a, spec=KERNEL)
    assert view["state"] == "running" and view["checkpoint_disk"] is None
    assert view["checkpoint_bytes"] == 0
    assert files_of(checkpoint_root / b) == b_files
    _, st = await api("GET", "status", spec="/status")
    assert st["budget"]["bases_dropped"] == 1 and st["budget"]["base_bytes"] == 0
    assert st["budget"]["used"] <= mgr.policy.max_checkpoint_bytes

    # A's state is its own; its next suspend is a whole image, and it comes back.
    mgr.policy.max_checkpoint_bytes = 0
    reply = (await a_client.run("print(int(a[:1000].sum() % 1000003))"))["reply"]
    assert reply["status"] == "ok"
    assert (await api("POST", "kernels", a, "suspend"))[0] == 200
    _, view = await api("GET", "kernels", a, spec=KERNEL)
    assert view["checkpoint_disk"]["layers"] == 1
    assert (await api("POST", "kernels", a, "resume"))[0] == 200


async def test_a_suspended_kernels_image_is_never_dropped(
    api, new_kernel, connect, jp_serverapp, checkpoint_root: Path
) -> None:
    """With no kept base to drop (the other kernel is suspended), a suspend that does not
    fit is refused, and the suspended kernel's image stays as it was."""
    mgr = manager(jp_serverapp)
    b, _ = await idle_kernel(new_kernel, connect, ARRAY)
    c, _ = await idle_kernel(new_kernel, connect, ARRAY)
    assert (await api("POST", "kernels", b, "suspend"))[0] == 200
    b_files = files_of(checkpoint_root / b)
    b_bytes = (await api("GET", "kernels", b))[1]["checkpoint_bytes"]
    mgr.policy.max_checkpoint_bytes = b_bytes + (1 << 20)
    status, err = await api("POST", "kernels", c, "suspend", spec=SUSPEND)
    assert status == 507 and "Checkpoint budget exceeded" in err["message"], err
    assert files_of(checkpoint_root / b) == b_files
    assert (await api("GET", "kernels", c))[1]["state"] == "running"
