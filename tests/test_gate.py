"""The message gate with a real jupyter server, real kernels and real CRIU: what clients
of a suspended kernel are answered, what wakes it, and races held mid-flight by a criu
wrapper that waits for the test's go."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from tornado.httpclient import HTTPClientError

from jupyter_cedana.checkpoint.proctree import process_tree
from jupyter_cedana.server.manager import EVENT_SCHEMA

from . import test_server as server
from .conftest import run

# The server fixtures of test_server (pytest finds fixtures by module attribute).
api, new_kernel, started, manager = server.api, server.new_kernel, server.started, server.manager
jp_server_config = server.jp_server_config

pytestmark = pytest.mark.criu

V1 = "v1.kernel.websocket.jupyter.org"


async def until(condition: Callable[[], Any], what: str, timeout: float = 120) -> None:
    """Wait for a condition (a bound on a loaded machine, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
def held_criu(criu_hold: Any, jp_serverapp: Any) -> Any:
    """The server's criu runs through the wrapper that holds it mid-flight."""
    criu_hold.attach(manager(jp_serverapp).engine)
    return criu_hold


class Client:
    """A websocket client of a kernel, speaking JupyterLab's v1 protocol or the JSON one."""

    def __init__(self, ws: Any, session: Session):
        self.ws = ws
        self.session = session
        self.v1 = ws.selected_subprotocol == V1
        self.received: list[dict[str, Any]] = []
        self._read = 0

    def send(self, msg_type: str, content: dict[str, Any], channel: str = "shell") -> str:
        msg = self.session.msg(msg_type, content)
        # Unique ids, as browsers make them: Session's counter-based ids would repeat the
        # server's own (same session id, same process, another counter).
        msg["msg_id"] = msg["header"]["msg_id"] = str(uuid.uuid4())
        if self.v1:
            self.ws.write_message(serialize_msg_to_ws_v1(msg, channel, self.session.pack), True)
        else:
            self.ws.write_message(json.dumps({**msg, "channel": channel}, default=json_default))
        return str(msg["header"]["msg_id"])

    def execute(self, code: str) -> str:
        return self.send("execute_request", {"code": code, "silent": False, "allow_stdin": True})

    async def _receive(self, timeout: float = 120) -> None:
        raw = await asyncio.wait_for(self.ws.read_message(), timeout)
        assert raw is not None, "websocket closed"
        if self.v1:
            channel, parts = deserialize_msg_from_ws_v1(raw)
            header, parent, _, content = (self.session.unpack(p) for p in parts[:4])
            msg = {"channel": channel, "header": header, "parent_header": parent}
            msg.update(content=content, msg_type=header["msg_type"])
        else:
            msg = json.loads(raw)
        self.received.append(msg)

    async def next(self) -> dict[str, Any]:
        """The next message in arrival order (all are kept in `received`)."""
        while self._read >= len(self.received):
            await self._receive()
        self._read += 1
        return self.received[self._read - 1]

    async def about(self, msg_id: str, done: Callable[[list[dict[str, Any]]], bool]) -> list:
        """The messages whose parent is `msg_id`, from the first received on, until
        `done(those)`."""
        seen: list[dict[str, Any]] = []
        i = 0
        while not done(seen):
            while i >= len(self.received):
                await self._receive()
            msg = self.received[i]
            i += 1
            if (msg.get("parent_header") or {}).get("msg_id") == msg_id:
                seen.append(msg)
        return seen

    async def until_idle(self, msg_id: str) -> list[dict[str, Any]]:
        return await self.about(msg_id, lambda ms: any(_idle(m) for m in ms))

    async def answer(self, msg_id: str, stdin: str | None = None) -> dict[str, Any]:
        """Everything the kernel (or the server in its name) sends for one request, up to
        its reply and idle status."""
        out: dict[str, Any] = {"reply": None, "stdout": "", "status": [], "msgs": []}
        asked: set[str] = set()

        def done(msgs: list[dict[str, Any]]) -> bool:
            for msg in msgs[len(out["msgs"]) :]:
                handle(msg)
            return out["reply"] is not None and "idle" in out["status"]

        def handle(msg: dict[str, Any]) -> None:
            out["msgs"].append(msg)
            kind = msg["msg_type"]
            if kind.endswith("_reply"):
                out["reply"] = msg
            elif kind == "stream":
                out["stdout"] += msg["content"]["text"]
            elif kind == "status":
                out["status"].append(msg["content"]["execution_state"])
            elif kind == "input_request" and msg["header"]["msg_id"] not in asked:
                assert stdin is not None, f"unexpected input request: {msg}"
                asked.add(msg["header"]["msg_id"])
                self.send("input_reply", {"value": stdin}, channel="stdin")

        await self.about(msg_id, done)
        return out

    async def run(self, code: str, stdin: str | None = None) -> str:
        got = await self.answer(self.execute(code), stdin)
        assert got["reply"]["content"]["status"] == "ok", got["reply"]
        return str(got["stdout"])


@pytest.fixture
def connect(jp_ws_fetch: Any) -> Any:
    clients: list[Client] = []

    async def open_(kernel_id: str, protocol: str = "v1") -> Client:
        session = Session()
        ws = await jp_ws_fetch(
            "api",
            "kernels",
            kernel_id,
            "channels",
            params={"session_id": session.session},
            subprotocols=[V1] if protocol == "v1" else None,
        )
        c = Client(ws, session)
        clients.append(c)
        return c

    yield open_
    for c in clients:
        c.ws.close()


@pytest.fixture
def events(jp_serverapp: Any) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        if data["action"] != "progress":
            seen.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=EVENT_SCHEMA, listener=listener)
    return seen


