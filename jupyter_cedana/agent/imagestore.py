"""The agent's image store: `<state>/images/<uid>/<kernel_id>/`, root's alone.

Every directory is 0700 and every file 0600, owned by root: a user can neither read an
image (it holds the kernel's memory, secrets included) nor write, rename or plant one
(CRIU treats images as trusted input: an image names the files it opens as root and the
credentials its tasks get). Each uid's images live in a CheckpointStore of its own (the
same atomic commit, checksums and verification a root server's images get) and count
against that uid's quota. An image that fails the check before a restore
(imagecheck.verify_owner) is moved aside to `<state>/refused/<uid>/` for the
administrator, never restored and never silently deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from ..checkpoint.chain_reader import chain_layers
from ..checkpoint.store import BASE_NAME, CheckpointStore, validate_kernel_id
from ..errors import CedanaError
from .protocol import AgentError
from .records import MAX_META, meta_size

DEFAULT_QUOTA = 64 << 30


def private_dir(path: Path) -> Path:
    """Make `path` a root-owned 0700 directory (its parent already is one) and refuse one
    that is anything else: a link, another owner, a wider mode."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_gid != 0:
        raise AgentError("failed", f"the agent's image store at {path} is not root's directory")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def disk_bytes(*paths: Path, skip: frozenset[Path] = frozenset()) -> int:
    """Bytes of the files under `paths` (recursively, but not under `skip`), each file
    once however many hard links it has (a chain's base linked into a dump in progress is
    on the disk once): apparent sizes, as the manifests count them."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top in paths:
        for dirpath, dirs, files in os.walk(top):
            here = Path(dirpath)
            dirs[:] = [d for d in dirs if here / d not in skip]
            for name in files:
                with contextlib.suppress(OSError):
                    st = os.lstat(here / name)
                    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
    return total


def chain_summary(images: Path) -> dict[str, int] | None:
    """`bytes` (the newest image's own), `held_bytes` (with all its bases) and `layers`
    of the image in `images`; None when it has no readable manifest."""
    layers = chain_layers(images)
    if layers is None:
        return None
    return {"bytes": layers[0], "held_bytes": sum(layers), "layers": len(layers)}


def kernel_id_arg(args: dict[str, Any]) -> str:
    """A request's `kernel_id`, checked before it names anything in the store."""
    kid = args.get("kernel_id")
    if not isinstance(kid, str):
        raise AgentError("bad_request", "kernel_id must be a string")
    try:
        return validate_kernel_id(kid)
    except CedanaError as e:
        raise AgentError("bad_request", e.message) from e


def manifest_meta(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The launch's `meta` a dump copied into its image's manifest (None: none, or not
    one a record could hold)."""
    meta = manifest.get("meta")
    if isinstance(meta, dict) and meta_size(meta) <= MAX_META:
        return meta
    return None


class ImageStore:
    def __init__(self, state_dir: str | os.PathLike[str], quota_bytes: int = DEFAULT_QUOTA):
        self.state_dir = Path(state_dir)
        self.root = self.state_dir / "images"
        self.refused_root = self.state_dir / "refused"
        #: Where running kernels' kept bases are (kept_bases.py): counted in the quota.
        self.bases_root = self.state_dir / "bases"
        self.quota_bytes = quota_bytes

    def for_uid(self, uid: int) -> CheckpointStore:
        private_dir(self.root)
        return CheckpointStore(private_dir(self.root / str(int(uid))))

    def image_dir(self, uid: int, kernel_id: str) -> Path:
        return self.for_uid(uid).path(validate_kernel_id(kernel_id))

    def usage(self, uid: int, excluding: str | None = None) -> int:
        """Bytes a uid holds on the disk: its images, their chains, dumps in progress and
        kept bases (kept_bases.py), each file once however many links it has; but kernel
        `excluding`'s image and base (which a dump in progress replaces)."""
        dirs = []
        for root in (self.root, self.bases_root):
            base = root / str(int(uid))
            if base.is_dir() and not base.is_symlink():
                dirs += [
                    e
                    for e in base.iterdir()
                    if e.name != excluding and e.is_dir() and not e.is_symlink()
                ]
        return disk_bytes(*dirs)

    def check_quota(self, uid: int, kernel_id: str, tmp: Path) -> int:
        """Refuse the image being written in `tmp` (replacing the kernel's image and base)
        over quota; otherwise its own bytes (not its base's, `tmp`/base)."""
        new_bytes = disk_bytes(tmp, skip=frozenset({tmp / BASE_NAME}))
        total = self.usage(uid, excluding=kernel_id)  # the dump in progress counts itself
        if total > self.quota_bytes:
            raise AgentError(
                "refused",
                f"the image of kernel {kernel_id} ({new_bytes} bytes) would exceed your "
                f"image quota of {self.quota_bytes} bytes ({max(total - new_bytes, 0)} used "
                "by others)",
            )
        return new_bytes

    def images(self, uid: int) -> list[dict[str, Any]]:
        store = self.for_uid(uid)
        out = []
        for kid in store.kernel_ids():
            try:
                manifest = store.read_manifest(kid)
            except Exception:
                continue
            out.append(
                {
                    "kernel_id": kid,
                    "bytes": int(manifest.get("total_bytes") or 0),
                    **(chain_summary(store.path(kid)) or {}),
                    "created": manifest.get("created"),
                }
            )
        return out

    def _existing(self, uid: int) -> CheckpointStore | None:
        """A uid's store if it exists; creates nothing (this answers every `list`)."""
        base = self.root / str(int(uid))
        if base.is_symlink() or not base.is_dir():
            return None
        return CheckpointStore(base)

    def manifests(self, uid: int, only: str | None = None) -> dict[str, dict[str, Any]]:
        """A uid's images (or only kernel `only`'s) and their manifests; {} stands for a
        manifest that cannot be read (a restore says why)."""
        store = self._existing(uid)
        if store is None:
            return {}
        out: dict[str, dict[str, Any]] = {}
        ids = store.kernel_ids()
        if only is not None:
            ids = [only] if only in ids else []
        for kid in ids:
            try:
                out[kid] = store.read_manifest(kid)
            except Exception:
                out[kid] = {}
        return out

    def refuse(self, uid: int, kernel_id: str, reason: str) -> Path:
        """Move a kernel's image out of use, with why, for the administrator."""
        src = self.image_dir(uid, kernel_id)
        private_dir(self.refused_root)
        dest_dir = private_dir(self.refused_root / str(int(uid)))
        dest = dest_dir / f"{kernel_id}.{time.strftime('%Y%m%dT%H%M%S')}.{time.monotonic_ns()}"
        os.rename(src, dest)
        fd = os.open(dest / "REFUSED.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"uid": uid, "kernel_id": kernel_id, "reason": reason}, f)
        return dest

    def refused(self, uid: int) -> list[str]:
        base = self.refused_root / str(int(uid))
        return sorted(p.name for p in base.iterdir()) if base.is_dir() else []
