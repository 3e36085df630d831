"""Incremental images: a dump that writes only the pages that changed since the image the
kernel was restored from (its base), in CRIU's own format for incremental dumps, so that
CRIU's restore reads base and delta as one image (docs/incremental.md).

The base's pages are known by a digest per 4 KiB page (`PageIndex`). As a dump streams
through the capture, each page is hashed and written only when no page of the base has its
content: no page address is needed then, which is as well, since CRIU sends a page map
entry only after its pages, up to a 4 KiB buffer of entries later. Once CRIU is done, the
page maps are rewritten (`finish_delta`): a page not written whose address holds the same
content in the base becomes an in-parent entry (flag PE_PARENT); one whose content the base
holds elsewhere (memory moved, rare) is copied from the base into the delta's page file;
and the directory links to its base (`parent`), as CRIU's `--prev-images-dir` does.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from .crimg import (
    PAGE_SIZE,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    ImageError,
    PageRun,
    decode,
    field_spans,
    int_field,
    pagemap,
    pagemap_record,
    pids,
    read_pagemap_entry,
)
from .digests import DIGEST_SIZE, page_digests

PARENT_LINK = "parent"  # CRIU's name for the link to the previous image (CR_PARENT_LINK)
INDEX_NAME = "page-index.bin"
MANIFEST_NAME = "manifest.json"  # checkpoint.MANIFEST (not imported: that module is heavier)
# 2: the index names the image it was made of (its manifest's `created`).
_INDEX_MAGIC = b"CDNPIDX2"
_TOKEN = struct.Struct("<32s")
_RECORD = struct.Struct("<IQ16s")  # pid, vaddr, digest
_READ_PAGES = 1024  # pages read at once while indexing
_BLOCK = 64  # pages a delta's page maps compare with the base at once


@dataclass
class PageIndex:
    """The digest of every page of an image, by process (as the image numbers them) and
    address, and where each content is found (`where`)."""

    directory: Path
    at: dict[int, dict[int, bytes]] = field(default_factory=dict)
    where: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    # The image the digests are of (image_token). An index is saved into its image's
    # directory after the image was made, while the kernel may be suspended and resumed
    # again; one made of an image that has been replaced meanwhile must never be taken
    # for the new image's (its pages would be taken as in the base: a wrong restore).
    image: str = ""

    def add(self, pid: int, vaddr: int, digest: bytes) -> None:
        self.at.setdefault(pid, {})[vaddr] = digest
        self.where.setdefault(digest, (pid, vaddr))

    @property
    def pages(self) -> int:
        return sum(len(m) for m in self.at.values())

    @classmethod
    def of_image(cls, images: Path) -> PageIndex:
        """Hash every page of `images` (following its chain of parents): the image's own
        index file when it has one, else read and hashed now (seconds a GB: to be done
        while the kernel runs, never while it is frozen)."""
        saved = images / INDEX_NAME
        if saved.exists():
            return cls.load(images)
        # Read before the pages: an image replaced while they are read leaves an index
        # that names the old one, which load() then refuses.
        token = image_token(images)
        parent = _parent_of(images)
        base = cls.of_image(parent) if parent is not None else None
        index = cls(images, image=token)
        for pid in pids(images):
            for run in pagemap(images, pid):
                if run.present:
                    for vaddr, data in _run_blocks(images, run):
                        digests = page_digests(data)
                        for i in range(len(data) // PAGE_SIZE):
                            own = digests[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE]
                            index.add(pid, vaddr + i * PAGE_SIZE, own)
                elif run.flags & PE_PARENT:
                    if base is None:
                        raise ImageError(f"{images.name}: pages in a parent, and no parent")
                    inherited = base.at.get(pid, {})
                    for i in range(run.pages):
                        digest = inherited.get(run.vaddr + i * PAGE_SIZE)
                        if digest is None:
                            raise ImageError(
                                f"{images.name}: page {run.vaddr + i * PAGE_SIZE:#x} of "
                                f"process {pid} is in no parent"
                            )
                        index.add(pid, run.vaddr + i * PAGE_SIZE, digest)
        return index

    def save(self) -> None:
        """Written next to the image (a few MB a GB), so that the next dump need not read
        the image again."""
        path = self.directory / INDEX_NAME
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_INDEX_MAGIC)
            f.write(_TOKEN.pack(self.image.encode()))
            f.write(
                b"".join(
                    _RECORD.pack(pid, vaddr, digest)
                    for pid, pages in self.at.items()
                    for vaddr, digest in pages.items()
                )
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, images: Path) -> PageIndex:
        """The index saved in `images`; ImageError when it is malformed, or was made of
        another image than the one there now."""
        data = (images / INDEX_NAME).read_bytes()
        head = 8 + _TOKEN.size
        if data[:8] != _INDEX_MAGIC or len(data) < head or (len(data) - head) % _RECORD.size:
            raise ImageError(f"{images.name}/{INDEX_NAME} is malformed")
        token = _TOKEN.unpack_from(data, 8)[0].rstrip(b"\0").decode(errors="replace")
        if not token or token != image_token(images):
            raise ImageError(f"{images.name}/{INDEX_NAME} was made of another image")
        index = cls(images, image=token)
        for pid, vaddr, digest in _RECORD.iter_unpack(memoryview(data)[head:]):
            index.add(pid, vaddr, digest)
        return index


def image_token(images: Path) -> str:
    """What tells one committed image from another of the same kernel: its manifest's
    `created` (the commit's time, to the nanosecond's precision of a float)."""
    try:
        manifest = json.loads((images / MANIFEST_NAME).read_text())
    except (OSError, ValueError) as e:
        raise ImageError(f"{images.name}: no readable manifest: {e}") from e
    token = manifest_token(manifest)
    if not token:
        raise ImageError(f"{images.name}: its manifest has no creation time")
    return token


def manifest_token(manifest: object) -> str:
    """image_token() of the image whose manifest this is; empty if it has no `created`."""
    created = manifest.get("created") if isinstance(manifest, dict) else None
    if not isinstance(created, int | float):
        return ""
    return repr(float(created))[:32]


def _parent_of(images: Path) -> Path | None:
    link = images / PARENT_LINK
    return (images / os.readlink(link)).resolve() if link.is_symlink() else None


def _run_blocks(images: Path, run: PageRun) -> Iterable[tuple[int, bytes]]:
    """A run's pages, up to _READ_PAGES at a time, each block with its first address."""
    with open(images / run.pages_file, "rb", buffering=0) as f:
        done = 0
        while done < run.pages:
            take = min(_READ_PAGES, run.pages - done)
            data = os.pread(f.fileno(), take * PAGE_SIZE, run.offset + done * PAGE_SIZE)
            if len(data) != take * PAGE_SIZE:
                raise ImageError(f"{run.pages_file} is shorter than its page map says")
            yield run.vaddr + done * PAGE_SIZE, data
            done += take


