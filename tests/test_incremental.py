"""Incremental images (jupyter_cedana/checkpoint/incremental.py): a streamed dump on a
base writes only the pages the base lacks, and real CRIU restores base plus deltas as one
image."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint.capture import ImageCapture
from jupyter_cedana.checkpoint.crimg import PE_PARENT, ImageError, pagemap, pids
from jupyter_cedana.checkpoint.incremental import INDEX_NAME, PARENT_LINK, PageIndex, image_token
from jupyter_cedana.checkpoint.integrity import chunk_crcs
from tests.test_capture import digest_of, restored_digest, running

pytestmark = pytest.mark.root

MB = 1 << 20

# 32 MiB of random pages in a private mmap (page aligned; a shared one is dumped apart).
# SIGUSR2 makes the next change: 1 MiB of `a` rewritten in place, and a new mapping
# holding a copy of 2 MiB of `a` (content the base holds at other addresses: memory
# that moved).
FILL = """
import hashlib, mmap, os, signal, time
priv = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
a = mmap.mmap(-1, 32 << 20, flags=priv)
a.write(os.urandom(32 << 20))
copies = []
step = 0
def change(*_):
    global step
    a[(4 + step) << 20 : (5 + step) << 20] = os.urandom(1 << 20)
    c = mmap.mmap(-1, 2 << 20, flags=priv)
    c[:] = a[(20 << 20) : (22 << 20)]
    copies.append(c)
    step += 1
    open("changed", "w").write(str(step))
def digest(*_):
    h = hashlib.sha256(a)
    for c in copies:
        h.update(c)
    with open("digest.tmp", "w") as f:
        f.write(h.hexdigest())
    os.rename("digest.tmp", "digest")
signal.signal(signal.SIGUSR1, digest)
signal.signal(signal.SIGUSR2, change)
print("ready", flush=True)
while True:
    time.sleep(600)
