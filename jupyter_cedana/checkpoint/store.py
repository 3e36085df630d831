"""Checkpoint store: one private directory per kernel, written under a temporary name and
renamed into place only when complete, with a manifest of sizes and checksums."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, InvalidId, NotFound
from ..timestamps import stamp
from . import readahead
from .durable import (
    fsync_path,
    lock_for_writing,
    replace_json_durably,
    stop_writing,
    write_json_durably,
)
from .exchange import rename_exchange
from .integrity import (
    CHUNK_SIZE,
    chunk_crcs,
    file_crc32,
    first_bad_chunk,
    is_page_file,
    read_table,
    table_name,
    write_table,
)

__all__ = ["CheckpointStore", "validate_kernel_id"]

MANIFEST = "manifest.json"
# An incremental image holds its base (the image before it, which may have a base too)
# in this directory, its files hard links to the ones of that image: a suspend replaces
# the kernel's image with one rename, whole chain included (docs/incremental.md).
BASE_NAME = "base"
# 2: page files carry per-chunk CRC tables (lazy restore checks pages as it serves them);
# images of format 1 (one CRC per file) are still read, and restored eagerly.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
# Written into every checkpoint root: what lets `jupyter cedana gc` tell a root of ours
# (whose logs and pid files it may clean) from a directory it was pointed at by mistake.
ROOT_MARKER = ".jupyter-cedana"
# Kernel ids are uuid4 strings in Jupyter; anything that could climb out of the root or
# hide as a dot-file is refused before it is joined to a path.
KERNEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")


def validate_kernel_id(kernel_id: str) -> str:
    if not isinstance(kernel_id, str) or not KERNEL_ID_RE.match(kernel_id):
        raise InvalidId(f"Invalid kernel id: {kernel_id!r}")
    return kernel_id


@dataclass
class Usage:
    bytes_used: int
    bytes_free: int


class CheckpointStore:
    """Owns the checkpoint root; every path under it is derived from a validated kernel id."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()

    def ensure_root(self) -> Path:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        with contextlib.suppress(FileExistsError):
            fd = os.open(self.root / ROOT_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"created_by": "jupyter-cedana", "format": FORMAT_VERSION}, f)
        return self.root

    def path(self, kernel_id: str) -> Path:
        return self.root / validate_kernel_id(kernel_id)

    def log_path(self, kernel_id: str) -> Path:
        """Where the kernel's stdout/stderr go: a file only the kernel writes, so that it
        does not grow between dump and restore (CRIU refuses a file whose size changed)."""
        logs = self.ensure_root() / ".logs"
        logs.mkdir(mode=0o700, exist_ok=True)
        return logs / f"{validate_kernel_id(kernel_id)}.log"

    def exists(self, kernel_id: str) -> bool:
        return (self.path(kernel_id) / MANIFEST).is_file()

    def begin(self, kernel_id: str) -> Path:
        """A fresh private temporary directory for a dump in progress, locked by this
        process until commit() or discard()."""
        validate_kernel_id(kernel_id)
        self.ensure_root()
        start = self.root / f".{kernel_id}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        start.mkdir(mode=0o700)
        return lock_for_writing(start)

    def discard(self, tmp: Path) -> None:
        if tmp.parent == self.root and tmp.name.startswith("."):
            shutil.rmtree(tmp, ignore_errors=True)
        stop_writing(tmp)

    def link_base(self, kernel_id: str, tmp: Path) -> Path | None:
        """The kernel's image (and its chain of bases), hard-linked into `tmp`/base for a
        dump to be made a delta on: no byte copied, and the image in place stays whole
        until commit() replaces it. None when there is no image."""
        src = self.path(kernel_id)
        if not (src / MANIFEST).is_file():
            return None
        dst = tmp / BASE_NAME
        try:
            for dirpath, dirs, files in os.walk(src):
                here = dst / os.path.relpath(dirpath, src)
                here.mkdir(mode=0o700, exist_ok=True)
                for name in [*dirs, *files]:
                    path = os.path.join(dirpath, name)
                    if os.path.islink(path):
                        os.symlink(os.readlink(path), here / name)
                    elif name in files:
                        os.link(path, here / name)
        except OSError:
            shutil.rmtree(dst, ignore_errors=True)
            raise
        return dst

    def commit(
        self,
        kernel_id: str,
        tmp: Path,
        manifest: dict[str, Any],
        known: dict[str, tuple[int, list[int]]] | None = None,
        delta: bool = False,
    ) -> dict[str, Any]:
        """Checksum every image file: page files by chunk, into a table beside them
        (reusing `known` (size, chunk CRCs) of a page file hashed while it was written, if
        the size still matches), the others whole; write the manifest, and rename the
        directory into place.

        `delta`: the image is incremental on tmp/base (link_base), which it keeps; else a
        base linked there is dropped.

        Returns only once the image is durable (files, directory and rename fsynced): the
        caller kills the kernel next, and the machine may go away right after."""
        t0 = time.monotonic()
        held_below = 0
        if delta:
            below = json.loads((tmp / BASE_NAME / MANIFEST).read_text())
            held_below = int(below.get("held_bytes") or below.get("total_bytes") or 0)
        else:
            shutil.rmtree(tmp / BASE_NAME, ignore_errors=True)
        files: dict[str, dict[str, Any]] = {}
        total = 0
        entries = sorted(e for e in tmp.iterdir() if e.is_file() and e.name != MANIFEST)
        for entry in entries:
            if not is_page_file(entry.name):
                continue
            size = entry.stat().st_size
            hashed, crcs = (known or {}).get(entry.name, (-1, []))
            if hashed != size:
                size, crcs = chunk_crcs(entry)
            table = table_name(entry.name)
            write_table(tmp / table, CHUNK_SIZE, size, crcs)
            files[entry.name] = {"size": size, "chunk_size": CHUNK_SIZE, "chunks": table}
            entries.append(tmp / table)
        for entry in entries:
            os.chmod(entry, 0o600)
            size = entry.stat().st_size
            total += size
            if entry.name not in files:
                files[entry.name] = {"size": size, "crc32": file_crc32(entry)}
        checksum_s = time.monotonic() - t0
        for name in files:
            fsync_path(tmp / name)
        manifest = {
            **manifest,
            "format": FORMAT_VERSION,
            "kernel_id": kernel_id,
            "created": time.time(),
            # The suspend on the boot clock too: retention must not end by a clock jump.
            "created_clock": stamp().to_json(),
            "host": socket.gethostname(),
            "files": files,
            "total_bytes": total,
            # What the image holds on disk, its bases included.
            "held_bytes": total + held_below,
            **({"base": BASE_NAME} if delta else {}),
        }
        timings = manifest.setdefault("timings", {})
        timings["checksum_s"] = checksum_s
        timings["fsync_s"] = time.monotonic() - t0 - checksum_s
        write_json_durably(tmp / MANIFEST, manifest)
        fsync_path(tmp, directory=True)
        final = self.path(kernel_id)
        old = self.detach_image(kernel_id)
        if old == final:  # could not be renamed away
            shutil.rmtree(final)
            old = None
        os.rename(tmp, final)
        stop_writing(tmp)
        os.chmod(final, 0o700)
        fsync_path(self.root, directory=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return manifest

    def exchange(self, kernel_id: str, tmp: Path) -> Path:
        """Put the complete image in `tmp` (from begin(), its manifest durable) in place of
        the kernel's image in one step a kill cannot split (exchange.py), for a compacted
        chain (compaction.py). Returns where the old image now is: a deletion name that
        gc removes, for the caller to delete. A kill before that rename leaves the old
        image at `tmp`'s name, whose lock (on the new image's directory) is gone: gc
        removes it too."""
        final = self.path(kernel_id)
        rename_exchange(tmp, final)
        fsync_path(self.root, directory=True)
        stop_writing(tmp)  # its lock is on the directory now at `final`
        os.chmod(final, 0o700)
        doomed = self.root / f".{kernel_id}.del-{time.monotonic_ns()}"
        os.rename(tmp, doomed)
        return doomed

    def read_manifest(self, kernel_id: str) -> dict[str, Any]:
        mpath = self.path(kernel_id) / MANIFEST
        try:
            with open(mpath) as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise NotFound(f"No checkpoint for kernel {kernel_id}") from None
        except (OSError, ValueError) as e:
            raise CheckpointCorrupt(f"Checkpoint manifest of {kernel_id} is unreadable: {e}") from e
        if manifest.get("format") not in READABLE_FORMATS or manifest.get("kernel_id") != kernel_id:
            raise CheckpointCorrupt(
                f"Checkpoint manifest of {kernel_id} does not match this kernel"
            )
        return manifest

    def write_manifest(self, kernel_id: str, manifest: dict[str, Any]) -> None:
        replace_json_durably(self.path(kernel_id) / MANIFEST, manifest)

    def check_sizes(self, kernel_id: str) -> dict[str, Any]:
        """The cheap half of verify(): every file there with its size. CRIU must never see
        a truncated page file (it retries the short read forever)."""
        manifest = self.read_manifest(kernel_id)
        for base, layer, prefix in self.layers(kernel_id, manifest):
            for name, meta in layer["files"].items():
                try:
                    size = (base / name).stat().st_size
                except FileNotFoundError:
                    raise CheckpointCorrupt(
                        f"Checkpoint of {kernel_id} is incomplete: {prefix}{name} is missing"
                    ) from None
                if size != meta["size"]:
                    raise CheckpointCorrupt(
                        f"Checkpoint of {kernel_id} is truncated or damaged: {prefix}{name} "
                        f"has {size} bytes, expected {meta['size']}"
                    )
        return manifest

    def layers(
        self, kernel_id: str, manifest: dict[str, Any]
    ) -> list[tuple[Path, dict[str, Any], str]]:
        """(directory, manifest, name prefix) of the image and of each of its bases."""
        where = self.path(kernel_id)
        out = [(where, manifest, "")]
        prefix = ""
        while manifest.get("base"):
            where = where / BASE_NAME
            prefix += BASE_NAME + "/"
            try:
                manifest = json.loads((where / MANIFEST).read_text())
            except FileNotFoundError:
                raise CheckpointCorrupt(
                    f"Checkpoint of {kernel_id} is incomplete: its base {prefix} is missing"
                ) from None
            except (OSError, ValueError) as e:
                raise CheckpointCorrupt(
                    f"Checkpoint of {kernel_id} is damaged: the manifest of its base "
                    f"{prefix} is unreadable: {e}"
                ) from e
            if (
                not isinstance(manifest, dict)
                or manifest.get("format") not in READABLE_FORMATS
                or manifest.get("kernel_id") != kernel_id
            ):
                raise CheckpointCorrupt(
                    f"Checkpoint of {kernel_id} is damaged: its base {prefix} is not its own"
                )
            out.append((where, manifest, prefix))
        return out

    def verify(
        self, kernel_id: str, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """Check sizes, then checksums: a damaged image is never let run.
        `progress(bytes_done, bytes_total)` follows the checksum pass."""
        manifest = self.check_sizes(kernel_id)
        total = int(manifest.get("held_bytes") or manifest.get("total_bytes") or 0)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        for base, layer, prefix in self.layers(kernel_id, manifest):
            # Chunk tables before the page files they describe.
            files = sorted(layer["files"].items(), key=lambda kv: "chunks" in kv[1])
            for name, meta in files:
                if "chunks" in meta:
                    bad = self._bad_chunk_in(base, kernel_id, layer, name, advance)
                    if bad is not None:
                        raise CheckpointCorrupt(
                            self._bad_chunk_message(kernel_id, prefix + name, meta, bad)
                        )
                elif file_crc32(base / name, advance) != meta["crc32"]:
                    raise CheckpointCorrupt(
                        f"Checkpoint of {kernel_id} is corrupted: checksum mismatch in "
                        f"{prefix}{name}"
                    )
        return manifest

    def chunk_table(
        self, kernel_id: str, manifest: dict[str, Any], name: str, where: Path | None = None
    ) -> list[int]:
        """The chunk CRCs of page file `name`, from its table (whose own CRC the caller
        has checked, e.g. by verify_small_files); in `where` (a base) if given."""
        meta = manifest["files"][name]
        try:
            chunk_size, size, crcs = read_table((where or self.path(kernel_id)) / meta["chunks"])
        except (OSError, ValueError) as e:
            raise CheckpointCorrupt(f"Checkpoint of {kernel_id} is damaged: {e}") from e
        if chunk_size != meta["chunk_size"] or size != meta["size"]:
            raise CheckpointCorrupt(
                f"Checkpoint of {kernel_id} is damaged: {meta['chunks']} does not match {name}"
            )
        return crcs

    def verify_small_files(self, kernel_id: str, manifest: dict[str, Any]) -> None:
        """CRC of every file that is not a page file (page files are checked by chunk),
        the bases' included (CRIU reads their page maps)."""
        small = [
            (base / name, prefix + name, meta["crc32"])
            for base, layer, prefix in self.layers(kernel_id, manifest)
            for name, meta in layer["files"].items()
            if "crc32" in meta and not is_page_file(name)
        ]
        # Dozens of files, cold after a long suspend: all asked of the disk at once.
        readahead.read_ahead({str(path): [(0, 0)] for path, _, _ in small})
        for path, name, crc in small:
            if file_crc32(path) != crc:
                raise CheckpointCorrupt(
                    f"Checkpoint of {kernel_id} is corrupted: checksum mismatch in {name}"
                )

    def layer_of(
        self, kernel_id: str, manifest: dict[str, Any], name: str
    ) -> tuple[Path, dict[str, Any], str]:
        """(directory, manifest, plain name) of the layer holding `name`: base/ prefixes
        name the bases (a file of the image itself has none)."""
        depth = 0
        while name.startswith(BASE_NAME + "/"):
            name = name[len(BASE_NAME) + 1 :]
            depth += 1
        layers = self.layers(kernel_id, manifest)
        if depth >= len(layers):
            raise CheckpointCorrupt(f"Checkpoint of {kernel_id} has no base for {name}")
        where, layer, _ = layers[depth]
        return where, layer, name

    def verify_chunks(
        self, kernel_id: str, manifest: dict[str, Any], name: str, chunks: set[int]
    ) -> None:
        """Check just these chunks of page file `name` (of a base: base/NAME)."""
        where, layer, plain = self.layer_of(kernel_id, manifest, name)
        bad = self._bad_chunk_in(where, kernel_id, layer, plain, None, chunks)
        if bad is not None:
            meta = layer["files"][plain]
            raise CheckpointCorrupt(self._bad_chunk_message(kernel_id, name, meta, bad))

    def _bad_chunk_in(
        self,
        where: Path,
        kernel_id: str,
        manifest: dict[str, Any],
        name: str,
        advance: Callable[[int], None] | None,
        only: set[int] | None = None,
    ) -> int | None:
        crcs = self.chunk_table(kernel_id, manifest, name, where)
        chunk_size = manifest["files"][name]["chunk_size"]
        return first_bad_chunk(where / name, chunk_size, crcs, advance, only)

    @staticmethod
    def _bad_chunk_message(kernel_id: str, name: str, meta: dict[str, Any], bad: int) -> str:
        return (
            f"Checkpoint of {kernel_id} is corrupted: checksum mismatch in {name} at offset "
            f"{bad * meta['chunk_size']} (chunk {bad})"
        )

    def work_dir(self, kernel_id: str) -> Path:
        """The working directory of the kernel's init (which CRIU restores with it, so it
        lives as long as the kernel, parked or not), and CRIU's logs and statistics of a
        restore: kept out of the image directory, which is deleted while the restored
        kernel (and CRIU) still run."""
        work = self.ensure_root() / ".work" / validate_kernel_id(kernel_id)
        work.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(work.parent, 0o700)
        return work

    def detach_image(self, kernel_id: str) -> Path | None:
        """Rename an image out of the way (instant); deleting gigabytes can follow later."""
        path = self.path(kernel_id)
        if not path.exists():
            return None
        doomed = self.root / f".{kernel_id}.del-{time.monotonic_ns()}"
        try:
            os.rename(path, doomed)
        except OSError:
            return path
        return doomed

    def remove_image(self, kernel_id: str) -> None:
        doomed = self.detach_image(kernel_id)
        if doomed is not None:
            shutil.rmtree(doomed, ignore_errors=True)

    def remove(self, kernel_id: str) -> None:
        """Delete everything of a kernel that is gone: image, log and CRIU work files."""
        self.remove_image(kernel_id)
        (self.root / ".logs" / f"{kernel_id}.log").unlink(missing_ok=True)
        shutil.rmtree(self.root / ".work" / kernel_id, ignore_errors=True)

    def kernel_ids(self) -> list[str]:
        """Kernels with an image here (a real directory with a manifest file)."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if KERNEL_ID_RE.match(p.name)
            and not p.is_symlink()
            and p.is_dir()
            and (p / MANIFEST).is_file()
        )

    def size_of(self, kernel_id: str) -> int:
        try:
            manifest = self.read_manifest(kernel_id)
            return int(manifest.get("held_bytes") or manifest["total_bytes"])
        except (NotFound, CheckpointCorrupt):
            return 0

    def usage(self) -> Usage:
        used = 0
        if self.root.is_dir():
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    with contextlib.suppress(OSError):
                        used += os.lstat(os.path.join(dirpath, name)).st_size
        probe = self.root if self.root.exists() else self.root.parent
        while not probe.exists():
            probe = probe.parent
        st = os.statvfs(probe)
        return Usage(bytes_used=used, bytes_free=st.f_bavail * st.f_frsize)
