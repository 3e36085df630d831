import datetime as dt
import time

from jupyter_cedana.timestamps import iso


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
