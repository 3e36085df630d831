"""A server of cedana-test on the checkpoint agent with `CheckpointEngine.keep_base` on:
its second suspend of a kernel is a delta on the image the kernel was resumed from, in the
agent's store (docs/incremental.md, *Through the checkpoint agent*).

Real parts: the agent as root, the server as cedana-test with no capability (a `criu`
first on its PATH records any run), real ipykernel, cells through the kernel websocket."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .conftest import Agent, ended_after
from .servers_on_agent import (
    USER,
    UserServer,
    agent_images,
    eventually,
    start_user_server,
    stop_user_server,
)

pytestmark = [pytest.mark.criu, pytest.mark.root]

MB = 1 << 20
ARRAY_MB = 96


def start_keep_base_server(base: Path, agent_socket: Path) -> UserServer:
    return start_user_server(base, USER, agent_socket, "--CheckpointEngine.keep_base=True")


@pytest.fixture
def keep_base_server(live_agent: Agent) -> Iterator[Callable[[], UserServer]]:
    def start() -> UserServer:
        return start_keep_base_server(live_agent.base, live_agent.socket_path)

    def stop(server: UserServer) -> None:
        stop_user_server(server)
        print(f"---- the server's log (last lines) ----\n{server.log_tail()}")

    with ended_after(start, stop) as started:
        yield started


def images(agent: Agent) -> dict[str, object]:
    reply = agent.run_as(USER, "images")
    assert reply["ok"], reply
    return dict(reply["result"])


def test_the_second_suspend_is_a_delta_at_the_agent(
    live_agent: Agent, keep_base_server: Callable[[], UserServer]
) -> None:
    server = keep_base_server()
    kid = server.start_kernel()
    server.output(
        kid,
        "import hashlib, numpy as np\n"
        f"a = np.random.default_rng(3).integers(0, 2**63, size={ARRAY_MB} * 2**20 // 8, "
        "dtype=np.int64)",
    )
    first = server.suspend(kid)
    (whole,) = agent_images(live_agent, USER)
    assert whole["layers"] == 1 and whole["bytes"] > ARRAY_MB * MB, whole
    assert first["checkpoint_bytes"] == whole["held_bytes"], (first, whole)

    # The cell resumes the kernel; the agent keeps its image as the next suspend's base
    # (once all of its memory is in, for a lazy resume: the hash reads it all).
    digest = server.output(kid, "a[100:2100] += 1\nprint(hashlib.sha256(a).hexdigest())").strip()
    assert eventually(lambda: images(live_agent)["bases"] != [], 60), images(live_agent)
    assert agent_images(live_agent, USER) == []

    second = server.suspend(kid)
    (delta,) = agent_images(live_agent, USER)
    print(f"whole image {whole['bytes']} bytes, delta {delta['bytes']} bytes")
    assert delta["layers"] == 2 and delta["bytes"] < whole["bytes"] // 10, (whole, delta)
    # What the server counts is what the chain holds, as for a root server's chain.
    assert second["checkpoint_bytes"] == delta["held_bytes"], (second, delta)
    assert delta["held_bytes"] == whole["bytes"] + delta["bytes"], delta

    assert server.output(kid, "print(hashlib.sha256(a).hexdigest())").strip() == digest
    # Shut down: nothing of it is left at the agent, kept base included.
    status, _ = server.api("DELETE", f"api/kernels/{kid}")
    assert status == 204, status
    assert eventually(lambda: images(live_agent)["bases"] == [], 30), images(live_agent)
    assert agent_images(live_agent, USER) == []
    stop_user_server(server)
    assert server.criu_runs() == [], server.log_errors()
