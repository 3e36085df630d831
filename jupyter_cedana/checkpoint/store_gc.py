"""What `jupyter cedana gc` may delete under a checkpoint root: only what it can prove
jupyter-cedana wrote, whatever directory it is pointed at.

Proof is, for an image, a directory named after a kernel id holding a manifest of our
format for that id; for a partial dump or deletion, the store's own temporary names
(`.<id>.tmp-<pid>-<n>.locked` whose writer no longer holds its lock, `.<id>.del-<n>`,
and a park record's `.parked/.<id>.json.tmp-<pid>-<n>[.locked]` nobody holds); for a park record,
one no server can adopt (_judge_records); for kernel logs, pid files and CRIU work
directories, the store's names inside a root that carries the store's marker file.
Everything must be a real directory or file (never a symbolic link), owned by the user
running gc. Anything else is left alone and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, NotFound
from .durable import writer_gone
from .parkrecords import (
    RECORD_FORMAT,
    RECORDS,
    RecordBusy,
    RecordInvalid,
    list_records,
    locked_record,
    parse_record,
    remove_record,
)
from .store import KERNEL_ID_RE, MANIFEST, ROOT_MARKER, CheckpointStore

#: Whether a kernelspec of this name exists for the user running gc; None: cannot say.
KernelspecKnown = Callable[[str], bool | None]

#: Logs, pid files and work directories younger than this are left alone: they may belong
#: to a kernel that is starting and not yet listed by its server.
GC_MIN_AGE = 600.0

_TMP_RE = re.compile(
    r"^\.(?P<kid>[A-Za-z0-9][A-Za-z0-9_-]*)\.tmp-(?P<pid>\d+)-\d+(?P<locked>\.locked)?$"
)
# A park record being written (durable.replace_json_durably, parkrecords), locked by
# its writer from just after it is made until it is renamed into place.
_RECORD_TMP_RE = re.compile(
    r"^\.(?P<kid>[A-Za-z0-9][A-Za-z0-9_-]*)\.json\.tmp-\d+-\d+(?P<locked>\.locked)?$"
)
#: A temporary record file is locked microseconds after it is made: one older than this
#: that nobody holds was left by a writer that died.
TMP_SETTLE = 60.0
_DEL_RE = re.compile(r"^\.(?P<kid>[A-Za-z0-9][A-Za-z0-9_-]*)\.del-\d+$")
_PIDFILE_RE = re.compile(r"^\.(?P<kid>[A-Za-z0-9][A-Za-z0-9_-]*)\.pid$")
_LOG_RE = re.compile(r"^(?P<kid>[A-Za-z0-9][A-Za-z0-9_-]*)\.log$")


@dataclass
class Leftover:
    kind: str  # image, record, partial record, temporary, log, pidfile, work
    path: Path
    kernel_id: str | None
    bytes: int
    why: str | None = None  # for what a suspended kernel left: why no server can adopt it
    # A record as it was judged (inode, size, mtime): one rewritten since is left alone.
    seen: tuple[int, int, int] | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "kind": self.kind,
            "path": str(self.path),
            "kernel_id": self.kernel_id,
            "bytes": self.bytes,
        }
        if self.why:
            found["why"] = self.why
        return found


@dataclass
class Foreign:
    """An entry gc leaves alone, and why."""

    path: Path
    why: str

    def to_json(self) -> dict[str, str]:
        return {"path": str(self.path), "why": self.why}


@dataclass
class Plan:
    remove: list[Leftover]
    foreign: list[Foreign]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tmp_writer_gone(path: Path, m: re.Match[str]) -> bool:
    """A dump's writer holds a lock on it (store.py); a dump not yet locked (its
    writer died within microseconds of making it, or an older version wrote it) is
    judged by the PID in its name, which a container's next server may well have."""
    if m.group("locked"):
        return writer_gone(path)
    return not _pid_alive(int(m.group("pid")))


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _mine(st: os.stat_result | None, kind: int) -> bool:
    """A real (not symlinked) entry of the wanted kind, owned by whoever runs gc."""
    return st is not None and stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.geteuid()


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def is_image(store: CheckpointStore, path: Path) -> bool:
    """A directory of ours holding a manifest of our format for the id it is named after."""
    if not KERNEL_ID_RE.match(path.name) or not _mine(_lstat(path), stat.S_IFDIR):
        return False
    if not _mine(_lstat(path / MANIFEST), stat.S_IFREG):
        return False
    try:
        store.read_manifest(path.name)
    except (NotFound, CheckpointCorrupt):
        return False
    return True