def _sans_tip(info: dict[str, Any]) -> dict[str, Any]:
    return {**info, "banner": info["banner"].split("Tip:")[0]}


def _idle(msg: dict[str, Any]) -> bool:
    return msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"


def gate(jp_serverapp: Any) -> Any:
    return jp_serverapp.web_app.settings["cedana_gate"]


def state(jp_serverapp: Any, kid: str) -> str:
    return str(manager(jp_serverapp).state_of(kid))


async def suspended(jp_serverapp: Any, kid: str) -> None:
    await until(lambda: state(jp_serverapp, kid) == "suspended", "the suspend")


@contextlib.contextmanager
def stopped(jp_serverapp: Any, kid: str) -> Any:
    """The kernel's processes stopped (SIGSTOP): it answers nothing until the block ends."""
    prov = jp_serverapp.kernel_manager.get_kernel(kid).provisioner
    pids = process_tree(prov.pid) - {prov.pid}
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        # Only those still in the kernel's tree: a dumped kernel's are gone, and PIDs
        # are reused quickly here.
        for pid in pids & process_tree(prov.pid or 0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def suspended_and_cut_off(
    api: Any, new_kernel: Any, connect: Any, jp_serverapp: Any, channel: str
) -> tuple[str, Any, Any, Callable[[], None]]:
    """A kernel with one client that ran `greeting = 'hi'`, suspended, whose server-side
    `channel` socket of that client is disconnected and reconnects only when the returned
    callable is called: (kernel id, client, the channel's stream, reconnect)."""
    kid = await new_kernel()
    client = await connect(kid)
    await client.run("greeting = 'hi'")
    await api("POST", "kernels", kid, "suspend")
    (conn,) = gate(jp_serverapp).connections(kid)
    stream = conn.channels[channel]
    info = jp_serverapp.kernel_manager.get_kernel(kid).get_connection_info()
    url = f"{info['transport']}://{info['ip']}:{info[channel + '_port']}"
    stream.socket.disconnect(url)  # no reconnect until the test connects it again
    return kid, client, stream, lambda: stream.socket.connect(url)


def idle_for_hours(jp_serverapp: Any, kid: str) -> None:
    """The policy sees the kernel idle far past its timeout (no waiting for a clock)."""
    m = manager(jp_serverapp)
    m.policy.idle_timeout = 3600
    kernel = jp_serverapp.kernel_manager.get_kernel(kid)
    kernel.last_activity = dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)


