"""The server's connection to the checkpoint agent (jupyter_cedana/server/kernel/
checkpoint_agent.py), against a real agent running as root: a request leaves nothing on
its event loop (jupyter_client's tests make and close many), a burst stays within the
agent's share of the uid, /status's probe never waits for the agent on the loop,
`AgentKernel.wait` honours its timeout as Popen's does, the engine is wired once (at the
extension's start, not by a lookup) and the extension's stop ends a probe in flight.

An agent that cannot answer is a real one stopped with SIGSTOP: it holds each request
exactly where the test wants it, until SIGCONT."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from jupyter_cedana.agent.client import AgentClient
from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.server.kernel.agent_kernel import PROBE_TIMEOUT
from jupyter_cedana.server.kernel.checkpoint_agent import (
    CheckpointAgent,
    agent_for,
)

from .conftest import Agent

pytestmark = [pytest.mark.root]

SLEEPER = (["/bin/sleep", "600"], {"PATH": "/usr/bin:/bin"}, "/")


def _sockets() -> set[str]:
    """The sockets this process holds open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                out.add(target)
    return out


@contextlib.contextmanager
def stopped(agent: Agent) -> Iterator[None]:
    """The agent stopped (SIGSTOP): whatever is asked of it waits until it continues."""
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)


def _refreshes() -> list[asyncio.Task[Any]]:
    return [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") == "CheckpointAgent.refresh"
    ]


def test_a_request_leaves_nothing_on_its_event_loop(agent: Agent) -> None:
    """As jupyter_client's tests do: a loop per test, closed without ceremony. Each
    request's connection ends with it: no socket left open, no task left pending on the
    loop (it would be 'destroyed but pending'), nothing for the collector to warn of."""
    ca = CheckpointAgent(socket=str(agent.socket_path))
    for _ in range(3):
        loop = asyncio.new_event_loop()
        try:
            before = _sockets()  # with the loop's own self-pipe
            hello = loop.run_until_complete(ca.call(lambda c: c.hello()))
            assert "dump" in hello["ops"]
            assert loop.run_until_complete(ca.call(lambda c: c.list())) == []
            assert asyncio.all_tasks(loop) == set()
            assert _sockets() == before
        finally:
            loop.close()
    gone = weakref.ref(loop)
    del loop
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught
    assert gone() is None  # nothing of ours holds the closed loop


def test_a_burst_of_requests_stays_within_the_agents_share(agent: Agent) -> None:
    """Each request has a connection of its own, and the agent answers `busy` beyond its
    share of a uid (4 here): a burst larger than that waits for connections, at most
    `connections` at once, and every request is answered."""
    assert agent.limits["max-connections-per-uid"] == 4
    ca = CheckpointAgent(socket=str(agent.socket_path))
    ca.connections = 2
    kid = str(uuid.uuid4())
    hold = 0.5

    async def main() -> float:
        await ca.call(lambda c: c.launch(kid, *SLEEPER))
        try:
            t0 = time.monotonic()
            # Each `wait` holds its connection `hold` seconds (the sleeper runs on).
            codes = await asyncio.gather(*(ca.call(lambda c: c.wait(kid, hold)) for _ in range(8)))
            elapsed = time.monotonic() - t0
            assert codes == [None] * 8
            return elapsed
        finally:
            await ca.call(lambda c: c.signal(kid, signal.SIGKILL))
            assert await ca.call(lambda c: c.wait(kid, 30)) is not None
            await ca.call(lambda c: c.release(kid))

    # 8 holds, 2 at a time: 4 rounds, however the loop interleaves them.
    assert asyncio.run(main()) >= 4 * hold


