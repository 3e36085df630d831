"""A suspended kernel answers what clients send by themselves on (re)connect, also after
its server was restarted (adopted kernels) and when nothing had been asked of it before
its suspend: real `jupyter server` processes, real kernels, real CRIU."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from jupyter_client.session import Session
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_cedana.server import replies as replies_module
from jupyter_cedana.server.replies import Message, ReplyCache

from . import test_gate, test_parking
from .test_cli import Server
from .test_gate import V1, Client, _sans_tip, gate, stopped, until
from .test_parking import records, server_with_kernel, start_server, stop_with

# Fixtures (pytest finds them by module attribute): servers in subprocesses, and an
# in-process server whose extension a test starts when it needs one.
servers = test_parking.servers
api, new_kernel, connect = test_gate.api, test_gate.new_kernel, test_gate.connect
jp_server_config = test_gate.jp_server_config

pytestmark = pytest.mark.criu

T = TypeVar("T")

# A comm the kernel opens itself, as a widget does, and some state.
WIDGET = """
from comm import create_comm
widget = create_comm(target_name="cedana.widget", data={"value": 1})
x = 41
"""


def lab_session(server: Server, kid: str, work: Callable[[Client], Awaitable[T]]) -> T:
    """Run `work` with a websocket to the kernel that speaks JupyterLab's protocol (v1)."""

    async def go() -> T:
        session = Session()
        url = server.url.replace("http://", "ws://")
        req = HTTPRequest(
            f"{url}api/kernels/{kid}/channels?session_id={session.session}",
            headers={"Authorization": f"token {server.token}"},
        )
        ws = await websocket_connect(req, subprotocols=[V1])
        try:
            return await work(Client(ws, session))
        finally:
            ws.close()

    return asyncio.run(asyncio.wait_for(go(), 300))


async def reconnect(lab: Client) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """What JupyterLab and ipywidgets' manager send on a reconnect: kernel_info, then the
    comm list. Both replies, and the execution states around the first."""
    info = await lab.answer(lab.send("kernel_info_request", {}))
    comms = await lab.answer(lab.send("comm_info_request", {}))
    states = [m["content"]["execution_state"] for m in info["msgs"] if m["msg_type"] == "status"]
    return info["reply"], comms["reply"], states


def test_adopted_kernel_answers_a_reconnect_without_waking(
    tmp_path: Path, servers: list[Server]
) -> None:
    a, root, kid = server_with_kernel(tmp_path, servers, WIDGET)

    async def set_up(lab: Client) -> tuple[dict[str, Any], str]:
        info = (await lab.answer(lab.send("kernel_info_request", {})))["reply"]
        return info, (await lab.run("print(widget.comm_id)")).strip()

    from_kernel, widget = lab_session(a, kid, set_up)
    assert "parked 1 of 1 kernel(s)" in stop_with(a, signal.SIGTERM)
    # What the reply cache needs is in the record, beside the connection info.
    saved = records(root)[kid]["replies"]
    assert saved["kernel_info"]["header"]["session"] == from_kernel["header"]["session"]
    assert saved["comms"] == {widget: "cedana.widget"}

    def reload_page(s: Server) -> Callable[[Client], Awaitable[None]]:
        async def work(lab: Client) -> None:
            reply, comms, states = await reconnect(lab)
            # Answered in the kernel's name, from what it said before its server stopped...
            assert _sans_tip(reply["content"]) == _sans_tip(from_kernel["content"])
            assert reply["header"]["session"] == from_kernel["header"]["session"]
            assert states == ["busy", "idle"]
            listed = {widget: {"target_name": "cedana.widget"}}
            assert comms["content"] == {"status": "ok", "comms": listed}
            # ...while it stays suspended.
            assert s.kernel(kid)["state"] == "suspended"

        return work

    # Adopted by the next server: a reconnect leaves it suspended.
    b = start_server(tmp_path / "b", checkpoint_root=root)
    servers.append(b)
    assert b.kernel(kid)["state"] == "suspended"
    lab_session(b, kid, reload_page(b))
    assert b.kernel(kid)["state"] == "suspended"

    # Culled again before anyone ran a cell: parked as it was, answers carried along.
    assert "parked 1 of 1 kernel(s)" in stop_with(b, signal.SIGTERM)
    assert records(root)[kid]["replies"] == saved
    c = start_server(tmp_path / "c", checkpoint_root=root)
    servers.append(c)

    async def then_a_cell(lab: Client) -> str:
        await reload_page(c)(lab)
        return await lab.run("print(x + 1, widget.comm_id)")

    # A cell wakes it, with its state and its comm.
    assert lab_session(c, kid, then_a_cell) == f"42 {widget}\n"
    assert c.kernel(kid)["state"] == "running"
    for s in (b, c):
        log = s.log.read_text()
        woken_by = [ln.split("] ")[-1] for ln in log.splitlines() if ": resuming it" in ln]
        assert woken_by == (
            [f"execute_request for suspended kernel {kid}: resuming it"] if s is c else []
        )


