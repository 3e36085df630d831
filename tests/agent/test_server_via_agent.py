"""A jupyter server of an ordinary user, configured with `--CheckpointAgent.socket`, whose
kernels live under the checkpoint agent: launched, interrupted, suspended, resumed and shut
down through it.

Real parts: the agent runs as root (tests/agent/conftest.py); the server runs as
cedana-test with the users' virtualenv, no supplementary group and no capability, so
that the agent is its only way to checkpoint (a `criu` first on its PATH records any run);
real ipykernel; cells go through the server's kernel websocket as a notebook's do."""

from __future__ import annotations

import asyncio
import json
import pwd
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint.proctree import process_tree, stat_fields
from tests.userserver import cmdline

from .conftest import Agent
from .servers_on_agent import (
    OTHER,
    USER,
    Cell,
    Reply,
    UserServer,
    agent_images,
    agent_kernels,
    at_agent,
    eventually,
    kernel_tasks,
    still_alive,
    stop_user_server,
)

pytestmark = [pytest.mark.criu, pytest.mark.root]

BIG_MB = 200

STATUS_FIELDS = ("Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")
# Run in the kernel: what its own /proc says of it.
PROBE = textwrap.dedent(
    f"""
    import json
    _f = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()
              if ':\\t' in l)
    print(json.dumps({{k: _f[k].strip() for k in {STATUS_FIELDS!r}}}))
    """
)


def status_fields(text: str) -> dict[str, str]:
    fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return {k: fields[k].strip() for k in STATUS_FIELDS}


def assert_confined(fields: dict[str, str], uid: int, where: str) -> None:
    """The user's uid (real, effective, saved, filesystem), no capability, no_new_privs."""
    assert fields["Uid"].split() == [str(uid)] * 4, (where, fields)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, (where, cap, fields)
    assert fields["NoNewPrivs"] == "1", (where, fields)


