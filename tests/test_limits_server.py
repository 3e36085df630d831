# The server fixtures of test_server.py are imported, and test parameters name them.
# ruff: noqa: F811
"""Limits under concurrency, the checkpoint budget and the backoff of failed suspends, with
a real jupyter server, real kernels and real CRIU.

Transitions are held mid-flight by the criu wrapper of tests/criu_hold.py (`criu_hold`
fixture), before CRIU runs; the policy is run one check at a time
(`SuspendManager.check()`), never by waiting for its loop.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint.store import CheckpointStore
from jupyter_cedana.server.limits import estimate_image_bytes
from jupyter_cedana.server.manager import EVENT_SCHEMA
from tests.test_server import api, connect, manager, new_kernel  # noqa: F401

pytestmark = pytest.mark.criu

SUSPEND, RESUME = "/kernels/{kernel_id}/suspend", "/kernels/{kernel_id}/resume"


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 120) -> None:
    """Wait for a condition; the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
def orphan(checkpoint_root: Path) -> str:
    """An image left by a crash: no server owns it."""
    kid = str(uuid.uuid4())
    store = CheckpointStore(checkpoint_root)
    tmp = store.begin(kid)
    (tmp / "pages-1.img").write_bytes(b"o" * 100_000)
    store.commit(kid, tmp, {})
    return kid


def orphan_bytes(root: Path, kid: str) -> int:
    """What the orphan takes on disk: its pages and their checksum table."""
    return CheckpointStore(root).size_of(kid)


@pytest.fixture
def jp_server_config(checkpoint_root: Path, criu_hold: Any, orphan: str) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_cedana": True}},
        "CedanaApp": {"checkpoint_root": str(checkpoint_root)},
        "CheckpointEngine": {"criu_path": str(criu_hold.wrapper), "ghost_limit": 1 << 20},
        # The policy loop checks once at start; tests run each further check themselves.
        "SuspendPolicy": {"idle_timeout": 0, "check_interval": 3600},
        "SuspendLimits": {"max_concurrent_suspends": 1, "max_concurrent_resumes": 1},
    }


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def server_log() -> Records:
    return Records()


@pytest.fixture(autouse=True)
async def started(jp_serverapp: Any, server_log: Records) -> Any:
    jp_serverapp.log.addHandler(server_log)
    await jp_serverapp.extension_manager.start_extension("jupyter_cedana")
    yield jp_serverapp
    jp_serverapp.log.removeHandler(server_log)


class Events(list[dict[str, Any]]):
    """The kernel-state events the server emitted."""

    logger: Any = None


@pytest.fixture
def events(jp_serverapp: Any) -> Events:
    seen = Events()
    seen.logger = jp_serverapp.event_logger

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        seen.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=EVENT_SCHEMA, listener=listener)
    return seen


def actions(events: list[dict[str, Any]], kid: str) -> list[str]:
    return [e["action"] for e in events if e["kernel_id"] == kid and e["action"] != "progress"]


async def idle_kernel(new_kernel: Any, connect: Any, code: str = "x = 1") -> str:
    """A started kernel that ran `code` and is idle."""
    kid = await new_kernel()
    client = await connect(kid)
    reply = (await client.run(code))["reply"]
    assert reply["status"] == "ok", reply
    return kid


async def state_is(api: Any, kid: str, state: str) -> bool:
    return (await api("GET", "kernels", kid))[1]["state"] == state


async def saw(events: Events, kid: str, expected: list[str]) -> None:
    """The kernel's events so far (once every listener has run) are `expected`."""
    await events.logger.gather_listeners()
    assert actions(events, kid) == expected


def due(mgr: Any, kid: str) -> Callable[[], Awaitable[bool]]:
    """The policy wants to suspend the kernel now."""

    async def check() -> bool:
        kernel = mgr.kernel_manager.get_kernel(kid)
        return mgr.policy.decide(mgr.facts(kid, kernel)).action is not None

    return check