async def test_kernel_suspended_before_anyone_asked_it_is_answered(
    api: Any, new_kernel: Any, connect: Any, jp_serverapp: Any
) -> None:
    """A kernel the reply cache had not heard from when its suspend began (e.g. suspended
    right after its start) is asked before it is frozen: a reconnect is answered while it
    stays suspended."""
    await jp_serverapp.extension_manager.start_extension("jupyter_cedana")
    kid = await new_kernel()
    replies = gate(jp_serverapp).replies
    await until(lambda: replies.knows(kid), "the kernel's first kernel_info")
    replies.forget(kid)  # as if the suspend had come before the kernel answered
    status, k = await api("POST", "kernels", kid, "suspend")
    assert status == 200 and k["state"] == "suspended", k
    assert replies.knows(kid)

    lab = await connect(kid)
    reply, comms, states = await reconnect(lab)
    assert reply["content"]["status"] == "ok" and reply["content"]["implementation"] == "ipython"
    assert states == ["busy", "idle"] and comms["content"] == {"status": "ok", "comms": {}}
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "suspended"
    assert await lab.run("print('woken')") == "woken\n"


async def test_kernel_that_does_not_answer_is_suspended_all_the_same(
    api: Any, new_kernel: Any, connect: Any, jp_serverapp: Any, monkeypatch: Any, caplog: Any
) -> None:
    """Asking before a suspend has a bound: a kernel that does not answer is frozen anyway
    (with a warning), and the first reconnect resumes it as before."""
    await jp_serverapp.extension_manager.start_extension("jupyter_cedana")
    kid = await new_kernel()
    replies = gate(jp_serverapp).replies
    await until(lambda: replies.knows(kid), "the kernel's first kernel_info")
    replies.forget(kid)
    prov = jp_serverapp.kernel_manager.get_kernel(kid).provisioner
    monkeypatch.setattr(replies_module, "ASK_BEFORE_SUSPEND_SECONDS", 0.5)
    with stopped(jp_serverapp, kid):
        await replies.before_suspend(prov)
    assert not replies.knows(kid)
    assert f"Kernel {kid} did not answer kernel_info within 0.5 s before its suspend" in caplog.text

    # It answers again: the suspend asks, and learns.
    status, k = await api("POST", "kernels", kid, "suspend")
    assert status == 200 and k["state"] == "suspended", k
    assert replies.knows(kid)


# -- what a park record keeps -----------------------------------------------------------------

KERNEL_INFO = {
    "header": {
        "msg_id": "m1",
        "msg_type": "kernel_info_reply",
        "session": "kernel-session",
        "username": "alice",
        "version": "5.3",
        "date": "2026-01-01T00:00:00Z",
    },
    "content": {"status": "ok", "implementation": "ipython", "protocol_version": "5.3"},
    "metadata": {},
}


def _ask(kind: str, **content: Any) -> Message:
    header = {"msg_id": "q", "msg_type": kind, "session": "client", "username": "u"}
    return Message("shell", header, body={"content": content})


def test_saved_replies_round_trip_through_json() -> None:
    before = ReplyCache()
    assert before.saved("k") is None  # nothing known: nothing saved
    before.from_kernel("k", KERNEL_INFO)
    before.from_kernel("k", {"header": {"msg_type": "comm_open"}, "content": {"comm_id": "c1",
                        "target_name": "w"}})  # fmt: skip
    saved = before.saved("k")
    assert saved is not None
    after = ReplyCache()
    assert after.seed("k", json.loads(json.dumps(saved)))

    answers = after.answer("k", _ask("kernel_info_request"))
    assert answers is not None
    reply = answers[1][1]
    assert reply["content"] == KERNEL_INFO["content"] and reply["parent_header"]["msg_id"] == "q"
    assert {m["header"]["session"] for _, m in answers} == {"kernel-session"}
    assert reply["header"]["username"] == "alice" and reply["header"]["version"] == "5.3"
    comms = after.answer("k", _ask("comm_info_request"))
    assert comms is not None and comms[1][1]["content"]["comms"] == {"c1": {"target_name": "w"}}

    # The start event of the adoption keeps what was seeded; a restart does not.
    after.forget("k", "start")
    assert after.knows("k")
    after.forget("k", "restart")
    assert not after.knows("k")
    before.forget("k", "start")  # not adopted: a start forgets
    assert not before.knows("k")


@pytest.mark.parametrize(
    "saved",
    [
        None,
        [],
        {},
        {"kernel_info": KERNEL_INFO},
        {"kernel_info": {**KERNEL_INFO, "header": {"username": "alice"}}, "comms": {}},
        {"kernel_info": {**KERNEL_INFO, "content": "ok"}, "comms": {}},
        {"kernel_info": KERNEL_INFO, "comms": ["c1"]},
    ],
)
def test_unusable_saved_replies_are_not_seeded(saved: Any) -> None:
    cache = ReplyCache()
    assert not cache.seed("k", saved)
    assert not cache.knows("k") and cache.answer("k", _ask("kernel_info_request")) is None
