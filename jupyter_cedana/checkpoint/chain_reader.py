"""Reading a kernel's chain of images (a whole image and the deltas on it: incremental.py)
as the one image it stands for: where each page of a page map is, in whichever layer
holds it, and its bytes, every 64 KiB chunk checked against its layer's chunk table as it
is read (every other file against its CRC). compaction.py folds a chain with it."""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isal.isal_zlib import crc32

from ..errors import CheckpointCorrupt
from .crimg import (
    PAGE_SIZE,
    PE_PARENT,
    PE_PRESENT,
    ImageError,
    decode,
    field_spans,
    int_field,
    read_pagemap_entry,
)
from .store import BASE_NAME, MANIFEST, CheckpointStore

__all__ = ["ChainReader", "PageSource"]


@dataclass
class _Run:
    vaddr: int
    end: int
    flags: int
    offset: int  # in the layer's page file, when present


class PageSource:
    """A layer's page file, read by chunk spans, each chunk checked against its table
    once; the last span read is kept (the fold reads a layer mostly in file order)."""

    def __init__(self, path: Path, name: str, chunk_size: int, size: int, crcs: list[int]):
        self.path, self.name = path, name
        self.chunk_size, self.size, self.crcs = chunk_size, size, crcs
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.checked: set[int] = set()
        self.span = (0, b"")
        self.read_bytes = 0

    def read(self, offset: int, length: int) -> bytes:
        lo, data = self.span
        if lo <= offset and offset + length <= lo + len(data):
            return data[offset - lo : offset - lo + length]
        if offset + length > self.size:
            raise CheckpointCorrupt(f"{self.name} is shorter than its page map says")
        cs = self.chunk_size
        first = offset // cs
        last = (offset + length - 1) // cs
        lo = first * cs
        hi = min((last + 1) * cs, self.size)
        data = os.pread(self.fd, hi - lo, lo)
        self.read_bytes += len(data)
        if len(data) != hi - lo:
            raise CheckpointCorrupt(f"{self.name} is shorter than its size")
        view = memoryview(data)
        for c in range(first, last + 1):
            if c not in self.checked:
                if crc32(view[(c - first) * cs : (c - first + 1) * cs]) != self.crcs[c]:
                    raise CheckpointCorrupt(
                        f"checksum mismatch in {self.name} at offset {c * cs} (chunk {c})"
                    )
                self.checked.add(c)
        self.span = (lo, data)
        return data[offset - lo : offset - lo + length]

    def close(self) -> None:
        os.close(self.fd)


class ChainReader:
    """The layers of one kernel's chain, newest first (depth 0), read with checks; each
    page map and page file is opened once."""

    def __init__(
        self, store: CheckpointStore, kernel_id: str, layers: list[tuple[Path, dict[str, Any]]]
    ):
        self.store, self.kid, self.layers = store, kernel_id, layers
        self.maps: dict[tuple[int, str], tuple[list[_Run], list[int], str]] = {}
        self.sources: dict[tuple[int, str], PageSource] = {}

    def prefix(self, depth: int) -> str:
        return "base/" * depth

    def verified(self, depth: int, name: str) -> bytes:
        """A small file of a layer, its CRC checked."""
        where, layer = self.layers[depth]
        meta = layer["files"].get(name)
        if meta is None or "crc32" not in meta:
            raise CheckpointCorrupt(
                f"Checkpoint of {self.kid} is damaged: {self.prefix(depth)}{name} is not in "
                "its manifest"
            )
        data = (where / name).read_bytes()
        if len(data) != meta["size"] or crc32(data) != meta["crc32"]:
            raise CheckpointCorrupt(
                f"Checkpoint of {self.kid} is corrupted: checksum mismatch in "
                f"{self.prefix(depth)}{name}"
            )
        return data

    def runs(self, depth: int, name: str) -> tuple[list[_Run], list[int], str]:
        """A layer's page map `name`: its runs (with their offsets), their starts, and
        its page file."""
        key = (depth, name)
        if key not in self.maps:
            data = self.verified(depth, name)
            spans = field_spans(data, name)
            pages_file = f"pages-{int_field(decode(data[spans[0][0] : spans[0][1]]), 1)}.img"
            out: list[_Run] = []
            offset = 0
            for lo, hi in spans[1:]:
                v, n, f = read_pagemap_entry(data, lo, hi)
                out.append(_Run(v, v + n * PAGE_SIZE, f, offset))
                if f & PE_PRESENT:
                    offset += n * PAGE_SIZE
            self.maps[key] = (out, [r.vaddr for r in out], pages_file)
        return self.maps[key]

    def source(self, depth: int, pages_file: str) -> PageSource:
        key = (depth, pages_file)
        if key not in self.sources:
            where, layer = self.layers[depth]
            meta = layer["files"].get(pages_file)
            if meta is None or "chunks" not in meta:
                raise CheckpointCorrupt(
                    f"Checkpoint of {self.kid} has no chunk table for "
                    f"{self.prefix(depth)}{pages_file}"
                )
            self.verified(depth, meta["chunks"])  # the table's own CRC
            crcs = self.store.chunk_table(self.kid, layer, pages_file, where)
            self.sources[key] = PageSource(
                where / pages_file,
                self.prefix(depth) + pages_file,
                meta["chunk_size"],
                meta["size"],
                crcs,
            )
        return self.sources[key]

    def resolve(
        self, depth: int, name: str, lo: int, hi: int, out: list[tuple[int, int, int]]
    ) -> None:
        """Where pages [lo, hi) of page map `name` are, from layer `depth` down: (layer,
        offset in its page file, length) pieces appended to `out`."""
        if depth >= len(self.layers):
            raise ImageError(f"{name}: pages at {lo:#x} are in no layer of the chain")
        runs, starts, _ = self.runs(depth, name)
        i = bisect.bisect_right(starts, lo) - 1
        pos = lo
        while pos < hi:
            if i < 0 or i >= len(runs) or runs[i].vaddr > pos or runs[i].end <= pos:
                raise ImageError(
                    f"{self.prefix(depth)}{name}: page {pos:#x} is not in its page map"
                )
            run = runs[i]
            end = min(hi, run.end)
            if run.flags & PE_PRESENT:
                piece = (depth, run.offset + pos - run.vaddr, end - pos)
                last = out[-1] if out else None
                if last and last[0] == depth and last[1] + last[2] == piece[1]:
                    out[-1] = (depth, last[1], last[2] + piece[2])
                else:
                    out.append(piece)
            elif run.flags & PE_PARENT:
                self.resolve(depth + 1, name, pos, end, out)
            else:
                raise ImageError(f"{self.prefix(depth)}{name}: page {pos:#x} has no content")
            pos = end
            i += 1

    def close(self) -> int:
        """Close the page files; returns the bytes read from them."""
        read = 0
        for source in self.sources.values():
            read += source.read_bytes
            source.close()
        return read


def chain_layers(images: Path) -> list[int] | None:
    """The `total_bytes` of each image of the chain in `images`, newest first (one for a
    whole image); None when the newest has no readable manifest. A damaged base ends the
    list there: what can be read (a resume says the rest)."""
    layers: list[int] = []
    where = images
    while True:
        try:
            manifest = json.loads((where / MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = None
        if not isinstance(manifest, dict):
            return layers or None
        layers.append(int(manifest.get("total_bytes") or 0))
        if not manifest.get("base"):
            return layers
        where = where / BASE_NAME
