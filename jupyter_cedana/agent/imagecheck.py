"""What a CRIU image would make of the restored processes' credentials, read before the
agent lets CRIU restore it.

CRIU restoring as root sets every task's user and group ids, supplementary groups and
capability sets from the task's `core-*.img` (criu/pie/restorer.c), and a user namespace
from `userns-*.img`: an image is a program for a root process. The agent restores only
images it wrote into its own root-only store, so an image should never say anything but
the caller's ids; this check makes sure of it anyway (a bug, an edit by root, a store
restored from a backup), and refuses before CRIU runs.

Field numbers are those of CRIU's images/core.proto and creds.proto (CRIU 4.x), checked
against images CRIU 4.2.1 wrote: core_entry.thread_core = 5, thread_core_entry.creds = 10,
creds_entry uid 1, gid 2, euid 3, egid 4, suid 5, sgid 6, fsuid 7, fsgid 8, cap_inh 9,
cap_prm 10, cap_eff 11, cap_bnd 12, secbits 13, groups 14, no_new_privs 18, cap_amb 19;
mm_entry.exe_file_id = 12; userns_entry uid_map 1, gid_map 2, each uid_gid_extent
first 1, lower_first 2, count 3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import crimg

_CORE_THREAD = 5
_MM_EXE_FILE_ID = 12
_THREAD_CREDS = 10
_IDS = {"uid": 1, "gid": 2, "euid": 3, "egid": 4, "suid": 5, "sgid": 6, "fsuid": 7, "fsgid": 8}
_CAPS = {"inheritable": 9, "permitted": 10, "effective": 11, "bounding": 12, "ambient": 19}
_GROUPS = 14
_NO_NEW_PRIVS = 18
_CORE_RE = re.compile(r"core-(\d+)\.img")


class ImageRefused(Exception):
    """The image would restore processes that are not exactly the caller's."""


@dataclass(frozen=True)
class TaskCreds:
    tid: int
    ids: dict[str, int]
    groups: tuple[int, ...]
    caps: dict[str, tuple[int, ...]]  # CRIU's 32-bit words of each set
    no_new_privs: int


def _ints(fields: crimg.Fields, number: int) -> list[int]:
    """A repeated uint32 field, written packed or not."""
    out: list[int] = []
    for value in fields.get(number, []):
        if isinstance(value, int):
            out.append(value)
            continue
        pos = 0
        while pos < len(value):
            item, pos = crimg.read_varint(value, pos)
            out.append(item)
    return out


def _message(fields: crimg.Fields, number: int, what: str) -> crimg.Fields:
    values = fields.get(number)
    if not values or not isinstance(values[-1], bytes):
        raise ImageRefused(f"{what} is missing")
    return crimg.decode(values[-1])


def task_creds(images: Path) -> list[TaskCreds]:
    """The credentials of every task (thread) an image restores."""
    out = []
    cores = sorted(p for p in images.iterdir() if _CORE_RE.fullmatch(p.name))
    if not cores:
        raise ImageRefused("the image has no core-*.img")
    for path in cores:
        tid = int(_CORE_RE.fullmatch(path.name).group(1))  # type: ignore[union-attr]
        try:
            recs = crimg.records(path)
            if not recs:
                raise ImageRefused(f"{path.name} is empty")
            thread = _message(crimg.decode(recs[0]), _CORE_THREAD, f"{path.name}: thread core")
            creds = _message(thread, _THREAD_CREDS, f"{path.name}: credentials")
        except (OSError, crimg.ImageError) as e:
            raise ImageRefused(f"{path.name} cannot be read: {e}") from e
        ids = {}
        for name, number in _IDS.items():
            values = _ints(creds, number)
            if not values:
                raise ImageRefused(f"{path.name}: credentials lack {name}")
            ids[name] = values[-1]
        nnp = _ints(creds, _NO_NEW_PRIVS)
        out.append(
            TaskCreds(
                tid=tid,
                ids=ids,
                groups=tuple(_ints(creds, _GROUPS)),
                caps={name: tuple(_ints(creds, n)) for name, n in _CAPS.items()},
                no_new_privs=nnp[-1] if nnp else 0,
            )
        )
    return out


def _userns_maps(images: Path) -> list[tuple[str, int, int, int]]:
    out = []
    for path in sorted(images.glob("userns-*.img")):
        for rec in crimg.records(path):
            entry = crimg.decode(rec)
            for kind, number in (("uid", 1), ("gid", 2)):
                for raw in entry.get(number, []):
                    if not isinstance(raw, bytes):
                        raise ImageRefused(f"{path.name} cannot be read")
                    ext = crimg.decode(raw)
                    first, lower, count = (
                        _ints(ext, n)[-1] if _ints(ext, n) else 0 for n in (1, 2, 3)
                    )
                    out.append((kind, first, lower, count))
    return out


def root_exe(images: Path) -> tuple[int, str]:
    """The root task of the image's tree (the namespace's init) and the file it runs."""
    try:
        root = crimg.pids(images)[0]
        mm = crimg.records(images / f"mm-{root}.img")
        exe_id = crimg.int_field(crimg.decode(mm[0]), _MM_EXE_FILE_ID, -1)
        return root, crimg.regular_files(images).get(exe_id, "")
    except (OSError, IndexError, crimg.ImageError) as e:
        raise ImageRefused(f"the image's process tree cannot be read: {e}") from e


def verify_owner(
    images: Path, uid: int, gid: int, groups: tuple[int, ...], init_path: str
) -> list[TaskCreds]:
    """Raise ImageRefused unless the image's tree is rooted at the agent's init
    (`init_path`) and every task of it, the init included (cedana-init --user drops it to
    the user too), has exactly these user and group ids (real, effective, saved, file
    system), these supplementary groups, every capability set (inheritable, permitted,
    effective, bounding, ambient) empty and no_new_privs set; and any user namespace in
    it maps ids to themselves. A root caller's tasks need only be root's."""
    if any(images.glob("creds-*.img")):
        # The pre-3.x layout, which CRIU still reads: not one the agent writes.
        raise ImageRefused("the image holds creds-*.img files (an old CRIU layout)")
    _, exe = root_exe(images)
    if exe != init_path:
        raise ImageRefused(f"the image's init runs {exe or 'an unknown file'}, not {init_path}")
    tasks = task_creds(images)
    want = sorted(set(groups))
    for t in tasks:
        if uid == 0:
            if any(t.ids.values()):
                raise ImageRefused(f"task {t.tid} would be restored with ids {t.ids}, not root")
            continue
        for name, value in t.ids.items():
            expected = uid if "uid" in name else gid
            if value != expected:
                raise ImageRefused(
                    f"task {t.tid} would be restored with {name} {value}, not {expected}"
                )
        if sorted(set(t.groups)) != want:
            raise ImageRefused(
                f"task {t.tid} would be restored with groups {list(t.groups)}, not {want}"
            )
        for name, words in t.caps.items():
            if any(words):
                value = sum(w << (32 * i) for i, w in enumerate(words))
                raise ImageRefused(
                    f"task {t.tid} would be restored with {name} capabilities {value:016x}"
                )
        if t.no_new_privs != 1:
            raise ImageRefused(f"task {t.tid} would be restored without no_new_privs")
    try:
        maps = _userns_maps(images)
    except (OSError, crimg.ImageError) as e:
        raise ImageRefused(f"the image's user namespace cannot be read: {e}") from e
    for kind, first, lower, count in maps:
        if first != lower:
            raise ImageRefused(
                f"the image's user namespace maps {kind}s {first}.. to {lower}.. ({count})"
            )
    return tasks