def has_marker(root: Path) -> bool:
    """Whether `root` carries the marker a checkpoint store writes into its root."""
    marker = root / ROOT_MARKER
    if not _mine(_lstat(marker), stat.S_IFREG):
        return False
    try:
        return json.loads(marker.read_text()).get("created_by") == "jupyter-cedana"
    except (OSError, ValueError, AttributeError):
        return False


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _refusal(path: Path, text: str, kernelspec_known: KernelspecKnown | None) -> str | None:
    """Why no server can adopt the kernel of this record, or None (it may be adopted)."""
    try:
        record = parse_record(path, text)
    except RecordInvalid as e:
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            fmt = json.loads(text).get("format")
            if isinstance(fmt, int) and fmt > RECORD_FORMAT:
                return None  # a newer jupyter-cedana's: it may adopt it
        return str(e)
    name = str(record["kernel_name"])
    if kernelspec_known is None or kernelspec_known(name) is not False:
        return None
    return f"record {path.name}: its kernelspec {name!r} is gone"


def _judge_records(
    store: CheckpointStore, kernelspec_known: KernelspecKnown | None, locks: bool = True
) -> tuple[set[str], list[Leftover], list[Foreign]]:
    """The kernels whose records keep them (and their images), and the records no server
    can adopt, with the reason: one that does not parse or is not a park record of our
    format, or one naming a kernelspec that `kernelspec_known` says is gone. A record
    that cannot be read is kept; so is one a live server holds locked (it owns the
    kernel), which is asked (`locks`) only of records about to be refused: a lock taken
    by gc, however briefly, makes an adopting server skip the kernel."""
    kept: set[str] = set()
    refused: list[Leftover] = []
    foreign: list[Foreign] = []
    for path in list_records(store):
        kid = path.name[: -len(".json")]
        st = _lstat(path)
        if not _mine(st, stat.S_IFREG):
            kept.add(kid)
            foreign.append(Foreign(path, "a park record that is not a file of this user"))
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            kept.add(kid)
            continue
        why = _refusal(path, text, kernelspec_known)
        if why is None:
            kept.add(kid)
            continue
        if locks:
            try:
                with locked_record(path) as (fd, again):
                    seen = _identity(os.fstat(fd))
            except (RecordBusy, OSError):
                kept.add(kid)  # held by the server that owns the kernel, or going away
                continue
            if again != text:
                kept.add(kid)  # rewritten meanwhile: judged at the next gc
                continue
        else:
            seen = _identity(st) if st is not None else (0, 0, 0)
        refused.append(Leftover("record", path, kid, seen[1], why, seen))
    return kept, refused, foreign


def recorded_kernel_ids(store: CheckpointStore) -> set[str]:
    """Kernels whose park records a server may adopt: their images are someone's. Records
    that no server can adopt (they do not parse) leave their images to nobody."""
    return _judge_records(store, None, locks=False)[0]


