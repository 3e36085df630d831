"""A parked kernel's ports at its adoption. Nobody held them since its server stopped: a
port taken meanwhile is moved to a free one, in the kernel's image and in the connection
info its clients get (checkpoint/portremap.py), and its record keeps the new ones."""

from __future__ import annotations

from typing import Any

from ..checkpoint import portremap
from ..checkpoint.parkrecords import HeldRecord
from ..checkpoint.store import CheckpointStore

__all__ = ["follow_port_map", "free_taken_ports"]


def free_taken_ports(
    store: CheckpointStore,
    kid: str,
    record: dict[str, Any],
    manifest: dict[str, Any],
    held: HeldRecord,
    log: Any,
) -> dict[str, Any]:
    """Move each of the kernel's ports taken since its server stopped to a free one, in
    its image and in the connection info its clients get. Returns the image's manifest
    as it is now."""
    moved = portremap.remap_taken(store, kid)
    manifest_map = store.read_manifest(kid).get("port_map") or {}
    follow_port_map(kid, record, held, moved, manifest_map, log)
    return store.read_manifest(kid) if moved else manifest


def follow_port_map(
    kid: str,
    record: dict[str, Any],
    held: HeldRecord,
    moved: dict[Any, int],
    port_map: dict[str, int],
    log: Any,
) -> None:
    """The connection info its clients get follows the image's map of ports; the
    record keeps it when ports moved now."""
    info = record["connection_info"] = portremap.with_port_map(record["connection_info"], port_map)
    if not moved:
        return
    log.warning(
        "jupyter-cedana: parked kernel %s: port(s) %s taken since its server stopped; "
        "moved to %s (its clients get the new connection info)",
        kid,
        ", ".join(map(str, moved)),
        ", ".join(map(str, moved.values())),
    )
    try:
        held.replace({**record, "connection_info": info})
    except OSError as e:
        # The image's map of ports says where they went (portremap.with_port_map).
        log.warning("jupyter-cedana: parked kernel %s: its record keeps the old ports: %s", kid, e)
