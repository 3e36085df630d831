"""`free_ports` through a real agent, real CRIU, real users: a dumped kernel whose port
was taken while it was suspended gets a free one in its image, and comes back there."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from . import test_launch
from .conftest import Agent
from .test_launch import Kernel, launch

kernels = test_launch.kernels  # the fixture: kernels launched here, closed after

USER = "cedana-test"


@contextmanager
def listening_on(port: int) -> Iterator[socket.socket]:
    """Another program's socket on the kernel's port, as one bound while nobody held it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    try:
        yield sock
    finally:
        sock.close()


def test_a_taken_port_is_moved_and_the_kernel_comes_back_there(
    agent: Agent, kernels: list[Kernel]
) -> None:
    kernel, _ = launch(agent, kernels, USER)
    kernel.run("state = [41]")
    kernel.close()
    kernel.client = None
    assert agent.run_as(USER, "dump", {"kernel_id": kernel.id})["ok"]
    info = json.loads(kernel.connection_file.read_text())
    shell = int(info["shell_port"])
    with listening_on(shell):
        # Nothing to move for another user: the kernel is not theirs.
        other = agent.run_as("cedana-test2", "free_ports", {"kernel_id": kernel.id})
        assert not other["ok"] and other["error"]["code"] == "not_found", other
        # With the port taken, a restore fails and keeps the image.
        failed = agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})
        assert not failed["ok"], failed
        images = agent.run_as(USER, "images")["result"]["images"]
        assert [i["kernel_id"] for i in images] == [kernel.id]

        reply = agent.run_as(USER, "free_ports", {"kernel_id": kernel.id})
        assert reply["ok"], reply
        moved = reply["result"]["moved"]
        assert list(moved) == [str(shell)], moved
        new = moved[str(shell)]
        assert new != shell and reply["result"]["port_map"][str(shell)] == new
        # The other ports were free: they stay.
        assert set(reply["result"]["port_map"]) == {str(shell)}
        # Asked again, nothing more moves; the map still says where the port went.
        again = agent.run_as(USER, "free_ports", {"kernel_id": kernel.id})["result"]
        assert again["moved"] == {} and again["port_map"] == {str(shell): new}

        restored = agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})
        assert restored["ok"], restored
        kernel.connection_file.write_text(json.dumps({**info, "shell_port": new}))
        assert kernel.run("print(state[0] + 1)").strip() == "42"


def test_free_ports_refuses_what_is_not_a_dumped_image(agent: Agent, kernels: list[Kernel]) -> None:
    kernel, _ = launch(agent, kernels, USER)
    running = agent.run_as(USER, "free_ports", {"kernel_id": kernel.id})
    assert not running["ok"] and running["error"]["code"] == "conflict", running
    bad = agent.run_as(USER, "free_ports", {"kernel_id": "../etc"})
    assert not bad["ok"] and bad["error"]["code"] == "bad_request", bad
    none = agent.run_as(USER, "free_ports", {"kernel_id": "0" * 8 + "-0000-4000-8000-" + "0" * 12})
    assert not none["ok"] and none["error"]["code"] == "not_found", none
    # The agent serves on.
    assert agent.run_as(USER, "list")["ok"]
