"""Park records and their locks (parkrecords.py), without a server."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint import parkrecords
from jupyter_cedana.checkpoint.parkrecords import (
    RECORD_FORMAT,
    HeldRecord,
    RecordBusy,
    RecordInvalid,
    list_records,
    locked_record,
    parked_kernel_ids,
    parkers,
    parse_record,
    record_path,
    wait_for_parkers,
    write_record,
)
from jupyter_cedana.checkpoint.store import CheckpointStore
from jupyter_cedana.errors import InvalidId

LOG = logging.getLogger("test")


def record(kid: str, **extra: Any) -> dict[str, Any]:
    return {
        "format": RECORD_FORMAT,
        "kernel_id": kid,
        "kernel_name": "python3",
        "connection_info": {"key": "k", "shell_port": 1},
        "uid": os.geteuid(),
        **extra,
    }


def test_record_is_private_whole_and_listed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "root")
    kid = str(uuid.uuid4())
    path = write_record(store, record(kid, sessions=[{"id": "s", "path": "a.ipynb"}]))
    assert path == record_path(store, kid)
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    assert parse_record(path, path.read_text())["sessions"] == [{"id": "s", "path": "a.ipynb"}]
    assert os.listdir(path.parent) == [path.name]  # no temporary left
    assert list_records(store) == [path]
    # gc must keep the image of a kernel whose record cannot even be read.
    garbled = str(uuid.uuid4())
    (path.parent / f"{garbled}.json").write_text("{")
    (path.parent / "not an id.json").write_text("{}")
    assert parked_kernel_ids(store) == {kid, garbled}


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    kid = str(uuid.uuid4())
    with pytest.raises(TypeError):
        write_record(store, record(kid, bad=b"bytes are not JSON"))
    assert os.listdir(tmp_path / ".parked") == []


def test_ids_are_validated_before_any_path_is_built(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for bad in ("../escape", ".hidden", "a/b"):
        with pytest.raises(InvalidId):
            write_record(store, record(bad))
    assert not (tmp_path / ".parked").exists()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{", "does not parse"),
        ("[]", "not a format-1 park record"),
        (json.dumps({"format": 99}), "not a format-1 park record"),
        (json.dumps(record("other")), "names another kernel"),
    ],
)
def test_parse_record_says_what_is_wrong(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "ID.json"
    assert parse_record(path, json.dumps(record("ID")))["kernel_name"] == "python3"
    with pytest.raises(RecordInvalid, match=why):
        parse_record(path, text)


def test_parse_record_needs_what_adoption_uses(tmp_path: Path) -> None:
    for key in ("kernel_name", "connection_info", "uid"):
        rec = record("ID")
        del rec[key]
        with pytest.raises(RecordInvalid, match=repr(key)):
            parse_record(tmp_path / "ID.json", json.dumps(rec))


def test_a_locked_record_is_busy(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = write_record(store, record(str(uuid.uuid4())))
    holder = os.open(path, os.O_RDONLY)  # another open file: another server's lock
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(RecordBusy), locked_record(path):
            pass
    finally:
        os.close(holder)
    with locked_record(path) as (_fd, text):
        assert json.loads(text)["kernel_id"] == path.stem


def test_a_lock_won_on_a_removed_record_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other server adopted the kernel and removed its record between our open and
    our lock: the lock we then win is on a dead inode."""
    store = CheckpointStore(tmp_path)
    path = write_record(store, record(str(uuid.uuid4())))
    flock = fcntl.flock

    def adopted_meanwhile(fd: int, op: int) -> None:
        path.unlink()
        flock(fd, op)

    monkeypatch.setattr(parkrecords.fcntl, "flock", adopted_meanwhile)
    with pytest.raises(FileNotFoundError), locked_record(path):
        pass


HOLD_RECORD = """
import sys
from jupyter_cedana.checkpoint.store import CheckpointStore
from jupyter_cedana.checkpoint.parkrecords import HeldRecord, RECORD_FORMAT
record = {"format": RECORD_FORMAT, "kernel_id": sys.argv[2], "kernel_name": "python3",
          "connection_info": {}, "uid": 0}
held = HeldRecord.create(CheckpointStore(sys.argv[1]), record)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_record_is_busy_while_its_owner_lives_and_free_once_it_is_killed(
    tmp_path: Path,
) -> None:
    """The server that owns a suspended kernel holds its record's lock; SIGKILL of that
    server releases it, and the next server can adopt the kernel."""
    kid = str(uuid.uuid4())
    owner = subprocess.Popen(
        [sys.executable, "-c", HOLD_RECORD, str(tmp_path), kid],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    path = record_path(CheckpointStore(tmp_path), kid)
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "held\n"
        with pytest.raises(RecordBusy):
            HeldRecord.acquire(path)
    finally:
        owner.kill()
        owner.wait()
    held, text = HeldRecord.acquire(path)
    try:
        assert json.loads(text)["kernel_id"] == kid
    finally:
        held.release()


def test_a_held_record_stays_locked_through_its_updates(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    kid = str(uuid.uuid4())
    held = HeldRecord.create(store, record(kid, sessions=[]))
    path = record_path(store, kid)
    held.replace(record(kid, sessions=[{"id": "s", "path": "b.ipynb"}]))
    assert json.loads(path.read_text())["sessions"] == [{"id": "s", "path": "b.ipynb"}]
    with pytest.raises(RecordBusy):  # another open file: another server
        HeldRecord.acquire(path)
    # An update that cannot be written leaves the record as it was, still locked.
    with pytest.raises(TypeError):
        held.replace(record(kid, bad=b"bytes are not JSON"))
    assert json.loads(path.read_text())["sessions"] == [{"id": "s", "path": "b.ipynb"}]
    with pytest.raises(RecordBusy):
        HeldRecord.acquire(path)
    assert os.listdir(path.parent) == [path.name]  # no temporary left
    # Parked: the record stays, for the next server to take.
    held.release()
    taken, _ = HeldRecord.acquire(path)
    # Resumed or shut down: the record goes.
    taken.remove()
    assert not path.exists()


HOLD_PARKING_LOCK = """
import sys
from jupyter_cedana.checkpoint.store import CheckpointStore
from jupyter_cedana.checkpoint.parkrecords import ParkingLock
lock = ParkingLock(CheckpointStore(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
lock.release()
"""


def test_a_starting_server_waits_for_a_parking_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    parker = subprocess.Popen(
        [sys.executable, "-c", HOLD_PARKING_LOCK, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parker.stdout is not None and parker.stdout.readline() == "locked\n"
        assert parkers(store) == [parker.pid]
        assert asyncio.run(wait_for_parkers(store, 0.2, LOG)) == [parker.pid]

        async def wait_while_it_finishes() -> list[int]:
            waiting = asyncio.ensure_future(wait_for_parkers(store, 60, LOG))
            await asyncio.sleep(0)
            assert parker.stdin is not None
            parker.stdin.close()  # the parker finishes
            return await waiting

        assert asyncio.run(wait_while_it_finishes()) == []
    finally:
        parker.kill()
        parker.wait()
    assert not list((tmp_path / ".parked").glob(".parking-*"))


def test_a_dead_parkers_file_is_stale(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    stale = tmp_path / ".parked" / ".parking-999999"
    stale.parent.mkdir(mode=0o700)
    stale.touch()
    assert parkers(store) == []
    assert not stale.exists()
