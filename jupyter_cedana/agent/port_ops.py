"""The agent's `free_ports` op: a dumped kernel whose listening ports were taken while
it was suspended gets free ones in its image, before anything restores it.

The agent's kernels share the host's network. While a server holds a suspended kernel,
its provisioner holds the kernel's ports; after that server dies and before the next one
adopts the kernel nobody does, and CRIU cannot restore a listening socket on a taken port
(EADDRINUSE). The rewrite is checkpoint/portremap.py's (crash-safe, checksums kept
true); the agent does it in its own store, as root, so that no user ever writes an
image. The reply has the ports moved now and the image's whole map (every number a
socket of the kernel had, to the one it has now), which the caller applies to its
connection info.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..checkpoint import portremap
from ..checkpoint.store import CheckpointStore
from ..errors import CedanaError
from .imagestore import ImageStore, kernel_id_arg
from .kernels import KernelRecord, State
from .protocol import AgentError
from .service import Caller, Progress, Service


class PortOps:
    def __init__(
        self,
        store: ImageStore,
        dumped_record: Callable[[Caller, str], KernelRecord],
        settle: Callable[[int, str], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.dumped_record = dumped_record
        # Waits until no background fold of the kernel's chain can replace its image
        # (compaction_ops.AgentCompactor.cancel): the rewrite must not race its swap.
        self.settle = settle

    def register(self, service: Service) -> None:
        service.register("free_ports", self.op_free_ports)

    async def op_free_ports(
        self, caller: Caller, args: dict[str, Any], _: Progress
    ) -> dict[str, Any]:
        kid = kernel_id_arg(args)
        record = self.dumped_record(caller, kid)
        store = self.store.for_uid(caller.uid)
        # Under the record's lock: a restore (which holds it) never reads a file the
        # rewrite is replacing.
        async with record.lock:
            if record.state != State.dumped:
                raise AgentError("conflict", f"kernel {kid} is {record.state.value}, not dumped")
            if self.settle is not None:
                await self.settle(caller.uid, kid)
            try:
                moved, port_map = await asyncio.to_thread(self._free, store, kid)
            except CedanaError as e:
                raise AgentError("failed", e.message) from e
            except OSError as e:
                raise AgentError("failed", f"the ports of kernel {kid} cannot be moved: {e}") from e
        return {"kernel_id": kid, "moved": moved, "port_map": port_map}

    @staticmethod
    def _free(store: CheckpointStore, kid: str) -> tuple[dict[str, int], dict[str, int]]:
        portremap.finish(store, kid)
        moved = portremap.remap_taken(store, kid)
        port_map = store.read_manifest(kid).get("port_map") or {}
        return {str(k): v for k, v in moved.items()}, {str(k): int(v) for k, v in port_map.items()}
