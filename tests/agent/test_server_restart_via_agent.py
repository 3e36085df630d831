"""Kernels at the checkpoint agent outlive their server: a user's server killed with
SIGKILL, or stopped, and started again on the same directories gets back every kernel,
under its id and with its state: running ones still running, suspended ones suspended.
Real agent (root), real servers as cedana-test, real ipykernel and CRIU."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable

import pytest

from .conftest import Agent
from .servers_on_agent import (
    USER,
    UserServer,
    agent_images,
    alive,
    at_agent,
    eventually,
    kernel_tasks,
)

pytestmark = [pytest.mark.criu, pytest.mark.root]

STATE = "import os\nword = 'kept ' + str(6 * 7)\nprint(os.getpid())"


def killed(server: UserServer) -> None:
    """SIGKILL: no stop code runs, nothing is parked."""
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)


def listed(server: UserServer) -> list[str]:
    status, kernels = server.api("GET", "api/kernels")
    assert status == 200, (status, kernels)
    return sorted(k["id"] for k in kernels)


def test_a_killed_servers_running_kernel_runs_on_and_is_attached_again(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    kid = server.start_kernel()
    inner_pid = server.output(kid, STATE).strip()
    init, tasks = kernel_tasks(live_agent, USER, kid)

    killed(server)
    # The kernel is the agent's: it did not go with its server.
    assert alive(init) and all(alive(p) for p in tasks)
    assert at_agent(live_agent, USER, kid)["state"] == "running"

    again = user_servers(USER)
    assert listed(again) == [kid]
    assert again.kernel(kid)["state"] == "running"
    # The same process, not a restore: its memory never left it.
    assert again.output(kid, "print(word, os.getpid())").split() == ["kept", "42", inner_pid]
    assert kernel_tasks(live_agent, USER, kid)[0] == init
    # It is this server's kernel now: suspend and a transparent resume work.
    again.suspend(kid)
    assert at_agent(live_agent, USER, kid)["state"] == "dumped"
    assert again.output(kid, "print(word)").strip() == "kept 42"


def test_a_killed_servers_suspended_kernel_comes_back_suspended(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    kid = server.start_kernel()
    server.output(kid, STATE)
    server.suspend(kid)

    killed(server)
    assert at_agent(live_agent, USER, kid)["state"] == "dumped"

    again = user_servers(USER)
    assert listed(again) == [kid]
    view = again.kernel(kid)
    assert view["state"] == "suspended" and view["checkpoint_bytes"] > 0, view
    assert again.output(kid, "print(word)").strip() == "kept 42"
    assert again.kernel(kid)["state"] == "running"


def test_a_port_taken_while_no_server_held_it_is_moved_at_adoption(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    """Between a killed server and the next nobody holds a suspended kernel's ports; one
    taken meanwhile is moved, in the agent's image and in what the clients get."""
    server = user_servers(USER)
    kid = server.start_kernel()
    server.output(kid, STATE)
    server.suspend(kid)
    shell = int(at_agent(live_agent, USER, kid)["meta"]["connection_info"]["shell_port"])
    killed(server)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", shell))
        taken.listen()
        again = user_servers(USER)
        assert listed(again) == [kid]
        assert again.kernel(kid)["state"] == "suspended"
        assert again.output(kid, "print(word)").strip() == "kept 42"
    log = again.log.read_text(errors="replace")
    assert f"port(s) {shell} taken since its server stopped" in log, again.log_tail()


def test_a_stopped_server_parks_its_kernel_at_the_agent_and_the_next_adopts_it(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    kid = server.start_kernel()
    server.output(kid, STATE)
    init, tasks = kernel_tasks(live_agent, USER, kid)

    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=90) == 0, server.log_tail()
    # Parked: dumped at the agent, its processes gone, its memory in the agent's store.
    assert at_agent(live_agent, USER, kid)["state"] == "dumped"
    assert eventually(lambda: not any(map(alive, {init, *tasks}))), (init, tasks)
    assert [i["kernel_id"] for i in agent_images(live_agent, USER)] == [kid]

    again = user_servers(USER)
    assert listed(again) == [kid]
    assert again.kernel(kid)["state"] == "suspended"
    assert again.output(kid, "print(word)").strip() == "kept 42"


def test_a_kernel_shut_down_is_not_brought_back(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    kid = server.start_kernel()
    status, _ = server.api("DELETE", f"api/kernels/{kid}")
    assert status == 204
    killed(server)

    again = user_servers(USER)
    assert listed(again) == []