class _Reader:
    """Pages of an image by address, following its parents (for the rare page a delta
    takes from its base)."""

    def __init__(self, images: Path):
        self.images = images
        self._runs: dict[int, list[PageRun]] = {}
        self._parent: _Reader | None = None

    def page(self, pid: int, vaddr: int) -> bytes:
        runs = self._runs.get(pid)
        if runs is None:
            runs = self._runs[pid] = pagemap(self.images, pid)
        i = bisect.bisect_right([r.vaddr for r in runs], vaddr) - 1
        if i < 0 or vaddr >= runs[i].end:
            raise ImageError(f"page {vaddr:#x} of process {pid} is not in {self.images.name}")
        run = runs[i]
        if run.present:
            with open(self.images / run.pages_file, "rb", buffering=0) as f:
                data = os.pread(f.fileno(), PAGE_SIZE, run.offset + (vaddr - run.vaddr))
            if len(data) != PAGE_SIZE:
                raise ImageError(f"{run.pages_file} is shorter than its page map says")
            return data
        parent = _parent_of(self.images)
        if not run.flags & PE_PARENT or parent is None:
            raise ImageError(f"page {vaddr:#x} of process {pid} has no content")
        if self._parent is None:
            self._parent = _Reader(parent)
        return self._parent.page(pid, vaddr)


@dataclass
class DeltaStream:
    """What the capture learnt of one page file as it streamed: each page's digest, and
    whether it was written (in order: the page file holds the written ones only)."""

    digests: bytearray = field(default_factory=bytearray)
    kept: bytearray = field(default_factory=bytearray)

    @property
    def pages(self) -> int:
        return len(self.kept)


