"""Message gate: messages that clients send to a suspended kernel are held in the server,
the kernel is resumed, IOPub is confirmed live on every connection, and then the held
messages are delivered in order. Without it, output published right after a restore is
lost while the clients' SUB sockets reconnect (ZMQ's slow joiner).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_client.jsonutil import json_default
from jupyter_server.services.kernels.connection.base import serialize_msg_to_ws_v1
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from .errors import CedanaError

V1 = "v1.kernel.websocket.jupyter.org"
# Requests JupyterLab sends by itself (the debugger probes a kernel whenever a notebook
# gets focus; resource monitors poll): held until the kernel resumes for a reason a person
# gave, instead of waking it up.
PASSIVE = frozenset({"debug_request", "usage_request"})


class MessageGate:
    """Per-kernel queues of held messages and the task that releases them."""

    def __init__(self, manager: Any, log: Any):
        self.manager = manager
        self.log = log
        self._held: dict[str, list[tuple[GatedWebsocketConnection, Any]]] = {}
        self._releasing: dict[str, asyncio.Task[None]] = {}

    def closed_to(self, kernel_id: str) -> bool:
        return (
            kernel_id in self._releasing
            or bool(self._held.get(kernel_id))
            or self.manager.state_of(kernel_id) in ("suspending", "suspended", "resuming", "failed")
        )

    def hold(self, conn: GatedWebsocketConnection, message: Any) -> None:
        kid = conn.kernel_id
        self._held.setdefault(kid, []).append((conn, message))
        if kid in self._releasing:
            return
        try:
            kind = conn._parse(message)[1]["header"]["msg_type"]
        except Exception:
            kind = "unknown"
        if kind in PASSIVE and self.manager.state_of(kid) != "running":
            self.log.debug("Holding %s for suspended kernel %s until it resumes", kind, kid)
            return
        self.log.info("%s for suspended kernel %s: resuming it", kind, kid)
        self.release(kid)

    def release(self, kernel_id: str) -> None:
        """Resume if needed and deliver what is held (also called after any resume)."""
        if self._held.get(kernel_id) and kernel_id not in self._releasing:
            self._releasing[kernel_id] = asyncio.ensure_future(self._release(kernel_id))

    def connections(self, kernel_id: str) -> list[GatedWebsocketConnection]:
        return [
            c
            for c in list(ZMQChannelsWebsocketConnection._open_sockets)
            if isinstance(c, GatedWebsocketConnection) and c.kernel_id == kernel_id and c.channels
        ]

    async def _release(self, kid: str) -> None:
        try:
            for conn in self.connections(kid):
                conn._send_status_message("busy")
            await self.manager.ensure_running(kid)
            await asyncio.gather(*(c.confirm_iopub() for c in self.connections(kid)))
        except Exception as e:
            message = e.message if isinstance(e, CedanaError) else str(e)
            self.log.error("Could not resume kernel %s for held messages: %s", kid, message)
            held = self._held.pop(kid, [])
            del self._releasing[kid]
            for conn, msg in held:
                conn.refuse(msg, message)
            return
        # Deliver synchronously, so that nothing arriving meanwhile can overtake the queue.
        held = self._held.pop(kid, [])
        del self._releasing[kid]
        self.log.info("Kernel %s resumed: delivering %d held messages", kid, len(held))
        for conn, msg in held:
            if conn.channels:
                ZMQChannelsWebsocketConnection.handle_incoming_message(conn, msg)


class GatedWebsocketConnection(ZMQChannelsWebsocketConnection):
    """jupyter_server's websocket connection, with messages to suspended kernels gated."""

    @property
    def gate(self) -> MessageGate | None:
        handler = self.websocket_handler
        settings = getattr(handler, "settings", None) or {}
        return settings.get("cedana_gate")

    def _gated(self) -> bool:
        gate = self.gate
        return gate is not None and gate.closed_to(self.kernel_id)

    async def prepare(self) -> None:
        if not self._gated():
            await super().prepare()
            return
        # A suspended kernel cannot answer kernel_info: opening a notebook must not wait
        # for it (nor resume it; only a message from the user does).
        await self._register_session()
        self.session.key = self.kernel_manager.session.key

    def nudge(self) -> asyncio.Future[None]:
        if self._gated():
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return super().nudge()

    async def confirm_iopub(self) -> None:
        """Nudge until this connection's IOPub delivers, then subscribe it again (nudge
        takes over the IOPub stream's callback while it runs)."""
        await ZMQChannelsWebsocketConnection.nudge(self)
        iopub = self.channels.get("iopub")
        if iopub is not None and not iopub.closed():
            iopub.on_recv_stream(self.handle_outgoing_message)

    def handle_incoming_message(self, incoming_msg: Any) -> None:
        gate = self.gate
        if gate is not None and self.channels and gate.closed_to(self.kernel_id):
            gate.hold(self, incoming_msg)
            return
        super().handle_incoming_message(incoming_msg)

    def _parse(self, ws_msg: Any) -> tuple[str, dict[str, Any]]:
        if self.subprotocol == V1:
            from jupyter_server.services.kernels.connection.base import (
                deserialize_msg_from_ws_v1,
            )

            channel, msg_list = deserialize_msg_from_ws_v1(ws_msg)
            return channel or "shell", {"header": self.session.unpack(msg_list[0])}
        msg = json.loads(ws_msg) if isinstance(ws_msg, str) else {}
        return msg.get("channel") or "shell", msg

    def _write(self, msg: dict[str, Any], channel: str) -> None:
        if self.subprotocol == V1:
            self.write_message(serialize_msg_to_ws_v1(msg, channel, self.session.pack), binary=True)
        else:
            msg["channel"] = channel
            self.write_message(json.dumps(msg, default=json_default))

    def refuse(self, ws_msg: Any, reason: str) -> None:
        """Answer a held request that cannot be delivered, so the client does not wait
        forever: an error reply for requests, and the kernel back to idle."""
        try:
            channel, msg = self._parse(ws_msg)
            header = msg.get("header") or {}
        except Exception:
            return
        text = f"The kernel could not be resumed: {reason}"
        msg_type = str(header.get("msg_type", ""))
        if msg_type.endswith("_request"):
            content: dict[str, Any] = {
                "status": "error",
                "ename": "KernelResumeError",
                "evalue": text,
                "traceback": [text],
            }
            if msg_type == "execute_request":
                content["execution_count"] = None
            reply = self.session.msg(msg_type.replace("_request", "_reply"), content, parent=header)
            if msg_type == "execute_request":
                err = self.session.msg(
                    "error",
                    {k: content[k] for k in ("ename", "evalue", "traceback")},
                    parent=header,
                )
                self._write(err, "iopub")
            self._write(reply, channel)
        idle = self.session.msg("status", {"execution_state": "idle"}, parent=header)
        self._write(idle, "iopub")
