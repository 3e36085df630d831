"""Checkpoint store: one private directory per kernel, written under a temporary name and
renamed into place only when complete, with a manifest of sizes and checksums."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointCorrupt, InvalidId, NotFound

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# Written into every checkpoint root: what lets `jupyter cedana gc` tell a root of ours
# (whose logs and pid files it may clean) from a directory it was pointed at by mistake.
ROOT_MARKER = ".jupyter-cedana"
# Kernel ids are uuid4 strings in Jupyter; anything that could climb out of the root or
# hide as a dot-file is refused before it is joined to a path.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_CHUNK = 4 << 20


def validate_kernel_id(kernel_id: str) -> str:
    if not isinstance(kernel_id, str) or not _ID_RE.match(kernel_id):
        raise InvalidId(f"Invalid kernel id: {kernel_id!r}")
    return kernel_id


def file_crc32(path: Path, on_bytes: Callable[[int], None] | None = None) -> int:
    """CRC-32 of a file: catches truncation and bit rot at several GB/s, unlike sha256."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            if on_bytes is not None:
                on_bytes(n)
    return crc


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, manifest: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


class FollowingHasher:
    """CRC-32 of CRIU's page files while CRIU is still writing them (they only grow), so
    that committing an image does not read gigabytes a second time."""

    PATTERN = "pages-*.img"

    def __init__(self, directory: Path):
        self._dir = directory
        self._done = threading.Event()
        self._sums: dict[str, tuple[int, int]] = {}  # name -> (bytes hashed, crc)
        self._thread = threading.Thread(target=self._run, name="cedana-crc", daemon=True)

    def start(self) -> FollowingHasher:
        self._thread.start()
        return self

    def finish(self) -> dict[str, tuple[int, int]]:
        """Call once the writer has exited: hashes what is left and returns the sums."""
        self._done.set()
        self._thread.join()
        return dict(self._sums)

    def _run(self) -> None:
        handles: dict[str, Any] = {}
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        try:
            while True:
                last_pass = self._done.is_set()
                progressed = False
                for path in sorted(self._dir.glob(self.PATTERN)):
                    f = handles.get(path.name)
                    if f is None:
                        f = handles[path.name] = open(path, "rb", buffering=0)  # noqa: SIM115
                    hashed, crc = self._sums.get(path.name, (0, 0))
                    while n := f.readinto(buf):
                        crc = zlib.crc32(view[:n], crc)
                        hashed += n
                        progressed = True
                    self._sums[path.name] = (hashed, crc)
                if last_pass:
                    return
                if not progressed:
                    self._done.wait(0.005)
        except OSError:
            self._sums.clear()  # commit() then hashes everything itself
        finally:
            for f in handles.values():
                f.close()


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
        """A fresh private temporary directory for a dump in progress."""
        validate_kernel_id(kernel_id)
        self.ensure_root()
        tmp = self.root / f".{kernel_id}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir(mode=0o700)
        return tmp

    def discard(self, tmp: Path) -> None:
        if tmp.parent == self.root and tmp.name.startswith("."):
            shutil.rmtree(tmp, ignore_errors=True)

    def commit(
        self,
        kernel_id: str,
        tmp: Path,
        manifest: dict[str, Any],
        known: dict[str, tuple[int, int]] | None = None,
    ) -> dict[str, Any]:
        """Checksum every image file (reusing `known` (size, crc) pairs that still match
        the file's size), write the manifest, and rename the directory into place.

        Returns only once the image is durable (files, directory and rename fsynced): the
        caller kills the kernel next, and the machine may go away right after."""
        t0 = time.monotonic()
        files: dict[str, dict[str, int]] = {}
        total = 0
        for entry in sorted(tmp.iterdir()):
            if not entry.is_file() or entry.name == MANIFEST:
                continue
            os.chmod(entry, 0o600)
            size = entry.stat().st_size
            hashed, crc = (known or {}).get(entry.name, (-1, 0))
            if hashed != size:
                crc = file_crc32(entry)
            files[entry.name] = {"size": size, "crc32": crc}
            total += size
        checksum_s = time.monotonic() - t0
        for name in files:
            fsync_path(tmp / name)
        manifest = {
            **manifest,
            "format": FORMAT_VERSION,
            "kernel_id": kernel_id,
            "created": time.time(),
            "host": socket.gethostname(),
            "files": files,
            "total_bytes": total,
        }
        timings = manifest.setdefault("timings", {})
        timings["checksum_s"] = checksum_s
        timings["fsync_s"] = time.monotonic() - t0 - checksum_s
        _write_durably(tmp / MANIFEST, manifest)
        fsync_path(tmp, directory=True)
        final = self.path(kernel_id)
        old = self.detach_image(kernel_id)
        if old == final:  # could not be renamed away
            shutil.rmtree(final)
            old = None
        os.rename(tmp, final)
        os.chmod(final, 0o700)
        fsync_path(self.root, directory=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return manifest

    def read_manifest(self, kernel_id: str) -> dict[str, Any]:
        mpath = self.path(kernel_id) / MANIFEST
        try:
            with open(mpath) as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise NotFound(f"No checkpoint for kernel {kernel_id}") from None
        except (OSError, ValueError) as e:
            raise CheckpointCorrupt(f"Checkpoint manifest of {kernel_id} is unreadable: {e}") from e
        if manifest.get("format") != FORMAT_VERSION or manifest.get("kernel_id") != kernel_id:
            raise CheckpointCorrupt(
                f"Checkpoint manifest of {kernel_id} does not match this kernel"
            )
        return manifest

    def write_manifest(self, kernel_id: str, manifest: dict[str, Any]) -> None:
        mpath = self.path(kernel_id) / MANIFEST
        tmp = mpath.with_suffix(".tmp")
        _write_durably(tmp, manifest)
        os.rename(tmp, mpath)
        fsync_path(mpath.parent, directory=True)

    def check_sizes(self, kernel_id: str) -> dict[str, Any]:
        """The cheap half of verify(): every file there with its size. CRIU must never see
        a truncated page file (it retries the short read forever)."""
        manifest = self.read_manifest(kernel_id)
        base = self.path(kernel_id)
        for name, meta in manifest["files"].items():
            try:
                size = (base / name).stat().st_size
            except FileNotFoundError:
                raise CheckpointCorrupt(
                    f"Checkpoint of {kernel_id} is incomplete: {name} is missing"
                ) from None
            if size != meta["size"]:
                raise CheckpointCorrupt(
                    f"Checkpoint of {kernel_id} is truncated or damaged: {name} has "
                    f"{size} bytes, expected {meta['size']}"
                )
        return manifest

    def verify(
        self, kernel_id: str, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """Check sizes, then checksums: a damaged image is never let run.
        `progress(bytes_done, bytes_total)` follows the checksum pass."""
        manifest = self.check_sizes(kernel_id)
        base = self.path(kernel_id)
        total = int(manifest.get("total_bytes") or 0)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        for name, meta in manifest["files"].items():
            if file_crc32(base / name, advance) != meta["crc32"]:
                raise CheckpointCorrupt(
                    f"Checkpoint of {kernel_id} is corrupted: checksum mismatch in {name}"
                )
        return manifest

    def work_dir(self, kernel_id: str) -> Path:
        """CRIU's logs and statistics of a restore: kept out of the image directory, which
        is deleted while the restored kernel (and CRIU) still run."""
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
            if _ID_RE.match(p.name)
            and not p.is_symlink()
            and p.is_dir()
            and (p / MANIFEST).is_file()
        )

    def size_of(self, kernel_id: str) -> int:
        try:
            return int(self.read_manifest(kernel_id)["total_bytes"])
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
