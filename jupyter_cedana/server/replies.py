"""What the server answers for a suspended kernel, and which messages wake it.

A suspended kernel has no process. Clients still talk to it by themselves: JupyterLab
sends `kernel_info_request` on every websocket (re)connect, ipywidgets' widget manager
opens its control comm and asks for the comm list, JupyterLab opens a subshell for each
comm target, the debugger and resource panels probe. None of that is a person asking for
work, so none of it may wake the kernel. Each client message gets one disposition:

- ANSWER: the server replies as the kernel would, from what the kernel said while it ran
  (its kernel_info_reply, the comms it opened and closed), with the kernel's session in
  the headers and busy/idle status around the reply, as ipykernel does.
- HOLD: kept in order and delivered when the kernel next runs, whoever resumes it.
- WAKE: a person did something (ran a cell, typed, moved a widget): resume and deliver.

What the cache knows of a kernel outlives its server: parking saves it in the kernel's
park record (`saved`), adoption puts it back (`seed`); and a kernel the cache has not
heard from is asked before it is frozen (`before_suspend`), so that a suspended kernel
always has an answer.

The table is in README.md ("Transparent resume").
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.jsonutil import json_default
from jupyter_client.session import msg_header

ANSWER, HOLD, WAKE = "answer", "hold", "wake"

# ipywidgets' manager opens this comm on every (re)connect to fetch all widget states
# (ipywidgets 8); a kernel without that target answers with comm_close, after which the
# manager falls back to comm_info_request + one `request_state` per widget.
WIDGET_CONTROL_TARGET = "jupyter.widget.control"
# Widget-manager housekeeping, not a widget someone used.
AUTOMATIC_COMM_METHODS = frozenset({"request_state", "request_states"})
# Probes and housekeeping that may wait for the kernel's next run: the debugger's
# debugInfo on notebook focus, resource panels' usage polls, JupyterLab's subshell per
# comm target, a comm closed by the frontend.
PASSIVE = frozenset(
    {
        "debug_request",
        "usage_request",
        "create_subshell_request",
        "delete_subshell_request",
        "list_subshell_request",
        "comm_close",
    }
)
# How long a kernel about to be frozen may take to say what it is; it answers on its
# control channel, even while it runs a cell.
ASK_BEFORE_SUSPEND_SECONDS = 10.0
# The same for a kernel already known, whose comm list is only refreshed: a kernel busy in
# code that holds the GIL keeps its suspend waiting no longer than this.
ASK_KNOWN_SECONDS = 2.0
# The parts of the kernel's reply header that the server's answers in its name carry.
_HEADER_KEYS = ("session", "username", "version")


@dataclass
class Message:
    """A client message as the gate sees it, with what goes to the kernel: the frame's
    packed parts (websocket protocol v1) or the message (JSON protocol)."""

    channel: str
    header: dict[str, Any]
    parts: list[bytes] | None = None
    body: dict[str, Any] | None = None
    unpack: Callable[[bytes], Any] | None = None
    _content: dict[str, Any] | None = None

    @property
    def content(self) -> dict[str, Any]:
        """Read only when needed: most messages to a running kernel just pass through."""
        if self._content is None:
            content: Any = None
            if self.body is not None:
                content = self.body.get("content")
            elif self.parts is not None and self.unpack is not None:
                with contextlib.suppress(Exception):
                    content = self.unpack(self.parts[3])
            self._content = content if isinstance(content, dict) else {}
        return self._content

    @property
    def msg_type(self) -> str:
        return str(self.header.get("msg_type", ""))

    @property
    def msg_id(self) -> str:
        return str(self.header.get("msg_id", ""))


def disposition(msg: Message) -> str:
    """HOLD or WAKE for a message the cache did not answer (see the module docstring)."""
    kind = msg.msg_type
    if kind in PASSIVE:
        return HOLD
    if kind == "history_request" and msg.content.get("hist_access_type") == "tail":
        return HOLD  # a console fetching its history when it (re)connects
    if kind == "comm_msg":
        data = msg.content.get("data")
        if isinstance(data, dict) and data.get("method") in AUTOMATIC_COMM_METHODS:
            return HOLD
    if kind == "comm_open" and msg.content.get("target_name") == WIDGET_CONTROL_TARGET:
        return HOLD  # answered by the cache when it knows the kernel's session
    return WAKE


@dataclass
class _Kernel:
    info: dict[str, Any] | None = None  # the kernel's last kernel_info_reply
    comms: dict[str, str] = field(default_factory=dict)  # comm_id -> target_name
    refused: set[str] = field(default_factory=set)  # control comms answered with a close
    adopted: bool = False  # seeded from a park record


class ReplyCache:
    """Per kernel: what it said while it ran, and the replies built from that."""

    def __init__(self) -> None:
        self._kernels: dict[str, _Kernel] = {}

    def _get(self, kernel_id: str) -> _Kernel:
        return self._kernels.setdefault(kernel_id, _Kernel())

    def forget(self, kernel_id: str, action: str = "shutdown") -> None:
        """The kernel was (re)started or shut down: nothing it said holds any more, except
        for the start that adopted it (what its record said holds; that event may come
        before or after the seed)."""
        k = self._kernels.get(kernel_id)
        if action == "start" and k is not None and k.adopted:
            return
        self._kernels.pop(kernel_id, None)

    def knows(self, kernel_id: str) -> bool:
        k = self._kernels.get(kernel_id)
        return k is not None and k.info is not None

    # -- what the kernel says -------------------------------------------------------------

    def from_kernel(self, kernel_id: str, msg: dict[str, Any], snapshot: bool = False) -> None:
        """Note a message the kernel sent (any channel). `snapshot`: a comm_info_reply to
        an unfiltered request of our own, which replaces the comm list."""
        kind = msg.get("header", {}).get("msg_type")
        content = msg.get("content") or {}
        if kind == "kernel_info_reply" and content.get("status", "ok") == "ok":
            self._get(kernel_id).info = {
                "header": dict(msg["header"]),
                "metadata": dict(msg.get("metadata") or {}),
                "content": copy.deepcopy(content),
            }
        elif kind == "comm_info_reply" and content.get("status", "ok") == "ok":
            comms = {
                str(cid): str((c or {}).get("target_name", ""))
                for cid, c in (content.get("comms") or {}).items()
            }
            k = self._get(kernel_id)
            if snapshot:
                k.comms = comms
            else:  # maybe filtered by target: it adds, comm_close removes
                k.comms.update(comms)
        elif kind == "comm_open" and content.get("comm_id"):
            self._get(kernel_id).comms[str(content["comm_id"])] = str(content.get("target_name"))
        elif kind == "comm_close" and content.get("comm_id"):
            self._get(kernel_id).comms.pop(str(content["comm_id"]), None)

    def from_client(self, kernel_id: str, msg: Message) -> None:
        """Note a client message delivered to the kernel (comms it opens or closes)."""
        if msg.msg_type in ("comm_open", "comm_close"):
            self.from_kernel(kernel_id, {"header": msg.header, "content": msg.content})

    async def ask(self, kernel_id: str, km: Any, timeout: float) -> None:
        """Ask a running kernel (km: its KernelManager) for its kernel_info and comm list,
        on a control channel of our own (untracked message types: not activity)."""
        stream = km.connect_control()
        session = km.session
        ours: set[str] = set()
        answered = asyncio.Event()

        def on_reply(msg_list: list[Any]) -> None:
            with contextlib.suppress(Exception):
                msg = session.deserialize(session.feed_identities(msg_list)[1])
                parent = msg["parent_header"].get("msg_id")
                if parent in ours:
                    ours.discard(parent)
                    snapshot = msg["header"]["msg_type"] == "comm_info_reply"
                    self.from_kernel(kernel_id, msg, snapshot=snapshot)
                if not ours:
                    answered.set()

        stream.on_recv(on_reply)
        try:
            for kind in ("kernel_info_request", "comm_info_request"):
                ours.add(session.send(stream, kind, {})["header"]["msg_id"])
            await asyncio.wait_for(answered.wait(), timeout)
        finally:
            if not stream.closed():
                stream.close()

    async def before_suspend(self, prov: Any) -> None:
        """A suspend hook (the kernel still runs): ask the kernel what it is and which
        comms it has, so that its clients are answered right while it is suspended. Comms
        opened or closed while no client was connected (so the gate saw nothing) count;
        a kernel that does not answer in time is known by what it said before."""
        kid = str(prov.kernel_id)
        known = self.knows(kid)
        timeout = ASK_KNOWN_SECONDS if known else ASK_BEFORE_SUSPEND_SECONDS
        with contextlib.suppress(asyncio.TimeoutError):
            await self.ask(kid, prov.parent, timeout)
        if not self.knows(kid):
            prov.log.warning(
                "Kernel %s did not answer kernel_info within %.1f s before its suspend: "
                "the first client to reconnect will resume it",
                kid,
                timeout,
            )

    # -- what outlives the server ---------------------------------------------------------

    def saved(self, kernel_id: str) -> dict[str, Any] | None:
        """What the cache knows of a kernel, as JSON for its park record (None: nothing)."""
        k = self._kernels.get(kernel_id)
        if k is None or k.info is None:
            return None
        header = {key: k.info["header"][key] for key in _HEADER_KEYS if key in k.info["header"]}
        info = {"header": header, "metadata": k.info["metadata"], "content": k.info["content"]}
        saved = {"kernel_info": info, "comms": dict(k.comms)}
        return dict(json.loads(json.dumps(saved, default=json_default)))

    def seed(self, kernel_id: str, saved: Any) -> bool:
        """Know an adopted kernel from what `saved` returned for it before its server
        stopped; False (nothing changed) when `saved` is not that."""
        try:
            info, comms = saved["kernel_info"], saved["comms"]
            header = {
                key: str(info["header"][key]) for key in _HEADER_KEYS if key in info["header"]
            }
            usable = isinstance(info["content"], dict) and isinstance(comms, dict)
            if not (usable and header.get("session")):
                return False
            seeded = _Kernel(
                info={
                    "header": header,
                    "metadata": dict(info.get("metadata") or {}),
                    "content": copy.deepcopy(info["content"]),
                },
                comms={str(cid): str(target) for cid, target in comms.items()},
                adopted=True,
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        self._kernels[kernel_id] = seeded
        return True

    # -- answers --------------------------------------------------------------------------

    def answer(self, kernel_id: str, msg: Message) -> list[tuple[str, dict[str, Any]]] | None:
        """The messages (channel, msg) a kernel would send for `msg`, or None if the
        cache cannot answer it."""
        k = self._kernels.get(kernel_id)
        if k is None or k.info is None:
            return None  # without the kernel's session no reply would be taken as its own
        kind = msg.msg_type
        body: list[tuple[str, dict[str, Any]]] = []
        after: list[tuple[str, dict[str, Any]]] = []
        if kind == "kernel_info_request":
            reply = self._msg(k, "kernel_info_reply", msg, copy.deepcopy(k.info["content"]))
            reply["metadata"] = dict(k.info["metadata"])
            body = [(msg.channel, reply)]
            # JupyterLab ignores status replies to kernel_info (an untracked type) and
            # would show the kernel's state as unknown: a suspended kernel is idle.
            idle = {"execution_state": "idle"}
            after = [("iopub", self._msg(k, "status", None, idle))]
        elif kind == "comm_info_request":
            target = msg.content.get("target_name")
            comms = {
                cid: {"target_name": t} for cid, t in k.comms.items() if not target or t == target
            }
            body = [
                (
                    msg.channel,
                    self._msg(k, "comm_info_reply", msg, {"status": "ok", "comms": comms}),
                )
            ]
        elif kind == "comm_open" and msg.content.get("target_name") == WIDGET_CONTROL_TARGET:
            comm_id = str(msg.content.get("comm_id", ""))
            k.refused.add(comm_id)
            close = self._msg(k, "comm_close", msg, {"comm_id": comm_id, "data": {}})
            body = [("iopub", close)]
        elif kind == "comm_msg" and msg.content.get("comm_id") in k.refused:
            body = []  # like a kernel that knows no such comm: status only
        elif kind == "comm_close" and msg.content.get("comm_id") in k.refused:
            k.refused.discard(str(msg.content.get("comm_id")))
            body = []
        else:
            return None
        return [
            ("iopub", self._msg(k, "status", msg, {"execution_state": "busy"})),
            *body,
            ("iopub", self._msg(k, "status", msg, {"execution_state": "idle"})),
            *after,
        ]

    def compose(
        self,
        kernel_id: str,
        msg_type: str,
        parent: Message | None,
        content: dict[str, Any],
        fallback: tuple[str, str] = ("", ""),
    ) -> dict[str, Any]:
        """A message in the kernel's name (its session, so that frontends take it as the
        kernel's); `fallback` (username, session) when the kernel never answered."""
        k = self._kernels.get(kernel_id)
        if k is not None and k.info is not None:
            return self._msg(k, msg_type, parent, content)
        return _message(msg_header(str(uuid.uuid4()), msg_type, *fallback), parent, content)

    def refusal(
        self,
        kernel_id: str,
        msg: Message,
        text: str,
        fallback: tuple[str, str],
        ename: str = "KernelResumeError",
    ) -> list[tuple[str, dict[str, Any]]]:
        """Error replies for a request that cannot be delivered, or that the kernel can no
        longer answer, and the kernel idle."""
        out = []
        if msg.msg_type.endswith("_request"):
            error = {"ename": ename, "evalue": text, "traceback": [text]}
            content: dict[str, Any] = {"status": "error", **error}
            if msg.msg_type == "execute_request":
                content["execution_count"] = None
                out.append(("iopub", self.compose(kernel_id, "error", msg, error, fallback)))
            kind = msg.msg_type.replace("_request", "_reply")
            out.append((msg.channel, self.compose(kernel_id, kind, msg, content, fallback)))
        idle = {"execution_state": "idle"}
        out.append(("iopub", self.compose(kernel_id, "status", msg, idle, fallback)))
        return out

    @staticmethod
    def _msg(
        k: _Kernel, msg_type: str, parent: Message | None, content: dict[str, Any]
    ) -> dict[str, Any]:
        assert k.info is not None
        kh = k.info["header"]
        header = msg_header(str(uuid.uuid4()), msg_type, kh.get("username", ""), kh["session"])
        if "version" in kh:
            header["version"] = kh["version"]
        return _message(header, parent, content)


def _message(
    header: dict[str, Any], parent: Message | None, content: dict[str, Any]
) -> dict[str, Any]:
    return {
        "header": header,
        "msg_id": header["msg_id"],
        "msg_type": header["msg_type"],
        "parent_header": dict(parent.header) if parent is not None else {},
        "metadata": {},
        "content": content,
        "buffers": [],
    }
