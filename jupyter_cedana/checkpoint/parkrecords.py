"""Records of suspended kernels: one JSON file per kernel under
`<checkpoint root>/.parked/`, written atomically and durably, and the file locks that keep
two servers from adopting the same kernel or adopting while another server is still parking.

A kernel's record is written with its image, before the image is committed, and kept
while the kernel is suspended (by this server, parked, or adopted by the next one); it
goes when the kernel is resumed and its image dropped, or shut down. So whatever way a
server ends (a clean stop, SIGKILL, a reboot), the next server on the same checkpoint
root finds every suspended kernel's record and adopts it.

The server that owns a suspended kernel holds an exclusive flock on its record
(`HeldRecord`) for as long as it does: another live server on the same root skips it as
busy, and the lock of a server that died is released with its file descriptors.

A record holds the kernel's HMAC key: files are 0600 in a 0700 directory, like images.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from .durable import fsync_path, replace_json_durably
from .store import CheckpointStore, validate_kernel_id

RECORDS = ".parked"
RECORD_FORMAT = 1
_RECORD_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]{0,127})\.json$")
_PARKER_RE = re.compile(r"^\.parking-(\d+)$")


class RecordInvalid(Exception):
    """A record that cannot be adopted; the message says why."""


class RecordBusy(Exception):
    """Another process holds the record's lock (it is adopting that kernel)."""


def records_dir(store: CheckpointStore, create: bool = False) -> Path:
    path = store.root / RECORDS
    if create:
        store.ensure_root()
        path.mkdir(mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
    return path


def record_path(store: CheckpointStore, kernel_id: str) -> Path:
    return records_dir(store) / f"{validate_kernel_id(kernel_id)}.json"


def parked_kernel_ids(store: CheckpointStore) -> set[str]:
    """Ids of every kernel with a park record, readable or not: their images (and logs)
    belong to a parked kernel, not to nobody, and gc must keep them."""
    return {p.name[: -len(".json")] for p in list_records(store)}


def write_record(store: CheckpointStore, record: dict[str, Any]) -> Path:
    """Write a record durably; readers see a whole record or none."""
    kid = validate_kernel_id(record["kernel_id"])
    final = records_dir(store, create=True) / f"{kid}.json"
    replace_json_durably(final, record)
    return final


# What a record says of the server that owns its kernel, beyond what the provisioner knows:
# the server's identity (adoption matches it), the kernel's sessions, the gate's replies.
# Set by the server's KernelParking; a provisioner outside such a server records none.
ServerFacts = Callable[[str], Awaitable[dict[str, Any]]]
_server_facts: ServerFacts | None = None


def set_server_facts(facts: ServerFacts | None) -> None:
    global _server_facts
    _server_facts = facts


async def server_facts(kernel_id: str) -> dict[str, Any]:
    """The parts of a kernel's record that come from its server, not its provisioner."""
    facts: dict[str, Any] = {
        "uid": os.geteuid(),
        "hub_user": os.environ.get("JUPYTERHUB_USER") or None,
        "hub_server_name": os.environ.get("JUPYTERHUB_SERVER_NAME") or None,
        "identity": None,
        "sessions": [],
        "replies": None,
        "server_pid": os.getpid(),
        "host": socket.gethostname(),
    }
    if _server_facts is not None:
        facts.update(await _server_facts(kernel_id))
    return facts


def parse_record(path: Path, text: str) -> dict[str, Any]:
    """The record's content, or RecordInvalid with the reason."""
    try:
        record = json.loads(text)
    except ValueError as e:
        raise RecordInvalid(f"record {path.name} does not parse: {e}") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise RecordInvalid(f"record {path.name} is not a format-{RECORD_FORMAT} park record")
    expected = path.name[: -len(".json")]
    if record.get("kernel_id") != expected:
        raise RecordInvalid(f"record {path.name} names another kernel: {record.get('kernel_id')!r}")
    for key in ("kernel_name", "connection_info", "uid"):
        if key not in record:
            raise RecordInvalid(f"record {path.name} lacks {key!r}")
    return record


def list_records(store: CheckpointStore) -> list[Path]:
    d = records_dir(store)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _RECORD_RE.match(p.name))


@contextlib.contextmanager
def locked_record(path: Path) -> Iterator[tuple[int, str]]:
    """Hold an exclusive lock on a record for as long as the block runs; yields the open
    descriptor and the record's text. RecordBusy when another process holds it;
    FileNotFoundError when it is gone (e.g. its kernel was resumed and it was removed)."""
    held, text = HeldRecord.acquire(path)
    try:
        yield held.fd, text
    finally:
        held.release()


