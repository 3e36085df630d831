"""Whether a websocket's stdin socket is connected to its kernel.

A kernel sends `input_request` on its stdin ROUTER socket, addressed to the client's
identity, and ZMQ silently drops a message to an identity that has not connected (yet).
After a restore every client socket reconnects on its own timer: the gate's nudge proves
shell and IOPub are back, but a held cell calling input(), delivered before stdin is back,
would wait forever for an answer to a prompt that never left the kernel.

So the stdin socket of a gated connection is connected with ZMQ_IMMEDIATE: its pipe to
the kernel exists only while a connection is complete, and the socket is writable
(POLLOUT) exactly then. (A ZMQ socket monitor would say the same, but libzmq's I/O thread
sends monitor events with a blocking send: one monitor not read blocks every socket of
the context.)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq

# ZMQ retries a connection every 0.1 s; this is how often we look.
_POLL_SECONDS = 0.02


def immediate(stream: Any) -> None:
    """Reconnect a just-connected stdin stream with ZMQ_IMMEDIATE (an option that only
    applies to connections made after it is set)."""
    sock: zmq.Socket[Any] = stream.socket
    url = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.disconnect(url)
    sock.immediate = True
    sock.connect(url)


def connected(stream: Any) -> bool:
    sock = stream.socket
    if sock is None or sock.closed:
        return False
    events = sock.get(zmq.EVENTS)
    # Reading EVENTS can consume the wakeup (edge) the stream's own loop waits for: hand
    # whatever is pending to the stream's callbacks now, as its loop would have.
    flag = (zmq.POLLIN if stream.receiving() else 0) | (zmq.POLLOUT if stream.sending() else 0)
    if events & flag:
        stream.flush(events & flag)
    return bool(events & zmq.POLLOUT)


async def wait_connected(stream: Any, timeout: float) -> bool:
    """True once `stream` (made `immediate`) is connected; False after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not connected(stream):
        if stream.closed() or time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_SECONDS)
    return True
