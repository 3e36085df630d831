"""A lazy restore that fails after the kernel already runs, with a real jupyter server,
real kernels and real CRIU: a cell the kernel had taken gets an error reply saying what
was lost, the kernel is `failed` with that reason, and the next cell resumes it from the
image taken at its suspend, saying so.

The kernel is made to fail deterministically: the page server's background transfer is
held (tests/test_lazy.py: hold_transfer), a cell is left waiting in the kernel on a FIFO
nobody writes, then the page server is killed or the kernel touches a damaged chunk.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.timestamps import iso

from . import test_gate as gated
from .test_lazy import EXPECTED_SUM, FILL, flip_byte, hold_transfer, lazy_page_in, page_servers

# The server fixtures (pytest finds fixtures by module attribute).
api, new_kernel, started, connect = gated.api, gated.new_kernel, gated.started, gated.connect
jp_server_config, events = gated.jp_server_config, gated.events

pytestmark = pytest.mark.criu


def _busy_for(msg_id: str) -> Any:
    def done(msgs: list[dict[str, Any]]) -> bool:
        return any(
            m["msg_type"] == "status" and m["content"]["execution_state"] == "busy" for m in msgs
        )

    return done


@pytest.mark.parametrize("failure", ["page server killed", "damaged chunk"])
async def test_a_failed_lazy_restore_answers_the_cell_and_says_what_is_lost(
    api, new_kernel, connect, jp_serverapp, events, tmp_path: Path, failure: str
) -> None:
    kid = await new_kernel()
    client = await connect(kid)
    out = await client.run(FILL)
    address = int(out.strip())
    prov = jp_serverapp.kernel_manager.get_kernel(kid).provisioner
    prov.engine.lazy_restore_min_bytes = 0
    hold = hold_transfer(prov, tmp_path)
    assert (await api("POST", "kernels", kid, "suspend"))[0] == 200
    store = prov.engine.store
    taken_at = store.read_manifest(kid)["created"]
    image = store.path(kid)
    if failure == "damaged chunk":
        name, offset = lazy_page_in(image, address + (16 << 20), address + (32 << 20))
        flip_byte(image / name, offset)
    # A cell resumes the kernel (its IOPub confirmed before the cell goes: no output is
    # lost) and does work that only the running kernel has.
    assert await client.run("since_resume = 1; print('ran')") == "ran\n"
    (server,) = page_servers(kid)  # its memory is still loading
    resumed_at = iso(getattr(prov, "resumed_at", None))

    # A cell the kernel takes and is still running when it fails.
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    code = f"open({str(fifo)!r}).read()" if failure != "damaged chunk" else "print(int(a.sum()))"
    cell = client.execute(code)
    await client.about(cell, _busy_for(cell))
    queued = None
    if failure == "page server killed":
        # Another notebook's cell, given to the kernel and waiting behind the first.
        other = await connect(kid, "json")
        queued = other.execute("print('queued')")
        g = gated.gate(jp_serverapp)
        await gated.until(lambda: queued in g._unanswered.get(kid, {}), "the queued cell sent")
        os.kill(server, signal.SIGKILL)

    got = await asyncio.wait_for(client.answer(cell), 60)
    reply = got["reply"]
    assert reply["msg_type"] == "execute_reply"
    content = reply["content"]
    assert content["status"] == "error" and content["ename"] == "KernelRestoreError", content
    text = content["evalue"]
    assert text.startswith("The kernel failed while its memory was being restored"), text
    assert f"after its resume at {resumed_at} is lost" in text, text
    assert f"taken at {iso(taken_at)}" in text, text
    shown = [m["content"] for m in got["msgs"] if m["msg_type"] == "error"]
    assert [(e["ename"], e["evalue"]) for e in shown] == [("KernelRestoreError", text)]
    assert got["status"][-1] == "idle"
    assert not [m for m in got["msgs"] if m["msg_type"] == "stream"]
    if queued is not None:
        got = await asyncio.wait_for(other.answer(queued), 60)
        assert got["reply"]["content"]["status"] == "error", got["reply"]
        assert got["reply"]["content"]["evalue"] == text
        assert got["stdout"] == "" and got["status"][-1] == "idle"

    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "failed" and k["reason"] == text, k
    # The busy process is gone: the server no longer takes the kernel for busy, which
    # would keep the next resume from confirming IOPub before its cell goes.
    assert jp_serverapp.kernel_manager.get_kernel(kid).execution_state == "idle"
    cause = "killed by SIGKILL" if failure == "page server killed" else "checksum mismatch"
    assert cause in text, text
    failed = [e for e in events if e["kernel_id"] == kid and e["action"] == "failed"]
    assert [(e["state"], e["reason"], e["lost_after"]) for e in failed] == [
        ("failed", text, resumed_at)
    ]
    assert image.exists()

    # The next cell resumes the kernel from the image taken at its suspend, and says so.
    if failure == "damaged chunk":
        flip_byte(image / name, offset)  # mended
    hold.unlink()
    got = await asyncio.wait_for(
        client.answer(client.execute("print('since_resume' in dir(), int(a.sum()))")), 120
    )
    assert got["reply"]["content"]["status"] == "ok", got["reply"]
    notice, result = got["stdout"].split("\n", 1)
    assert result == f"False {EXPECTED_SUM}\n"
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "running", k
    back = k["reason"]
    assert back.startswith(f"Resumed from its checkpoint taken at {iso(taken_at)}"), back
    assert f"what it did after its resume at {resumed_at} was lost" in back, back
    assert notice == back
    resumed = [e for e in events if e["kernel_id"] == kid and e["action"] == "resumed"]
    assert [(e["reason"], e["lost_after"]) for e in resumed[-1:]] == [(back, resumed_at)]
    # Told once: the cells after it run as always.
    assert await client.run("print('again')") == "again\n"
