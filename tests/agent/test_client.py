"""The agent's client (jupyter_cedana.agent.client): one connection serves many requests,
and a request its caller gives up does not spoil the connection for the others; frames
read by a caller with no event loop (protocol.recv_frame) are checked as the asyncio
reader's are."""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import uuid

import pytest

from jupyter_cedana.agent import protocol
from jupyter_cedana.agent.client import AgentClient
from jupyter_cedana.agent.protocol import AgentError, FrameError

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


def test_a_blocking_reader_checks_frames_as_the_asyncio_one_does() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        obj = {"id": 1, "ok": True, "result": {"text": "é"}}
        a.sendall(protocol.encode(obj, 1024) * 2)
        assert protocol.recv_frame(b, 1024) == obj
        assert protocol.recv_frame(b, 1024) == obj
        # Refused from its header, before a byte of the body is read.
        a.sendall(struct.pack(">I", 2000))
        with pytest.raises(FrameError) as e:
            protocol.recv_frame(b, 1024)
        assert e.value.code == "too_large"
        for body in (b"[1]", b"\xff"):
            a.sendall(struct.pack(">I", len(body)) + body)
            with pytest.raises(FrameError) as e:
                protocol.recv_frame(b, 1024)
            assert e.value.code == "bad_request"
        a.sendall(struct.pack(">I", 10) + b"{}")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match="inside a frame"):
            protocol.recv_frame(b, 1024)
    a, b = socket.socketpair()
    with a, b:
        a.close()
        assert protocol.recv_frame(b, 1024) is None  # a clean end between frames


def test_replies_are_read_by_the_protocol_module() -> None:
    assert protocol.result_of({"id": 1, "ok": True, "result": {"pid": 3}}) == {"pid": 3}
    with pytest.raises(AgentError) as e:
        protocol.result_of({"id": 1, "ok": False, "error": {"code": "busy", "message": "full"}})
    assert (e.value.code, e.value.message) == ("busy", "full")
    # A code this side does not know (a newer agent's) is `failed`, not a crash.
    error = protocol.error_of({"id": None, "error": {"code": "new_code", "message": "m"}})
    assert (error.code, error.message) == ("failed", "m")
