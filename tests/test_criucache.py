"""Where CRIU keeps its probe of the Linux kernel (criucache.py): the file system of a
path read from mountinfo, and the reason given when CRIU cannot keep it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint import criucache

MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
26 25 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
27 22 0:24 / /run rw,nosuid shared:4 - ext4 /dev/vda rw
28 27 0:25 / /run rw,nosuid shared:5 - tmpfs tmpfs rw,size=65536k
29 22 0:26 / /home/a\\040b rw shared:6 - xfs /dev/vdb rw
"""


@pytest.fixture
def mountinfo(tmp_path: Path) -> str:
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO)
    return str(path)


def test_the_innermost_and_topmost_mount_decides(mountinfo: str) -> None:
    assert criucache.fs_type("/run/criu.kdat", mountinfo) == "tmpfs"  # stacked on ext4
    assert criucache.fs_type("/run", mountinfo) == "tmpfs"
    assert criucache.fs_type("/runaway", mountinfo) == "ext4"  # not under /run
    assert criucache.fs_type("/dev/shm/x", mountinfo) == "tmpfs"
    assert criucache.fs_type("/dev/null", mountinfo) == "devtmpfs"
    assert criucache.fs_type("/home/a b/c", mountinfo) == "xfs"  # octal escapes
    assert criucache.fs_type("/x", str(Path(mountinfo).parent / "gone")) is None


def test_the_problem_is_named() -> None:
    got = criucache.problem()
    if criucache.fs_type("/run") == "tmpfs":
        assert got is None or "interrupted CRIU run" in got
    else:
        assert got and got.startswith("/run is ") and got.endswith("not a tmpfs")
    assert criucache.problem("/proc") == "/proc is proc, not a tmpfs"


@pytest.fixture
def tmpfs_dir() -> Iterator[Path]:
    if criucache.fs_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    place = Path(tempfile.mkdtemp(prefix="cedana-test-", dir="/dev/shm"))
    yield place
    shutil.rmtree(place, ignore_errors=True)


def test_a_cache_file_left_half_written_is_named(tmpfs_dir: Path) -> None:
    tmp = tmpfs_dir / "criu.kdat.tmp"
    tmp.touch()
    assert criucache.problem(str(tmpfs_dir)) is None  # another CRIU may be writing it now
    old = tmp.stat().st_mtime - 600
    os.utime(tmp, (old, old))
    assert "interrupted CRIU run" in (criucache.problem(str(tmpfs_dir)) or "")
    (tmpfs_dir / "criu.kdat").touch()
    assert criucache.problem(str(tmpfs_dir)) is None  # the cache is there: CRIU reads it