@dataclass
class DeltaResult:
    directory: Path
    pages: int = 0  # present in the new image
    written: int = 0  # of those, in the delta's page files
    in_parent: int = 0
    copied: int = 0  # content found in the base at another address: copied from it
    rebuilt: list[str] = field(default_factory=list)  # page files written again
    # (pid, first address, digests) of each run of present pages: the new image's index,
    # built only when asked for (`index`), once the kernel is no longer frozen.
    runs: list[tuple[int, int, bytes]] = field(default_factory=list)

    @cached_property
    def index(self) -> PageIndex:
        """Of the new image (base and delta as one)."""
        index = PageIndex(self.directory)
        for pid, vaddr, digests in self.runs:
            for i in range(len(digests) // DIGEST_SIZE):
                own = digests[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE]
                index.add(pid, vaddr + i * PAGE_SIZE, own)
        return index


def finish_delta(images: Path, base: PageIndex, streams: dict[str, DeltaStream]) -> DeltaResult:
    """Turn the image CRIU just streamed into `images` (page files holding only the
    pages `streams` marks written) into a delta on `base`: page maps rewritten with
    in-parent entries, pages the base holds at other addresses copied in, the parent
    link made. ImageError when the page maps and the streams disagree (the dump is then
    no good: the caller fails it)."""
    result = DeltaResult(images)
    reader = _Reader(base.directory)
    for path in sorted(images.glob("pagemap-*.img")):
        name = path.name[len("pagemap-") : -len(".img")]
        # Shared memory (pagemap-shmem-ID.img) is not indexed: its pages are all written.
        pid = int(name) if name.isdigit() else -1
        data = path.read_bytes()
        spans = field_spans(data, path.name)
        if not spans:
            continue
        pages_name = f"pages-{int_field(decode(data[spans[0][0] : spans[0][1]]), 1)}.img"
        stream = streams.get(pages_name, DeltaStream())
        known = base.at.get(pid, {}) if pid >= 0 else {}
        out = [data[: spans[1][0] - 4] if len(spans) > 1 else data]
        # (vaddr, pages, flags) of the new page map; and, per page the delta's file will
        # hold, where it comes from: its written position, or a base page to copy.
        entries: list[tuple[int, int, int]] = []
        sources: list[int | bytes] = []
        written = 0
        k = 0  # page of the stream
        for lo, hi in spans[1:]:
            vaddr, count, flags = read_pagemap_entry(data, lo, hi)
            if not flags & PE_PRESENT:
                entries.append((vaddr, count, flags))
                continue
            if k + count > stream.pages:
                raise ImageError(f"{pages_name} holds fewer pages than {path.name} lists")
            if pid >= 0:
                result.runs.append(
                    (pid, vaddr, bytes(stream.digests[k * DIGEST_SIZE : (k + count) * DIGEST_SIZE]))
                )
            # This runs while the kernel is frozen: most blocks of a repeat suspend are
            # all in the base at the same addresses, taken whole by comparing their
            # digests as one string; only the others are looked at page by page.
            for start in range(0, count, _BLOCK):
                n = min(_BLOCK, count - start)
                at, j = vaddr + start * PAGE_SIZE, k + start
                if 1 not in stream.kept[j : j + n] and _in_base_as_is(
                    known, at, n, stream.digests[j * DIGEST_SIZE : (j + n) * DIGEST_SIZE]
                ):
                    _extend(entries, at, PE_PARENT | (flags & PE_LAZY), n)
                    result.in_parent += n
                    continue
                for i in range(n):
                    page_at = at + i * PAGE_SIZE
                    digest = bytes(
                        stream.digests[(j + i) * DIGEST_SIZE : (j + i + 1) * DIGEST_SIZE]
                    )
                    if stream.kept[j + i]:
                        page_flags = flags
                        sources.append(written)
                        written += 1
                    elif known.get(page_at) == digest:
                        page_flags = PE_PARENT | (flags & PE_LAZY)
                        result.in_parent += 1
                    else:
                        page_flags = flags
                        sources.append(digest)
                        result.copied += 1
                    _extend(entries, page_at, page_flags)
            k += count
        if k != stream.pages:
            raise ImageError(f"{pages_name} holds more pages than {path.name} lists")
        result.pages += k
        result.written += written
        wide = any(5 in decode(data[lo:hi]) for lo, hi in spans[1:2])
        out.extend(pagemap_record(v, n, f, wide) for v, n, f in entries)
        if len(sources) != written:  # pages to copy from the base: the file is rewritten
            _rebuild(images / pages_name, sources, base, reader)
            result.rebuilt.append(pages_name)
        tmp = path.with_name(path.name + ".delta")
        tmp.write_bytes(b"".join(out))
        os.replace(tmp, path)
    link = images / PARENT_LINK
    link.unlink(missing_ok=True)
    os.symlink(os.path.relpath(base.directory, images), link)
    return result


def _in_base_as_is(known: dict[int, bytes], vaddr: int, pages: int, digests: Any) -> bool:
    """Whether the base holds these `pages` pages' `digests` at the same addresses."""
    try:
        held = b"".join(map(known.__getitem__, range(vaddr, vaddr + pages * PAGE_SIZE, PAGE_SIZE)))
    except KeyError:
        return False
    return held == digests


def _extend(entries: list[tuple[int, int, int]], vaddr: int, flags: int, pages: int = 1) -> None:
    if entries:
        v, n, f = entries[-1]
        if f == flags and v + n * PAGE_SIZE == vaddr:
            entries[-1] = (v, n + pages, f)
            return
    entries.append((vaddr, pages, flags))


def _rebuild(path: Path, sources: list[int | bytes], base: PageIndex, reader: _Reader) -> None:
    tmp = path.with_name(path.name + ".delta")
    with open(path, "rb", buffering=0) as old, open(tmp, "wb") as new:
        for source in sources:
            if isinstance(source, int):
                page = os.pread(old.fileno(), PAGE_SIZE, source * PAGE_SIZE)
            else:
                pid, vaddr = base.where[source]
                page = reader.page(pid, vaddr)
            if len(page) != PAGE_SIZE:
                raise ImageError(f"{path.name} is shorter than its page map says")
            new.write(page)
        new.flush()
        os.fsync(new.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
