"""The server extension with a real jupyter server, real kernels and real CRIU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from openapi_schema_validator import OAS30Validator
from tornado.httpclient import HTTPClientError

from jupyter_cedana.server.manager import EVENT_SCHEMA
from tests.conftest import AGENT_SOCKET, agent_kernel, has_image

pytestmark = pytest.mark.criu

SPEC = yaml.safe_load((Path(__file__).parents[1] / "docs" / "rest-api.yaml").read_text())


@pytest.fixture
def jp_server_config(checkpoint_root: Path) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_cedana": True}},
        "CedanaApp": {"checkpoint_root": str(checkpoint_root)},
        # Automatic suspend off unless a test turns it on; checks are fast when it does.
        "SuspendPolicy": {"idle_timeout": 0, "check_interval": 0.2},
    }


@pytest.fixture(autouse=True)
async def started(jp_serverapp: Any) -> Any:
    """pytest-jupyter does not run the extensions' start hooks; the policy loop lives there."""
    await jp_serverapp.extension_manager.start_extension("jupyter_cedana")
    return jp_serverapp


def check_spec(path: str, method: str, status: int, body: Any) -> None:
    """A real response must be declared by docs/rest-api.yaml and match its schema."""
    op = SPEC["paths"][path][method]
    assert str(status) in op["responses"], f"{method} {path} -> {status} not in the spec"
    resp = op["responses"][str(status)]
    if "$ref" in resp:
        resp = SPEC["components"]["responses"][resp["$ref"].rsplit("/", 1)[1]]
    schema = resp["content"]["application/json"]["schema"]
    OAS30Validator({**schema, "components": SPEC["components"]}).validate(body)


@pytest.fixture
def api(jp_fetch):
    async def call(method: str, *parts: str, body: Any = None, spec: str | None = None, **params):
        kwargs: dict[str, Any] = {"method": method, "params": params or None}
        if method == "POST":
            kwargs["body"] = json.dumps(body if body is not None else {})
        try:
            r = await jp_fetch("api", "cedana", *parts, **kwargs)
            status, data = r.code, json.loads(r.body)
        except HTTPClientError as e:
            status = e.code
            data = json.loads(e.response.body) if e.response is not None else None
        if spec:
            check_spec(spec, method.lower(), status, data)
        return status, data

    return call


@pytest.fixture
async def new_kernel(jp_fetch):
    async def start() -> str:
        r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
        return json.loads(r.body)["id"]

    return start


def manager(jp_serverapp: Any) -> Any:
    return jp_serverapp.web_app.settings["cedana_manager"]


class Client:
    """A notebook-like websocket client speaking the default JSON protocol."""

    def __init__(self, ws: Any):
        self.ws = ws
        self.session = Session()
        self.messages: list[dict[str, Any]] = []

    def execute(self, code: str) -> str:
        msg = self.session.msg("execute_request", {"code": code, "silent": False})
        msg["channel"] = "shell"
        self.ws.write_message(json.dumps(msg, default=json_default))
        return msg["header"]["msg_id"]

    async def collect(self, msg_ids: list[str], timeout: float = 60) -> dict[str, dict[str, Any]]:
        """Replies, stdout and idle status for each request, in arrival order."""
        out = {m: {"reply": None, "stdout": "", "idle": False, "busy": False} for m in msg_ids}
        deadline = time.monotonic() + timeout
        while not all(o["reply"] and o["idle"] for o in out.values()):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {out}"
            raw = await asyncio.wait_for(self.ws.read_message(), left)
            assert raw is not None, "websocket closed"
            msg = json.loads(raw)
            self.messages.append(msg)
            parent = (msg.get("parent_header") or {}).get("msg_id")
            if parent not in out:
                continue
            kind = msg["msg_type"]
            if kind == "execute_reply":
                out[parent]["reply"] = msg["content"]
            elif kind == "stream":
                out[parent]["stdout"] += msg["content"]["text"]
            elif kind == "status":
                state = msg["content"]["execution_state"]
                out[parent]["idle"] |= state == "idle"
                out[parent]["busy"] |= state == "busy"
        return out

    async def run(self, code: str) -> dict[str, Any]:
        mid = self.execute(code)
        return (await self.collect([mid]))[mid]


@pytest.fixture
def connect(jp_ws_fetch):
    clients: list[Client] = []

    async def open_(kernel_id: str) -> Client:
        ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
        c = Client(ws)
        clients.append(c)
        return c

    yield open_
    for c in clients:
        c.ws.close()