def plan(
    store: CheckpointStore,
    keep: set[str],
    now: float | None = None,
    kernelspec_known: KernelspecKnown | None = None,
) -> Plan:
    """What gc removes under the store's root: images of kernels not in `keep` and
    without a record a server can adopt; records no server can adopt (see
    _judge_records), with their images; partial dumps whose writer is gone, deletions
    left half done; and, under a marked root, logs, pid files and CRIU work directories
    of such kernels once older than GC_MIN_AGE."""
    now = time.time() if now is None else now
    root = store.root
    remove: list[Leftover] = []
    foreign: list[Foreign] = []
    if not root.is_dir():
        return Plan(remove, foreign)
    recorded, refused, odd = _judge_records(store, kernelspec_known)
    keep = keep | recorded
    foreign.extend(odd)
    why_of = {item.kernel_id: item.why for item in refused if item.kernel_id not in keep}
    marked = has_marker(root)

    def old(st: os.stat_result) -> bool:
        return now - st.st_mtime > GC_MIN_AGE

    def leave(path: Path, why: str) -> None:
        foreign.append(Foreign(path, why))

    images: set[str] = set()
    for path in sorted(root.iterdir()):
        name = path.name
        st = _lstat(path)
        if st is None:
            continue
        if stat.S_ISLNK(st.st_mode):
            leave(path, "a symbolic link")
        elif name in (".logs", ".work", ROOT_MARKER, RECORDS):
            continue  # looked at below; park records are parking's own business
        elif KERNEL_ID_RE.match(name):
            if is_image(store, path):
                if name not in keep:
                    images.add(name)
                    size = _tree_bytes(path)
                    remove.append(Leftover("image", path, name, size, why_of.get(name)))
            else:
                leave(path, "no manifest of jupyter-cedana's for this kernel id")
        elif m := _TMP_RE.match(name):
            if not _mine(st, stat.S_IFDIR):
                leave(path, "not a directory of this user")
            elif m.group("kid") not in keep and _tmp_writer_gone(path, m):
                remove.append(Leftover("temporary", path, m.group("kid"), _tree_bytes(path)))
        elif m := _DEL_RE.match(name):
            if _mine(st, stat.S_IFDIR):
                remove.append(Leftover("temporary", path, m.group("kid"), _tree_bytes(path)))
            else:
                leave(path, "not a directory of this user")
        elif m := _PIDFILE_RE.match(name):
            if not marked or not _mine(st, stat.S_IFREG):
                leave(path, "not a file of this user under a marked checkpoint root")
            elif m.group("kid") not in keep and old(st):
                remove.append(Leftover("pidfile", path, m.group("kid"), st.st_size))
        else:
            leave(path, "not a name jupyter-cedana uses")

    for sub, kind, pattern, wanted in (
        (".logs", "log", _LOG_RE, stat.S_IFREG),
        (".work", "work", KERNEL_ID_RE, stat.S_IFDIR),
    ):
        folder = root / sub
        st = _lstat(folder)
        if st is None:
            continue
        if not marked or not _mine(st, stat.S_IFDIR):
            leave(folder, "not a directory of this user under a marked checkpoint root")
            continue
        for path in sorted(folder.iterdir()):
            m = pattern.match(path.name)
            pst = _lstat(path)
            if not m or pst is None or not _mine(pst, wanted):
                leave(path, "not a name jupyter-cedana uses")
                continue
            kid = m.group("kid") if "kid" in pattern.groupindex else path.name
            # The log and work files of an image being removed go with it.
            if kid not in keep and (kid in images or old(pst)):
                size = pst.st_size if wanted == stat.S_IFREG else _tree_bytes(path)
                remove.append(Leftover(kind, path, kid, size))
    records = root / RECORDS
    if _mine(_lstat(records), stat.S_IFDIR):
        for path in sorted(records.iterdir()):
            m = _RECORD_TMP_RE.match(path.name)
            pst = _lstat(path)
            # One named `.locked` was locked before it had a name (parkrecords.py); one
            # without may be between its creation and its lock, so it must settle first.
            settled = pst is not None and (
                bool(m and m.group("locked")) or now - pst.st_mtime > TMP_SETTLE
            )
            if m and settled and _mine(pst, stat.S_IFREG) and writer_gone(path):
                size = pst.st_size if pst is not None else 0
                remove.append(Leftover("partial record", path, m.group("kid"), size))
    # Records last: a record left without its image is dropped by the next adoption.
    remove.extend(item for item in refused if item.kernel_id not in keep)
    return Plan(remove, foreign)


def _remove_record(item: Leftover) -> str | None:
    """Unlink a refused record under its lock, unless it changed since it was judged."""
    try:
        with locked_record(item.path) as (fd, _text):
            if _identity(os.fstat(fd)) != item.seen:
                return f"{item.path} was rewritten since it was checked; left alone"
            remove_record(item.path)
    except RecordBusy:
        return f"{item.path} is now held by a server; left alone"
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"could not remove {item.path}: {e}"
    return None


def apply(leftovers: list[Leftover]) -> tuple[list[Leftover], list[str]]:
    """Remove what `plan` found, checking each entry again just before (it may have been
    replaced meanwhile); returns what was removed and the errors."""
    removed: list[Leftover] = []
    errors: list[str] = []
    for item in leftovers:
        st = _lstat(item.path)
        if st is None:
            continue
        is_dir = item.kind in ("image", "temporary", "work")
        if not _mine(st, stat.S_IFDIR if is_dir else stat.S_IFREG):
            errors.append(f"{item.path} changed since it was checked; left alone")
            continue
        m = _TMP_RE.match(item.path.name) if item.kind == "temporary" else None
        if m and not _tmp_writer_gone(item.path, m):
            errors.append(f"{item.path} is being written again; left alone")
            continue
        if item.kind == "partial record" and not writer_gone(item.path):
            errors.append(f"{item.path} is being written again; left alone")
            continue
        if item.kind == "record":
            error = _remove_record(item)
            if error is not None:
                errors.append(error)
                continue
            removed.append(item)
            continue
        try:
            if is_dir:
                # Out of the way first: a half-deleted image must never look whole.
                doomed = item.path
                if item.kind == "image":
                    doomed = item.path.with_name(f".{item.path.name}.del-{time.monotonic_ns()}")
                    os.rename(item.path, doomed)
                shutil.rmtree(doomed)
            else:
                item.path.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            errors.append(f"could not remove {item.path}: {e}")
            continue
        removed.append(item)
    return removed, errors
