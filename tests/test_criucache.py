"""Where CRIU keeps its probe of the Linux kernel (criucache.py): the file system of a
path read from mountinfo, the reason given when CRIU cannot keep it, and the directory of
ours an unprivileged CRIU is given on /dev/shm (and refused if someone else made it)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from jupyter_cedana import criucache

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
    where = criucache.cache_dir(False, {})
    assert where == "/run"
    got = criucache.problem(False, {})
    if criucache.fs_type("/run") == "tmpfs":
        assert got is None or "interrupted CRIU run" in got
    else:
        assert got and got.startswith("/run is ") and got.endswith("not a tmpfs")
    assert criucache.problem(True, {}) == "XDG_RUNTIME_DIR is not set"
    shm = criucache.problem(True, {"XDG_RUNTIME_DIR": "/dev/shm"})
    assert shm is None or "not a tmpfs" in shm


@pytest.fixture
def shm() -> Path:
    if criucache.fs_type(criucache.SHM) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    place = Path(criucache.SHM) / f"cedana-test-{uuid.uuid4().hex[:8]}"
    place.mkdir(mode=0o700)
    yield place
    shutil.rmtree(place, ignore_errors=True)


def test_own_shm_dir_is_private_and_refused_when_not_ours(shm: Path) -> None:
    uid = os.geteuid()
    made = criucache.own_shm_dir(uid, str(shm))
    assert made == str(shm / f"cedana-criu-{uid}")
    st = os.lstat(made)
    assert st.st_uid == uid and st.st_mode & 0o777 == 0o700
    assert criucache.own_shm_dir(uid, str(shm)) == made  # found again

    os.chmod(made, 0o777)  # anyone could have put a file there
    assert criucache.own_shm_dir(uid, str(shm)) is None
    os.rmdir(made)
    os.symlink("/tmp", made)  # a link planted by someone else
    assert criucache.own_shm_dir(uid, str(shm)) is None
    os.unlink(made)
    assert criucache.own_shm_dir(uid, "/proc") is None  # not a tmpfs


def test_an_unprivileged_criu_gets_a_tmpfs_runtime_dir(shm: Path) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    given = criucache.criu_env(True, env, shm=str(shm))
    assert given == {**env, "XDG_RUNTIME_DIR": str(shm / f"cedana-criu-{os.geteuid()}")}
    assert criucache.problem(True, given) is None
    assert criucache.criu_env(True, {"XDG_RUNTIME_DIR": str(shm)}, shm=str(shm)) is None
    assert criucache.criu_env(False, env, shm=str(shm)) is None  # root: /run, or nothing


def test_a_cache_file_left_half_written_is_named_and_ours_is_cleared(shm: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(shm)}
    tmp = shm / "criu.kdat.tmp"
    tmp.touch()
    assert criucache.problem(True, env) is None  # another CRIU may be writing it now
    old = tmp.stat().st_mtime - 600
    os.utime(tmp, (old, old))
    assert "interrupted CRIU run" in (criucache.problem(True, env) or "")
    (shm / "criu.kdat").touch()
    assert criucache.problem(True, env) is None  # the cache is there: CRIU reads it

    (shm / "criu.kdat").unlink()
    given = criucache.criu_env(True, env, shm=str(shm))  # not this one: ours, instead
    mine = Path(given["XDG_RUNTIME_DIR"]) if given else None
    assert mine == shm / f"cedana-criu-{os.geteuid()}"
    stale = mine / "criu.kdat.tmp"
    stale.touch()
    os.utime(stale, (old, old))
    assert criucache.criu_env(True, env, shm=str(shm)) == given
    assert not stale.exists() and tmp.exists()  # only what is in our own directory