# -- REST ---------------------------------------------------------------------------------


async def test_rest_suspend_resume_and_spec(api, new_kernel, jp_serverapp, checkpoint_root):
    kid = await new_kernel()
    status, kernels = await api("GET", "kernels", spec="/kernels")
    assert status == 200 and [k["id"] for k in kernels] == [kid]
    status, k = await api("GET", "kernels", kid, spec="/kernels/{kernel_id}")
    assert k["state"] == "running" and k["suspendable"] and k["name"] == "python3"

    status, k = await api("POST", "kernels", kid, "suspend", spec="/kernels/{kernel_id}/suspend")
    assert status == 200 and k["state"] == "suspended" and k["tier"] == "disk", k
    assert k["checkpoint_bytes"] > 0 and k["last_suspend_seconds"] > 0 and k["suspended_at"]
    assert await has_image(checkpoint_root, kid)
    if AGENT_SOCKET:
        at_agent = await agent_kernel(kid)
        assert at_agent is not None and at_agent["state"] == "dumped", at_agent
        assert at_agent["image"]["bytes"] == k["checkpoint_bytes"]

    status, st = await api("GET", "status", spec="/status")
    assert st["available"]
    if not AGENT_SOCKET:  # the agent runs CRIU and keeps the images
        assert st["criu_version"].startswith("4.") and st["bytes_used"] > 0
    assert st["checkpoint_root"] == str(checkpoint_root)
    assert st["gpu"]["available"] is False and st["gpu"]["reason"]

    status, k = await api("POST", "kernels", kid, "resume", spec="/kernels/{kernel_id}/resume")
    assert status == 200 and k["state"] == "running" and k["last_resume_seconds"] > 0
    # A lazily restored kernel runs before its memory is in; its image goes after that.
    await jp_serverapp.kernel_manager.get_kernel(kid).provisioner.memory_loaded()
    if AGENT_SOCKET:  # the agent loads the memory, and says nothing when it is in
        deadline = time.monotonic() + 120
        while await has_image(checkpoint_root, kid):
            assert time.monotonic() < deadline, await agent_kernel(kid)
            await asyncio.sleep(0.1)
    assert not await has_image(checkpoint_root, kid)
    assert not (checkpoint_root / kid).exists()

    # 202 while a transition runs in the background (the answer goes before the dump, a
    # CRIU run, can have ended); the state then tells.
    status, k = await api(
        "POST", "kernels", kid, "suspend", wait="0", spec="/kernels/{kernel_id}/suspend"
    )
    assert status == 202 and k["state"] == "suspending"
    await until(api, kid, lambda k: k["state"] == "suspended")


@pytest.mark.in_process
async def test_lazy_restore_is_probed_at_start(jp_serverapp):
    """The first resume after a start does not wait for `criu check` (tenths of a
    second on the way to its first output): the server probes in the background."""
    engine = manager(jp_serverapp).engine
    (app,) = jp_serverapp.extension_manager.extension_apps["jupyter_cedana"]
    assert app._warm_up is not None
    await asyncio.wait_for(asyncio.shield(app._warm_up), 60)
    assert engine._lazy_probed
    if os.geteuid() == 0:
        assert engine.lazy_unsupported() is None
    else:  # CRIU 4.2 ignores userfaultfd with --unprivileged: said once, at start
        assert "userfaultfd" in (engine.lazy_unsupported() or "")


async def test_rest_errors(api, new_kernel):
    kid = await new_kernel()
    unknown = str(uuid.uuid4())
    for method, parts, spec in [
        ("GET", (unknown,), "/kernels/{kernel_id}"),
        ("POST", (unknown, "suspend"), "/kernels/{kernel_id}/suspend"),
        ("POST", (unknown, "resume"), "/kernels/{kernel_id}/resume"),
        ("POST", ("not..an$id", "suspend"), "/kernels/{kernel_id}/suspend"),
        ("GET", ("x" * 300,), "/kernels/{kernel_id}"),
    ]:
        status, err = await api(method, "kernels", *parts, spec=spec)
        assert status == 404, (parts, err)
        assert err["code"] in ("not_found", "invalid_id") and err["message"]

    status, err = await api("POST", "kernels", kid, "resume", spec="/kernels/{kernel_id}/resume")
    assert status == 409 and err["code"] == "conflict" and "running" in err["message"]
    await api("POST", "kernels", kid, "suspend")
    status, err = await api("POST", "kernels", kid, "suspend", spec="/kernels/{kernel_id}/suspend")
    assert status == 409 and "already suspended" in err["message"]
    status, err = await api("POST", "kernels", kid, "suspend", tier="cloud")
    assert status == 400 and err["code"] == "bad_request"

    ka = "/kernels/{kernel_id}/keep-awake"
    status, err = await api("POST", "kernels", kid, "keep-awake", body={"secs": 3}, spec=ka)
    assert status == 400 and err["code"] == "bad_request"
    status, err = await api("POST", "kernels", kid, "keep-awake", body={"seconds": -1}, spec=ka)
    assert status == 400
    status, err = await api("POST", "kernels", unknown, "keep-awake", body={"seconds": 5}, spec=ka)
    assert status == 404