def remove_record(path: Path) -> None:
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        fsync_path(path.parent, directory=True)


class HeldRecord:
    """A record and the exclusive lock on it that its owner (the server whose suspended
    kernel it describes) holds for as long as it owns the kernel.

    The lock is on the inode: every write makes a new file, locked before it is renamed
    over the old one, and a removal unlinks the file before it unlocks; so a lock won on
    an unlinked or replaced file means nothing (`acquire` says FileNotFoundError)."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    @property
    def fd(self) -> int:
        assert self._fd is not None, "record released"
        return self._fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    @classmethod
    def acquire(cls, path: Path) -> tuple[HeldRecord, str]:
        """Lock an existing record; returns it and its text. RecordBusy when another
        process holds it; FileNotFoundError when it is gone."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise RecordBusy(f"record {path.name} is locked by another server") from None
                raise
            st = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                raise FileNotFoundError(path) from None
            if st.st_nlink == 0 or (st.st_ino, st.st_dev) != (now.st_ino, now.st_dev):
                raise FileNotFoundError(path)
            with os.fdopen(os.dup(fd), "r") as f:
                text = f.read()
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd), text

    @classmethod
    def create(cls, store: CheckpointStore, record: dict[str, Any]) -> HeldRecord:
        """Write a new record durably, locked from before anyone can see it; replaces a
        record of the same kernel (e.g. one its owner died holding)."""
        kid = validate_kernel_id(record["kernel_id"])
        path = records_dir(store, create=True) / f"{kid}.json"
        held = cls(path, _write_locked(path, record))
        try:
            fsync_path(path.parent, directory=True)
        except BaseException:
            held.remove()  # not known to be durable: not a record to count on
            raise
        return held

    def replace(self, record: dict[str, Any]) -> None:
        """Write new content (e.g. the kernel's sessions changed); the lock stays held.
        On failure the previous content stays, whole, or the new one is in place."""
        fd = _write_locked(self.path, record)
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)
        fsync_path(self.path.parent, directory=True)

    def remove(self) -> None:
        """The kernel is gone from its image (resumed, shut down): delete the record."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self._fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                remove_record(self.path)
        self.release()

    def release(self) -> None:
        """Keep the record, give up the lock (e.g. parked: the next server takes it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_locked(final: Path, record: dict[str, Any]) -> int:
    """Write JSON under a temporary name, lock and fsync it, rename it over `final`;
    returns the locked descriptor (the caller fsyncs the directory).

    The file is made as `.<name>.tmp-<pid>-<n>`, locked, and at once renamed to the same
    name with `.locked` (as dumps are, store.py): a temporary record so named is
    locked for as long as its writer lives, so gc takes one nobody holds at once; only
    one without `.locked` (its writer died within microseconds of making it) must settle
    first (store_gc.py)."""
    made = final.with_name(f".{final.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(made, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    tmp = made
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tmp = made.with_name(made.name + ".locked")
        os.rename(made, tmp)
        view = memoryview(json.dumps(record, indent=1).encode())
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        os.close(fd)
        raise
    return fd


class ParkingLock:
    """Held by a server while it parks its kernels (`.parked/.parking-<pid>`, flock), so
    that a server starting on the same root meanwhile can wait for the records."""

    def __init__(self, store: CheckpointStore):
        self.path = records_dir(store, create=True) / f".parking-{os.getpid()}"
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlink first: a waiter that wins the lock then finds the file gone or unlinked.
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _parker_busy(path: Path) -> bool:
    """Whether a `.parking-<pid>` file is locked by a live parker; a stale one (its server
    died or finished) is removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                path.unlink()
        return False
    finally:
        os.close(fd)


def parkers(store: CheckpointStore) -> list[int]:
    """PIDs of other servers parking kernels into this root right now."""
    d = records_dir(store)
    if not d.is_dir():
        return []
    busy = []
    for p in sorted(d.iterdir()):
        m = _PARKER_RE.match(p.name)
        if m and int(m.group(1)) != os.getpid() and _parker_busy(p):
            busy.append(int(m.group(1)))
    return busy


async def wait_for_parkers(store: CheckpointStore, timeout: float, log: Any) -> list[int]:
    """Wait until no other server is parking into this root, at most `timeout` seconds;
    returns the PIDs still parking then (empty: all done)."""
    busy = parkers(store)
    if not busy:
        return []
    log.info(
        "jupyter-cedana: server(s) %s still parking kernels into %s; waiting up to %.0f s "
        "before adopting",
        ", ".join(map(str, busy)),
        store.root,
        timeout,
    )
    deadline = time.monotonic() + timeout
    while busy and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        busy = parkers(store)
    return busy
