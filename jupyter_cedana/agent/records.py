"""The agent's kernel records on disk, so that a restarted agent can own its kernels again.

`<state>/records/<uid>/<kernel_id>.json`, root's alone (directories 0700, files 0600),
one file per kernel, replaced atomically (written beside, fsynced, renamed, the directory
fsynced). A record carries what re-owning the kernel takes: its uid and ids, its state,
the host pids of its init and of the process standing for it (cedana-init's watcher or
keeper) with their start times and the boot they belong to, and how it was launched.

A record is signed (HMAC-SHA256 with a key kept in the same directory) and checked field
by field when read back. The key guards against damage and hand edits, not against root,
who can read it: the state directory is root's, and root is trusted. A record that fails
any check is never trusted and never deleted: it is moved to `<state>/refused-records/`
with a file saying why, for the administrator.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = 1
STATES = ("running", "dumping", "dumped", "restoring", "exited")
_KERNEL_ID = re.compile(r"[0-9a-f-]{1,64}")
_BOOT_ID = re.compile(r"[0-9a-f-]{36}")
_NAME = re.compile(r"([0-9a-f-]{1,64})\.json")
MAX_RECORD = 256 * 1024
#: The most bytes a kernel's `meta` (launch) may take, encoded as compact JSON.
MAX_META = 16 * 1024
KEY_NAME = ".key"

log = logging.getLogger("jupyter_cedana.agent")


class BadRecord(Exception):
    """A record file that is not one this agent wrote, or not whole."""


def boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot): with the boot id, what tells a
    process from a later one that reused its pid. None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its end.
    return int(text.rpartition(")")[2].split()[19])


@dataclass(frozen=True)
class Proc:
    """A pid and the start time that makes it this process and no other."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> Proc | None:
        start = start_time(pid) if pid > 0 else None
        return None if start is None else cls(pid, start)

    def alive(self) -> bool:
        return start_time(self.pid) == self.start

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}


def _private_dir(path: Path) -> Path:
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        raise BadRecord(f"{path} is not a directory of root's")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _int(value: Any, what: str, low: int = 0, high: int = 2**32 - 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRecord(f"{what} is not an integer in [{low}, {high}]: {value!r}")
    return value


def _proc(value: Any, what: str) -> Proc | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"pid", "start"}:
        raise BadRecord(f"{what} must be {{pid, start}}")
    return Proc(_int(value["pid"], f"{what}.pid", 1, 2**22), _int(value["start"], what, 0, 2**63))


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and "\0" not in v for v in value):
        raise BadRecord(f"{what} must be a list of strings")
    return value


def meta_size(meta: dict[str, Any]) -> int:
    """Bytes of `meta` as compact JSON: what MAX_META bounds."""
    return len(json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode())


def validate(data: Any, uid: int, kernel_id: str) -> dict[str, Any]:
    """The record's fields, checked: types, ranges, and that it names the uid and kernel
    its file's place names. Raises BadRecord."""
    if not isinstance(data, dict):
        raise BadRecord("not a JSON object")
    expected = {
        "version",
        "uid",
        "kernel_id",
        "gid",
        "groups",
        "state",
        "returncode",
        "note",
        "argv",
        "cwd",
        "boot_id",
        "init",
        "keeper",
        "since",
    }
    # `meta` came later: a record written before it has none, and is as good.
    given = set(data) - {"meta"}
    if given != expected:
        raise BadRecord(f"fields {sorted(given ^ expected)} are missing or unknown")
    if data["version"] != VERSION:
        raise BadRecord(f"version {data['version']!r} is not {VERSION}")
    if _int(data["uid"], "uid", 0, 2**32 - 2) != uid:
        raise BadRecord(f"it names uid {data['uid']} but lies under uid {uid}")
    if not isinstance(data["kernel_id"], str) or not _KERNEL_ID.fullmatch(data["kernel_id"]):
        raise BadRecord(f"kernel id {data['kernel_id']!r} is not a kernel id")
    if data["kernel_id"] != kernel_id:
        raise BadRecord(f"it names kernel {data['kernel_id']!r}, its file {kernel_id!r}")
    _int(data["gid"], "gid", 0, 2**32 - 2)
    if not isinstance(data["groups"], list) or not data["groups"]:
        raise BadRecord("groups must be a non-empty list")
    for g in data["groups"]:
        _int(g, "a group", 0, 2**32 - 2)
    if data["state"] not in STATES:
        raise BadRecord(f"state {data['state']!r} is unknown")
    if data["returncode"] is not None:
        _int(data["returncode"], "returncode", -(2**31), 2**31)
    if data["note"] is not None and not isinstance(data["note"], str):
        raise BadRecord("note must be a string or null")
    _strings(data["argv"], "argv")
    if not isinstance(data["cwd"], str) or not os.path.isabs(data["cwd"]):
        raise BadRecord("cwd must be an absolute path")
    if not isinstance(data["boot_id"], str) or not _BOOT_ID.fullmatch(data["boot_id"]):
        raise BadRecord("boot_id is not a boot id")
    _proc(data["init"], "init")
    _proc(data["keeper"], "keeper")
    if not isinstance(data["since"], int | float) or isinstance(data["since"], bool):
        raise BadRecord("since must be a number")
    meta = data.get("meta")
    if meta is not None and (not isinstance(meta, dict) or meta_size(meta) > MAX_META):
        raise BadRecord(f"meta must be null or an object of at most {MAX_META} bytes")
    if data["state"] in ("running", "dumping") and data["init"] is None:
        raise BadRecord(f"a {data['state']} kernel's record has no init")
    return data