# -- answered while suspended -------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["v1", "json"])
async def test_reconnect_is_answered_and_does_not_wake(
    protocol, new_kernel, connect, jp_serverapp, events
):
    """A page reload sends kernel_info (and ipywidgets comm_info): the server answers from
    what the kernel said, and the policy does not suspend the kernel again and again."""
    kid = await new_kernel()
    m = manager(jp_serverapp)
    await m.stop()  # policy passes run when the test calls check()
    first = await connect(kid, protocol)
    from_kernel = (await first.answer(first.send("kernel_info_request", {})))["reply"]
    assert await first.run("x = 41") == ""
    idle_for_hours(jp_serverapp, kid)
    await m.check()
    await suspended(jp_serverapp, kid)
    first.ws.close()

    reloaded = await connect(kid, protocol)
    req = reloaded.send("kernel_info_request", {})
    got = await reloaded.answer(req)
    reply = got["reply"]
    # What the kernel said (IPython's banner ends with a tip that changes at each reply).
    assert _sans_tip(reply["content"]) == _sans_tip(from_kernel["content"])
    assert reply["channel"] == "shell" and reply["parent_header"]["msg_id"] == req
    assert reply["header"]["session"] == from_kernel["header"]["session"]
    # Status around it, in the kernel's name, as the kernel would send.
    assert [s["content"]["execution_state"] for s in got["msgs"] if s["msg_type"] == "status"] == [
        "busy",
        "idle",
    ]
    assert {s["header"]["session"] for s in got["msgs"]} == {reply["header"]["session"]}
    ctl = reloaded.send("kernel_info_request", {}, channel="control")
    assert (await reloaded.answer(ctl))["reply"]["channel"] == "control"
    comms = (await reloaded.answer(reloaded.send("comm_info_request", {})))["reply"]
    assert comms["content"] == {"status": "ok", "comms": {}}

    await m.check()
    assert state(jp_serverapp, kid) == "suspended"
    assert [e["action"] for e in events] == ["suspending", "suspended"]

    # A cell is a person's doing: it resumes the kernel, and that counts as activity.
    before = dt.datetime.now(dt.UTC)
    assert await reloaded.run("print(x + 1)") == "42\n"
    kernel = jp_serverapp.kernel_manager.get_kernel(kid)
    assert kernel.last_activity >= before
    await m.check()
    assert state(jp_serverapp, kid) == "running" and not m.transition_pending(kid)
    assert [e["action"] for e in events] == ["suspending", "suspended", "resuming", "resumed"]


WIDGETS = """
from comm import create_comm, get_comm_manager

def _opened(comm, msg):
    comm.on_msg(lambda m: comm.send({"echo": m["content"]["data"]}))
    comm.send({"opened": msg["content"]["data"]})

get_comm_manager().register_target("cedana.echo", _opened)
widget = create_comm(target_name="cedana.widget", data={"value": 1})
widget.on_msg(lambda m: widget.send({"echo": m["content"]["data"]}))
"""


