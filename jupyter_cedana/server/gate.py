"""Message gate: messages that clients send to a suspended kernel are answered from what
the kernel said before (replies.py), held, or held and the kernel resumed; once it runs
and IOPub is confirmed live on every connection, the held messages are delivered in
order. Without it, output published right after a restore is lost while the clients'
SUB sockets reconnect (ZMQ's slow joiner), and every reconnect would wake the kernel.

A suspend never strands a connection: a websocket that is still connecting (jupyter_server
nudges the kernel with kernel_info requests inside `open()`) stops waiting when the
kernel leaves `running`, and is checked again like every other once the kernel is back.

A lazily restored kernel runs before its memory is all in; if the rest cannot be loaded
it is killed and goes to `failed`. Every request it had been given and not answered then
gets an error reply in its name (on IOPub too, for a cell), saying what was lost; the
first cell run after the next resume, which goes back to the image taken at the suspend,
shows the same in its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from ..errors import CedanaError
from .replies import WAKE, Message, ReplyCache, disposition
from .websocket import Gate, GatedWebsocketConnection

KERNEL_ACTIONS = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"
# A delivered request keeps the policy off the kernel until the kernel is idle again for
# it, or for this long (then the kernel's own busy state, if it still runs it, does).
DELIVERY_GRACE_SECONDS = 30.0
Held = tuple[GatedWebsocketConnection, Message]
# Kernel messages the reply cache learns from.
_CACHED = frozenset({"kernel_info_reply", "comm_info_reply", "comm_open", "comm_close"})
# The requests given to a kernel and not yet answered that the gate keeps, per kernel; a
# client that never reads a reply (or a kernel that ignores a request) must not grow it.
MAX_UNANSWERED = 1024


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
        # kid -> msg_id -> requests given to the kernel since its last resume, unanswered.
        self._unanswered: dict[str, dict[str, Held]] = {}
        # kid -> what the first cell after a resume from an older image shows.
        self._notices: dict[str, str] = {}
        # Clients whose websocket is opening (weakly: a handshake may end without close).
        self._connecting: dict[str, weakref.WeakKeyDictionary[Any, float]] = {}
        self._left_running: dict[str, set[asyncio.Future[None]]] = {}
        # Kernels being resumed: once running, their clients' IOPub is confirmed before
        # anything more reaches them, whoever resumed them.
        self._resuming: set[str] = set()
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
        """Whether the policy must leave the kernel alone: a person's message is held for
        it, messages are being delivered or not yet answered, or a client is still
        connecting to it. Passive messages held for a suspended kernel (a debugger probe)
        wait for its next run whatever tier it is in: they do not keep an offloaded kernel
        from moving to disk."""
        cutoff = time.monotonic() - DELIVERY_GRACE_SECONDS
        delivered = self._expire(self._delivered.get(kernel_id) or {})
        connecting: Any = self._connecting.get(kernel_id) or {}
        held = bool(self._held.get(kernel_id)) and (
            kernel_id in self._wake or self.state(kernel_id) == "running"
        )
        return bool(
            held
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
            if prov.state.value == "resuming":
                self._resuming.add(kid)
            else:
                self._resuming.discard(kid)
            if prov.state.value == "failed":
                self._answer_unanswered(kid, prov.reason or "the kernel failed")
            elif prov.state.value in ("resuming", "suspending"):
                # What a kernel was given before its suspend was answered (the policy
                # waits for it); the notice is about the image being replaced.
                self._unanswered.pop(kid, None)
                self._notices.pop(kid, None)
        elif getattr(prov.parent, "shutting_down", False):
            self._resuming.discard(kid)
            # Discarded for a shutdown or restart: held requests have no kernel to go to.
            if self._held.get(kid) and kid not in self._releasing:
                self._refuse_all(kid, "the kernel was shut down or restarted")
        else:
            if getattr(prov, "work_lost_after", None) is not None and prov.reason:
                self._notices[kid] = str(prov.reason)  # resumed from an older image
            resumed = kid in self._resuming
            self._resuming.discard(kid)
            if self._held.get(kid):
                # Resumed by anyone: what waited goes now.
                self.release(kid)
            elif resumed and kid not in self._releasing and self.connections(kid):
                # Resumed with nothing held (REST, the sidebar, the CLI): each client's
                # IOPub reconnects on its own, later than the kernel runs. Until it is
                # back, what clients send is held, or the output of a cell sent at once
                # would be published to nobody.
                self._releasing[kid] = asyncio.ensure_future(self._release(kid, announce=False))

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
            self._unanswered.pop(kid, None)
            self._notices.pop(kid, None)
        if data.get("action") == "shutdown":
            self._held.pop(kid, None)
            self._wake.discard(kid)
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

    def refresh_later(self, kernel_id: str) -> None:
        """Refresh what the reply cache knows of a kernel, in the background."""
        self._background(self.refresh(kernel_id))

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
        kid = conn.kernel_id
        notice = self._notices.pop(kid, None) if msg.msg_type == "execute_request" else None
        if notice is not None:
            with contextlib.suppress(Exception):
                conn.notice(msg, notice)
        if not conn.send_to_kernel(msg):
            return
        self.replies.from_client(kid, msg)
        if msg.channel != "stdin" and msg.msg_type.endswith("_request"):
            unanswered = self._unanswered.setdefault(kid, {})
            unanswered[msg.msg_id] = (conn, msg)
            if len(unanswered) > MAX_UNANSWERED:
                unanswered.pop(next(iter(unanswered)))
        # Probes (kernel_info on every reconnect...) are not activity, nor worth a delay.
        if msg.channel != "stdin" and self.kernel_manager.track_message_type(msg.msg_type):
            delivered = self._delivered.setdefault(kid, {})
            delivered[msg.msg_id] = time.monotonic()
            if len(delivered) > 256:
                self._expire(delivered)

    def observes(self, kernel_id: str, msg_type: str) -> bool:
        """Whether a kernel message of this type tells the gate something."""
        return (
            msg_type in _CACHED
            or (msg_type == "status" and bool(self._delivered.get(kernel_id)))
            or (msg_type.endswith("_reply") and bool(self._unanswered.get(kernel_id)))
        )

    def from_kernel(self, kernel_id: str, msg: dict[str, Any]) -> None:
        """A message from the kernel to a client: note what it tells, and what it answers."""
        self.replies.from_kernel(kernel_id, msg)
        unanswered = self._unanswered.get(kernel_id)
        if unanswered and msg["header"].get("msg_type", "").endswith("_reply"):
            unanswered.pop(msg["parent_header"].get("msg_id", ""), None)
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

    async def _release(self, kid: str, announce: bool = True) -> None:
        """Resume the kernel if it is not running, confirm every client's IOPub and stdin,
        then deliver what is held. `announce`: the clients are told the kernel is busy
        meanwhile (a held message is waiting for it)."""
        try:
            if announce:
                self._status(kid, "busy")
            while True:
                await self.manager.ensure_running(kid)
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
        if announce:
            self._status(kid, "idle")
        if announce or held:
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

    def _answer_unanswered(self, kid: str, text: str) -> None:
        """The kernel is gone before it answered what it was given: an error reply for
        each, so that no cell waits forever, saying what happened and what was lost."""
        unanswered = self._unanswered.pop(kid, {})
        self._delivered.pop(kid, None)
        with contextlib.suppress(KeyError):
            # What the server last heard from the process that is gone: a "busy" kept
            # would make the next resume's IOPub nudge skip this kernel (jupyter_server
            # does not nudge a busy kernel), and a cell's output could then be lost.
            self.kernel_manager.get_kernel(kid).execution_state = "idle"
        if unanswered:
            self.log.error("Kernel %s failed with %d requests unanswered", kid, len(unanswered))
        for conn, msg in unanswered.values():
            try:
                conn.answer_error(msg, text, "KernelRestoreError")
            except Exception as e:  # a closed websocket must not keep the others waiting
                self.log.debug("Could not answer a %s: %s", msg.msg_type, e)

    def _status(self, kid: str, state: str) -> None:
        for conn in self.connections(kid):
            with contextlib.suppress(Exception):
                conn.send_status(state)


if TYPE_CHECKING:
    # Connections see the gate through websocket.Gate: mypy checks that it fits.
    def _as_gate(gate: MessageGate) -> Gate:
        return gate
