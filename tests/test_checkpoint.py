"""The checkpoint store: ids, permissions, checksums."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint import (
    CheckpointStore,
    FollowingHasher,
    file_crc32,
    validate_kernel_id,
)
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
    assert manifest["total_bytes"] == (1 << 20) + 4
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
    assert sums["pages-7.img"] == (size, file_crc32(tmp_path / "pages-7.img"))


def test_commit_recomputes_a_stale_known_checksum(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    tmp = store.begin("k3")
    (tmp / "pages-1.img").write_bytes(b"abc" * 1000)
    manifest = store.commit("k3", tmp, {}, known={"pages-1.img": (10, 1234)})
    assert manifest["files"]["pages-1.img"]["crc32"] == file_crc32(store.path("k3") / "pages-1.img")


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