async def test_widget_traffic_answered_held_or_woken(api, new_kernel, connect, jp_serverapp):
    kid = await new_kernel()
    first = await connect(kid)
    await first.answer(first.send("kernel_info_request", {}))
    got = await first.answer(first.execute(WIDGETS))
    assert got["reply"]["content"]["status"] == "ok", got
    opened = [m for m in got["msgs"] if m["msg_type"] == "comm_open"]
    assert [m["content"]["target_name"] for m in opened] == ["cedana.widget"], [
        (m["msg_type"], m["parent_header"].get("msg_type")) for m in first.received
    ]
    widget = opened[0]["content"]["comm_id"]
    await api("POST", "kernels", kid, "suspend")
    first.ws.close()

    # What ipywidgets' manager and JupyterLab send by themselves on a reconnect.
    lab = await connect(kid)
    await lab.answer(lab.send("kernel_info_request", {}))
    query = lab.send("comm_info_request", {"target_name": "cedana.widget"})
    listed = (await lab.answer(query))["reply"]["content"]["comms"]
    assert listed == {widget: {"target_name": "cedana.widget"}}
    assert (await lab.answer(lab.send("comm_info_request", {"target_name": "other"})))["reply"][
        "content"
    ]["comms"] == {}
    control = str(uuid.uuid4())
    req = lab.send("comm_open", {"comm_id": control, "target_name": "jupyter.widget.control"})
    answered = await lab.until_idle(req)  # as a kernel without that comm target does
    assert [m["msg_type"] for m in answered] == ["status", "comm_close", "status"]
    assert answered[1]["content"]["comm_id"] == control
    states = lab.send("comm_msg", {"comm_id": control, "data": {"method": "request_states"}})
    quiet = await lab.until_idle(states)  # a kernel that knows no such comm: status only
    assert [m["msg_type"] for m in quiet] == ["status", "status"]
    subshell = lab.send("create_subshell_request", {}, channel="control")
    state_req = lab.send("comm_msg", {"comm_id": widget, "data": {"method": "request_state"}})
    # None of these may resume the kernel: the status answers above came after them.
    await lab.until_idle(lab.send("kernel_info_request", {}))
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "suspended" and len(gate(jp_serverapp)._held[kid]) == 2

    # Someone moves the widget: that wakes the kernel, which answers in order.
    moved = lab.send("comm_msg", {"comm_id": widget, "data": {"method": "update", "value": 2}})
    echoed = await lab.about(moved, lambda ms: any(m["msg_type"] == "comm_msg" for m in ms))
    assert echoed[-1]["content"]["data"] == {"echo": {"method": "update", "value": 2}}
    # What was held went to the kernel first, in order.
    restored = await lab.about(state_req, lambda ms: any(m["msg_type"] == "comm_msg" for m in ms))
    assert restored[-1]["content"]["data"] == {"echo": {"method": "request_state"}}
    sub = await lab.answer(subshell)
    assert sub["reply"]["msg_type"] == "create_subshell_reply"
    assert sub["reply"]["content"]["status"] == "ok"
    order = [m["parent_header"].get("msg_id") for m in lab.received if m["msg_type"] == "comm_msg"]
    assert order.index(state_req) < order.index(moved)
    assert states not in order  # the control comm closed by the server stays unknown
    # A comm the frontend opens is a person's doing too; it works on the resumed kernel.
    echo = str(uuid.uuid4())
    req = lab.send("comm_open", {"comm_id": echo, "target_name": "cedana.echo", "data": {"a": 1}})
    said = await lab.about(req, lambda ms: any(m["msg_type"] == "comm_msg" for m in ms))
    assert said[-1]["content"]["data"] == {"opened": {"a": 1}}


async def test_comms_changed_while_no_client_was_connected(api, new_kernel, connect, jp_serverapp):
    """A reconnecting client is told the comms the kernel has at its suspend, also those
    opened or closed while no websocket was connected (a cell that finished while the
    laptop slept): the gate saw none of that traffic."""
    kid = await new_kernel()
    first = await connect(kid)
    got = await first.answer(first.execute(WIDGETS))
    old = next(m for m in got["msgs"] if m["msg_type"] == "comm_open")["content"]["comm_id"]
    first.ws.close()
    await until(lambda: not gate(jp_serverapp).connections(kid), "the websocket to close")

    # Another client of the kernel, beside the server's websockets.
    kc = jp_serverapp.kernel_manager.get_kernel(kid).client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        code = "widget.close()\nlater = create_comm(target_name='cedana.widget')\n"
        reply, printed = await run(kc, code + "print(later.comm_id)")
        assert reply["status"] == "ok", reply
    finally:
        kc.stop_channels()
    new = printed.strip()
    await api("POST", "kernels", kid, "suspend")

    lab = await connect(kid)
    query = lab.send("comm_info_request", {"target_name": "cedana.widget"})
    listed = (await lab.answer(query))["reply"]["content"]["comms"]
    assert listed == {new: {"target_name": "cedana.widget"}}, (old, listed)
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "suspended"


