"""The agent's wire format: length-prefixed JSON frames, and its typed error.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON holding
one object. Lengths are checked before anything is read, so an oversized frame costs the
agent nothing but the four bytes of its header.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
from typing import Any

VERSION = 1
DEFAULT_SOCKET = "/run/jupyter-cedana/agent.sock"
MAX_REQUEST = 64 * 1024
MAX_RESPONSE = 1024 * 1024
_HEADER = struct.Struct(">I")

# Every code the agent answers with; a client can rely on this list being closed.
CODES = frozenset(
    {
        "bad_request",
        "too_large",
        "unsupported_version",
        "unknown_op",
        "not_found",
        "conflict",
        "refused",
        "busy",
        "failed",
        "timeout",
    }
)

_KERNEL_ID = re.compile(r"[0-9a-f-]{1,64}")


class AgentError(Exception):
    """An error with a machine-readable code, sent to the caller as `error`."""

    def __init__(self, code: str, message: str):
        if code not in CODES:
            raise ValueError(f"unknown agent error code {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def kernel_id(args: dict[str, Any], key: str = "kernel_id") -> str:
    """The request's kernel id, validated before it names any path or record."""
    value = args.get(key)
    if not isinstance(value, str) or not _KERNEL_ID.fullmatch(value):
        raise AgentError("bad_request", f"{key} must be 1-64 characters of [0-9a-f-]")
    return value


def encode(obj: dict[str, Any], limit: int) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > limit:
        raise AgentError("too_large", f"frame of {len(body)} bytes exceeds {limit}")
    return _HEADER.pack(len(body)) + body


class FrameError(AgentError):
    """The stream is no longer usable: the connection must be closed after replying."""


async def read_frame(
    reader: asyncio.StreamReader, limit: int, frame_timeout: float | None
) -> dict[str, Any] | None:
    """The next frame's object, or None at a clean end of stream.

    Waiting for a frame's first byte is the caller's (idle) business; once it came, the
    rest must arrive within `frame_timeout` seconds, so a client that sends half a frame
    and stalls holds nothing but its own connection.
    """
    first = await reader.read(1)
    if not first:
        return None
    try:
        async with asyncio.timeout(frame_timeout):
            header = first + await reader.readexactly(_HEADER.size - 1)
            body = await reader.readexactly(_length(header, limit))
    except TimeoutError:
        raise FrameError(
            "timeout", f"frame not complete within {frame_timeout:g} s of its first byte"
        ) from None
    except asyncio.IncompleteReadError:
        raise FrameError("bad_request", "connection closed inside a frame") from None
    return _decode(body)


def recv_frame(sock: socket.socket, limit: int) -> dict[str, Any] | None:
    """`read_frame` on a blocking socket, for a caller with no event loop: the next
    frame's object, or None at a clean end of stream. The socket's own timeout bounds
    each wait (`TimeoutError`)."""
    header = _recv_exactly(sock, _HEADER.size, at_start=True)
    if header is None:
        return None
    body = _recv_exactly(sock, _length(header, limit), at_start=False)
    assert body is not None
    return _decode(body)


def _recv_exactly(sock: socket.socket, n: int, at_start: bool) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            if at_start and not data:
                return None
            raise FrameError("bad_request", "connection closed inside a frame")
        data += chunk
    return bytes(data)


def _length(header: bytes, limit: int) -> int:
    (length,) = _HEADER.unpack(header)
    if length > limit:
        raise FrameError("too_large", f"frame of {length} bytes exceeds {limit}")
    return int(length)


def _decode(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError("bad_request", f"frame is not UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict):
        raise FrameError("bad_request", "frame must hold a JSON object")
    return obj


def result_of(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply's `result`, or its error raised as `AgentError` with the agent's code."""
    if reply.get("ok"):
        result = reply.get("result")
        return result if isinstance(result, dict) else {}
    raise error_of(reply)


def error_of(reply: dict[str, Any]) -> AgentError:
    """The `AgentError` an error reply carries. A code this side does not know (a newer
    agent's) reads as `failed`."""
    error = reply.get("error")
    error = error if isinstance(error, dict) else {}
    code = error.get("code")
    return AgentError(
        code if isinstance(code, str) and code in CODES else "failed",
        str(error.get("message") or "no message"),
    )
