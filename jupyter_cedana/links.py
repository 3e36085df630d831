"""Whether a websocket's stdin socket is connected to its kernel.

A kernel sends `input_request` on its stdin ROUTER socket, addressed to the client's
identity, and ZMQ silently drops a message to an identity that has not connected (yet).
After a restore every client socket reconnects on its own timer: the gate's nudge proves
shell and IOPub are back, but a held cell calling input(), delivered before stdin is back,
would wait forever for an answer to a prompt that never left the kernel. So each stdin
socket is watched (a ZMQ socket monitor) and the gate waits for it before delivering.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream
from zmq.utils.monitor import parse_monitor_message

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED


class LinkWatch:
    """Follows one connecting socket's handshakes with its peer."""

    def __init__(self, socket: zmq.Socket[Any], connected: bool):
        # `connected`: what the caller knows now. A handshake that completed before the
        # monitor was attached is never reported, but it can only have happened with a
        # running kernel; a suspended one listens on nothing.
        self._up = asyncio.Event()
        if connected:
            self._up.set()
        addr = f"inproc://cedana-monitor-{uuid.uuid4().hex}"
        self._monitor = ZMQStream(socket.get_monitor_socket(_EVENTS, addr))
        self._monitor.on_recv(self._on_event)

    def _on_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._up.set()
        elif event == zmq.EVENT_DISCONNECTED:
            self._up.clear()
        elif event == zmq.EVENT_MONITOR_STOPPED:  # the socket was closed
            self._up.clear()
            self._monitor.close(linger=0)

    @property
    def connected(self) -> bool:
        return self._up.is_set()

    async def wait(self, timeout: float) -> bool:
        """True once the socket is connected; False after `timeout` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._up.wait(), timeout)
        return self._up.is_set()


def watch(stream: Any, connected: bool) -> LinkWatch:
    """The watch of `stream` (a ZMQStream), made on first use. It lives with the stream,
    which jupyter_server may hand on to the next connection of the same session."""
    link: LinkWatch | None = getattr(stream, "_cedana_link", None)
    if link is None:
        link = LinkWatch(stream.socket, connected)
        stream._cedana_link = link
    return link
