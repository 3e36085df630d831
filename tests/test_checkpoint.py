"""The checkpoint store: ids, permissions, checksums."""

from __future__ import annotations

import os
import stat
import threading
import time
import zlib
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint.integrity import CHUNK_SIZE, FollowingHasher, chunk_crcs, read_table
from jupyter_cedana.checkpoint.store import CheckpointStore, validate_kernel_id
from jupyter_cedana.errors import CheckpointCorrupt, InvalidId


@pytest.mark.parametrize("bad", ["", "..", "../x", "a/b", ".hidden", "x" * 200, "a b", "é"])
def test_ids_that_could_reach_outside_are_refused(bad: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidId):
        validate_kernel_id(bad)
    with pytest.raises(InvalidId):
        CheckpointStore(tmp_path).path(bad)


def image(store: CheckpointStore, kid: str, payload: bytes) -> dict:
    tmp = store.begin(kid)
    (tmp / "pages-1.img").write_bytes(payload)
    (tmp / "core-1.img").write_bytes(b"core")
    return store.commit(kid, tmp, {"timings": {}})


def test_commit_is_private_and_verifiable(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "root")
    manifest = image(store, "k1", os.urandom(1 << 20))
    path = store.path("k1")
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in path.iterdir())
    table = (1 << 20) // CHUNK_SIZE * 4 + 24  # header and one CRC per chunk
    assert manifest["total_bytes"] == (1 << 20) + 4 + table
    assert store.verify("k1")["files"] == manifest["files"]
    assert not [p for p in store.root.iterdir() if ".tmp-" in p.name]