def status_line(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    return ""


def host_status(pid: int) -> dict[str, str]:
    return status_fields(Path(f"/proc/{pid}/status").read_text())


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        fields = stat_fields(pid)
        if len(fields) < 2:
            break
        pid = int(fields[1])
        chain.append(pid)
    return chain


def assert_kernel_of_agent(
    agent: Agent, server: UserServer, kid: str, uid: int, restored: bool = False
) -> set[int]:
    """Every task of the kernel is the user's, confined, and none is the server's
    descendant; a launched kernel is the agent's descendant."""
    init, tasks = kernel_tasks(agent, server.user, kid)
    chain = ancestors(init)
    assert server.proc.pid not in chain, (init, chain, server.proc.pid)
    if not restored:
        assert agent.proc.pid in chain, (init, chain, agent.proc.pid)
    for pid in tasks:
        assert server.proc.pid not in ancestors(pid), (pid, cmdline(pid))
        assert_confined(host_status(pid), uid, f"host pid {pid}: {cmdline(pid)}")
    assert any("ipykernel" in cmdline(p) for p in tasks), [cmdline(p) for p in tasks]
    below_server = [cmdline(p) for p in process_tree(server.proc.pid)]
    assert not any("ipykernel" in c for c in below_server), below_server
    return tasks


# -- the cases ------------------------------------------------------------------------------


def test_kernel_runs_under_the_agent_as_the_user_without_capabilities(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    uid = pwd.getpwnam(USER).pw_uid
    server = user_servers(USER)
    # The server holds nothing privileged: no supplementary group, no capability.
    assert status_line(server.proc.pid, "Groups").split() == [], server.proc.pid
    assert int(status_line(server.proc.pid, "CapEff"), 16) == 0
    # It says where its kernels are checkpointed, and that the agent checkpoints GPU
    # memory (its hello says so).
    status, st = server.api("GET", "api/cedana/status")
    assert status == 200 and st["available"], st
    assert st["agent_socket"] == str(live_agent.socket_path), st
    assert st["gpu"]["checkpoint"] is True and st["warnings"] == [], st
    kid = server.start_kernel()
    inside = json.loads(server.output(kid, PROBE))
    assert_confined(inside, uid, "the kernel's own /proc/self/status")
    assert_kernel_of_agent(live_agent, server, kid, uid)
    assert [k["kernel_id"] for k in agent_kernels(live_agent, USER)] == [kid]


def test_state_survives_suspend_and_a_transparent_resume(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    uid = pwd.getpwnam(USER).pw_uid
    server = user_servers(USER)
    kid = server.start_kernel()
    digest = server.output(
        kid,
        "import hashlib, os\nx = 41\n"
        f"big = bytearray(os.urandom(1 << 20)) * {BIG_MB}\n"
        "print(hashlib.sha256(big).hexdigest())",
    ).strip()
    tasks = assert_kernel_of_agent(live_agent, server, kid, uid)

    view = server.suspend(kid)
    assert view["checkpoint_bytes"] >= BIG_MB << 20, view
    assert eventually(lambda: not still_alive(tasks)), still_alive(tasks)
    assert at_agent(live_agent, USER, kid)["state"] == "dumped"
    assert [i["kernel_id"] for i in agent_images(live_agent, USER)] == [kid]

    # No resume asked: the cell resumes it.
    assert server.output(kid, "print(x + 1)").strip() == "42"
    assert server.kernel(kid)["state"] == "running"
    assert server.output(kid, "print(hashlib.sha256(big).hexdigest())").strip() == digest
    assert_confined(json.loads(server.output(kid, PROBE)), uid, "the restored kernel's own view")
    assert_kernel_of_agent(live_agent, server, kid, uid, restored=True)
    # Every page is in (the digest read them all): the image goes.
    assert eventually(lambda: not agent_images(live_agent, USER), 60), agent_images(
        live_agent, USER
    )
    # Once stopped, the server has finished whatever it started in the background.
    stop_user_server(server)
    assert server.criu_runs() == [], server.log_errors()


def test_interrupt_through_rest_reaches_the_cell_and_the_kernel_lives(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    kid = server.start_kernel()
    server.output(kid, "y = 'still here'")
    init, _ = kernel_tasks(live_agent, USER, kid)

    async def interrupted() -> Reply:
        ws = await server.channels(kid)
        try:
            cell = Cell(ws)
            mid = cell.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(60)")
            await cell.until_printed(mid, "sleeping")
            status, body = await asyncio.to_thread(
                server.api, "POST", f"api/kernels/{kid}/interrupt"
            )
            assert status == 204, (status, body, server.log_tail())
            # Well before the sleep would end by itself.
            return await cell.collect(mid, timeout=30)
        finally:
            ws.close()

    reply = asyncio.run(interrupted())
    assert (reply.status, reply.ename) == ("error", "KeyboardInterrupt"), reply
    assert server.output(kid, "print(y)").strip() == "still here"
    assert kernel_tasks(live_agent, USER, kid)[0] == init  # the same kernel, not a restart


def test_shutdown_leaves_nothing_at_the_agent(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    running, suspended = server.start_kernel(), server.start_kernel()
    for kid in (running, suspended):
        server.output(kid, "z = 1")
    _, tasks = kernel_tasks(live_agent, USER, running)
    server.suspend(suspended)
    assert [i["kernel_id"] for i in agent_images(live_agent, USER)] == [suspended]

    for kid in (running, suspended):
        status, body = server.api("DELETE", f"api/kernels/{kid}")
        assert status == 204, (kid, status, body, server.log_tail())
    assert eventually(lambda: not still_alive(tasks)), still_alive(tasks)

    def left_at_agent() -> dict[str, Any]:
        return {
            "kernels": agent_kernels(live_agent, USER),
            "images": agent_images(live_agent, USER),
        }

    assert eventually(lambda: not any(left_at_agent().values()), 30), left_at_agent()


def test_another_users_server_cannot_reach_the_kernels(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    other = user_servers(OTHER)
    kid = server.start_kernel()
    server.output(kid, "secret = 'only mine'")

    for method, path in (
        ("GET", f"api/kernels/{kid}"),
        ("GET", f"api/cedana/kernels/{kid}"),
        ("POST", f"api/cedana/kernels/{kid}/suspend"),
        ("POST", f"api/cedana/kernels/{kid}/resume"),
    ):
        status, body = other.api(method, path)
        assert status == 404, (method, path, status, body)
    assert kid not in [k["id"] for k in other.api("GET", "api/cedana/kernels")[1]]
    # The other server's own kernel is the other user's, at the agent too.
    mine = other.start_kernel()
    assert_confined(json.loads(other.output(mine, PROBE)), pwd.getpwnam(OTHER).pw_uid, OTHER)
    assert [k["kernel_id"] for k in agent_kernels(live_agent, OTHER)] == [mine]

    # The agent, asked as the other user, does not know the kernel, running or dumped.
    for op, args in (("dump", {}), ("signal", {"signum": int(signal.SIGKILL)})):
        reply = live_agent.run_as(OTHER, op, {"kernel_id": kid, **args})
        assert reply.get("error", {}).get("code") == "not_found", (op, reply)
    server.suspend(kid)
    for op in ("restore", "discard"):
        reply = live_agent.run_as(OTHER, op, {"kernel_id": kid})
        assert reply.get("error", {}).get("code") == "not_found", (op, reply)
    assert kid not in [i["kernel_id"] for i in agent_images(live_agent, OTHER)]
    status, body = other.api("POST", f"api/cedana/kernels/{kid}/resume")
    assert status == 404, (status, body)

    assert server.kernel(kid)["state"] == "suspended"
    assert server.output(kid, "print(secret)").strip() == "only mine"


def test_no_agent_at_the_socket(agent_base: Path, user_servers: Callable[..., UserServer]) -> None:
    """Kernels start and run as without the agent; checkpointing says why it cannot."""
    nowhere = agent_base / "no-agent" / "agent.sock"
    server = user_servers(USER, nowhere)
    status, st = server.api("GET", "api/cedana/status")
    assert status == 200 and st["available"] is False, st
    assert str(nowhere) in (st["reason"] or ""), st

    kid = server.start_kernel()
    assert server.output(kid, "print(6 * 7)").strip() == "42"
    status, body = server.api("POST", f"api/cedana/kernels/{kid}/suspend")
    assert status in (409, 503), (status, body)
    assert str(nowhere) in body["message"], body
    assert server.kernel(kid)["state"] == "running"
    assert server.output(kid, "print('after')").strip() == "after"
    stop_user_server(server)
    assert server.criu_runs() == [], server.log_errors()