async def test_unauthenticated_requests_are_refused(jp_fetch, new_kernel):
    kid = await new_kernel()
    for method, parts in [
        ("GET", ("kernels",)),
        ("GET", ("status",)),
        ("POST", ("kernels", kid, "suspend")),
    ]:
        with pytest.raises(HTTPClientError) as info:
            await jp_fetch(
                "api",
                "cedana",
                *parts,
                method=method,
                body="{}" if method == "POST" else None,
                headers={"Authorization": ""},
            )
        assert info.value.code in (401, 403)


async def test_keep_awake_postpones_policy(api, new_kernel, connect, jp_serverapp):
    kid = await new_kernel()
    client = await connect(kid)  # makes the kernel report "idle"
    await client.run("pass")
    policy = manager(jp_serverapp).policy
    policy.idle_timeout = 1.5
    status, k = await api(
        "POST",
        "kernels",
        kid,
        "keep-awake",
        body={"seconds": 60},
        spec="/kernels/{kernel_id}/keep-awake",
    )
    assert status == 200 and k["keep_awake_until"]
    # Idle past the timeout, and checked by the policy once more since: kept awake.
    await until(api, kid, lambda k: k["idle_seconds"] > policy.idle_timeout)
    await manager(jp_serverapp).check()
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "running"
    assert k["suspend_at"] is not None  # still planned, after the keep-awake
    await api("POST", "kernels", kid, "keep-awake", body={"seconds": 0})
    await until(api, kid, lambda k: k["state"] == "suspended")


# -- policy -------------------------------------------------------------------------------


async def test_policy_suspends_idle_not_busy_or_excluded(
    api, new_kernel, connect, jp_serverapp, tmp_path
):
    idle, busy = await new_kernel(), await new_kernel()
    c_idle, c_busy = await connect(idle), await connect(busy)
    await c_idle.run("x = 1")
    # Busy until the test says so, however long the checks below take.
    go = tmp_path / "go"
    busy_id = c_busy.execute(
        f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\nprint('done')"
    )
    policy = manager(jp_serverapp).policy
    policy.excluded_kernelspecs = ["python3"]
    policy.idle_timeout = 1.0
    k = await until(api, idle, lambda k: k["reason"] and "excluded" in k["reason"])
    assert k["state"] == "running"

    policy.excluded_kernelspecs = []
    await until(api, idle, lambda k: k["state"] == "suspended")
    await until(api, busy, lambda k: k["execution_state"] == "busy")
    await manager(jp_serverapp).check()  # at least one more check while it is busy
    _, b = await api("GET", "kernels", busy)
    assert b["state"] == "running" and b["execution_state"] == "busy"
    go.touch()
    got = await c_busy.collect([busy_id])
    assert got[busy_id]["stdout"] == "done\n"