def settled(mgr: Any, kid: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not mgr.transition_pending(kid)

    return check


# -- concurrency ---------------------------------------------------------------------------


async def test_suspends_beyond_the_limit_wait_in_line(
    api, new_kernel, criu_hold, events, jp_serverapp
):
    first, second = await new_kernel(), await new_kernel()
    criu_hold.arm("dump", "before")
    status, k1 = await api("POST", "kernels", first, "suspend", wait="0", spec=SUSPEND)
    assert status == 202 and k1["state"] == "suspending" and k1["queued"] is None
    await criu_hold.wait_reached("dump", "before")

    status, k2 = await api("POST", "kernels", second, "suspend", wait="0", spec=SUSPEND)
    assert status == 202
    assert k2["state"] == "running"  # still running: it only waits for its turn
    assert k2["queued"]["action"] == "suspend" and k2["queued"]["position"] == 1
    _, st = await api("GET", "status", spec="/status")
    assert st["queued"] == {"suspend": 1, "resume": 0}
    await saw(events, second, ["queued"])  # not started

    criu_hold.arm("dump", "before")  # hold the next dump: the second one's
    criu_hold.release("dump", "before")
    await criu_hold.wait_reached("dump", "before")
    _, k1 = await api("GET", "kernels", first)
    _, k2 = await api("GET", "kernels", second)
    assert k1["state"] == "suspended"  # the second started once the first was done
    assert k2["state"] == "suspending" and k2["queued"] is None
    criu_hold.release("dump", "before")
    await until(lambda: state_is(api, second, "suspended"), "the second suspend")
    await saw(events, second, ["queued", "suspending", "suspended"])


async def test_resumes_beyond_the_limit_wait_in_line(api, new_kernel, criu_hold):
    first, second = await new_kernel(), await new_kernel()
    for kid in (first, second):
        assert (await api("POST", "kernels", kid, "suspend"))[0] == 200
    criu_hold.arm("restore", "before")
    status, _ = await api("POST", "kernels", first, "resume", wait="0")
    assert status == 202
    await criu_hold.wait_reached("restore", "before")
    status, k2 = await api("POST", "kernels", second, "resume", wait="0", spec=RESUME)
    assert status == 202
    assert k2["state"] == "suspended" and k2["queued"]["action"] == "resume"
    criu_hold.release("restore", "before")
    for kid in (first, second):
        await until(lambda kid=kid: state_is(api, kid, "running"), f"resume of {kid}")


async def policy_suspend_in_line(
    api: Any, new_kernel: Any, connect: Any, criu_hold: Any, mgr: Any
) -> str:
    """An idle kernel whose automatic suspend waits behind another kernel's held dump
    (max_concurrent_suspends = 1)."""
    busy = await new_kernel()
    idle = await idle_kernel(new_kernel, connect)
    criu_hold.arm("dump", "before")
    await api("POST", "kernels", busy, "suspend", wait="0")
    await criu_hold.wait_reached("dump", "before")
    mgr.policy.idle_timeout = 0.01
    await until(due(mgr, idle), "the policy to want a suspend")
    await mgr.check()
    _, k = await api("GET", "kernels", idle)
    assert k["queued"] and k["queued"]["action"] == "suspend", k
    return idle


async def test_a_queued_policy_suspend_is_dropped_when_no_longer_due(
    api, new_kernel, connect, criu_hold, events, jp_serverapp
):
    mgr = manager(jp_serverapp)
    idle = await policy_suspend_in_line(api, new_kernel, connect, criu_hold, mgr)
    # While it waits, someone asks to keep the kernel awake: the policy changes its mind.
    await api("POST", "kernels", idle, "keep-awake", body={"seconds": 3600})
    criu_hold.release("dump", "before")
    await until(settled(mgr, idle), "the queued suspend to end")
    await saw(events, idle, ["queued", "keep-awake", "dequeued"])  # never dumped
    _, k = await api("GET", "kernels", idle)
    assert k["state"] == "running" and k["queued"] is None


async def test_a_manual_suspend_joining_a_queued_automatic_one_is_not_dropped(
    api, new_kernel, connect, criu_hold, events, jp_serverapp
):
    mgr = manager(jp_serverapp)
    idle = await policy_suspend_in_line(api, new_kernel, connect, criu_hold, mgr)
    await api("POST", "kernels", idle, "keep-awake", body={"seconds": 3600})
    # The policy no longer wants it, but a person does.
    status, k = await api("POST", "kernels", idle, "suspend", wait="0")
    assert status == 202 and k["queued"]["action"] == "suspend"
    criu_hold.release("dump", "before")
    await until(lambda: state_is(api, idle, "suspended"), "the suspend")
    await saw(events, idle, ["queued", "keep-awake", "suspending", "suspended"])


async def test_a_queued_suspend_of_a_kernel_shut_down_is_answered(
    api, new_kernel, criu_hold, events, jp_serverapp
):
    mgr = manager(jp_serverapp)
    first, second = await new_kernel(), await new_kernel()
    criu_hold.arm("dump", "before")
    await api("POST", "kernels", first, "suspend", wait="0")
    await criu_hold.wait_reached("dump", "before")
    waiting = asyncio.ensure_future(api("POST", "kernels", second, "suspend", spec=SUSPEND))

    async def queued() -> bool:
        return mgr.queue.queued(second) is not None

    await until(queued, "the second suspend to queue")
    await mgr.kernel_manager.shutdown_kernel(second)
    await mgr.check()  # the policy loop drops what waits for kernels that are gone
    status, err = await asyncio.wait_for(waiting, 60)
    assert status == 409 and "cancelled while it waited" in err["message"], err
    assert mgr.queue.counts() == {"suspend": 0, "resume": 0}
    await saw(events, second, ["queued"])  # never started
    criu_hold.release("dump", "before")
    await until(lambda: state_is(api, first, "suspended"), "the first suspend")


# -- budget --------------------------------------------------------------------------------


async def test_concurrent_suspends_cannot_overshoot_the_budget(
    api, new_kernel, connect, criu_hold, events, jp_serverapp, checkpoint_root, orphan
):
    mgr = manager(jp_serverapp)
    mgr.limits.max_concurrent_suspends = 2
    first = await idle_kernel(new_kernel, connect)
    second = await idle_kernel(new_kernel, connect)
    criu_hold.arm("dump", "before")
    await api("POST", "kernels", first, "suspend", wait="0")
    await criu_hold.wait_reached("dump", "before")
    _, st = await api("GET", "status", spec="/status")
    reserved = st["budget"]["reserved"]
    assert reserved > 10 << 20  # the first kernel's memory, reserved before its dump
    # Room for half of the second kernel's memory next to the dump under way.
    pid = mgr.kernel_manager.get_kernel(second).provisioner.pid
    budget = reserved + estimate_image_bytes(pid) // 2
    mgr.policy.max_checkpoint_bytes = budget

    status, err = await api("POST", "kernels", second, "suspend", spec=SUSPEND)
    assert status == 507 and err["code"] == "insufficient_storage", err
    assert "Checkpoint budget exceeded" in err["message"]
    assert "reserved by dumps under way" in err["message"]
    assert not list(checkpoint_root.glob(f".{second}.tmp-*"))
    _, k2 = await api("GET", "kernels", second)
    assert k2["state"] == "running"
    assert k2["backoff"] is not None and not k2["backoff"]["not_checkpointable"]
    await saw(events, second, ["failed"])  # refused before any dump: no "suspending"
    assert "budget" in next(e for e in events if e["kernel_id"] == second)["reason"]

    criu_hold.release("dump", "before")
    await until(lambda: state_is(api, first, "suspended"), "the first suspend")
    _, st = await api("GET", "status", spec="/status")
    assert st["budget"]["reserved"] == 0
    # The orphan does not count; what counts never went over the budget.
    images = {i.kernel_id: i.bytes for i in mgr.budget.images()}
    assert set(images) == {first, orphan}
    assert st["budget"]["used"] == images[first] <= budget
    assert st["budget"]["orphaned_kernel_ids"] == [orphan]


async def test_orphaned_images_are_reported_at_start(api, server_log, orphan, checkpoint_root):
    assert any(orphan in line and "belong to no kernel" in line for line in server_log.lines)
    _, st = await api("GET", "status", spec="/status")
    assert st["budget"]["orphaned_images"] == 1
    assert st["budget"]["orphaned_bytes"] == orphan_bytes(checkpoint_root, orphan) > 100_000
    assert st["budget"]["used"] == 0


async def test_parked_images_are_owned(api, checkpoint_root, orphan):
    records = checkpoint_root / ".parked"
    records.mkdir(mode=0o700)
    record = records / f"{orphan}.json"
    record.write_text("{}")  # no server can adopt this: its image is nobody's
    _, st = await api("GET", "status")
    assert st["budget"]["orphaned_kernel_ids"] == [orphan] and st["budget"]["used"] == 0
    # Parked by a server that stopped: the next one adopts it.
    record.write_text(
        json.dumps(
            {
                "format": 1,
                "kernel_id": orphan,
                "kernel_name": "python3",
                "connection_info": {},
                "uid": os.geteuid(),
            }
        )
    )
    _, st = await api("GET", "status")
    assert st["budget"]["orphaned_images"] == 0 and st["budget"]["used"] == orphan_bytes(
        checkpoint_root, orphan
    )


async def test_suspend_is_refused_when_the_disk_would_fill(api, new_kernel, jp_serverapp):
    mgr = manager(jp_serverapp)
    kid = await new_kernel()
    mgr.limits.min_free_disk_bytes = mgr.budget.free_bytes()
    status, err = await api("POST", "kernels", kid, "suspend")
    assert status == 507 and "Not enough free space" in err["message"]
    assert (await api("GET", "kernels", kid))[1]["state"] == "running"
    mgr.limits.min_free_disk_bytes = 0
    assert (await api("POST", "kernels", kid, "suspend"))[0] == 200


# -- backoff -------------------------------------------------------------------------------


GHOST = (
    "import os, tempfile; g = tempfile.NamedTemporaryFile(dir='.', delete=False); "
    "g.write(b'x' * (2 << 20)); g.flush(); os.unlink(g.name); y = 7"
)


async def test_a_kernel_that_cannot_be_checkpointed_is_not_dumped_at_every_check(
    api, new_kernel, connect, events, jp_serverapp
):
    mgr = manager(jp_serverapp)
    kid = await new_kernel()
    client = await connect(kid)
    assert (await client.run(GHOST))["reply"]["status"] == "ok"
    mgr.policy.idle_timeout = 0.01
    await until(due(mgr, kid), "the policy to want a suspend")
    await mgr.check()
    await until(settled(mgr, kid), "the automatic suspend")
    attempt = ["suspending", "failed"]
    await saw(events, kid, attempt)
    _, k = await api("GET", "kernels", kid, spec="/kernels/{kernel_id}")
    assert k["state"] == "running"
    assert k["backoff"]["not_checkpointable"] is True and k["backoff"]["failures"] == 1
    assert k["reason"].startswith("Not checkpointable: it holds a deleted file"), k["reason"]
    assert "ghost file" in k["reason"]
    assert k["suspend_at"] >= k["backoff"]["retry_at"]

    for _ in range(3):
        await mgr.check()
    assert not mgr.transition_pending(kid)
    await saw(events, kid, attempt)  # not frozen and dumped again

    # A manual suspend still tries, and says why it failed.
    status, err = await api("POST", "kernels", kid, "suspend")
    assert status == 500 and "ghost file" in err["message"]
    await saw(events, kid, attempt * 2)
    _, k = await api("GET", "kernels", kid)
    assert k["backoff"]["failures"] == 2

    # The user lets go of the file: running code ends the wait, and the next check works.
    assert (await client.run("g.close(); z = y * 6"))["reply"]["status"] == "ok"
    _, k = await api("GET", "kernels", kid)
    assert k["backoff"] is None and not k["reason"].startswith("Not checkpointable")
    await until(due(mgr, kid), "the policy to want a suspend")
    await mgr.check()
    await until(lambda: state_is(api, kid, "suspended"), "the automatic suspend")
    await saw(events, kid, [*attempt, *attempt, "suspending", "suspended"])
    assert (await client.run("print(z)"))["stdout"] == "42\n"


async def test_a_socket_to_another_process_is_not_checkpointable(
    api, new_kernel, connect, jp_serverapp, tmp_path
):
    mgr = manager(jp_serverapp)
    path = str(tmp_path / "service.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        kid = await new_kernel()
        client = await connect(kid)
        code = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({path!r})"
        assert (await client.run(code))["reply"]["status"] == "ok"
        peer, _ = listener.accept()
        mgr.policy.idle_timeout = 0.01
        await until(due(mgr, kid), "the policy to want a suspend")
        await mgr.check()
        await until(settled(mgr, kid), "the automatic suspend")
        _, k = await api("GET", "kernels", kid)
        assert k["state"] == "running"
        assert k["backoff"] and k["backoff"]["not_checkpointable"], k
        assert "socket connected to a process outside" in k["reason"], k["reason"]
        # The kernel runs on with its connection.
        assert (await client.run("s.sendall(b'ping')"))["reply"]["status"] == "ok"
        assert peer.recv(4) == b"ping"
        peer.close()
    finally:
        listener.close()
        os.unlink(path)


async def test_failed_automatic_suspends_back_off(api, new_kernel, connect, events, jp_serverapp):
    mgr = manager(jp_serverapp)
    mgr.backoff.retry_delay = 600.0
    mgr.backoff.max_retry_delay = 900.0
    mgr.policy.max_checkpoint_bytes = 1  # every dump is refused: a failure that may pass
    kid = await idle_kernel(new_kernel, connect)
    mgr.policy.idle_timeout = 0.01
    await until(due(mgr, kid), "the policy to want a suspend")

    before = time.time()
    await mgr.check()
    await until(settled(mgr, kid), "the automatic suspend")
    after = time.time()
    _, k = await api("GET", "kernels", kid)
    assert k["backoff"]["failures"] == 1 and not k["backoff"]["not_checkpointable"]
    assert "Automatic suspend failed once" in k["reason"] and "budget" in k["reason"]
    retry = _timestamp(k["backoff"]["retry_at"])
    assert before + 600 <= retry <= after + 600
    for _ in range(3):
        await mgr.check()
    await saw(events, kid, ["failed"])  # no new attempt while backing off

    # The budget is raised: nothing retries before the wait ends, but a manual suspend works
    # and clears the record.
    mgr.policy.max_checkpoint_bytes = 0
    assert (await api("POST", "kernels", kid, "suspend"))[0] == 200
    await api("POST", "kernels", kid, "resume")
    _, k = await api("GET", "kernels", kid)
    assert k["backoff"] is None


def _timestamp(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp()
