"""The kernel websocket connection of jupyter_server with the message gate (gate.py) in
front of it: messages from the client go through the gate; a suspended kernel's
websocket opens without waiting for the kernel, and its IOPub and stdin channels are
checked again after every restore.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, Protocol

from jupyter_client.jsonutil import json_default
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from . import links
from .replies import Message, ReplyCache


class Gate(Protocol):
    """What a connection asks of the message gate (gate.py's MessageGate). Declared here
    so that the gate depends on the connection and not the other way round."""

    log: Any
    replies: ReplyCache

    def watch(self, kernel_id: str) -> None: ...
    def connecting(self, conn: GatedWebsocketConnection, now: bool) -> None: ...
    def closed_to(self, kernel_id: str) -> bool: ...
    async def unless_suspended(
        self, kernel_id: str, work: Awaitable[Any], cancel: bool
    ) -> bool: ...
    def refresh_later(self, kernel_id: str) -> None: ...
    def incoming(self, conn: GatedWebsocketConnection, raw: Any) -> None: ...
    def observes(self, kernel_id: str, msg_type: str) -> bool: ...
    def from_kernel(self, kernel_id: str, msg: dict[str, Any]) -> None: ...


V1 = "v1.kernel.websocket.jupyter.org"
# ZMQ reconnects every 0.1 s; a stdin socket not back by then is stuck for another reason.
STDIN_RECONNECT_TIMEOUT = 10.0


class GatedWebsocketConnection(ZMQChannelsWebsocketConnection):
    """jupyter_server's websocket connection, with messages to suspended kernels gated."""

    @property
    def gate(self) -> Gate | None:
        handler = self.websocket_handler
        settings = getattr(handler, "settings", None) or {}
        return settings.get("cedana_gate")

    async def prepare(self) -> None:
        gate = self.gate
        if gate is None:
            await super().prepare()
            return
        gate.watch(self.kernel_id)
        gate.connecting(self, True)
        try:
            # A suspended kernel cannot answer kernel_info: opening a notebook must not
            # wait for it, nor resume it (the client's own kernel_info is answered). The
            # server's own request, if the kernel leaves meanwhile, finishes on its own.
            if gate.closed_to(self.kernel_id) or not await gate.unless_suspended(
                self.kernel_id, super().prepare(), cancel=False
            ):
                await self._register_session()
                self.session.key = self.kernel_manager.session.key
        except BaseException:
            gate.connecting(self, False)
            raise

    def create_stream(self) -> None:
        super().create_stream()
        stdin = self.channels.get("stdin")
        if self.gate is not None and stdin is not None:
            links.immediate(stdin)

    async def stdin_ready(self, timeout: float | None = None) -> None:
        """Wait until this connection's stdin socket is connected to the kernel (links.py)."""
        timeout = STDIN_RECONNECT_TIMEOUT if timeout is None else timeout
        stdin = self.channels.get("stdin")
        if stdin is None or stdin.closed() or await links.wait_connected(stdin, timeout):
            return
        self.log.warning(
            "The stdin channel of a client of kernel %s did not reconnect in %ss: "
            "an input() prompt may not reach it",
            self.kernel_id,
            timeout,
        )

    def nudge(self) -> asyncio.Future[None]:
        gate = self.gate
        if gate is None:
            return super().nudge()
        return asyncio.ensure_future(self._nudge_unless_suspended(gate))

    async def _nudge_unless_suspended(self, gate: Gate) -> None:
        kid = self.kernel_id
        try:
            if not gate.closed_to(kid):
                if not await gate.unless_suspended(kid, super().nudge(), cancel=True):
                    gate.log.info("Kernel %s left running while a client connected", kid)
                elif not gate.replies.knows(kid):
                    gate.refresh_later(kid)
        finally:
            gate.connecting(self, False)

    async def confirm_iopub(self) -> bool:
        """Nudge until this connection's IOPub delivers, then subscribe it again (nudge
        takes over the IOPub stream's callback while it runs). False if the kernel left
        `running` meanwhile."""
        gate = self.gate
        nudged = ZMQChannelsWebsocketConnection.nudge(self)
        confirmed = gate is None or await gate.unless_suspended(self.kernel_id, nudged, True)
        iopub = self.channels.get("iopub")
        if iopub is not None and not iopub.closed():
            iopub.on_recv_stream(self.handle_outgoing_message)
        return confirmed

    def disconnect(self) -> None:  # type: ignore[override]
        gate = self.gate
        if gate is not None:
            gate.connecting(self, False)
        super().disconnect()

    def handle_incoming_message(self, incoming_msg: Any) -> None:
        gate = self.gate
        if gate is None or not self.channels:
            super().handle_incoming_message(incoming_msg)
            return
        gate.incoming(self, incoming_msg)

    def send_to_kernel(self, msg: Message) -> bool:
        """What jupyter_server does with a client message, from the parsed message (the
        websocket may have closed since it was held)."""
        stream = self.channels.get(msg.channel)
        if stream is None or stream.closed():
            self.log.debug("No open %r channel for a %s", msg.channel, msg.msg_type)
            return False
        allowed = self.multi_kernel_manager.allowed_message_types
        if allowed and msg.msg_type not in allowed:
            self.log.warning('Received message of type "%s", which is not allowed.', msg.msg_type)
            return False
        if msg.parts is not None:
            self.session.send_raw(stream, msg.parts)
        elif msg.body is not None:
            self.session.send(stream, msg.body)
        return True

    def handle_outgoing_message(self, stream: Any, outgoing_msg: list[Any]) -> None:
        gate = self.gate
        if gate is not None:
            try:
                parts = self.session.feed_identities(outgoing_msg)[1]
                header = self.session.unpack(parts[1])
                if gate.observes(self.kernel_id, header.get("msg_type", "")):
                    msg = {
                        "header": header,
                        "parent_header": self.session.unpack(parts[2]),
                        "metadata": self.session.unpack(parts[3]),
                        "content": self.session.unpack(parts[4]),
                    }
                    gate.from_kernel(self.kernel_id, msg)
            except Exception as e:
                self.log.debug("cedana gate: unreadable kernel message: %s", e)
        super().handle_outgoing_message(stream, outgoing_msg)

    def parse(self, ws_msg: Any) -> Message:
        """A client frame's channel and header, its content read when needed (ValueError if
        malformed)."""
        try:
            if self.subprotocol == V1:
                # The frame's first word counts its offsets: check it before trusting it.
                count = int.from_bytes(ws_msg[:8], "little")
                if not 6 <= count <= len(ws_msg) // 8:
                    raise ValueError(f"{count} offsets in a frame of {len(ws_msg)} bytes")
                channel, parts = deserialize_msg_from_ws_v1(ws_msg)
                header = self.session.unpack(parts[0])
                body = None
            else:
                body = (
                    deserialize_binary_message(ws_msg)
                    if isinstance(ws_msg, bytes)
                    else json.loads(ws_msg)
                )
                channel, header, parts = body.pop("channel", None), body["header"], None
            if not isinstance(header, dict):
                raise TypeError("the header must be an object")
            return Message(str(channel or "shell"), header, parts, body, self.session.unpack)
        except Exception as e:
            raise ValueError(f"{type(e).__name__}: {e}") from e

    def write_all(self, msgs: list[tuple[str, dict[str, Any]]]) -> None:
        for channel, msg in msgs:
            if self.subprotocol == V1:
                frame = serialize_msg_to_ws_v1(msg, channel, self.session.pack)
                self.write_message(frame, binary=True)
            else:
                self.write_message(json.dumps({**msg, "channel": channel}, default=json_default))

    def _fallback(self) -> tuple[str, str]:
        return self.session.username, self.session.session

    def send_status(self, state: str) -> None:
        gate = self.gate
        assert gate is not None
        content = {"execution_state": state}
        status = gate.replies.compose(self.kernel_id, "status", None, content, self._fallback())
        self.write_all([("iopub", status)])

    def refuse(self, msg: Message, reason: str) -> None:
        """Answer a held request that cannot be delivered, so the client does not wait
        forever: an error reply for requests, and the kernel back to idle."""
        self.answer_error(msg, f"The kernel could not be resumed: {reason}", "KernelResumeError")

    def answer_error(self, msg: Message, text: str, ename: str) -> None:
        """Answer a request in the kernel's name with an error (on IOPub too, for a cell),
        and the kernel back to idle."""
        gate = self.gate
        assert gate is not None
        replies = gate.replies.refusal(self.kernel_id, msg, text, self._fallback(), ename)
        self.write_all(replies)

    def notice(self, msg: Message, text: str) -> None:
        """Show `text` in the output of the cell `msg` (stderr, in the kernel's name)."""
        gate = self.gate
        assert gate is not None
        content = {"name": "stderr", "text": text + "\n"}
        stream = gate.replies.compose(self.kernel_id, "stream", msg, content, self._fallback())
        self.write_all([("iopub", stream)])
