"""The ports of a kernel that has no process (suspended to disk), held by the server so
that no other program takes them and the restored kernel can bind them again."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port")


def kernel_ports(connection_info: Mapping[str, Any] | None) -> list[int]:
    info = connection_info or {}
    return [int(info[n]) for n in PORT_NAMES if info.get(n)]


class PortHold:
    """Listening sockets on a kernel's ports while it has no process."""

    def __init__(self, log: Any, kernel_id: Any):
        self.log = log
        self.kernel_id = kernel_id
        self._sockets: list[socket.socket] = []

    def reserve(self, connection_info: Mapping[str, Any] | None) -> None:
        ip = (connection_info or {}).get("ip", "127.0.0.1")
        for port in kernel_ports(connection_info):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((ip, port))
                # Listening (not just bound) is what makes Linux refuse other binds, even
                # SO_REUSEADDR ones; queued client connections are reset when it closes.
                # A full queue would drop clients' SYNs instead, and TCP's retransmission
                # backoff would keep them away from the restored kernel for up to a minute.
                s.listen(socket.SOMAXCONN)
            except OSError as e:
                s.close()
                self.log.warning(
                    "Could not reserve port %s of kernel %s: %s", port, self.kernel_id, e
                )
                continue
            self._sockets.append(s)

    def release(self) -> None:
        for s in self._sockets:
            s.close()
        self._sockets = []