async def test_input_in_a_cell_sent_to_a_suspended_kernel(api, new_kernel, connect):
    kid = await new_kernel()
    client = await connect(kid)
    await client.run("greeting = 'hi'")
    await api("POST", "kernels", kid, "suspend")
    out = await client.run("name = input('who? '); print(greeting, name)", stdin="bob")
    assert out == "hi bob\n"
    prompts = [m["content"]["prompt"] for m in client.received if m["msg_type"] == "input_request"]
    assert prompts == ["who? "]


async def test_a_held_cell_waits_for_stdin_to_reconnect(
    api, new_kernel, connect, jp_serverapp, monkeypatch
):
    """After a restore each client socket reconnects on its own; the kernel's input
    request to a stdin socket not yet back is dropped by ZMQ, so the gate delivers a held
    cell only once stdin is connected. Here the test keeps it away until it lets it go."""
    from jupyter_cedana.server import links, websocket

    monkeypatch.setattr(websocket, "STDIN_RECONNECT_TIMEOUT", 600.0)
    kid, client, stdin, reconnect = await suspended_and_cut_off(
        api, new_kernel, connect, jp_serverapp, "stdin"
    )
    g = gate(jp_serverapp)

    cell = client.execute("name = input('who? '); print(greeting, name)")
    await until(lambda: state(jp_serverapp, kid) == "running", "the resume")
    # Resumed, IOPub confirmed, the cell still held: it waits for stdin.
    await until(lambda: kid in g._releasing, "the release to run")
    assert [m for _, m in g._held.get(kid, [])] and not links.connected(stdin)
    assert not [m for m in client.received if m["parent_header"].get("msg_id") == cell]

    reconnect()
    got = await client.answer(cell, stdin="bob")
    assert got["reply"]["content"]["status"] == "ok" and got["stdout"] == "hi bob\n"
    assert [m["content"]["prompt"] for m in got["msgs"] if m["msg_type"] == "input_request"]


async def test_a_cell_sent_right_after_a_rest_resume_waits_for_iopub(
    api, new_kernel, connect, jp_serverapp
):
    """Resumed by REST with nothing held, the kernel runs before each client's IOPub has
    reconnected; a cell sent then would publish its output to nobody. The gate holds it
    until that client's IOPub is back. Here the test keeps IOPub away until it lets it go."""
    kid, client, _, reconnect = await suspended_and_cut_off(
        api, new_kernel, connect, jp_serverapp, "iopub"
    )
    g = gate(jp_serverapp)

    await api("POST", "kernels", kid, "resume")
    assert state(jp_serverapp, kid) == "running"
    cell = client.execute("print(greeting)")
    await until(
        lambda: [m for _, m in g._held.get(kid, []) if m.msg_id == cell], "the cell to be held"
    )
    assert kid in g._releasing  # confirming the client's IOPub

    reconnect()
    got = await client.answer(cell)
    assert got["reply"]["content"]["status"] == "ok" and got["stdout"] == "hi\n", got


async def test_interrupt_of_a_suspended_kernel_is_409(
    api, new_kernel, connect, jp_fetch, jp_serverapp
):
    kid = await new_kernel()
    client = await connect(kid)
    await client.run("pass")  # started: a SIGINT no longer stops its start
    r = await jp_fetch("api", "kernels", kid, "interrupt", method="POST", body="")
    assert r.code == 204
    status, _ = await api("POST", "kernels", kid, "suspend")
    assert status == 200
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch("api", "kernels", kid, "interrupt", method="POST", body="")
    assert info.value.code == 409 and info.value.response is not None
    body = json.loads(info.value.response.body)
    assert "suspended" in body["message"] and "nothing runs" in body["message"]
    assert state(jp_serverapp, kid) == "suspended"
    # Resume asked for by a person: activity, the idle countdown starts again.
    before = dt.datetime.now(dt.UTC)
    status, _ = await api("POST", "kernels", kid, "resume")
    assert status == 200
    assert jp_serverapp.kernel_manager.get_kernel(kid).last_activity >= before