def test_verify_reports_which_file_is_damaged(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    image(store, "k2", b"x" * 10000)
    pages = store.path("k2") / "pages-1.img"
    pages.write_bytes(b"y" * 10000)
    with pytest.raises(CheckpointCorrupt, match=r"checksum mismatch in pages-1\.img"):
        store.verify("k2")
    pages.write_bytes(b"x" * 9000)
    with pytest.raises(CheckpointCorrupt, match="truncated"):
        store.check_sizes("k2")


def test_a_byte_flipped_deep_in_a_page_file_names_its_chunk(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    manifest = image(store, "k5", os.urandom(10 * CHUNK_SIZE + 123))
    pages = store.path("k5") / "pages-1.img"
    offset = 7 * CHUNK_SIZE + 4567
    with open(pages, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    where = rf"pages-1\.img at offset {7 * CHUNK_SIZE} \(chunk 7\)"
    with pytest.raises(CheckpointCorrupt, match=where):
        store.verify("k5")
    store.verify_chunks("k5", manifest, "pages-1.img", {0, 6, 8, 10})  # the others are fine
    with pytest.raises(CheckpointCorrupt, match="chunk 7"):
        store.verify_chunks("k5", manifest, "pages-1.img", {2, 7})


def test_a_damaged_chunk_table_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    manifest = image(store, "k6", os.urandom(3 * CHUNK_SIZE))
    table = store.path("k6") / manifest["files"]["pages-1.img"]["chunks"]
    data = bytearray(table.read_bytes())
    data[-1] ^= 1
    table.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=r"checksum mismatch in pages-1\.img\.chunks"):
        store.verify("k6")
    with pytest.raises(CheckpointCorrupt, match=r"checksum mismatch in pages-1\.img\.chunks"):
        store.verify_small_files("k6", manifest)
    table.write_bytes(bytes(data[:-4]))
    with pytest.raises(CheckpointCorrupt, match="not a chunk table"):
        store.chunk_table("k6", manifest, "pages-1.img")


def test_images_of_the_previous_format_still_verify(tmp_path: Path) -> None:
    """Format 1: one CRC per file, page files included (restored eagerly)."""
    store = CheckpointStore(tmp_path)
    manifest = image(store, "k7", b"p" * 5000)
    path = store.path("k7")
    (path / "pages-1.img.chunks").unlink()
    manifest["format"] = 1
    manifest["files"] = {
        "pages-1.img": {"size": 5000, "crc32": zlib.crc32(b"p" * 5000)},
        "core-1.img": manifest["files"]["core-1.img"],
    }
    store.write_manifest("k7", manifest)
    assert store.verify("k7")["format"] == 1
    (path / "pages-1.img").write_bytes(b"q" * 5000)
    with pytest.raises(CheckpointCorrupt, match=r"checksum mismatch in pages-1\.img"):
        store.verify("k7")


def test_following_hasher_matches_a_file_that_grows_while_hashed(tmp_path: Path) -> None:
    chunks = [os.urandom(300_000) for _ in range(20)]
    hasher = FollowingHasher(tmp_path).start()

    def writer() -> None:
        with open(tmp_path / "pages-7.img", "wb") as f:
            for c in chunks:
                f.write(c)
                f.flush()
                time.sleep(0.002)

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    sums = hasher.finish()
    size = sum(len(c) for c in chunks)
    assert sums["pages-7.img"] == (size, chunk_crcs(tmp_path / "pages-7.img")[1])
    assert len(sums["pages-7.img"][1]) == -(-size // CHUNK_SIZE)


def test_commit_recomputes_a_stale_known_checksum(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    tmp = store.begin("k3")
    (tmp / "pages-1.img").write_bytes(b"abc" * 1000)
    manifest = store.commit("k3", tmp, {}, known={"pages-1.img": (10, [1234])})
    table = store.path("k3") / manifest["files"]["pages-1.img"]["chunks"]
    assert read_table(table) == (CHUNK_SIZE, 3000, chunk_crcs(store.path("k3") / "pages-1.img")[1])


def test_commit_returns_only_once_the_image_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file and the directory are fsynced before the rename, the rename after it (the
    kernel is killed right after commit, and the machine may go away then)."""
    store = CheckpointStore(tmp_path / "root")
    image(store, "k4", b"old image")  # a commit that replaces an image
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    tmp = store.begin("k4")
    for name in ("pages-1.img", "core-1.img", "pagemap-1.img"):
        (tmp / name).write_bytes(os.urandom(5000))
    store.commit("k4", tmp, {})
    final = str(store.path("k4"))
    into_place = events.index(("rename", final))
    before = {path for kind, path in events[:into_place] if kind == "fsync"}
    assert {str(tmp / n) for n in ("pages-1.img", "core-1.img", "pagemap-1.img")} <= before
    assert str(tmp / "manifest.json") in before and str(tmp) in before
    assert ("fsync", str(store.root)) in events[into_place:]
    assert store.verify("k4")["files"]["pages-1.img"]["size"] == 5000

    events.clear()
    manifest = store.read_manifest("k4")
    store.write_manifest("k4", {**manifest, "note": 1})
    assert ("fsync", final) in events and store.read_manifest("k4")["note"] == 1


def test_zero_chunks_become_holes_and_read_back_the_same(tmp_path: Path) -> None:
    """Pages written with zeros cost no disk blocks; they read back as zeros (same CRCs)."""
    data = os.urandom(CHUNK_SIZE) + bytes(40 * CHUNK_SIZE) + os.urandom(3 * CHUNK_SIZE)
    data += bytes(CHUNK_SIZE - 1) + b"\1"  # almost zero: kept
    hasher = FollowingHasher(tmp_path).start()
    with open(tmp_path / "pages-1.img", "wb") as f:
        for i in range(0, len(data), 100_000):
            f.write(data[i : i + 100_000])
            f.flush()
    sums = hasher.finish()
    path = tmp_path / "pages-1.img"
    assert path.read_bytes() == data
    assert sums["pages-1.img"] == chunk_crcs(path)
    assert hasher.zero_bytes == 40 * CHUNK_SIZE
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    assert path.stat().st_blocks * 512 <= len(data) - 40 * CHUNK_SIZE + CHUNK_SIZE
