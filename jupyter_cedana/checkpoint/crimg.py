"""Reading the few CRIU image records jupyter-cedana needs: the process tree, each
process's memory areas and page map (which pages a lazy restore serves, and where they are
in the page files), and the dump statistics (where a suspend's time went); and the one
rewrite it makes, of the page map's lazy marks (`mark_lazy`).

CRIU images are a magic number or two followed by length-prefixed protobuf records; the
field numbers below are those of CRIU's images/*.proto (stable across CRIU versions).
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass
from pathlib import Path

_COMMON_MAGIC = 0x54564319
_SERVICE_MAGIC = 0x55105940
PAGE_SIZE = 4096

# pagemap_entry.flags
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2

# vma_entry.status, file_entry.type
VMA_AREA_REGULAR = 1 << 0
VMA_AREA_VSYSCALL = 1 << 2
VMA_AREA_VDSO = 1 << 3
VMA_FILE_PRIVATE = 1 << 6
VMA_ANON_PRIVATE = 1 << 9
_FD_REG = 1
# vma_entry.flags (mmap's)
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_LOCKED, _MAP_HUGETLB = 0x02, 0x20, 0x2000, 0x40000

Fields = dict[int, list[int | bytes]]


class ImageError(ValueError):
    """A CRIU image that cannot be read as expected."""


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """A protobuf varint at `pos`: (value, position after it)."""
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ImageError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields_in_order(message: bytes) -> list[tuple[int, int, bytes, int | bytes]]:
    """(field number, wire type, raw bytes of the field, value) of each field of a
    protobuf message, in order, so that a message can be written back with only some
    values changed (portremap.py)."""
    out = []
    pos = 0
    while pos < len(message):
        start = pos
        key, pos = read_varint(message, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = read_varint(message, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", message, pos)[0], pos + 8
        elif wire == 5:
            value, pos = struct.unpack_from("<I", message, pos)[0], pos + 4
        elif wire == 2:
            length, pos = read_varint(message, pos)
            value, pos = message[pos : pos + length], pos + length
        else:
            raise ImageError(f"unsupported wire type {wire}")
        out.append((number, wire, message[start:pos], value))
    if pos != len(message):
        raise ImageError("truncated record")
    return out


def decode(message: bytes) -> Fields:
    """Field number → values (ints for varint and fixed fields, bytes for the rest)."""
    fields: Fields = {}
    for number, _wire, _raw, value in fields_in_order(message):
        fields.setdefault(number, []).append(value)
    return fields


def field_spans(data: bytes, name: str) -> list[tuple[int, int]]:
    """[start, end) of each protobuf record in the bytes of a CRIU image file."""
    if len(data) < 8:
        raise ImageError(f"{name} is too short")
    pos = 8 if struct.unpack_from("<I", data)[0] in (_COMMON_MAGIC, _SERVICE_MAGIC) else 4
    out = []
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError(f"{name}: truncated record header")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise ImageError(f"{name}: truncated record")
        out.append((pos, pos + size))
        pos += size
    return out


def records(path: Path) -> list[bytes]:
    """The protobuf records of a CRIU image file."""
    data = path.read_bytes()
    return [data[start:end] for start, end in field_spans(data, path.name)]


def int_field(fields: Fields, number: int, default: int = 0) -> int:
    values = fields.get(number)
    value = values[-1] if values else default
    if not isinstance(value, int):
        raise ImageError(f"field {number} is not a number")
    return value


def pids(images: Path) -> list[int]:
    """The processes of the dumped tree, as the image numbers them (its own PID namespace)."""
    return [int_field(decode(r), 1) for r in records(images / "pstree.img")]


@dataclass(frozen=True)
class Area:
    """A memory area of a process: [start, end); for a private mapping of a file, the
    file's bytes from `offset` on (file_id: its entry in files.img)."""

    start: int
    end: int
    offset: int
    file_id: int
    private_file: bool


def areas(images: Path, pid: int) -> list[Area]:
    """The memory areas of a process, in address order."""
    mm = records(images / f"mm-{pid}.img")
    if not mm:
        return []
    out = []
    for raw in decode(mm[0]).get(14, []):
        if not isinstance(raw, bytes):
            raise ImageError("vma entry is not a message")
        vma = decode(raw)
        private_file = bool(int_field(vma, 7) & VMA_FILE_PRIVATE)
        out.append(
            Area(
                int_field(vma, 1),
                int_field(vma, 2),
                int_field(vma, 3),
                int_field(vma, 4),
                private_file,
            )
        )
    return sorted(out, key=lambda a: a.start)