def test_the_probe_does_not_queue_behind_the_kernels_requests(agent: Agent) -> None:
    """Every slot held by a long request (dumps, a shutdown's waits): the probe still
    gets its answer, instead of 'no answer within 2 s' while the agent works."""
    ca = CheckpointAgent(socket=str(agent.socket_path))
    ca.connections = 2
    kid = str(uuid.uuid4())

    async def main() -> None:
        await ca.call(lambda c: c.launch(kid, *SLEEPER))
        holders = [asyncio.ensure_future(ca.call(lambda c: c.wait(kid, 60))) for _ in range(2)]
        await asyncio.sleep(0)  # each took its slot (free: no wait) and is connecting
        try:
            assert (await ca.refresh()).available
        finally:
            # Not through `ca`: its slots are all taken until the kernel exits.
            async with await AgentClient.connect(str(agent.socket_path)) as c:
                await c.signal(kid, signal.SIGKILL)
            codes = await asyncio.gather(*holders)
            assert all(code is not None for code in codes), codes
            await ca.call(lambda c: c.release(kid))

    asyncio.run(main())


def test_the_probe_never_waits_for_the_agent_on_the_event_loop(agent: Agent) -> None:
    """/status's probe on the server's loop: an answer past its time is given again at
    once, and the agent is asked in the background. Before, the loop waited up to 2 s
    for `hello`, and said 'unavailable' when it did not come."""
    ca = CheckpointAgent(socket=str(agent.socket_path), probe_ttl=0.0)  # always past
    first = ca.probe()  # no loop runs here: asked in place
    assert first.available, first

    async def main() -> None:
        with stopped(agent):
            assert ca.probe() == first  # without waiting for the stopped agent
            assert len(_refreshes()) == 1
            assert ca.probe() == first and len(_refreshes()) == 1  # one at a time
            # The background `hello` gets no answer from the stopped agent within its
            # time; the next probe says so.
            await asyncio.wait(_refreshes(), timeout=PROBE_TIMEOUT + 30)
            late = ca.probe()
            assert not late.available
            assert f"no checkpoint agent answers at {agent.socket_path}" in (late.reason or "")
        assert (await ca.refresh()).available
        await ca.close()

    asyncio.run(main())


def test_a_stop_ends_probing_on_its_loop_only(agent: Agent) -> None:
    """close() at one loop's end (a server's stop, a test's) leaves the next loop's probe
    asking the agent again: a singleton shared by tests is not left stale."""
    ca = CheckpointAgent(socket=str(agent.socket_path), probe_ttl=0.0)

    async def stop() -> None:
        await ca.close()
        ca.probe()
        assert _refreshes() == []  # none started after the stop

    async def next_loop() -> None:
        ca.probe()
        assert len(_refreshes()) == 1
        await asyncio.wait(_refreshes(), timeout=PROBE_TIMEOUT + 30)
        await ca.close()

    asyncio.run(stop())
    asyncio.run(next_loop())


def test_a_loop_with_no_answer_yet_is_not_kept_waiting(agent: Agent) -> None:
    ca = CheckpointAgent(socket=str(agent.socket_path))

    async def main() -> None:
        with stopped(agent):
            info = ca.probe()
            assert not info.available and "has not answered yet" in (info.reason or "")
            await ca.close()  # ends the `hello` in flight
            assert _refreshes() == []
            ca.probe()  # a closed agent asks nothing more in the background
            assert _refreshes() == []

    asyncio.run(main())


def test_the_agents_features_decide_whether_gpu_memory_is_said_checkpointed(
    agent: Agent, tmp_path: Any
) -> None:
    """The agent says in `hello` that it checkpoints GPU memory with its dumps; a server
    on it says so in its status, and on an agent that did not say it (an older one), that
    GPU memory is not checkpointed, and why."""
    from jupyter_cedana.server.limits import Budget, SuspendLimits, TransitionQueue
    from jupyter_cedana.server.status import server_status

    ca = CheckpointAgent(socket=str(agent.socket_path))
    assert ca.features == frozenset()
    assert ca.probe().available
    assert "gpu" in ca.features

    engine = CheckpointEngine(checkpoint_root=str(tmp_path / "root"))
    engine.probe_through = ca.probe
    budget = Budget(lambda: engine.store, lambda: 0, lambda: 0, lambda: ())
    args = (engine, None, budget, TransitionQueue(SuspendLimits()), ca.socket)
    assert server_status(*args, ca.features)["gpu"]["checkpoint"] is True
    older = server_status(*args, frozenset())["gpu"]
    assert older["checkpoint"] is False


