"""The receiving end of `criu dump --stream` (jupyter_cedana/checkpoint/capture.py),
against real CRIU."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint.capture import (
    _BUF,
    SOCKET_NAME,
    CaptureFailed,
    ImageCapture,
    _request_name,
)
from jupyter_cedana.checkpoint.integrity import CHUNK_SIZE, chunk_crcs

pytestmark = pytest.mark.root

# 24 MiB of random pages, 8 MiB of pages written with zeros, and a stretch of a random
# page every 3 chunks, so that zero and non-zero chunks alternate.
FILL = """
import hashlib, os, signal, sys, time
a = bytearray(os.urandom(24 << 20))
z = bytearray(8 << 20)
for i in range(0, len(z), 4096):
    z[i] = 0  # touched: CRIU dumps these pages
m = bytearray(16 << 20)
for i in range(0, len(m), 3 * 65536):
    m[i : i + 4096] = os.urandom(4096)
def digest(*_):
    with open("digest.tmp", "w") as f:
        f.write(hashlib.sha256(a + z + m).hexdigest())
    os.rename("digest.tmp", "digest")
signal.signal(signal.SIGUSR1, digest)
print("ready", flush=True)
while True:
    time.sleep(600)
"""


@contextlib.contextmanager
def running(program: str, cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A python process running `program` in `cwd`, once it printed "ready"; killed after
    (or the process CRIU restored in its place, under the same pid)."""
    out = cwd / "filler.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", program],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
    deadline = time.monotonic() + 60
    while "ready" not in out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.05)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def filler(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with running(FILL, tmp_path) as proc:
        yield proc


def digest_of(pid: int, cwd: Path) -> str:
    """The process's digest of its memory. Asked again each second: a signal sent right
    after `criu restore -d` returns can be lost (seen under load), and the answer is the
    same however often it is asked."""
    (cwd / "digest").unlink(missing_ok=True)
    deadline = time.monotonic() + 30
    while True:
        os.kill(pid, signal.SIGUSR1)
        asked = time.monotonic()
        while time.monotonic() - asked < 1:
            if (cwd / "digest").exists():
                return (cwd / "digest").read_text()
            time.sleep(0.02)
        assert time.monotonic() < deadline


def restored_digest(filler: subprocess.Popen[bytes], images: Path, cwd: Path) -> str:
    """Kill the process, restore it from `images` with CRIU: the digest of its memory."""
    filler.kill()
    filler.wait()
    restored = subprocess.run(
        ["criu", "restore", "-D", str(images), "-o", "restore.log", "--shell-job", "-d"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert restored.returncode == 0, (images / "restore.log").read_text()[-2000:]
    return digest_of(filler.pid, cwd)


def criu_dump(pid: int, images: Path, stream: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["criu", "dump", "-t", str(pid), "-D", "." if stream else str(images)]
        + ["-o", "dump.log", "--shell-job", "--leave-stopped"]
        + (["--stream"] if stream else []),
        cwd=images,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "page-cache"])
def test_a_streamed_image_is_the_one_criu_writes_itself(
    tmp_path: Path, filler: subprocess.Popen[bytes], direct: bool
) -> None:
    """The same files; CRCs of every chunk; zero chunks are holes; CRIU restores the
    process from them with its memory intact. The image directory is deeper than a UNIX
    socket's path may be long (108 bytes)."""
    pid = filler.pid
    before = digest_of(pid, tmp_path)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert criu_dump(pid, plain, stream=False).returncode == 0
    os.kill(pid, signal.SIGCONT)
    streamed = tmp_path.joinpath(*["deep-directory-name"] * 6)
    streamed.mkdir(parents=True)
    assert len(str(streamed / SOCKET_NAME)) > 108
    capture = ImageCapture(streamed, direct=direct).start()
    dumped = criu_dump(pid, streamed, stream=True)
    sums = capture.finish()
    assert dumped.returncode == 0, (streamed / "dump.log").read_text()[-2000:]
    assert capture.error is None
    assert not (streamed / SOCKET_NAME).exists()

    images = {p.name for p in plain.iterdir() if p.name != "dump.log"}
    assert images == {p.name for p in streamed.iterdir() if p.name != "dump.log"}
    assert any(n.startswith("pages-") for n in images) and "inventory.img" in images
    assert set(sums) == {n for n in images if n.startswith("pages-")}
    for name, (size, crcs) in sums.items():
        assert (size, crcs) == chunk_crcs(streamed / name)
        assert (streamed / name).stat().st_mode & 0o777 == 0o600
    assert capture.direct_files == (len(sums) if direct else 0)

    # 8 MiB of zero pages and the empty 2 of every 3 chunks of the sparse stretch.
    assert capture.zero_bytes >= (8 << 20) + (10 << 20)
    pages = max(sums, key=lambda n: sums[n][0])
    with open(streamed / pages, "rb") as f:
        os.fsync(f.fileno())
    blocks = (streamed / pages).stat().st_blocks * 512
    assert blocks <= sums[pages][0] - capture.zero_bytes + CHUNK_SIZE
    assert (streamed / pages).stat().st_size == (plain / pages).stat().st_size

    assert restored_digest(filler, streamed, tmp_path) == before


def cached_bytes(path: Path) -> int:
    """Bytes of a file in the page cache (util-linux's fincore: mincore(2) over it)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def test_an_image_written_through_the_page_cache_holds_little_of_it(
    tmp_path: Path, filler: subprocess.Popen[bytes]
) -> None:
    """Written through the page cache, a page file's ranges are dropped from it once
    written back: at the end it holds about the last buffer's worth, not the ~29 MiB
    written (which it held before), and the image is intact."""
    before = digest_of(filler.pid, tmp_path)
    images = tmp_path / "images"
    images.mkdir()
    capture = ImageCapture(images, direct=False, writers=1, writeback_step=1 << 20).start()
    dumped = criu_dump(filler.pid, images, stream=True)
    sums = capture.finish()
    assert dumped.returncode == 0, (images / "dump.log").read_text()[-2000:]
    assert capture.error is None and capture.direct_files == 0
    pages = max(sums, key=lambda n: sums[n][0])
    written = sums[pages][0] - capture.zero_bytes
    assert written > 24 << 20
    assert cached_bytes(images / pages) <= 3 * _BUF
    assert restored_digest(filler, images, tmp_path) == before


def test_a_file_is_closed_only_once_every_write_of_it_is_in(
    tmp_path: Path, filler: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several writers write one file's buffers at once. With the file's first write held
    until CRIU has sent all of the image and exited, and a writer has taken the order to
    close the file, that writer waits for the held write: the file is closed after it
    (a write after the close would go to a closed descriptor, or to whatever file took
    its number next), and CRIU restores the process from the image, intact."""
    import threading

    from jupyter_cedana.checkpoint import capture as capture_module

    held, release, closed = threading.Event(), threading.Event(), threading.Event()
    went_to: list[str] = []  # where the held write's descriptor leads after, and before
    real_write, real_close = capture_module.pwrite_all, capture_module._Sink.close

    def first_write_held(fd: int, data: memoryview, offset: int) -> None:
        if not held.is_set():
            target = os.readlink(f"/proc/self/fd/{fd}")
            held.set()
            assert release.wait(60)
            with contextlib.suppress(OSError):
                went_to.append(os.readlink(f"/proc/self/fd/{fd}"))
            went_to.append(target)
        real_write(fd, data, offset)

    def close(sink: Any) -> None:
        real_close(sink)
        if sink.pages:
            closed.set()

    monkeypatch.setattr(capture_module, "pwrite_all", first_write_held)
    monkeypatch.setattr(capture_module._Sink, "close", close)
    before = digest_of(filler.pid, tmp_path)
    images = tmp_path / "images"
    images.mkdir()
    capture = ImageCapture(images, writers=4).start()
    dumped = criu_dump(filler.pid, images, stream=True)
    assert dumped.returncode == 0, (images / "dump.log").read_text()[-2000:]
    assert held.is_set() and capture.error is None
    # The close order taken: its writer waits for the held write (or, were it not to,
    # the file is closed already).
    deadline = time.monotonic() + 30
    while not (capture._written._waiters or closed.is_set()):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "no writer took the close of the page file"
        time.sleep(0.01)
    release.set()
    sums = capture.finish()
    assert len(went_to) == 2 and went_to[0] == went_to[1], went_to
    assert capture.error is None and sums
    for name, (size, crcs) in sums.items():
        assert (size, crcs) == chunk_crcs(images / name)
    assert restored_digest(filler, images, tmp_path) == before


def test_a_full_disk_fails_the_dump_with_the_reason_and_leaves_the_process(
    tmp_path: Path, filler: subprocess.Popen[bytes]
) -> None:
    """The pipes are closed on CRIU, which fails instead of waiting; the process runs on."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        capture = ImageCapture(mnt).start()
        dumped = criu_dump(filler.pid, mnt, stream=True)
        t = time.monotonic()
        sums = capture.finish()
        assert time.monotonic() - t < 5
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    assert dumped.returncode != 0
    assert sums == {}
    assert capture.error is not None and "No space left" in capture.error
    os.kill(filler.pid, signal.SIGCONT)
    assert digest_of(filler.pid, tmp_path)  # it runs on


def test_finish_returns_when_criu_never_connected(tmp_path: Path) -> None:
    capture = ImageCapture(tmp_path).start()
    assert (tmp_path / SOCKET_NAME).exists()
    t = time.monotonic()
    assert capture.finish() == {}
    assert time.monotonic() - t < 2 and capture.error is None
    assert not (tmp_path / SOCKET_NAME).exists()


@pytest.mark.parametrize("name", ["../pages-1.img", "a/b", "", ".", "..", SOCKET_NAME], ids=repr)
def test_only_plain_image_names_are_accepted(name: str) -> None:
    """CRIU names the files; a file is created for each, so nothing else gets through."""
    raw = name.encode()
    with pytest.raises(CaptureFailed):
        _request_name(b"\x0a" + bytes([len(raw)]) + raw)


def test_an_image_name_is_read_from_criu_s_request() -> None:
    name = "pages-" + "1" * 200 + ".img"  # a length needing two varint bytes
    raw = name.encode()
    assert _request_name(b"\x0a" + bytes([len(raw) & 0x7F | 0x80, len(raw) >> 7]) + raw) == name
    with pytest.raises(CaptureFailed):
        _request_name(b"\x12\x01x")  # another field
    with pytest.raises(CaptureFailed):
        _request_name(b"\x0a\x05ab")  # cut short
