import datetime as dt
import time

from jupyter_cedana.checkpoint.store import CheckpointStore
from jupyter_cedana.timestamps import CLOCK, Stamp, iso


def test_iso_is_utc_whatever_the_local_zone(monkeypatch) -> None:
    monkeypatch.setenv("TZ", "XST8")  # POSIX: 8 hours west of UTC, no tzdata needed
    time.tzset()
    try:
        assert time.localtime(0).tm_hour == 16  # the local zone is not UTC
        assert iso(0) == "1970-01-01T00:00:00+00:00"
        assert dt.datetime.fromisoformat(iso(1700000000.25)).timestamp() == 1700000000.25
        assert iso(None) is None
    finally:
        monkeypatch.undo()
        time.tzset()


def test_an_image_says_when_it_was_made_on_the_boot_clock(tmp_path) -> None:
    """The manifest keeps its suspend's boot and boot-clock time: what retention counts
    from after the server that made it is gone."""
    store = CheckpointStore(tmp_path)
    before = CLOCK.boottime()
    tmp = store.begin("k")
    (tmp / "pages-1.img").write_bytes(b"p" * 4096)
    manifest = store.commit("k", tmp, {})
    made = Stamp.from_json(store.read_manifest("k")["created_clock"])
    assert made is not None and made.boot_id == CLOCK.boot_id()
    assert before is not None and made.boottime is not None
    assert before <= made.boottime <= (CLOCK.boottime() or 0)
    assert made.wall == manifest["created_clock"]["wall"]
    for garbage in (None, "x", {}, {"wall": "soon"}, [1]):
        assert Stamp.from_json(garbage) is None
