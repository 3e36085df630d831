"""crimg's reading of CRIU page maps, on images written here byte by byte (the real ones
come from CRIU in tests/test_lazy.py and tests/test_provisioner.py)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint import crimg
from jupyter_cedana.checkpoint.crimg import PAGE_SIZE, PE_LAZY, PE_PARENT, PE_PRESENT, ImageError

PAGEMAP_MAGIC = 0x56084025
BASE = 0x7F0000000000


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def message(*fields: tuple[int, int]) -> bytes:
    return b"".join(varint(number << 3) + varint(value) for number, value in fields)


def entry(vaddr: int, pages: int, flags: int | None = PE_PRESENT | PE_LAZY) -> bytes:
    fields = [(1, vaddr), (2, pages)]
    if flags is not None:
        fields.append((4, flags))
    return message(*fields)


def write_pagemap(images: Path, *entries: bytes, pid: int = 1, pages_id: int = 7) -> Path:
    path = images / f"pagemap-{pid}.img"
    body = struct.pack("<II", crimg._COMMON_MAGIC, PAGEMAP_MAGIC)
    for rec in (message((1, pages_id)), *entries):
        body += struct.pack("<I", len(rec)) + rec
    path.write_bytes(body)
    return path


def runs(images: Path) -> list[tuple[int, int, int, int, str]]:
    return [(r.vaddr, r.pages, r.flags, r.offset, r.pages_file) for r in crimg.pagemap(images, 1)]


def test_entries_that_continue_one_another_are_one_run(tmp_path: Path) -> None:
    # CRIU's ~1 MiB cuts of one big area, then a gap, then pages CRIU restores itself.
    write_pagemap(
        tmp_path,
        entry(BASE, 256),
        entry(BASE + 256 * PAGE_SIZE, 256),
        entry(BASE + 512 * PAGE_SIZE, 10),
        entry(BASE + 1000 * PAGE_SIZE, 4),
        entry(BASE + 1004 * PAGE_SIZE, 2, PE_PRESENT),
    )
    assert runs(tmp_path) == [
        (BASE, 522, PE_PRESENT | PE_LAZY, 0, "pages-7.img"),
        (BASE + 1000 * PAGE_SIZE, 4, PE_PRESENT | PE_LAZY, 522 * PAGE_SIZE, "pages-7.img"),
        (BASE + 1004 * PAGE_SIZE, 2, PE_PRESENT, 526 * PAGE_SIZE, "pages-7.img"),
    ]


def test_only_present_pages_take_room_in_the_page_file(tmp_path: Path) -> None:
    write_pagemap(
        tmp_path,
        entry(BASE, 3),
        entry(BASE + 3 * PAGE_SIZE, 5, PE_PARENT),  # in a parent image: not in this file
        entry(BASE + 8 * PAGE_SIZE, 2),
    )
    got = crimg.pagemap(tmp_path, 1)
    assert [(r.pages, r.offset, r.present) for r in got] == [
        (3, 0, True),
        (5, 3 * PAGE_SIZE, False),
        (2, 3 * PAGE_SIZE, True),
    ]
    assert got[0].end == BASE + 3 * PAGE_SIZE and got[0].lazy and not got[1].lazy


def test_entries_of_older_images(tmp_path: Path) -> None:
    # Before the flags field: in_parent, or else present; a 64-bit page count in field 5.
    write_pagemap(
        tmp_path,
        entry(BASE, 1, flags=None),
        message((1, BASE + 4 * PAGE_SIZE), (2, 1), (3, 1)),
        message((1, BASE + 8 * PAGE_SIZE), (2, 0), (4, PE_PRESENT), (5, 1 << 33)),
    )
    assert [(r.pages, r.flags) for r in crimg.pagemap(tmp_path, 1)] == [
        (1, PE_PRESENT),
        (1, PE_PARENT),
        (1 << 33, PE_PRESENT),
    ]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda rec: rec[:-1] + b"\x80", id="varint-past-the-record"),
        pytest.param(lambda rec: rec + message((6, 1)), id="unknown-field"),
        pytest.param(lambda rec: rec + b"\x12\x01x", id="not-a-varint"),
    ],
)
def test_a_damaged_entry_is_refused(tmp_path: Path, damage: Callable[[bytes], bytes]) -> None:
    write_pagemap(tmp_path, entry(BASE, 1), damage(entry(BASE + PAGE_SIZE, 1)), entry(BASE, 1))
    with pytest.raises(ImageError):
        crimg.pagemap(tmp_path, 1)


def test_a_cut_file_is_refused(tmp_path: Path) -> None:
    path = write_pagemap(tmp_path, entry(BASE, 1), entry(BASE + PAGE_SIZE, 1))
    whole = path.read_bytes()
    for cut in (len(whole) - 1, len(whole) - 3):
        path.write_bytes(whole[:cut])
        with pytest.raises(ImageError, match="truncated"):
            crimg.pagemap(tmp_path, 1)


def test_records_are_read_past_either_header(tmp_path: Path) -> None:
    recs = [message((1, 1)), message((1, 42), (2, 3))]
    body = b"".join(struct.pack("<I", len(r)) + r for r in recs)
    with_magic = tmp_path / "pstree.img"
    with_magic.write_bytes(struct.pack("<II", crimg._COMMON_MAGIC, 0x50273030) + body)
    assert crimg.records(with_magic) == recs
    assert crimg.pids(tmp_path) == [1, 42]
    one_magic = tmp_path / "stats-dump"
    one_magic.write_bytes(struct.pack("<I", 0x57093306) + body)
    assert crimg.records(one_magic) == recs