async def until(api, kid: str, condition: Any, timeout: float = 120) -> dict[str, Any]:
    """The kernel's view once `condition` holds (the bound only catches a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        _, k = await api("GET", "kernels", kid)
        if condition(k):
            return k
        assert time.monotonic() < deadline, k
        await asyncio.sleep(0.1)


# -- transparent resume -------------------------------------------------------------------


async def test_messages_to_suspended_kernel_are_delivered_in_order(api, new_kernel, connect):
    kid = await new_kernel()
    client = await connect(kid)
    r = await client.run("a = 10")
    assert r["reply"]["status"] == "ok"
    count = r["reply"]["execution_count"]
    _, k = await api("POST", "kernels", kid, "suspend")
    assert k["state"] == "suspended"

    ids = [
        client.execute("print(a + 1)"),
        client.execute("a += 5; print(a)"),
        client.execute("print(a * 2)"),
    ]
    got = await client.collect(ids)
    assert [got[m]["stdout"] for m in ids] == ["11\n", "15\n", "30\n"]
    assert [got[m]["reply"]["status"] for m in ids] == ["ok"] * 3
    assert [got[m]["reply"]["execution_count"] for m in ids] == [count + 1, count + 2, count + 3]
    # Replies arrived in the order the requests were sent.
    replies = [
        m["parent_header"]["msg_id"]
        for m in client.messages
        if m["msg_type"] == "execute_reply" and m["parent_header"]["msg_id"] in ids
    ]
    assert replies == ids
    # The client saw the kernel busy while it was being restored, before any reply.
    first_reply = next(
        i
        for i, m in enumerate(client.messages)
        if m["msg_type"] == "execute_reply" and m["parent_header"]["msg_id"] in ids
    )
    assert any(
        m["msg_type"] == "status" and m["content"]["execution_state"] == "busy"
        for m in client.messages[:first_reply]
    )
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "running"


@contextlib.contextmanager
def logged(log: Any) -> Iterator[list[str]]:
    """The messages `log` logs meanwhile, debug ones included."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = getattr(log, "logger", log)  # a LoggerAdapter's logger
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_passive_requests_do_not_wake_a_suspended_kernel(
    api, new_kernel, connect, jp_serverapp
):
    """JupyterLab's debugger probes a kernel whenever its notebook gets focus: that must
    not resume it. The probe is answered once a cell run resumes the kernel."""
    kid = await new_kernel()
    client = await connect(kid)
    await client.run("q = 5")
    await api("POST", "kernels", kid, "suspend")
    probe = client.session.msg(
        "debug_request", {"seq": 1, "type": "request", "command": "debugInfo"}
    )
    probe["channel"] = "control"
    gate = jp_serverapp.web_app.settings["cedana_gate"]
    with logged(gate.log) as lines:
        client.ws.write_message(json.dumps(probe, default=json_default))
        # The gate decides as the message arrives: held for later, or resuming the kernel
        # for it (said either way).
        held = f"Holding debug_request for suspended kernel {kid}"
        waking = f"debug_request for suspended kernel {kid}: resuming it"
        deadline = time.monotonic() + 60
        while held not in lines and waking not in lines:
            assert time.monotonic() < deadline, "the gate never took the probe"
            await asyncio.sleep(0.01)
    assert held in lines and waking not in lines, lines
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "suspended"
    mid = client.execute("print(q)")
    got = await client.collect([mid])
    assert got[mid]["stdout"] == "5\n"
    # The probe was delivered once the kernel was back; its reply comes on the control
    # channel, on its own schedule.
    for _ in range(100):
        if any(m["msg_type"] == "debug_reply" for m in client.messages):
            break
        raw = await asyncio.wait_for(client.ws.read_message(), 10)
        client.messages.append(json.loads(raw))
    debug_replies = [
        m
        for m in client.messages
        if m["msg_type"] == "debug_reply"
        and m["parent_header"]["msg_id"] == probe["header"]["msg_id"]
    ]
    assert len(debug_replies) == 1


async def test_two_clients_on_one_suspended_kernel(api, new_kernel, connect):
    kid = await new_kernel()
    one, two = await connect(kid), await connect(kid)
    await one.run("shared = 'state'")
    await api("POST", "kernels", kid, "suspend")
    a = one.execute("print('one', shared)")
    b = two.execute("print('two', shared)")
    got_a, got_b = await asyncio.gather(one.collect([a]), two.collect([b]))
    assert got_a[a]["stdout"] == "one state\n" and got_a[a]["reply"]["status"] == "ok"
    assert got_b[b]["stdout"] == "two state\n" and got_b[b]["reply"]["status"] == "ok"


