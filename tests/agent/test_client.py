"""The agent's client (jupyter_cedana.agent.client): one connection serves many requests,
and a request its caller gives up does not spoil the connection for the others."""

from __future__ import annotations

import asyncio
import signal
import uuid

import pytest

from jupyter_cedana.agent.client import AgentClient

from .conftest import Agent

pytestmark = [pytest.mark.root]


def test_a_cancelled_request_leaves_the_connection_usable(agent: Agent) -> None:
    async def main() -> None:
        kid = str(uuid.uuid4())
        async with await AgentClient.connect(str(agent.socket_path)) as c:
            await c.launch(kid, ["/bin/sleep", "600"], {"PATH": "/usr/bin:/bin"}, "/")
            try:
                # Given up at 0.3 s: the agent answers it at 2 s all the same.
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(c.wait(kid, 2), 0.3)
                # Answered after the abandoned one's reply has come in.
                assert await c.wait(kid, 2.5) is None
                assert not c.closed
                assert [k["kernel_id"] for k in await c.list()] == [kid]
            finally:
                await c.signal(kid, signal.SIGKILL)
                assert await c.wait(kid, 30) is not None
                await c.release(kid)

    asyncio.run(main())
