"""The kept bases of running kernels (CheckpointEngine.keep_base, docs/incremental.md),
as the checkpoint budget sees them: a cache it may drop for room, and what a kernel's
checkpoint holds on disk, as the REST API and the sidebar show it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from ...checkpoint.chain_reader import chain_layers
from ...checkpoint.store import MANIFEST, CheckpointStore
from .transitions import KernelState

if TYPE_CHECKING:
    from .provisioner import CedanaProvisioner


class Kernels(Protocol):
    """Where the kernels are found: the manager (manager.SuspendManager), declared here
    so that the manager depends on this module and not the other way round."""

    @property
    def kernel_manager(self) -> Any: ...
    @property
    def log(self) -> Any: ...
    def provisioner_of(self, kernel: Any) -> CedanaProvisioner | None: ...


def droppable(prov: CedanaProvisioner) -> bool:
    """Whether the kernel's image on disk is only the base of its next suspend: the
    kernel runs on its own memory (a lazy restore's pages all in), and no suspend or
    resume of it is under way (they set another state first, on the same event loop)."""
    return (
        prov.state == KernelState.running
        and prov.memory_loading is None
        and prov.engine.store.exists(prov.kernel_id_str)
    )


def kept_bases(manager: Kernels) -> list[str]:
    """Kernels whose image on disk the budget may drop."""
    km = manager.kernel_manager
    found = []
    for kid in list(km.list_kernel_ids()) if km is not None else []:
        try:
            prov = manager.provisioner_of(km.get_kernel(kid))
        except KeyError:
            continue
        if prov is not None and droppable(prov):
            found.append(kid)
    return found


def drop_base(manager: Kernels, kernel_id: str) -> bool:
    """Delete a running kernel's kept image now (the budget needs the room now): its next
    suspend is a whole one. False when the image is no longer only a base."""
    try:
        prov = manager.provisioner_of(manager.kernel_manager.get_kernel(kernel_id))
    except KeyError:
        return False
    if prov is None or not droppable(prov):
        return False
    held = prov.engine.store.size_of(kernel_id)
    prov.engine.store.remove_image(kernel_id)
    prov.checkpoint_bytes = 0
    manager.log.info(
        "Kernel %s: its kept base (%.1f MB) dropped to make room on the checkpoint disk; "
        "its next suspend writes a whole image",
        kernel_id,
        held / 1e6,
    )
    return True


# (image directory's inode, manifest's mtime) -> the summary made of it.
_SEEN: dict[str, tuple[tuple[int, int], dict[str, Any] | None]] = {}


def checkpoint_disk(store: CheckpointStore, kernel_id: str, prov: Any) -> dict[str, Any] | None:
    """What the kernel's checkpoint holds on disk: the newest image (`image_bytes`), the
    bases under it (`base_bytes`: an incremental image's chain), how many images the
    chain has (`layers`: 1 for a whole image), and whether it is only kept as the base
    of the next suspend of a running kernel (`kept_base`: dropped first for room).
    None when the kernel has no image on disk."""
    images = store.path(kernel_id)
    try:
        st = os.stat(images / MANIFEST)
        key = (st.st_ino, st.st_mtime_ns)
    except (OSError, ValueError):
        _SEEN.pop(kernel_id, None)
        return None
    seen = _SEEN.get(kernel_id)
    if seen is None or seen[0] != key:
        seen = (key, _chain(images))
        _SEEN[kernel_id] = seen
    summary = seen[1]
    if summary is None:
        return None
    return {**summary, "kept_base": prov is not None and droppable(prov)}


def _chain(images: Any) -> dict[str, Any] | None:
    layers = chain_layers(images)
    if layers is None:
        return None
    return {"image_bytes": layers[0], "base_bytes": sum(layers[1:]), "layers": len(layers)}