@pytest.mark.in_process  # it damages the image, which at the agent is root's
async def test_failed_resume_answers_held_request_and_keeps_image(
    api, new_kernel, connect, checkpoint_root
):
    kid = await new_kernel()
    client = await connect(kid)
    await client.run("z = 3")
    await api("POST", "kernels", kid, "suspend")
    pages = max((checkpoint_root / kid).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    original = pages.read_bytes()
    pages.write_bytes(original[:-4096])
    mid = client.execute("print(z)")
    got = (await client.collect([mid]))[mid]
    assert got["reply"]["status"] == "error"
    assert "truncated" in got["reply"]["evalue"]
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "failed" and "truncated" in k["reason"]
    assert (checkpoint_root / kid / "manifest.json").exists()
    # Put the image right: the next cell resumes it.
    pages.write_bytes(original)
    got = await client.run("print(z * 14)")
    assert got["stdout"] == "42\n"


# -- lifecycle ----------------------------------------------------------------------------


async def test_restarter_leaves_suspended_kernel_alone(api, new_kernel, jp_serverapp):
    kid = await new_kernel()
    km = jp_serverapp.kernel_manager.get_kernel(kid)
    assert km.autorestart and km._restarter is not None and km._restarter._pcallback is not None
    await api("POST", "kernels", kid, "suspend")
    restarts: list[str] = []
    for event in ("restart", "dead"):
        km._restarter.add_callback(lambda event=event: restarts.append(event), event)
    # What the restarter does every time_to_dead seconds, done here: a kernel it finds
    # dead is restarted at once (jupyter_client's KernelRestarter.poll).
    for _ in range(km._restarter.restart_limit + 1):
        await km._restarter.poll()
    assert restarts == []
    assert km.provisioner.state.value == "suspended"
    _, k = await api("GET", "kernels", kid)
    assert k["state"] == "suspended"


async def test_culler_spares_suspended_kernel_until_retention(api, new_kernel, jp_serverapp):
    import datetime as dt

    kid = await new_kernel()
    await api("POST", "kernels", kid, "suspend")
    mkm = jp_serverapp.kernel_manager
    mkm.cull_idle_timeout = 1
    mkm.get_kernel(kid).last_activity = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    await mkm.cull_kernel_if_idle(kid)
    assert kid in mkm
    # Past the retention time the culler may act (the policy loop, which would shut it
    # down itself, is stopped so that the culler's decision is the one tested).
    await manager(jp_serverapp).stop()
    manager(jp_serverapp).policy.retention = 0.5
    await asyncio.sleep(0.6)
    await mkm.cull_kernel_if_idle(kid)
    assert kid not in mkm


async def test_policy_shuts_down_after_retention(api, new_kernel, jp_serverapp, checkpoint_root):
    kid = await new_kernel()
    await api("POST", "kernels", kid, "suspend")
    manager(jp_serverapp).policy.retention = 0.5
    deadline = time.monotonic() + 120
    while kid in jp_serverapp.kernel_manager and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert kid not in jp_serverapp.kernel_manager
    assert not await has_image(checkpoint_root, kid)


async def test_shutdown_of_suspended_kernel_removes_image(
    api, new_kernel, jp_fetch, checkpoint_root
):
    kid = await new_kernel()
    await api("POST", "kernels", kid, "suspend")
    assert await has_image(checkpoint_root, kid)
    r = await jp_fetch("api", "kernels", kid, method="DELETE")
    assert r.code == 204
    assert not await has_image(checkpoint_root, kid)
    assert not (checkpoint_root / kid).exists()
    if AGENT_SOCKET:  # nothing of it is left there
        assert await agent_kernel(kid) is None
    status, _ = await api("GET", "kernels", kid)
    assert status == 404


# -- events, metrics ----------------------------------------------------------------------


async def test_events_and_metrics(api, new_kernel, jp_serverapp, jp_fetch):
    seen: list[dict[str, Any]] = []

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        seen.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=EVENT_SCHEMA, listener=listener)

    def metric(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = (await jp_fetch("metrics")).body.decode()
    kid = await new_kernel()
    await api("POST", "kernels", kid, "suspend")
    await api("POST", "kernels", kid, "resume")

    def kernel_actions() -> list[str]:
        return [e["action"] for e in seen if e["kernel_id"] == kid and e["action"] != "progress"]

    deadline = time.monotonic() + 60  # listeners run as tasks of their own
    while len(kernel_actions()) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    actions = kernel_actions()
    assert actions == ["suspending", "suspended", "resuming", "resumed"]
    suspended = next(e for e in seen if e["action"] == "suspended")
    assert suspended["checkpoint_bytes"] > 0 and suspended["duration_seconds"] > 0
    assert next(e for e in seen if e["action"] == "resumed")["duration_seconds"] > 0

    after = (await jp_fetch("metrics")).body.decode()
    for name in (
        'cedana_suspends_total{tier="disk"}',
        'cedana_resumes_total{tier="disk"}',
        "cedana_suspend_duration_seconds_count",
        "cedana_resume_duration_seconds_count",
    ):
        assert metric(after, name) == metric(before, name) + 1, name
    assert "cedana_gpu_seconds_reclaimed_total" in after
    assert "cedana_checkpoint_bytes" in after