def regular_files(images: Path) -> dict[int, str]:
    """File id → path of the regular files the tree had open or mapped (empty where the
    image has no files.img, as older CRIU versions wrote)."""
    try:
        recs = records(images / "files.img")
    except FileNotFoundError:
        return {}
    paths = {}
    for rec in recs:
        entry = decode(rec)
        reg = entry.get(3)
        if int_field(entry, 1) != _FD_REG or not reg or not isinstance(reg[0], bytes):
            continue
        name = decode(reg[0]).get(6)
        if name and isinstance(name[0], bytes):
            paths[int_field(entry, 2)] = name[0].decode(errors="surrogateescape")
    return paths


@dataclass(frozen=True)
class PageRun:
    """Pages [vaddr, vaddr + pages*4096) of a process, stored at `offset` in `pages_file`
    when present there."""

    vaddr: int
    pages: int
    flags: int
    offset: int
    pages_file: str

    @property
    def end(self) -> int:
        return self.vaddr + self.pages * PAGE_SIZE

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY)

    @property
    def present(self) -> bool:
        return bool(self.flags & PE_PRESENT)


def pagemap(images: Path, pid: int) -> list[PageRun]:
    """The page runs of a process, with the offset of each in its page file; entries
    that continue one another (CRIU cuts a big area into entries of a pipe's size,
    ~1 MiB: thousands for a kernel of a few GB) come back as one run."""
    path = images / f"pagemap-{pid}.img"
    data = path.read_bytes()
    spans = field_spans(data, path.name)
    if not spans:
        return []
    head = data[spans[0][0] : spans[0][1]]
    pages_file = f"pages-{int_field(decode(head), 1)}.img"
    runs = []
    offset = 0
    vaddr = pages = flags = -1  # the run being extended
    start = 0  # its offset
    for lo, hi in spans[1:]:
        try:
            v, n, f = read_pagemap_entry(data, lo, hi)
        except IndexError:  # a varint running past the file
            raise ImageError("truncated pagemap entry") from None
        if f == flags and v == vaddr + pages * PAGE_SIZE:
            pages += n
        else:
            if vaddr >= 0:
                runs.append(PageRun(vaddr, pages, flags, start, pages_file))
            vaddr, pages, flags, start = v, n, f, offset
        if f & PE_PRESENT:
            offset += n * PAGE_SIZE
    if vaddr >= 0:
        runs.append(PageRun(vaddr, pages, flags, start, pages_file))
    return runs