def test_wait_honours_its_timeout_as_popen_does(agent: Agent) -> None:
    ca = CheckpointAgent(socket=str(agent.socket_path))
    remote = ca.kernel(str(uuid.uuid4()))
    asyncio.run(remote.launch(*SLEEPER))
    try:
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            remote.wait(0.5)  # the sleeper runs on
        assert time.monotonic() - t0 >= 0.5
        assert remote.poll() is None
    finally:
        asyncio.run(remote.signal(signal.SIGKILL))
        code = remote.wait(30)
        asyncio.run(remote.release())
    assert code == -signal.SIGKILL or code == 128 + signal.SIGKILL, code
    assert remote.poll() == code


def test_agent_for_is_a_lookup_and_the_extension_wires_the_engine(agent: Agent) -> None:
    from jupyter_cedana.server.kernel.checkpoint_agent import use_agent

    CheckpointEngine.clear_instance()
    CheckpointAgent.clear_instance()
    CheckpointAgent.instance(socket=str(agent.socket_path))
    try:
        found = agent_for(None)
        assert found is CheckpointAgent.instance()
        assert CheckpointEngine.instance().probe_through is None  # a lookup changes nothing
        assert use_agent(None) is found
        assert CheckpointEngine.instance().probe_through == found.probe
        assert CheckpointEngine.instance().probe().available
    finally:
        CheckpointEngine.clear_instance()
        CheckpointAgent.clear_instance()


@pytest.fixture
def jp_server_config(agent: Agent, tmp_path: Any) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_cedana": True}},
        "CedanaApp": {"checkpoint_root": str(tmp_path / "checkpoints")},
        "CheckpointAgent": {"socket": str(agent.socket_path)},
        "KernelParking": {"park_on_stop": False},
        "SuspendPolicy": {"idle_timeout": 0, "check_interval": 3600},
    }


async def test_the_extension_wires_the_agent_and_its_stop_ends_a_probe_in_flight(
    jp_serverapp: Any, agent: Agent
) -> None:
    manager = jp_serverapp.extension_manager
    await manager.start_extension("jupyter_cedana")
    ca = CheckpointAgent.instance()
    engine = CheckpointEngine.instance()
    assert engine.probe_through == ca.probe  # wired as the extension started
    # A probe on a running loop never waits for the agent: its first answer comes from
    # the background (which a loaded machine may not have finished), or from asking now.
    assert (await ca.refresh()).available
    if _refreshes():
        await asyncio.wait(_refreshes())
    assert engine.probe().available
    ca.probe_ttl = 0.0
    with stopped(agent):
        assert engine.probe().available  # the last answer; `hello` is in flight
        assert len(_refreshes()) == 1
        await manager.stop_extension("jupyter_cedana", manager.extension_apps["jupyter_cedana"])
        assert _refreshes() == []


def _agent_tasks() -> list[asyncio.Task[Any]]:
    """Tasks of the agent's client (a connection's reader) on this loop."""
    return [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "").startswith("AgentClient.")
    ]


async def test_the_extensions_stop_leaves_nothing_of_the_agent_pending(
    jp_serverapp: Any, agent: Agent
) -> None:
    """What the server asked the agent leaves no reading task on its loop, before and
    after the extension stops: none for the loop's close or the process's exit to
    destroy ('Task was destroyed but it is pending')."""
    manager = jp_serverapp.extension_manager
    await manager.start_extension("jupyter_cedana")
    ca = CheckpointAgent.instance()
    assert await ca.call(lambda c: c.list()) == []
    assert await ca.find(str(uuid.uuid4())) is None
    await manager.stop_extension("jupyter_cedana", manager.extension_apps["jupyter_cedana"])
    assert _agent_tasks() == []
    assert _refreshes() == []
