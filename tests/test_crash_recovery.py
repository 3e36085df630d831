"""Suspended kernels survive any end of their server: SIGKILL of the server that suspended
them and of the one that adopted them, a record that cannot be written, and servers of
other projects sharing the checkpoint root. Real `jupyter server` processes, real
kernels, real CRIU.

Each server is killed at a named point: once `jupyter cedana suspend` has returned, the
kernel's image and record are committed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_cli import Server, cedana
from tests.test_lazy import PAGES
from tests.test_parking import (
    create_session,
    execute,
    gone,
    kernel_processes,
    listed,
    records,
    server_with_kernel,
    servers,
    start_server,
    stop_with,
)

__all__ = ["servers"]  # a fixture, used by name

pytestmark = pytest.mark.criu

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount)")


def sigkill(server: Server) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=60)


def sessions(server: Server) -> list[tuple[str, str, str]]:
    status, found = server.api("GET", "api/sessions")
    assert status == 200
    return [(s["id"], s["path"], s["kernel"]["id"]) for s in found]


def test_a_suspended_kernel_survives_sigkill_of_every_server(
    tmp_path: Path, servers: list[Server]
) -> None:
    a, root, kid = server_with_kernel(
        tmp_path, servers, "import numpy as np; arr = np.arange(1000); x = 41"
    )
    session = create_session(a, "work/crash.ipynb", kid)
    cedana(a, "suspend", kid)
    # The record is written with the image, not when the server stops...
    assert set(records(root)) == {kid}
    assert records(root)[kid]["sessions"][0]["path"] == "work/crash.ipynb"
    # ...and follows the kernel's sessions while it is suspended (a notebook renamed).
    status, _ = a.api("PATCH", f"api/sessions/{session['id']}", {"path": "work/renamed.ipynb"})
    assert status == 200
    assert records(root)[kid]["sessions"][0]["path"] == "work/renamed.ipynb"

    # A second live server on the same root leaves the kernel to the one that owns it.
    other = start_server(tmp_path / "other", checkpoint_root=root)
    servers.append(other)
    assert listed(other) == set()
    assert f"parked kernel {kid} not adopted: record {kid}.json is locked" in (
        other.log.read_text()
    )
    stop_with(other, signal.SIGTERM)

    sigkill(a)
    b = start_server(tmp_path / "b", checkpoint_root=root)
    servers.append(b)
    assert listed(b) == {kid}
    assert b.kernel(kid)["state"] == "suspended"
    assert sessions(b) == [(session["id"], "work/renamed.ipynb", kid)]
    assert set(records(root)) == {kid}  # kept while it is suspended

    # The adopting server dies too, before anyone ran a cell: the next one adopts it again.
    sigkill(b)
    c = start_server(tmp_path / "c", checkpoint_root=root)
    servers.append(c)
    assert listed(c) == {kid}
    assert c.kernel(kid)["state"] == "suspended"
    assert sessions(c) == [(session["id"], "work/renamed.ipynb", kid)]
    out = execute(c, kid, "print(x + 1, int(arr.sum()))")
    assert out["reply"]["status"] == "ok" and out["stdout"].strip() == "42 499500", out
    assert c.kernel(kid)["state"] == "running"
    # Resumed: a server started after a crash now must not bring back the older state.
    assert records(root) == {}

    # Suspended again, and killed again: the new state comes back.
    assert execute(c, kid, "x = 99")["reply"]["status"] == "ok"
    cedana(c, "suspend", kid)
    sigkill(c)
    d = start_server(tmp_path / "d", checkpoint_root=root)
    servers.append(d)
    assert execute(d, kid, "print(x)")["stdout"].strip() == "99"

    # Closed while suspended: the kernel is shut down, its image and record go with it.
    cedana(d, "suspend", kid)
    assert d.api("DELETE", f"api/sessions/{session['id']}")[0] == 204
    assert records(root) == {} and not (root / kid).exists()


def test_kernels_of_another_project_are_left_alone(tmp_path: Path, servers: list[Server]) -> None:
    """Servers of one user in two directories share the default checkpoint root: each
    adopts only its own kernels, and says why it leaves the others."""
    root = tmp_path / "checkpoints"
    a = start_server(tmp_path / "a", checkpoint_root=root, notebooks="project-a")
    servers.append(a)
    kid = a.start_kernel()
    assert execute(a, kid, "w = 'a'")["reply"]["status"] == "ok"
    cedana(a, "suspend", kid)
    sigkill(a)

    b = start_server(tmp_path / "b", checkpoint_root=root, notebooks="project-b")
    servers.append(b)
    assert listed(b) == set()
    theirs = os.path.realpath(tmp_path / "project-a")
    assert (
        f"parked kernel {kid} not adopted: it belongs to the server with identity {theirs!r}"
    ) in b.log.read_text()
    assert set(records(root)) == {kid} and (root / kid / "manifest.json").is_file()
    stop_with(b, signal.SIGTERM)

    # An explicit identity names the same server from elsewhere.
    c = start_server(
        tmp_path / "c",
        f"--KernelParking.server_identity={theirs}",
        checkpoint_root=root,
        notebooks="project-c",
    )
    servers.append(c)
    assert listed(c) == {kid}
    assert execute(c, kid, "print(w)")["stdout"].strip() == "a"


@contextlib.contextmanager
def full_records_dir(root: Path) -> Iterator[Path]:
    """The records' directory on a tiny tmpfs, which `fill` fills up: no record can be
    written there, while the images (elsewhere) still can."""
    records_dir = root / ".parked"
    records_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(records_dir)],
        check=True,
    )
    try:
        yield records_dir
    finally:
        subprocess.run(["umount", "-l", str(records_dir)], check=False)


def fill(directory: Path) -> None:
    fd = os.open(directory / ".filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


@needs_root
def test_a_suspend_without_room_for_the_record_fails_and_the_kernel_runs_on(
    tmp_path: Path, servers: list[Server]
) -> None:
    root = tmp_path / "checkpoints"
    with full_records_dir(root) as rdir:
        a = start_server(tmp_path / "a", checkpoint_root=root)
        servers.append(a)
        kid = a.start_kernel()
        assert execute(a, kid, "x = 41")["reply"]["status"] == "ok"

        # No room for the record: the suspend fails before the image is committed, says
        # why, and the kernel runs on with its state.
        fill(rdir)
        status, err = a.api("POST", f"api/cedana/kernels/{kid}/suspend")
        assert status >= 400, err
        assert "record" in err["message"] and "No space left" in err["message"], err
        assert a.kernel(kid)["state"] == "running"
        assert "could not be written" in (a.kernel(kid)["reason"] or ""), a.kernel(kid)
        assert execute(a, kid, "print(x + 1)")["stdout"].strip() == "42"
        assert not (root / kid).exists() and records(root) == {}


@needs_root
def test_parking_without_room_for_the_record_keeps_the_image(
    tmp_path: Path, servers: list[Server]
) -> None:
    root = tmp_path / "checkpoints"
    with full_records_dir(root) as rdir:
        a = start_server(tmp_path / "a", checkpoint_root=root)
        servers.append(a)
        kid = a.start_kernel()
        assert execute(a, kid, "x = 41")["reply"]["status"] == "ok"

        # Suspended; then the disk fills up before the server stops: parking cannot bring
        # the record up to date, and keeps the image and the record of the suspend.
        cedana(a, "suspend", kid)
        fill(rdir)
        log = stop_with(a, signal.SIGTERM)
        assert (root / kid / "manifest.json").is_file(), log[-4000:]
        assert f"kernel {kid}: its record could not be brought up to date" in log, log[-4000:]
        assert "parked 1 of 1 kernel(s)" in log
        assert set(records(root)) == {kid}

        b = start_server(tmp_path / "b", checkpoint_root=root)
        servers.append(b)
        assert b.kernel(kid)["state"] == "suspended"
        assert execute(b, kid, "print(x + 2)")["stdout"].strip() == "43"


def held_lazy_restores(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """Server options for restores that are all lazy, with a page server whose transfer
    holds while the returned file exists (the kernel runs on pages served on demand)."""
    hold = tmp_path / "hold-transfer"
    wrapper = tmp_path / "cedana-pages"
    wrapper.write_text(f'#!/bin/sh\nexec {PAGES} --pause-file {hold} "$@"\n')
    wrapper.chmod(0o755)
    lazy = (
        "--CheckpointEngine.lazy_restore_min_bytes=0",
        f"--CheckpointEngine.pages_path={wrapper}",
    )
    return hold, lazy


def test_a_server_killed_mid_lazy_resume_gives_back_the_checkpoint_and_says_so(
    tmp_path: Path, servers: list[Server]
) -> None:
    """A lazily resumed kernel runs while its memory comes in; its image and record stay
    until then. A server killed meanwhile takes the kernel with it; the next server gives
    back the kernel as it was at its checkpoint, and says what was lost."""
    hold, lazy = held_lazy_restores(tmp_path)
    a, root, kid = server_with_kernel(
        tmp_path, servers, "import numpy as np; a = np.arange(4 << 20); x = 1", *lazy
    )
    cedana(a, "suspend", kid)
    hold.touch()  # the resume's transfer holds: the kernel runs on pages served on demand
    assert execute(a, kid, "x = 2; print(x)")["stdout"].strip() == "2"
    assert a.kernel(kid)["state"] == "running"
    assert records(root)[kid]["resumed_at"] and (root / kid / "manifest.json").is_file()

    watched = kernel_processes(a, [kid])
    sigkill(a)
    assert gone(watched, timeout=60) == []
    b = start_server(tmp_path / "b", checkpoint_root=root)
    servers.append(b)
    k = b.kernel(kid)
    assert k["state"] == "suspended", k
    assert "what it did after that resume is lost" in (k["reason"] or ""), k
    assert execute(b, kid, "print(x, int(a.sum()))")["stdout"].strip() == (
        f"1 {sum(range(4 << 20))}"
    )
