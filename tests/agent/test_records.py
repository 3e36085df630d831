"""The agent's records on disk (records.py) and its kernels' output files (output.py),
without an agent: what is written, what is read back, what is refused and kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.agent.output import KernelOutput
from jupyter_cedana.agent.records import MAX_META, BadRecord, RecordStore, boot_id, start_time

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the records are root's")

KID = "0123abcd-0000-4000-8000-000000000001"


def fields(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "version": 1,
        "uid": 1001,
        "kernel_id": KID,
        "gid": 1001,
        "groups": [1001],
        "state": "running",
        "returncode": None,
        "note": None,
        "argv": ["python", "-m", "ipykernel_launcher"],
        "cwd": "/home/u",
        "boot_id": boot_id(),
        "init": {"pid": os.getpid(), "start": start_time(os.getpid())},
        "keeper": None,
        "since": 1.5,
    }
    return {**base, **over}


def test_written_private_and_read_back(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    store.save(fields())
    path = store.path(1001, KID)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert oct(store.root.stat().st_mode & 0o777) == "0o700"
    assert RecordStore(tmp_path).load() == [fields()]
    store.delete(1001, KID)
    assert RecordStore(tmp_path).load() == []


@pytest.mark.parametrize(
    "edit",
    [
        {"uid": 1002},  # moved to another user
        {"state": "dumped"},
        {"init": {"pid": 1, "start": 0}},
        {"version": 2},
    ],
)
def test_an_edited_record_is_refused_and_kept(tmp_path: Path, edit: dict[str, Any]) -> None:
    store = RecordStore(tmp_path)
    store.save(fields())
    path = store.path(1001, KID)
    data = json.loads(path.read_text())
    data.update(edit)
    path.write_text(json.dumps(data))
    assert RecordStore(tmp_path).load() == []
    kept = sorted((tmp_path / "refused-records").iterdir())
    assert [p.name.split(".json.")[0] for p in kept] == [f"1001-{KID}"] * 2
    reason = next(p for p in kept if p.name.endswith(".reason")).read_text()
    assert "signature does not match" in reason
    body = next(p for p in kept if not p.name.endswith(".reason")).read_text()
    assert json.loads(body) == data  # kept as found


def test_a_signed_record_that_does_not_validate_is_refused(tmp_path: Path) -> None:
    """Signed with the right key but naming another place than its file's."""
    store = RecordStore(tmp_path)
    with pytest.raises(BadRecord):
        store.save(fields(kernel_id="../../etc"))
    store.save(fields())
    os.rename(store.path(1001, KID).parent, store.root / "1002")
    assert RecordStore(tmp_path).load() == []
    reasons = [p.read_text() for p in (tmp_path / "refused-records").glob("*.reason")]
    assert len(reasons) == 1 and "names uid 1001 but lies under uid 1002" in reasons[0]


def test_strangers_in_the_records_directory(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    store.save(fields())
    udir = store.path(1001, KID).parent
    (udir / "notes.txt").write_text("hi")
    (udir / f".{KID}.json.tmp-1-2").write_text("half a record")  # a write cut short
    (store.root / "alice").mkdir()
    assert RecordStore(tmp_path).load() == [fields()]
    assert not (udir / f".{KID}.json.tmp-1-2").exists()
    names = sorted(p.name.split(".")[0] for p in (tmp_path / "refused-records").iterdir())
    assert names == ["1001-notes", "1001-notes", "alice", "alice"]


def test_a_record_of_another_mode_or_a_link_is_refused(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    store.save(fields())
    path = store.path(1001, KID)
    os.chmod(path, 0o644)
    assert RecordStore(tmp_path).load() == []
    store.save(fields())
    target = tmp_path / "elsewhere.json"
    os.rename(path, target)
    path.symlink_to(target)
    assert RecordStore(tmp_path).load() == []


def test_meta_is_kept_and_a_record_from_before_meta_still_reads(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    meta = {"kernel_name": "python3", "connection": {"key": "k", "shell_port": 1}}
    store.save(fields(meta=meta))
    assert RecordStore(tmp_path).load() == [fields(meta=meta)]
    store.save(fields())  # no `meta` at all: what an agent before it wrote
    assert RecordStore(tmp_path).load() == [fields()]
    assert not (tmp_path / "refused-records").exists()


@pytest.mark.parametrize("meta", ["a string", [1], {"k": "x" * MAX_META}])
def test_a_bad_meta_is_never_written(tmp_path: Path, meta: Any) -> None:
    with pytest.raises(BadRecord, match="meta"):
        RecordStore(tmp_path).save(fields(meta=meta))


def test_output_is_capped_and_its_tail_kept(tmp_path: Path) -> None:
    out = KernelOutput(tmp_path / "output" / "0" / f"{KID}.log", limit=64 * 1024)
    fd = out.open_writer()
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os\nfor i in range(32768): os.write(1, b'%07d\\n' % i)",
        ],
        stdout=fd,
    )
    out.close_writer()
    assert writer.wait() == 0
    size = out.path.stat().st_size
    assert size == 32768 * 8
    out.enforce_limit()
    assert out.path.stat().st_size == size  # the kernel's offset does not move
    assert out.path.stat().st_blocks * 512 <= 64 * 1024 + 2 * 4096
    kept = out.tail()
    assert out.dropped == size - len(kept) and out.dropped % 4096 == 0
    assert 64 * 1024 <= len(kept) <= 64 * 1024 + 4096
    assert kept.endswith(b"0032767\n")
    lines = kept.split(b"\n")[1:-1]  # the first may be cut
    assert [int(x) for x in lines] == list(range(32768 - len(lines), 32768))
    assert out.tail(8) == b"0032767\n"
    # A new agent learns where the data starts from the file alone.
    again = KernelOutput(out.path, limit=64 * 1024)
    assert again.dropped == out.dropped and again.tail() == kept