# -- races held mid-flight ----------------------------------------------------------------


async def test_suspend_while_a_client_connects(api, new_kernel, connect, jp_serverapp):
    """A websocket whose IOPub check (nudge) is running when a suspend starts is answered
    once the kernel is back; while it connects, the policy leaves the kernel alone."""
    kid = await new_kernel()
    m = manager(jp_serverapp)
    await m.stop()
    first = await connect(kid)
    await first.run("v = 7")
    with stopped(jp_serverapp, kid):  # the kernel cannot answer the new client's nudge
        second = await connect(kid)
        assert gate(jp_serverapp).busy(kid)
        idle_for_hours(jp_serverapp, kid)
        await m.check()
        assert state(jp_serverapp, kid) == "running" and not m.transition_pending(kid)
        status, k = await api(
            "POST", "kernels", kid, "suspend", wait="0", spec="/kernels/{kernel_id}/suspend"
        )
        # Not waited for (wait=0): answered while the dump runs, which takes a CRIU run.
        assert status == 202 and k["state"] == "suspending"
        await suspended(jp_serverapp, kid)
    assert await second.run("print(v * 6)") == "42\n"
    assert await first.run("print(v)") == "7\n"


async def test_messages_during_a_dump_wait_for_the_resume(
    api, new_kernel, connect, jp_serverapp, held_criu
):
    """Messages sent while the kernel is being frozen are held, never delivered to the
    freezing kernel, and delivered exactly once after the resume."""
    kid = await new_kernel()
    first = await connect(kid)
    await first.run("n = 0")
    held_criu.arm("dump", "before")
    await api("POST", "kernels", kid, "suspend", wait="0")
    await held_criu.wait_reached("dump", "before")
    assert state(jp_serverapp, kid) == "suspending"

    second = await connect(kid)
    info = await second.answer(second.send("kernel_info_request", {}))
    assert info["reply"]["content"]["status"] == "ok"
    bump = second.execute("n += 1; print(n)")
    await until(lambda: gate(jp_serverapp).busy(kid), "the execute to be held")
    held_criu.release("dump", "before")
    got = await second.answer(bump)
    assert got["reply"]["content"]["status"] == "ok" and got["stdout"] == "1\n"
    assert await first.run("print(n)") == "1\n"


async def test_failed_resume_answers_every_held_request(
    api, new_kernel, connect, jp_serverapp, held_criu
):
    kid = await new_kernel()
    a, b, c = await connect(kid), await connect(kid, "json"), await connect(kid)
    await a.run("z = 3")
    await api("POST", "kernels", kid, "suspend")
    held_criu.arm("restore", "before")
    first = a.execute("print(z)")
    await held_criu.wait_reached("restore", "before")
    assert state(jp_serverapp, kid) == "resuming"
    b.execute("print(z * 2)")
    b.send("debug_request", {"seq": 1, "type": "request", "command": "debugInfo"}, "control")
    c.ws.write_message(b"\x00garbage", binary=True)
    later = c.execute("print(z * 3)")
    probe = a.send(
        "debug_request", {"seq": 2, "type": "request", "command": "debugInfo"}, "control"
    )
    await until(lambda: len(gate(jp_serverapp)._held.get(kid, [])) == 5, "5 held messages")
    b.ws.close()
    held_criu.release("restore", "before", fail=True)

    for client, msg_id, kind in [(a, first, "execute"), (a, probe, "debug"), (c, later, "execute")]:
        got = await client.answer(msg_id)
        reply = got["reply"]
        assert reply["msg_type"] == f"{kind}_reply"
        assert reply["content"]["status"] == "error"
        assert "could not be resumed" in reply["content"]["evalue"]
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "failed" and "criu" in k["reason"].lower()
    # The image is kept: the next cell resumes the kernel.
    mid = c.execute("print(z * 14)")
    got = await c.answer(mid)
    assert got["stdout"] == "42\n"