def read_pagemap_entry(data: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(vaddr, pages, flags) of the pagemap_entry in data[pos:end]: all its fields are
    varints, so this reads them in one pass."""
    vaddr = nr_pages = in_parent = flags = pages = 0
    has_flags = has_pages = False
    while pos < end:
        key = data[pos]
        byte = data[pos + 1]
        pos += 2
        value, shift = byte & 0x7F, 7
        while byte & 0x80:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
        if key == 0x08:  # field 1, vaddr
            vaddr = value
        elif key == 0x10:  # 2, nr_pages
            nr_pages = value
        elif key == 0x20:  # 4, flags
            flags, has_flags = value, True
        elif key == 0x18:  # 3, in_parent (images older than flags)
            in_parent = value
        elif key == 0x28:  # 5, pages (a 64-bit nr_pages)
            pages, has_pages = value, True
        else:
            raise ImageError(f"unexpected field {key >> 3} in a pagemap entry")
    if pos != end:
        raise ImageError("truncated pagemap entry")
    if not has_flags:
        flags = PE_PARENT if in_parent else PE_PRESENT
    return vaddr, pages if has_pages else nr_pages, flags


DUMP_STATS = {
    1: "freezing_time",
    2: "frozen_time",
    3: "memdump_time",
    4: "memwrite_time",
    5: "pages_scanned",
    6: "pages_skipped_parent",
    7: "pages_written",
    8: "irmap_resolve",
    9: "pages_lazy",
    10: "page_pipes",
    11: "page_pipe_bufs",
}


def dump_stats(images: Path) -> dict[str, int]:
    """CRIU's own dump statistics (times in microseconds); empty if there are none."""
    try:
        recs = records(images / "stats-dump")
    except (OSError, ImageError):
        return {}
    if not recs:
        return {}
    dump = decode(recs[0]).get(1, [])
    if not dump or not isinstance(dump[0], bytes):
        return {}
    fields = decode(dump[0])
    return {
        name: int_field(fields, number) for number, name in DUMP_STATS.items() if number in fields
    }


def dump_breakdown(images: Path) -> dict[str, float]:
    """Where CRIU's dump time went, in seconds: freezing the tree, the tree frozen (until
    CRIU let go of it), dumping memory (parasite and transfer), writing the pages."""
    stats = dump_stats(images)
    names = ("freezing_time", "frozen_time", "memdump_time", "memwrite_time")
    return {f"criu_{n[:-5]}_s": stats[n] / 1e6 for n in names if n in stats}


def _lazy_areas(images: Path, pid: int) -> list[tuple[int, int]]:
    """[start, end) of the process's areas that a lazy restore registers with its
    userfaultfd (CRIU's vma_entry_can_be_lazy(), and no more: a page marked lazy in any
    other area would never be filled)."""
    mm = records(images / f"mm-{pid}.img")
    out = []
    for raw in decode(mm[0]).get(14, []) if mm else []:
        if not isinstance(raw, bytes):
            raise ImageError("vma entry is not a message")
        vma = decode(raw)
        flags, status = int_field(vma, 6), int_field(vma, 7)
        private_anon = flags & _MAP_PRIVATE and flags & _MAP_ANONYMOUS
        regular = status & VMA_AREA_REGULAR and status & VMA_ANON_PRIVATE
        special = flags & (_MAP_LOCKED | _MAP_HUGETLB) or status & (
            VMA_AREA_VDSO | VMA_AREA_VSYSCALL
        )
        if private_anon and regular and not special:
            out.append((int_field(vma, 1), int_field(vma, 2)))
    return sorted(out)


def varint_bytes(value: int) -> bytes:
    """A protobuf varint, as read_varint reads it."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def pagemap_record(vaddr: int, pages: int, flags: int, wide: bool) -> bytes:
    """A pagemap_entry as CRIU writes it: `wide` (CRIU 4) with nr_pages 0 and the count
    in the 64-bit `pages`, else in nr_pages."""
    count = b"\x10\x00" + b"\x20" + varint_bytes(flags) + b"\x28" + varint_bytes(pages)
    if not wide:
        count = b"\x10" + varint_bytes(pages) + b"\x20" + varint_bytes(flags)
    body = b"\x08" + varint_bytes(vaddr) + count
    return struct.pack("<I", len(body)) + body


def mark_lazy(images: Path) -> int:
    """Mark lazy the present pages of the areas a lazy restore serves, in each process
    whose page map marks none lazy; returns how many pages were marked.

    CRIU 4's dump leaves every page of a process unmarked when one of its threads' stack
    pointers is page aligned (is_stack() compares the offset within a page, not the page),
    and the resume then reads all of that process's memory before it runs. Elsewhere
    CRIU marks all of these pages lazy (that comparison being false), as this does."""
    marked = 0
    for pid in pids(images):
        path = images / f"pagemap-{pid}.img"
        data = path.read_bytes()
        spans = field_spans(data, path.name)[1:]  # the first is the head (the page file's id)
        # Marked at all: as CRIU meant (the first lazy entry comes within a few).
        if any(read_pagemap_entry(data, lo, hi)[2] & PE_LAZY for lo, hi in spans):
            continue
        fields = {frozenset(decode(data[lo:hi])) for lo, hi in spans}
        if not fields <= {frozenset({1, 2, 4}), frozenset({1, 2, 4, 5})}:
            continue  # a field this would not write back: left as CRIU wrote it
        areas = _lazy_areas(images, pid)
        head = spans[0][0] - 4 if spans else len(data)
        out = [data[:head]]
        count = 0
        for lo, hi in spans:
            vaddr, pages, flags = read_pagemap_entry(data, lo, hi)
            wide = 5 in decode(data[lo:hi])
            count += _split_lazy(out, vaddr, vaddr + pages * PAGE_SIZE, flags, areas, wide)
        if count:
            tmp = path.with_name(path.name + ".marking")
            try:
                tmp.write_bytes(b"".join(out))
                os.replace(tmp, path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
            marked += count
    return marked


def _split_lazy(
    out: list[bytes], lo: int, hi: int, flags: int, areas: list[tuple[int, int]], wide: bool
) -> int:
    """Append [lo, hi)'s records to `out`, cut where it enters and leaves `areas`, present
    pieces inside them marked lazy; returns the pages marked. The page files need no
    change: present entries keep their order, and so their offsets."""
    marked = 0
    i = bisect.bisect_right([end for _, end in areas], lo)  # the first area ending after lo
    while lo < hi:
        if i < len(areas) and areas[i][0] <= lo:
            end, lazy = min(hi, areas[i][1]), bool(flags & PE_PRESENT)
            i += 1
        else:
            end, lazy = (min(hi, areas[i][0]) if i < len(areas) else hi), False
        pages = (end - lo) // PAGE_SIZE
        out.append(pagemap_record(lo, pages, flags | PE_LAZY if lazy else flags, wide))
        marked += pages if lazy else 0
        lo = end
    return marked