class RecordStore:
    """`<state>/records/`: one signed file per kernel."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self.root = self.state_dir / "records"
        self.refused_root = self.state_dir / "refused-records"
        self._key: bytes | None = None

    def _ready(self) -> Path:
        return _private_dir(self.root)

    @property
    def key(self) -> bytes:
        if self._key is None:
            path = self._ready() / KEY_NAME
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                write_atomic(path, secrets.token_bytes(32))
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
                    raise BadRecord(f"{path} must be root's, mode 0600")
                key = f.read()
            if len(key) != 32:
                raise BadRecord(f"{path} is not a 32-byte key")
            self._key = key
        return self._key

    def _mac(self, fields: dict[str, Any]) -> str:
        body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.key, body, hashlib.sha256).hexdigest()

    def path(self, uid: int, kernel_id: str) -> Path:
        return self.root / str(int(uid)) / f"{kernel_id}.json"

    def save(self, fields: dict[str, Any]) -> None:
        uid, kid = int(fields["uid"]), str(fields["kernel_id"])
        validate(fields, uid, kid)  # never write what could not be read back
        _private_dir(self._ready() / str(uid))
        signed = {**fields, "mac": self._mac(fields)}
        write_atomic(self.path(uid, kid), json.dumps(signed, sort_keys=True).encode())

    def delete(self, uid: int, kernel_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(uid, kernel_id))
            _fsync_dir(self.path(uid, kernel_id).parent)

    def _read(self, path: Path, uid: int, kernel_id: str) -> dict[str, Any]:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
                raise BadRecord("not a regular file of root's with mode 0600")
            raw = f.read(MAX_RECORD + 1)
        if len(raw) > MAX_RECORD:
            raise BadRecord(f"larger than {MAX_RECORD} bytes")
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise BadRecord(f"not JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("mac"), str):
            raise BadRecord("not signed")
        mac = data.pop("mac")
        if not hmac.compare_digest(mac, self._mac(data)):
            raise BadRecord("its signature does not match: it was edited or damaged")
        return validate(data, uid, kernel_id)

    def load(self) -> list[dict[str, Any]]:
        """Every record that checks out; any other file is moved aside, with why."""
        out: list[dict[str, Any]] = []
        root = self._ready()
        self.key  # noqa: B018 (made now, not in the middle of the first save)
        for udir in sorted(root.iterdir()):
            if udir.name == KEY_NAME:
                continue
            if udir.name.startswith(f".{KEY_NAME}.tmp-"):
                with contextlib.suppress(OSError):
                    udir.unlink()  # a key write cut short: the key is made again
                continue
            if not udir.name.isdigit() or udir.is_symlink() or not udir.is_dir():
                self.refuse(udir, "not a uid's directory of records")
                continue
            uid = int(udir.name)
            for entry in sorted(udir.iterdir()):
                if entry.name.startswith(".") and ".tmp-" in entry.name:
                    # A write cut short: the record it was replacing is still whole.
                    with contextlib.suppress(OSError):
                        entry.unlink()
                    continue
                m = _NAME.fullmatch(entry.name)
                try:
                    if m is None:
                        raise BadRecord("not a record's name")
                    out.append(self._read(entry, uid, m.group(1)))
                except (BadRecord, OSError) as e:
                    self.refuse(entry, str(e))
        return out

    def refuse(self, path: Path, reason: str) -> Path:
        """Move `path` out of use, beside a note of why: kept, never trusted."""
        base = _private_dir(self.refused_root)
        rel = path.relative_to(self.root)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dest = base / f"{'-'.join(rel.parts)}.{stamp}.{time.monotonic_ns()}"
        os.rename(path, dest)
        write_atomic(dest.with_name(dest.name + ".reason"), (reason + "\n").encode())
        log.error("kernel record %s refused (kept as %s): %s", path, dest, reason)
        return dest

    def refused(self, uid: int) -> list[str]:
        """Names of a uid's records kept aside."""
        if not self.refused_root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.refused_root.iterdir()
            if p.name.startswith(f"{int(uid)}-") and not p.name.endswith(".reason")
        )