async def test_policy_leaves_a_kernel_alone_until_it_took_a_request(
    new_kernel, connect, jp_serverapp
):
    """A cell sent to a running kernel that has not picked it up yet (it is stopped here,
    so its busy status cannot arrive) must not be frozen with the kernel."""
    kid = await new_kernel()
    m = manager(jp_serverapp)
    await m.stop()
    client = await connect(kid)
    await client.run("u = 5")
    with stopped(jp_serverapp, kid):
        cell = client.execute("print(u * 3)")
        await until(lambda: gate(jp_serverapp).busy(kid), "the cell to be sent")
        idle_for_hours(jp_serverapp, kid)
        await m.check()
        assert state(jp_serverapp, kid) == "running" and not m.transition_pending(kid)
    got = await client.answer(cell)
    assert got["stdout"] == "15\n"
    # Answered: the kernel is the policy's again.
    assert not gate(jp_serverapp).busy(kid)
    idle_for_hours(jp_serverapp, kid)
    await m.check()
    await suspended(jp_serverapp, kid)


async def test_restart_during_a_held_resume_answers_the_held_cell(
    api, new_kernel, connect, jp_fetch, jp_serverapp, held_criu
):
    kid = await new_kernel()
    client = await connect(kid)
    await client.run("gone = 1")
    await api("POST", "kernels", kid, "suspend")
    held_criu.arm("restore", "before")
    cell = client.execute("print(gone)")
    await held_criu.wait_reached("restore", "before")
    restart = asyncio.ensure_future(
        jp_fetch("api", "kernels", kid, "restart", method="POST", body="")
    )
    got = await client.answer(cell)
    assert got["reply"]["content"]["status"] == "error"
    assert "could not be resumed" in got["reply"]["content"]["evalue"]
    held_criu.disarm()
    assert (await restart).code == 200
    # As JupyterLab does after a restart: a new websocket, whose IOPub the server checks
    # (the old one's may still be reconnecting to the new kernel: output sent before
    # would be lost, with or without jupyter-cedana).
    fresh = await connect(kid)
    assert await fresh.run("print('gone' in dir())") == "False\n"


async def test_the_policy_leaves_a_restarting_kernel_alone(
    api, new_kernel, jp_fetch, jp_serverapp, monkeypatch
):
    """A restart is something a person did, and while it runs there is no settled process
    to freeze (the execution state and activity seen are the old process's)."""
    from jupyter_cedana.server.kernel.provisioner import CedanaProvisioner

    launching, go = asyncio.Event(), asyncio.Event()
    launch = CedanaProvisioner.launch_kernel

    async def held_launch(self: Any, cmd: list[str], **kwargs: Any) -> Any:
        launching.set()
        await go.wait()
        return await launch(self, cmd, **kwargs)

    kid = await new_kernel()
    m = manager(jp_serverapp)
    await m.stop()
    assert (await api("POST", "kernels", kid, "suspend"))[0] == 200  # its image is discarded
    before = dt.datetime.now(dt.UTC)
    monkeypatch.setattr(CedanaProvisioner, "launch_kernel", held_launch)
    restart = asyncio.ensure_future(
        jp_fetch("api", "kernels", kid, "restart", method="POST", body="")
    )
    await asyncio.wait_for(launching.wait(), 120)  # the old process is gone, the new not up
    # What the torture run met: the old process's state (idle, long idle) still shown.
    idle_for_hours(jp_serverapp, kid)
    jp_serverapp.kernel_manager.get_kernel(kid).execution_state = "idle"
    await m.check()
    assert not m.transition_pending(kid) and state(jp_serverapp, kid) == "running"
    go.set()
    assert (await restart).code == 200
    assert jp_serverapp.kernel_manager.get_kernel(kid).last_activity >= before
    await m.check()
    assert not m.transition_pending(kid) and state(jp_serverapp, kid) == "running"
