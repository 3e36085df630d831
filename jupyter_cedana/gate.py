"""Message gate: messages that clients send to a suspended kernel are answered from what
the kernel said before (replies.py), held, or held and the kernel resumed; once it runs
and IOPub is confirmed live on every connection, the held messages are delivered in
order. Without it, output published right after a restore is lost while the clients'
SUB sockets reconnect (ZMQ's slow joiner), and every reconnect would wake the kernel.

A suspend never strands a connection: a websocket that is still connecting (jupyter_server
nudges the kernel with kernel_info requests inside `open()`) stops waiting when the
kernel leaves `running`, and is checked again like every other once the kernel is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from collections.abc import Awaitable
from typing import Any

from jupyter_client.jsonutil import json_default
from jupyter_server._tz import utcnow
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from . import links
from .errors import CedanaError
from .replies import WAKE, Message, ReplyCache, disposition

V1 = "v1.kernel.websocket.jupyter.org"
KERNEL_ACTIONS = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"
# A delivered request keeps the policy off the kernel until the kernel is idle again for
# it, or for this long (then the kernel's own busy state, if it still runs it, does).
DELIVERY_GRACE_SECONDS = 30.0
# ZMQ reconnects every 0.1 s; a stdin socket not back by then is stuck for another reason.
STDIN_RECONNECT_TIMEOUT = 10.0
Held = tuple["GatedWebsocketConnection", Message]
# Kernel messages the reply cache learns from.
_CACHED = frozenset({"kernel_info_reply", "comm_info_reply", "comm_open", "comm_close"})


def touch(kernel_manager: Any, kernel_id: str) -> None:
    """Record activity a person caused (e.g. a resume): the idle countdown starts again."""
    with contextlib.suppress(KeyError):
        kernel_manager.get_kernel(kernel_id).last_activity = now = utcnow()
        kernel_manager.last_kernel_activity = now


class MessageGate:
    """Per-kernel queues of held messages, the task that releases them, and the cache of
    what each kernel said."""

    def __init__(self, manager: Any, log: Any):
        self.manager = manager
        self.log = log
        self.replies = ReplyCache()
        self._held: dict[str, list[Held]] = {}
        self._releasing: dict[str, asyncio.Task[None]] = {}
        self._wake: set[str] = set()  # kernels with a held message a person sent
        self._delivered: dict[str, dict[str, float]] = {}  # kid -> msg_id -> delivered at
        # Clients whose websocket is opening (weakly: a handshake may end without close).
        self._connecting: dict[str, weakref.WeakKeyDictionary[Any, float]] = {}
        self._left_running: dict[str, set[asyncio.Future[None]]] = {}
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._closed = False

    @property
    def kernel_manager(self) -> Any:
        return self.manager.kernel_manager

    def state(self, kernel_id: str) -> str:
        return str(self.manager.state_of(kernel_id))

    def closed_to(self, kernel_id: str) -> bool:
        return (
            kernel_id in self._releasing
            or bool(self._held.get(kernel_id))
            or self.state(kernel_id) != "running"
        )

    def busy(self, kernel_id: str) -> bool:
        """Whether the policy must leave the kernel alone: messages are held for it, being
        delivered or not yet answered, or a client is still connecting to it."""
        cutoff = time.monotonic() - DELIVERY_GRACE_SECONDS
        delivered = self._expire(self._delivered.get(kernel_id) or {})
        connecting: Any = self._connecting.get(kernel_id) or {}
        return bool(
            self._held.get(kernel_id)
            or kernel_id in self._releasing
            or delivered
            or any(t >= cutoff for t in list(connecting.values()))
        )

    @staticmethod
    def _expire(delivered: dict[str, float]) -> dict[str, float]:
        cutoff = time.monotonic() - DELIVERY_GRACE_SECONDS
        for msg_id in [m for m, t in delivered.items() if t < cutoff]:
            delivered.pop(msg_id)
        return delivered

    def connecting(self, conn: GatedWebsocketConnection, now: bool) -> None:
        clients = self._connecting.setdefault(conn.kernel_id, weakref.WeakKeyDictionary())
        if now:
            clients[conn] = time.monotonic()
        else:
            clients.pop(conn, None)

    # -- kernel state ---------------------------------------------------------------------

    def watch(self, kernel_id: str) -> None:
        """Follow the state of a kernel's provisioner (once per provisioner)."""
        with contextlib.suppress(KeyError):
            prov = self.kernel_manager.get_kernel(kernel_id).provisioner
            if prov is not None and hasattr(prov, "add_listener") and prov not in self._watched:
                self._watched.add(prov)
                prov.add_listener(self._on_state)
                prov.add_suspend_hook(self.replies.before_suspend)

    def _on_state(self, prov: Any, what: str) -> None:
        if what != "state":
            return
        kid = str(prov.kernel_id)
        if prov.state.value != "running":
            for fut in self._left_running.pop(kid, set()):
                if not fut.done():
                    fut.set_result(None)
        elif getattr(prov.parent, "shutting_down", False):
            # Discarded for a shutdown or restart: held requests have no kernel to go to.
            if self._held.get(kid) and kid not in self._releasing:
                self._refuse_all(kid, "the kernel was shut down or restarted")
        elif self._held.get(kid):
            # Resumed by anyone: what waited goes now.
            self.release(kid)

    async def unless_suspended(self, kernel_id: str, work: Awaitable[Any], cancel: bool) -> bool:
        """Await `work` unless the kernel leaves `running` first: then False, and `work`
        is cancelled, or (cancel=False) left to finish in the background."""
        task = asyncio.ensure_future(work)
        left: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._left_running.setdefault(kernel_id, set()).add(left)
        if self.state(kernel_id) != "running":
            left.set_result(None)
        try:
            await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                return True
            if not cancel:
                self._background(task)
                return False
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return False
        finally:
            self._left_running.get(kernel_id, set()).discard(left)
            left.cancel()

    async def on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        """jupyter_server's kernel action events: a (re)started kernel is a new process."""
        kid = data.get("kernel_id")
        if not kid or data.get("status") != "success":
            return
        if data.get("action") in ("start", "restart", "shutdown"):
            self.replies.forget(kid, data["action"])
            self._delivered.pop(kid, None)
        if data.get("action") == "shutdown":
            self._held.pop(kid, None)
            self._wake.discard(kid)
        if data.get("action") == "restart":
            touch(self.kernel_manager, kid)  # a person restarted it: not idle since
        if data.get("action") in ("start", "restart"):
            self.watch(kid)
            self._background(self.refresh(kid))

    async def refresh(self, kernel_id: str, timeout: float = 60.0) -> None:
        """Have the reply cache ask a running kernel what it is (not once it is gone)."""
        with contextlib.suppress(KeyError, asyncio.TimeoutError):
            km = self.kernel_manager.get_kernel(kernel_id)
            work = self.replies.ask(kernel_id, km, timeout)
            await self.unless_suspended(kernel_id, work, cancel=True)

    async def close(self) -> None:
        """Stop the gate's own background work (the server is stopping)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _background(self, work: Awaitable[Any]) -> None:
        if self._closed:
            if asyncio.iscoroutine(work):
                work.close()
            return
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.debug("cedana gate: background work failed: %s", task.exception())

    # -- messages -------------------------------------------------------------------------

    def incoming(self, conn: GatedWebsocketConnection, raw: Any) -> None:
        kid = conn.kernel_id
        try:
            msg = conn.parse(raw)
        except Exception as e:
            self.log.warning("Dropping a malformed message for kernel %s: %s", kid, e)
            return
        if not self.closed_to(kid):
            self.deliver(conn, msg)
            return
        state = self.state(kid)
        if state != "running" and kid not in self._wake:
            answer = self.replies.answer(kid, msg)
            if answer is not None:
                self.log.debug("Answered %s for %s kernel %s", msg.msg_type, state, kid)
                conn.write_all(answer)
                return
        self._held.setdefault(kid, []).append((conn, msg))
        if disposition(msg) == WAKE:
            if kid not in self._wake and state != "running":
                self.log.info("%s for %s kernel %s: resuming it", msg.msg_type, state, kid)
            self._wake.add(kid)
            self.release(kid)
        elif state == "running":
            self.release(kid)
        else:
            self.log.debug("Holding %s for %s kernel %s", msg.msg_type, state, kid)

    def deliver(self, conn: GatedWebsocketConnection, msg: Message) -> None:
        """Send to the kernel; until the kernel is idle again for it, busy() is true (a
        kernel frozen with a request in flight could lose it)."""
        if not conn.send_to_kernel(msg):
            return
        kid = conn.kernel_id
        self.replies.from_client(kid, msg)
        # Probes (kernel_info on every reconnect...) are not activity, nor worth a delay.
        if msg.channel != "stdin" and self.kernel_manager.track_message_type(msg.msg_type):
            delivered = self._delivered.setdefault(kid, {})
            delivered[msg.msg_id] = time.monotonic()
            if len(delivered) > 256:
                self._expire(delivered)

    def observes(self, kernel_id: str, msg_type: str) -> bool:
        """Whether a kernel message of this type tells the gate something."""
        return msg_type in _CACHED or (
            msg_type == "status" and bool(self._delivered.get(kernel_id))
        )

    def from_kernel(self, kernel_id: str, msg: dict[str, Any]) -> None:
        """A message from the kernel to a client: note what it tells, and what it answers."""
        self.replies.from_kernel(kernel_id, msg)
        delivered = self._delivered.get(kernel_id)
        if delivered and msg["content"].get("execution_state") == "idle":
            delivered.pop(msg["parent_header"].get("msg_id", ""), None)

    def release(self, kernel_id: str) -> None:
        """Resume if needed and deliver what is held."""
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
            self._status(kid, "busy")
            while True:
                await self.manager.ensure_running(kid)
                if kid in self._wake:
                    touch(self.kernel_manager, kid)
                # A client still connecting has its IOPub checked by its own nudge.
                connecting: Any = self._connecting.get(kid) or {}
                conns = [c for c in self.connections(kid) if c not in connecting]
                results = await asyncio.gather(
                    *(c.confirm_iopub() for c in conns), return_exceptions=True
                )
                for result in results:
                    if isinstance(result, BaseException):
                        self.log.warning("IOPub of a client of kernel %s: %s", kid, result)
                # The kernel asks for input() on stdin, which the nudge does not prove.
                await asyncio.gather(*(c.stdin_ready() for c in self.connections(kid)))
                # Delivery below is synchronous: a suspend that has not begun by now
                # begins after the messages are on their way, and busy() holds the policy.
                if self.state(kid) == "running" and not self.manager.transition_pending(kid):
                    break
                self.log.info("Kernel %s is being suspended again: resuming it first", kid)
        except asyncio.CancelledError:
            # The resume was cancelled (a shutdown, a restart, a timeout), or this task.
            self._refuse_all(kid, "the resume was cancelled")
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return
        except Exception as e:
            self._refuse_all(kid, e.message if isinstance(e, CedanaError) else str(e))
            return
        finally:
            self._releasing.pop(kid, None)
        held = self._held.pop(kid, [])
        self._wake.discard(kid)
        self._status(kid, "idle")
        self.log.info("Kernel %s runs: delivering %d held messages", kid, len(held))
        for conn, msg in held:
            try:
                self.deliver(conn, msg)
            except Exception:
                self.log.exception("Could not deliver a held %s to kernel %s", msg.msg_type, kid)

    def _refuse_all(self, kid: str, reason: str) -> None:
        """Answer every held request of every connection, so that no client waits."""
        self.log.error("Could not resume kernel %s for held messages: %s", kid, reason)
        held = self._held.pop(kid, [])
        self._wake.discard(kid)
        for conn, msg in held:
            try:
                conn.refuse(msg, reason)
            except Exception as e:  # a closed websocket must not keep the others waiting
                self.log.debug("Could not answer a held %s: %s", msg.msg_type, e)
        self._status(kid, "idle")

    def _status(self, kid: str, state: str) -> None:
        for conn in self.connections(kid):
            with contextlib.suppress(Exception):
                conn.send_status(state)


class GatedWebsocketConnection(ZMQChannelsWebsocketConnection):
    """jupyter_server's websocket connection, with messages to suspended kernels gated."""

    @property
    def gate(self) -> MessageGate | None:
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

    async def stdin_ready(self, timeout: float = STDIN_RECONNECT_TIMEOUT) -> None:
        """Wait until this connection's stdin socket is connected to the kernel (links.py)."""
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

    async def _nudge_unless_suspended(self, gate: MessageGate) -> None:
        kid = self.kernel_id
        try:
            if not gate.closed_to(kid):
                if not await gate.unless_suspended(kid, super().nudge(), cancel=True):
                    gate.log.info("Kernel %s left running while a client connected", kid)
                elif not gate.replies.knows(kid):
                    gate._background(gate.refresh(kid))
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
        gate = self.gate
        assert gate is not None
        text = f"The kernel could not be resumed: {reason}"
        self.write_all(gate.replies.refusal(self.kernel_id, msg, text, self._fallback()))
