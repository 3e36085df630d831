"""Where CRIU keeps what it learns about the running Linux kernel.

Every CRIU run first probes the kernel's features (memfd, userfaultfd, TCP repair, mount
and network namespaces...): about 30 ms of every dump and every restore on our machines.
CRIU keeps the answers between runs only in a file on a tmpfs, so that they are gone
after a reboot: /run/criu.kdat as root, $XDG_RUNTIME_DIR/criu.kdat with --unprivileged.
Where /run is not a tmpfs (many containers), every run probes again; CRIU 4.2 then also
leaves its temporary file behind, and says nothing more.

As root only the host can mend that (a tmpfs on /run; docs/deployment.md), so the server
says so once at start and in /status. An unprivileged CRIU is pointed at a directory of
ours on /dev/shm when the user's own runtime directory is missing or not a tmpfs.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path

ROOT_DIR = "/run"
SHM = "/dev/shm"
CACHE = "criu.kdat"
STALE_TMP_S = 60.0  # CRIU writes the file in microseconds


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str, str] | None:
    """The mount that holds `path`: (mount point, file system type, source); None if
    unknown."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    found: tuple[str, str, str] | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = _unescape(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        # Later lines are mounts on top of earlier ones at the same point.
        if inside and (found is None or len(point) >= len(found[0])):
            found = (point, tail[0], tail[1])
    return found


def fs_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The file system type of the mount that holds `path` (None if unknown)."""
    found = mount_of(path, mountinfo)
    return found[1] if found else None


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def cache_dir(unprivileged: bool, env: Mapping[str, str]) -> str | None:
    """The directory CRIU keeps its probe in (None: it has none)."""
    return env.get("XDG_RUNTIME_DIR") if unprivileged else ROOT_DIR


def problem(unprivileged: bool, env: Mapping[str, str]) -> str | None:
    """Why CRIU probes the kernel again on every run here (None: it keeps its probe)."""
    where = cache_dir(unprivileged, env)
    if not where:
        return "XDG_RUNTIME_DIR is not set"
    kind = fs_type(where)
    if kind != "tmpfs":
        return f"{where} is {kind or 'of an unknown file system'}, not a tmpfs"
    # CRIU writes the cache as NAME.tmp and renames it; a CRIU killed in between leaves
    # the .tmp, and every later CRIU, finding it, leaves the cache unwritten (it takes
    # the file for another CRIU's, writing at the same moment).
    cache, tmp = os.path.join(where, CACHE), os.path.join(where, CACHE + ".tmp")
    try:
        age = time.time() - os.stat(tmp).st_mtime
    except OSError:
        return None
    if age > STALE_TMP_S and not os.path.exists(cache):
        return f"{tmp}, left by an interrupted CRIU run, keeps CRIU from writing {cache}"
    return None


def own_shm_dir(uid: int, shm: str = SHM) -> str | None:
    """A directory only `uid` can use, on the tmpfs at `shm`: made if missing; None if
    that is no tmpfs, or what is there is not ours (a world-writable place)."""
    if fs_type(shm) != "tmpfs":
        return None
    path = os.path.join(shm, f"cedana-criu-{uid}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        return None
    return path


def criu_env(
    unprivileged: bool, env: Mapping[str, str] | None = None, shm: str = SHM
) -> dict[str, str] | None:
    """The environment for CRIU runs: None (ours) unless an unprivileged CRIU would
    otherwise have no tmpfs to keep its probe in."""
    env = os.environ if env is None else env
    if not unprivileged or problem(True, env) is None:
        return None
    mine = own_shm_dir(os.geteuid(), shm)
    if mine is None:
        return None
    ours = {**env, "XDG_RUNTIME_DIR": mine}
    if problem(True, ours) is not None:  # a stale .tmp, in a directory only we use
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(mine, CACHE + ".tmp"))
    return ours