"""


@pytest.fixture
def filler(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with running(FILL, tmp_path) as proc:
        yield proc


def _wait_for(path: Path, text: str | None = None) -> str:
    deadline = time.monotonic() + 30
    while not path.exists() or (text is not None and path.read_text() != text):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return path.read_text()


def change(pid: int, cwd: Path, step: int) -> None:
    os.kill(pid, signal.SIGUSR2)
    _wait_for(cwd / "changed", str(step))


def dump(pid: int, images: Path, base: PageIndex | None) -> ImageCapture:
    """A streamed dump (on `base`), the process left running."""
    images.mkdir()
    capture = ImageCapture(images, base=base).start()
    done = subprocess.run(
        [
            *("criu", "dump", "-t", str(pid), "-D", ".", "-o", "dump.log"),
            *("--shell-job", "--leave-stopped", "--stream"),
        ],
        cwd=images,
        capture_output=True,
        text=True,
        timeout=120,
    )
    sums = capture.finish()
    os.kill(pid, signal.SIGCONT)
    assert done.returncode == 0, (images / "dump.log").read_text()[-2000:]
    assert capture.error is None, capture.error
    for name, (size, crcs) in sums.items():
        assert (size, crcs) == chunk_crcs(images / name)  # what was really written
    commit(images)
    return capture


def commit(images: Path) -> None:
    """What of the store's commit an index looks at: the manifest's creation time."""
    (images / "manifest.json").write_text(json.dumps({"created": time.time()}))


def page_bytes(images: Path) -> int:
    return sum(p.stat().st_size for p in images.glob("pages-*.img"))


def test_deltas_hold_what_changed_and_criu_restores_the_chain(
    tmp_path: Path, filler: subprocess.Popen[bytes]
) -> None:
    """A full image, then two deltas, each on the one before, after changes of 1 MiB in
    place plus 2 MiB copied to a new address: each delta's page files hold about the
    changed MiB (the copies come from the base's pages, found by content), a quarter of
    the full image or less; the unchanged pages are in-parent entries; the index saved
    and loaded is the index computed from the images; CRIU restores the process from the
    last delta, through its chain, with all its memory right."""
    pid = filler.pid
    full = tmp_path / "full"
    dump(pid, full, None)
    base = PageIndex.of_image(full)
    assert base.pages * 4096 >= 32 * MB

    images = full
    for step in (1, 2):
        change(pid, tmp_path, step)
        before = digest_of(pid, tmp_path)
        delta = tmp_path / f"delta{step}"
        capture = dump(pid, delta, base)
        result = capture.delta
        assert result is not None
        assert os.readlink(delta / PARENT_LINK) == f"../{images.name}"
        # The changed MiB, the pages a Python process touches anyway, and the copies
        # (whose pages the base holds elsewhere: copied into the delta's page file).
        assert result.written * 4096 >= 1 * MB
        assert result.copied * 4096 >= 2 * MB
        assert page_bytes(delta) <= page_bytes(full) // 4
        assert result.in_parent * 4096 >= 26 * MB
        assert any(r.flags & PE_PARENT for p in pids(delta) for r in pagemap(delta, p))
        # The index of base + delta, as the capture learnt it, is what the images hold.
        computed = PageIndex.of_image(delta)
        assert computed.at == result.index.at
        result.index.image = image_token(delta)
        result.index.save()
        assert (delta / INDEX_NAME).exists()
        assert PageIndex.load(delta).at == computed.at
        base, images = result.index, delta
    # An index names its image: once another image is committed in its place (the kernel
    # suspended again while the index was made or saved), it is refused, never used.
    time.sleep(0.001)
    made_of = image_token(images)
    commit(images)
    assert image_token(images) != made_of
    with pytest.raises(ImageError, match="made of another image"):
        PageIndex.load(images)

    assert restored_digest(filler, images, tmp_path) == before


def test_a_dump_on_an_unrelated_base_writes_every_page(
    tmp_path: Path, filler: subprocess.Popen[bytes]
) -> None:
    """A base that shares no page with the process (another image's index): every page
    is written, none is in-parent, and the image restores as a whole one would."""
    other = tmp_path / "other"
    other.mkdir()
    empty = PageIndex(other)
    before = digest_of(filler.pid, tmp_path)
    capture = dump(filler.pid, tmp_path / "images", empty)
    assert capture.delta is not None
    assert capture.delta.in_parent == 0 and capture.delta.copied == 0
    assert capture.delta.written == capture.delta.pages
    assert page_bytes(tmp_path / "images") >= 32 * MB
    assert restored_digest(filler, tmp_path / "images", tmp_path) == before


class _BrokenIndex(dict):  # type: ignore[type-arg]
    """A base whose lookups fail: what any failure on the packing thread looks like."""

    def __contains__(self, key: object) -> bool:
        raise MemoryError("lookup failed")


def test_a_failure_while_packing_fails_the_dump_and_the_process_runs_on(
    tmp_path: Path, filler: subprocess.Popen[bytes]
) -> None:
    """Packing runs on its own thread while the receiver reads on: a failure there must
    still reach CRIU (its pipes closed: the dump fails, not hangs) and the capture's
    error, and the process, left by CRIU, runs on with its memory."""
    base = PageIndex(tmp_path)
    base.where = _BrokenIndex()
    before = digest_of(filler.pid, tmp_path)
    images = tmp_path / "images"
    images.mkdir()
    capture = ImageCapture(images, base=base).start()
    done = subprocess.run(
        [
            "criu",
            "dump",
            "-t",
            str(filler.pid),
            "-D",
            ".",
            "-o",
            "dump.log",
            "--shell-job",
            "--stream",
        ],
        cwd=images,
        capture_output=True,
        text=True,
        timeout=120,
    )
    capture.finish()
    assert done.returncode != 0
    assert capture.error is not None and "packing an incremental image" in capture.error
    assert "lookup failed" in capture.error
    assert filler.poll() is None
    assert digest_of(filler.pid, tmp_path) == before
