"""`jupyter cedana gc`'s plan: it removes only what it can prove jupyter-cedana wrote."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from jupyter_cedana.checkpoint import store_gc
from jupyter_cedana.checkpoint.store import ROOT_MARKER, CheckpointStore


def image(store: CheckpointStore, kid: str, payload: bytes = b"p" * 4096) -> Path:
    tmp = store.begin(kid)
    (tmp / "pages-1.img").write_bytes(payload)
    store.commit(kid, tmp, {"timings": {}})
    return store.path(kid)


def tree(root: Path) -> dict[str, str]:
    """Every entry under root (links not followed) with what it is and holds."""
    found = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = "link->" + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = "file:" + path.read_bytes().hex()
    return found


def age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past), follow_symlinks=False)


def test_only_provably_ours_is_removed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "root")
    store.ensure_root()
    root = store.root
    kept, orphan, gone = (str(uuid.uuid4()) for _ in range(3))
    image(store, kept)
    image(store, orphan)
    dead_tmp = root / f".{gone}.tmp-999999999-1"
    dead_tmp.mkdir()
    live_tmp = store.begin(str(uuid.uuid4()))  # named after this live process
    half_deleted = root / f".{gone}.del-5"
    half_deleted.mkdir()
    (half_deleted / "pages-1.img").write_bytes(b"x")
    for kid in (kept, orphan, gone):
        (store.log_path(kid)).write_text("log")
        age(store.log_path(kid), store_gc.GC_MIN_AGE + 60)
    work = store.work_dir(gone)
    age(work, store_gc.GC_MIN_AGE + 60)

    # Foreign things, some named like ours.
    elsewhere = tmp_path / "elsewhere"
    outside = CheckpointStore(elsewhere)
    target = image(outside, str(uuid.uuid4()))
    (root / target.name).symlink_to(target)  # a link to a valid image elsewhere
    no_manifest = root / str(uuid.uuid4())
    no_manifest.mkdir()
    (no_manifest / "data.csv").write_text("1,2,3")
    other_format = root / str(uuid.uuid4())
    other_format.mkdir()
    (other_format / "manifest.json").write_text(json.dumps({"format": 99}))
    wrong_id = root / str(uuid.uuid4())
    wrong_id.mkdir()
    (wrong_id / "manifest.json").write_text(json.dumps({"format": 1, "kernel_id": "other"}))
    file_like_id = root / str(uuid.uuid4())
    file_like_id.write_text("not a directory")
    (root / "notes.txt").write_text("mine")
    tmp_file = root / f".{gone}.tmp-999999999-2"
    tmp_file.write_text("a file, not a dump directory")

    before = tree(root)
    outside_before = tree(elsewhere)
    plan = store_gc.plan(store, keep={kept})
    planned = {(i.kind, i.path.name) for i in plan.remove}
    assert planned == {
        ("image", orphan),
        ("temporary", dead_tmp.name),
        ("temporary", half_deleted.name),
        ("log", f"{orphan}.log"),
        ("log", f"{gone}.log"),
        ("work", gone),
    }
    left = {f.path.name for f in plan.foreign}
    assert {
        target.name,
        no_manifest.name,
        other_format.name,
        wrong_id.name,
        file_like_id.name,
        "notes.txt",
        tmp_file.name,
    } <= left

    removed, errors = store_gc.apply(plan.remove)
    assert errors == []
    assert {(i.kind, i.path.name) for i in removed} == planned
    after = tree(root)
    gone_paths = {k for k in before if k not in after}
    for rel in gone_paths:
        top = rel.split("/")[0]
        assert top in (orphan, dead_tmp.name, half_deleted.name, ".logs", ".work"), rel
    assert {k: v for k, v in before.items() if k in after} == after  # nothing else changed
    assert store.exists(kept) and live_tmp.is_dir()
    assert tree(elsewhere) == outside_before  # the link's target is untouched
    assert (root / target.name).is_symlink()


def test_a_users_directory_is_left_alone(tmp_path: Path) -> None:
    """gc pointed at the wrong root (here: someone's home) removes nothing: without the
    store's marker not even files named like its logs and pid files are touched."""
    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    (home / "project" / "train.py").write_text("print('hi')")
    (home / ".bashrc").write_text("export A=1")
    kid = str(uuid.uuid4())
    (home / ".logs").mkdir()
    (home / ".logs" / f"{kid}.log").write_text("my own log")
    (home / f".{kid}.pid").write_text("123")
    (home / ".work" / kid).mkdir(parents=True)
    (home / str(uuid.uuid4())).mkdir()
    (home / str(uuid.uuid4())).write_text("a file named like a kernel id")
    (home / "link").symlink_to(tmp_path)
    (home / str(uuid.uuid4())).symlink_to(home / "project")
    for path in home.rglob("*"):
        age(path, store_gc.GC_MIN_AGE + 60)
    before = tree(home)

    store = CheckpointStore(home)
    plan = store_gc.plan(store, keep=set())
    assert plan.remove == []
    assert len(plan.foreign) >= 8
    assert store_gc.apply(plan.remove) == ([], [])
    assert tree(home) == before
    assert not (home / ROOT_MARKER).exists()  # planning writes nothing either


def test_fresh_leftovers_may_belong_to_a_starting_kernel(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.ensure_root()
    live, starting = str(uuid.uuid4()), str(uuid.uuid4())
    for kid in (live, starting):
        store.log_path(kid).write_text("log")
        (tmp_path / f".{kid}.pid").write_text("1")
    image(store, orphan := str(uuid.uuid4()))
    store.log_path(orphan).write_text("the log of an image goes with it, however young")

    now = time.time()
    fresh = {(i.kind, i.kernel_id) for i in store_gc.plan(store, {live}, now=now).remove}
    assert fresh == {("image", orphan), ("log", orphan)}
    later = store_gc.plan(store, {live}, now=now + store_gc.GC_MIN_AGE + 1).remove
    assert {(i.kind, i.kernel_id) for i in later} == {
        ("image", orphan),
        ("log", orphan),
        ("log", starting),
        ("pidfile", starting),
    }


def test_an_entry_replaced_after_planning_is_left_alone(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "root")
    store.ensure_root()
    orphan = image(store, str(uuid.uuid4()))
    plan = store_gc.plan(store, keep=set())
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    for p in sorted(orphan.rglob("*"), reverse=True):
        p.unlink()
    orphan.rmdir()
    orphan.symlink_to(victim)
    removed, errors = store_gc.apply(plan.remove)
    assert removed == [] and len(errors) == 1 and "changed" in errors[0]
    assert (victim / "precious").read_text() == "keep me"


def record(store: CheckpointStore, kid: str, kernel_name: str = "python3") -> Path:
    """A park record as a server writes it for a suspended kernel."""
    path = store.root / ".parked" / f"{kid}.json"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    body = {
        "format": 1,
        "kernel_id": kid,
        "kernel_name": kernel_name,
        "connection_info": {"key": "k", "ip": "127.0.0.1"},
        "uid": os.geteuid(),
    }
    path.write_text(json.dumps(body))
    return path


def test_suspended_kernels_keep_their_images_and_records(tmp_path: Path) -> None:
    """A suspended kernel (a record under .parked/) owns its image although no running
    server lists it: the next server adopts it. Only images with no record are orphans."""
    store = CheckpointStore(tmp_path)
    store.ensure_root()
    parked, orphan = str(uuid.uuid4()), str(uuid.uuid4())
    image(store, parked)
    image(store, orphan)
    kept = record(store, parked)
    plan = store_gc.plan(store, keep=set(), kernelspec_known=lambda name: True)
    assert {(i.kind, i.kernel_id) for i in plan.remove} == {("image", orphan)}
    assert ".parked" not in {f.path.name for f in plan.foreign}
    store_gc.apply(plan.remove)
    assert store.exists(parked) and kept.is_file() and not store.exists(orphan)


def test_records_adoption_refuses_are_collected_with_the_reason(tmp_path: Path) -> None:
    """A record no server can adopt (it does not parse, is of another format, or names a
    kernelspec that is gone) holds its image for nobody: gc says why and removes both.
    A record a live server holds locked is its kernel's, whatever gc makes of it."""
    store = CheckpointStore(tmp_path)
    store.ensure_root()
    good, torn, alien, nospec, held, unjudged, newer = (str(uuid.uuid4()) for _ in range(7))
    for kid in (good, torn, alien, nospec, held, unjudged, newer):
        image(store, kid)
    record(store, good)
    record(store, torn).write_text('{"format": 1, "kernel_id"')
    record(store, alien).write_text(json.dumps([{"format": 1, "kernel_id": alien}]))
    # A newer jupyter-cedana's record: that version may adopt it.
    record(store, newer).write_text(json.dumps({"format": 99, "kernel_id": newer}))
    record(store, nospec, kernel_name="gone-spec")
    held_path = record(store, held)
    held_path.write_text("not json either")
    record(store, unjudged, kernel_name="unknown-spec")
    fd = os.open(held_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the server that owns the kernel does
    try:
        known = {"python3": True, "gone-spec": False}
        plan = store_gc.plan(store, keep=set(), kernelspec_known=known.get)
        planned = {(i.kind, i.kernel_id): i.why for i in plan.remove}
        assert set(planned) == {
            ("record", torn),
            ("image", torn),
            ("record", alien),
            ("image", alien),
            ("record", nospec),
            ("image", nospec),
        }
        assert "does not parse" in (planned["record", torn] or "")
        assert "format" in (planned["record", alien] or "")
        assert "kernelspec 'gone-spec' is gone" in (planned["record", nospec] or "")
        assert planned["image", nospec] == planned["record", nospec]
        removed, errors = store_gc.apply(plan.remove)
        assert errors == [] and len(removed) == 6
    finally:
        os.close(fd)
    for kid in (good, held, unjudged, newer):
        assert store.exists(kid)
    assert {p.name for p in (tmp_path / ".parked").iterdir()} == {
        f"{good}.json",
        f"{held}.json",
        f"{unjudged}.json",
        f"{newer}.json",
    }
    for kid in (torn, alien, nospec):
        assert not store.exists(kid)


# A process that starts a dump the way a server does, says where, and waits to be killed.
_WRITER = """
import sys, time
from jupyter_cedana.checkpoint.store import CheckpointStore
tmp = CheckpointStore(sys.argv[1]).begin(sys.argv[2])
(tmp / "pages-1.img").write_bytes(b"p" * 4096)
print(tmp, flush=True)
time.sleep(3600)
"""


def _start_writer(root: Path, kid: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), kid], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the writer did not start its dump"
    return proc, Path(line)


def _renamed_for_pid(tmp: Path, pid: int) -> Path:
    """The same partial dump under a name that says another process wrote it."""
    m = store_gc._TMP_RE.match(tmp.name)
    assert m, tmp.name
    new = tmp.with_name(tmp.name.replace(f".tmp-{m.group('pid')}-", f".tmp-{pid}-", 1))
    os.rename(tmp, new)
    return new


def test_a_dead_writers_partial_dump_is_collected_though_its_pid_was_reused(
    tmp_path: Path,
) -> None:
    """In a container a server is PID 1 (or 7) every time: the dump a SIGKILLed server
    left names the PID of the server now running gc, and is collected all the same."""
    store = CheckpointStore(tmp_path)
    kid = str(uuid.uuid4())
    proc, tmp = _start_writer(tmp_path, kid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reused = _renamed_for_pid(tmp, os.getpid())  # this live process: the PID's new owner
    plan = store_gc.plan(store, keep=set())
    assert {(i.kind, i.path.name) for i in plan.remove} == {("temporary", reused.name)}
    removed, errors = store_gc.apply(plan.remove)
    assert errors == [] and len(removed) == 1 and not reused.exists()


def test_a_live_writers_partial_dump_is_kept_whatever_its_name_says(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    kid = str(uuid.uuid4())
    proc, tmp = _start_writer(tmp_path, kid)
    try:
        elsewhere = _renamed_for_pid(tmp, 999999999)  # no such process
        assert store_gc.plan(store, keep=set()).remove == []
        assert (elsewhere / "pages-1.img").read_bytes() == b"p" * 4096
    finally:
        proc.kill()
        proc.wait()
    assert {i.path.name for i in store_gc.plan(store, keep=set()).remove} == {elsewhere.name}


def test_a_record_write_cut_short_is_collected_once_its_writer_is_gone(tmp_path: Path) -> None:
    """A server killed between writing a record's temporary file and renaming it leaves
    the file (with the kernel's key in it). Its writer held a lock on it while writing:
    a file nobody holds is collected, by whatever PID its name says wrote it."""
    store = CheckpointStore(tmp_path)
    store.ensure_root()
    records = tmp_path / ".parked"
    records.mkdir(mode=0o700)
    kid = str(uuid.uuid4())
    left = records / f".{kid}.json.tmp-{os.getpid()}-1"  # a PID that lives: this one's
    left.write_text('{"format": 1, "kernel_id": "' + kid + '", "connection_info": {"key": "s')
    writing = records / f".{kid}.json.tmp-999999999-2"  # held by a live writer
    writing.write_text("{")
    just_made = records / f".{kid}.json.tmp-999999999-3"  # made, not yet locked
    just_made.write_text("")
    for path in (left, writing):
        age(path, store_gc.TMP_SETTLE + 1)
    fd = os.open(writing, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        plan = store_gc.plan(store, keep=set())
        assert {(i.kind, i.path.name) for i in plan.remove} == {("partial record", left.name)}
        removed, errors = store_gc.apply(plan.remove)
        assert errors == [] and [i.path for i in removed] == [left] and not left.exists()
    finally:
        os.close(fd)
    assert writing.exists() and just_made.exists()


def test_a_locked_record_write_cut_short_is_collected_at_once(tmp_path: Path) -> None:
    """The record writer locks its file before naming it `.locked`, so gc needs no
    settling time for such a file: a fresh one nobody holds is a dead writer's, at once;
    one held is being written; one without `.locked` still waits to settle."""
    store = CheckpointStore(tmp_path)
    store.ensure_root()
    records = tmp_path / ".parked"
    records.mkdir(mode=0o700)
    kid = str(uuid.uuid4())
    left = records / f".{kid}.json.tmp-999999999-1.locked"
    holder = records / f".{kid}.json.tmp-999999999-2.locked"
    unlocked = records / f".{kid}.json.tmp-999999999-3"
    for path in (left, holder, unlocked):
        path.write_text("{")
    fd = os.open(holder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        plan = store_gc.plan(store, keep=set())
        assert {(i.kind, i.path.name) for i in plan.remove} == {("partial record", left.name)}
        _removed, errors = store_gc.apply(plan.remove)
        assert errors == [] and not left.exists()
    finally:
        os.close(fd)
    assert holder.exists() and unlocked.exists()


def test_the_record_writer_names_its_file_only_once_locked(tmp_path: Path) -> None:
    """The name a record write's temporary file carries while it is written is already
    locked: seen from outside at the rename over the record (intercepted)."""
    from jupyter_cedana.checkpoint import parkrecords
    from jupyter_cedana.checkpoint.durable import writer_gone

    store = CheckpointStore(tmp_path)
    store.ensure_root()
    kid = str(uuid.uuid4())
    parkrecords.record_path(store, kid).parent.mkdir(mode=0o700, exist_ok=True)
    seen: list[tuple[str, bool]] = []
    real_rename = os.rename

    def looking_rename(src: str | Path, dst: str | Path) -> None:
        seen.append((Path(src).name, writer_gone(Path(src))))
        real_rename(src, dst)

    os.rename = looking_rename  # type: ignore[assignment]
    try:
        held = parkrecords.HeldRecord.create(store, {"format": 1, "kernel_id": kid})
    finally:
        os.rename = real_rename
    held.release()
    assert len(seen) == 2 and seen[-1][0].endswith(".locked") and seen[-1][1] is False, seen
