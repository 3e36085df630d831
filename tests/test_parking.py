"""Park on stop, adopt on start, against real `jupyter server` processes (stdin not a
terminal, as under a spawner), real kernels and real CRIU.

Races are held deterministically: a wrapper around criu blocks every dump while a file
exists, so a test can stop a server in the middle of parking.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import subprocess
import time
import urllib.error
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect
from traitlets.config import Config

from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.timestamps import Stamp, stamp
from tests import test_cli
from tests.conftest import run, start_kernel, stop_kernel, wait_iopub
from tests.test_cli import (
    Server,
    _alive,
    _descendants,
    _proc_table,
    cedana,
    plant_image,
    stop_server,
    wait_ready,
)
from tests.test_server import Client

pytestmark = pytest.mark.criu

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, criu wrapper)")


# -- helpers --------------------------------------------------------------------------------


def start_server(base: Path, *args: str, checkpoint_root: Path | None = None, **kw: Any) -> Server:
    """test_cli.start_server, with the root_dir that every server of a test shares (a
    server adopts only the kernels of servers with its identity: by default its root_dir),
    reached through base/root as a symlink. `notebooks=` names another shared directory."""
    notebooks = kw.pop("notebooks", "notebooks")
    shared = (checkpoint_root or base / "checkpoints").parent / notebooks
    shared.mkdir(parents=True, exist_ok=True)
    base.mkdir(parents=True, exist_ok=True)
    if not (base / "root").exists():
        (base / "root").symlink_to(shared)
    return test_cli.start_server(base, *args, checkpoint_root=checkpoint_root, **kw)


def wait_log(server: Server, text: str, count: int = 1, timeout: float = 120) -> str:
    """Wait until the server's log holds `text` `count` times (an event, not a delay)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = server.log.read_text(errors="replace")
        if log.count(text) >= count:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the log {count}x:\n{server.server_log()}")


def stop_with(server: Server, sig: int, timeout: float = 120) -> str:
    """Stop a server with a signal; returns its log. It must exit cleanly."""
    server.proc.send_signal(sig)
    try:
        server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_server(server)
        raise
    log = server.log.read_text(errors="replace")
    assert server.proc.returncode == 0, log[-6000:]
    return log


def records(root: Path) -> dict[str, dict[str, Any]]:
    d = root / ".parked"
    if not d.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")}


def execute(server: Server, kid: str, code: str, timeout: float = 120) -> dict[str, Any]:
    """Run code through the server's kernel websocket, as a notebook does."""

    async def go() -> dict[str, Any]:
        url = server.url.replace("http://", "ws://") + f"api/kernels/{kid}/channels"
        req = HTTPRequest(url, headers={"Authorization": f"token {server.token}"})
        ws = await websocket_connect(req)
        try:
            return await Client(ws).run(code)
        finally:
            ws.close()

    return asyncio.run(asyncio.wait_for(go(), timeout))


def server_with_kernel(
    tmp_path: Path, servers: list[Server], code: str, *args: str, **kw: Any
) -> tuple[Server, Path, str]:
    """A server on tmp_path/checkpoints with one kernel that ran `code`."""
    root = tmp_path / "checkpoints"
    server = start_server(tmp_path / "a", *args, checkpoint_root=root, **kw)
    servers.append(server)
    kid = server.start_kernel()
    assert execute(server, kid, code)["reply"]["status"] == "ok"
    return server, root, kid


def create_session(server: Server, path: str, kid: str) -> dict[str, Any]:
    body = {"path": path, "name": Path(path).name, "type": "notebook", "kernel": {"id": kid}}
    status, session = server.api("POST", "api/sessions", body)
    assert status == 201, session
    return dict(session)


def listed(server: Server) -> set[str]:
    status, kernels = server.api("GET", "api/kernels")
    assert status == 200
    return {k["id"] for k in kernels}


def kernel_processes(server: Server, kids: list[str]) -> dict[int, tuple[int, str, str, str]]:
    """Every process of these kernels (and of the server's children), to check later that
    none is left."""
    table = _proc_table()
    below = _descendants(table, server.proc.pid)
    return {
        pid: row
        for pid, row in table.items()
        if pid != server.proc.pid and (pid in below or any(k in row[3] for k in kids))
    }


def gone(watched: dict[int, tuple[int, str, str, str]], timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while _alive(watched) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(watched)


def leftovers(root: Path) -> list[str]:
    """Partial dumps and partial records: what a failed park must not leave behind."""
    names = [p.name for p in root.iterdir()]
    if (root / ".parked").is_dir():
        names += [p.name for p in (root / ".parked").iterdir()]
    return [n for n in names if ".tmp" in n]


@dataclass
class CriuGate:
    """A criu wrapper that blocks each dump while `hold` exists."""

    dir: Path
    wrapper: Path

    @property
    def arg(self) -> str:
        return f"--CheckpointEngine.criu_path={self.wrapper}"

    def hold(self) -> None:
        (self.dir / "hold").touch()

    def release(self) -> None:
        (self.dir / "hold").unlink(missing_ok=True)

    def wait_dump(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not list(self.dir.glob("dump-waiting.*")):
            assert time.monotonic() < deadline, "no dump reached the criu wrapper"
            time.sleep(0.02)


@pytest.fixture
def criu_gate(tmp_path: Path) -> Iterator[CriuGate]:
    criu = CheckpointEngine().probe().criu_path
    assert criu, "CRIU is needed"
    d = tmp_path / "criu-gate"
    d.mkdir()
    wrapper = d / "criu"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do\n'
        f'  if [ "$a" = dump ] && [ -e "{d}/hold" ]; then\n'
        f'    : > "{d}/dump-waiting.$$"\n'
        f'    while [ -e "{d}/hold" ]; do sleep 0.02; done\n'
        "    break\n"
        "  fi\n"
        "done\n"
        f'exec {criu} "$@"\n'
    )
    wrapper.chmod(0o755)
    gate = CriuGate(d, wrapper)
    yield gate
    gate.release()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """Servers a test starts; stopped at teardown whatever happened."""
    started: list[Server] = []
    yield started
    for s in started:
        stop_server(s)


# -- park on stop, adopt on start -------------------------------------------------------------


def test_sigterm_parks_every_kernel_and_the_next_server_adopts_them(
    tmp_path: Path, servers: list[Server]
) -> None:
    root = tmp_path / "checkpoints"
    a = start_server(tmp_path / "a", checkpoint_root=root)
    servers.append(a)
    running, suspended = a.start_kernel(), a.start_kernel()
    session = create_session(a, "work/analysis.ipynb", running)
    out = execute(a, running, "import numpy as np; arr = np.arange(1_000_000); x = 41")
    assert out["reply"]["status"] == "ok", out
    assert execute(a, suspended, "y = 'kept'")["reply"]["status"] == "ok"
    cedana(a, "suspend", suspended)
    before = {k: a.kernel(k) for k in (running, suspended)}
    watched = kernel_processes(a, [running, suspended])
    assert any("ipykernel" in row[3] for row in watched.values())

    log = stop_with(a, signal.SIGTERM)
    assert "parked 2 of 2 kernel(s)" in log
    assert "not parked" not in log
    assert gone(watched) == [], log[-4000:]

    # One private, complete record per kernel; the images are whole.
    parked = records(root)
    assert set(parked) == {running, suspended}
    assert (root / ".parked").stat().st_mode & 0o777 == 0o700
    for kid, rec in parked.items():
        assert (root / ".parked" / f"{kid}.json").stat().st_mode & 0o777 == 0o600
        assert (root / kid / "manifest.json").is_file()
        assert rec["uid"] == os.geteuid() and rec["kernel_name"] == "python3"
        assert rec["connection_info"]["key"] and rec["connection_info"]["shell_port"]
        assert rec["provisioner"]["name"] == "cedana-provisioner"
        assert rec["last_activity"] == before[kid]["last_activity"]
        assert rec["hub_user"] is None and rec["server_pid"] == a.proc.pid
    assert parked[running]["sessions"] == [
        {"id": session["id"], "path": "work/analysis.ipynb", "name": "analysis.ipynb",
         "type": "notebook"}
    ]  # fmt: skip
    assert parked[suspended]["sessions"] == []
    assert leftovers(root) == []

    b = start_server(tmp_path / "b", checkpoint_root=root)
    servers.append(b)
    assert listed(b) == {running, suspended}
    for kid in (running, suspended):
        k = b.kernel(kid)
        assert k["state"] == "suspended" and k["tier"] == "disk", k
        assert k["last_activity"] == before[kid]["last_activity"]  # adoption is not activity
    assert b.api("GET", "api/sessions")[0] == 200
    _, sessions = b.api("GET", "api/sessions")
    assert [(s["id"], s["path"], s["kernel"]["id"]) for s in sessions] == [
        (session["id"], "work/analysis.ipynb", running)
    ]
    # Adopted, still suspended: the records stay (a crash of b must not lose them).
    assert set(records(root)) == {running, suspended}

    # The next cell resumes the kernel through the message gate, with all its state.
    out = execute(b, running, "print(x + 1, int(arr.sum()))")
    assert out["reply"]["status"] == "ok" and out["stdout"].strip() == "42 499999500000", out
    assert b.kernel(running)["state"] == "running"
    assert set(records(root)) == {suspended}  # resumed: its image and record are done
    assert execute(b, suspended, "print(y)")["stdout"].strip() == "kept"
    assert records(root) == {}


@needs_root
def test_sigint_without_terminal_parks_once_despite_more_signals(
    tmp_path: Path, criu_gate: CriuGate, servers: list[Server]
) -> None:
    a, root, kid = server_with_kernel(tmp_path, servers, "z = 7", criu_gate.arg)

    criu_gate.hold()
    a.proc.send_signal(signal.SIGINT)
    criu_gate.wait_dump()  # parking is in the middle of the kernel's dump
    a.proc.send_signal(signal.SIGTERM)
    a.proc.send_signal(signal.SIGINT)
    wait_log(a, "while the server is stopping (parking its kernels): ignored", count=2)
    assert a.proc.poll() is None
    criu_gate.release()
    a.proc.wait(timeout=120)
    log = a.log.read_text()
    assert a.proc.returncode == 0, log[-4000:]
    assert log.count(", stopping") == 1  # one stop: the later signals did not start another
    assert log.count("jupyter-cedana: parking 1 kernel(s)") == 1
    assert "parked 1 of 1 kernel(s)" in log
    assert set(records(root)) == {kid}

    b = start_server(tmp_path / "b", checkpoint_root=root)
    servers.append(b)
    assert b.kernel(kid)["state"] == "suspended"
    assert execute(b, kid, "print(z * 6)")["stdout"].strip() == "42"


@needs_root
def test_server_started_ignoring_sigint_says_so_and_parks_on_sigterm(
    tmp_path: Path, servers: list[Server]
) -> None:
    # As a non-interactive shell's `jupyterhub &` would pass it on to the servers.
    a, root, kid = server_with_kernel(tmp_path, servers, "z = 7", sigint_ignored=True)
    assert "SIGINT is ignored by this server (inherited from its parent)" in a.log.read_text()
    log = stop_with(a, signal.SIGTERM)
    assert "parked 1 of 1 kernel(s)" in log
    assert set(records(root)) == {kid}


@needs_root
def test_kernel_not_parked_by_the_deadline_is_shut_down(
    tmp_path: Path, criu_gate: CriuGate, servers: list[Server]
) -> None:
    root = tmp_path / "checkpoints"
    a = start_server(
        tmp_path / "a", criu_gate.arg, "--KernelParking.deadline=2", checkpoint_root=root
    )
    servers.append(a)
    early, late = a.start_kernel(), a.start_kernel()
    cedana(a, "suspend", early)
    criu_gate.hold()  # from now on no dump ends
    watched = kernel_processes(a, [late])
    assert any(late in row[3] for row in watched.values())

    log = stop_with(a, signal.SIGTERM)
    assert f"kernel {late} not parked (not parked within the deadline of 2 s): it is shut down" in (
        log
    )
    assert "parked 1 of 2 kernel(s)" in log
    assert gone(watched) == []
    assert set(records(root)) == {early}
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [early]
    assert leftovers(root) == []


@needs_root
def test_disk_full_while_parking(tmp_path: Path, servers: list[Server]) -> None:
    root = tmp_path / "tiny"
    root.mkdir()
    # Two idle kernels' images fit (~37 MB each), the third kernel's 200 MB do not.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", str(root)], check=True)
    try:
        a = start_server(
            tmp_path / "a",
            "--KernelParking.concurrency=1",
            "--SuspendLimits.min_free_disk_bytes=0",
            checkpoint_root=root,
        )  # one dump at a time, smallest first: which kernel meets the full disk is known
        servers.append(a)
        small1, small2, big = a.start_kernel(), a.start_kernel(), a.start_kernel()
        out = execute(a, big, "import numpy as np; big = np.ones(25_000_000)")
        assert out["reply"]["status"] == "ok", out
        for kid in (small1, small2):
            assert execute(a, kid, f"name = {kid!r}")["reply"]["status"] == "ok"
        watched = kernel_processes(a, [big])

        log = stop_with(a, signal.SIGTERM)
        # Refused before its dump, as the policy's suspends are: its estimate does not fit.
        assert f"kernel {big} not parked (Not enough free space on the checkpoint disk" in log
        # What the log says happened to it is what happened (the refusal's own words are
        # those of a suspend, after which a kernel runs on).
        said = next(line for line in log.splitlines() if f"kernel {big} not parked" in line)
        assert "keeps running" not in said, said
        assert said.endswith(
            "): it is shut down with the server, and what it held in memory is lost"
        ), said
        assert "parked 2 of 3 kernel(s)" in log
        assert gone(watched) == []
        assert set(records(root)) == {small1, small2}
        images = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        assert images == sorted([small1, small2])
        assert leftovers(root) == []

        b = start_server(tmp_path / "b", checkpoint_root=root)
        servers.append(b)
        assert listed(b) == {small1, small2}
        assert execute(b, small2, "print(name)")["stdout"].strip() == small2
    finally:
        for s in servers:
            stop_server(s)
        subprocess.run(["umount", "-l", str(root)], check=False)


def test_two_servers_never_adopt_the_same_kernel(tmp_path: Path, servers: list[Server]) -> None:
    root = tmp_path / "checkpoints"
    a = start_server(tmp_path / "a", checkpoint_root=root)
    servers.append(a)
    kids = [a.start_kernel() for _ in range(3)]
    stop_with(a, signal.SIGTERM)
    assert set(records(root)) == set(kids)

    # A third party mid-adoption of one kernel: it holds that record's lock.
    busy = root / ".parked" / f"{kids[0]}.json"
    fd = os.open(busy, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        b = start_server(tmp_path / "b", checkpoint_root=root, wait=False)
        servers.append(b)
        c = start_server(tmp_path / "c", checkpoint_root=root, wait=False)
        servers.append(c)
        wait_ready(b)
        wait_ready(c)
        in_b, in_c = listed(b), listed(c)
        assert not in_b & in_c, (in_b, in_c)
        assert in_b | in_c == set(kids[1:])
        assert busy.exists()
        for s in (b, c):
            assert f"parked kernel {kids[0]} not adopted: record {busy.name} is locked" in (
                s.log.read_text()
            )
    finally:
        os.close(fd)


@needs_root
def test_server_started_while_the_previous_one_is_still_parking(
    tmp_path: Path, criu_gate: CriuGate, servers: list[Server]
) -> None:
    # A deadline the two servers' starts (seconds each on a loaded machine) cannot pass.
    a, root, kid = server_with_kernel(
        tmp_path, servers, "w = 5", criu_gate.arg, "--KernelParking.deadline=300"
    )
    criu_gate.hold()
    a.proc.send_signal(signal.SIGTERM)
    criu_gate.wait_dump()

    # A server that may wait only briefly starts without the kernel, and says why.
    b = start_server(tmp_path / "b", "--KernelParking.wait_for_parking=0.5", checkpoint_root=root)
    servers.append(b)
    assert listed(b) == set()
    assert f"server(s) {a.proc.pid} still parking kernels after 0 s" in b.log.read_text()

    # One that waits longer adopts the kernel once the first server is done.
    c = start_server(tmp_path / "c", checkpoint_root=root, wait=False)
    servers.append(c)
    wait_log(c, f"server(s) {a.proc.pid} still parking kernels into {root}")
    assert a.proc.poll() is None
    with pytest.raises(urllib.error.URLError):  # no request is served before adoption
        c.api("GET", "api/status")
    criu_gate.release()
    a.proc.wait(timeout=120)
    assert a.proc.returncode == 0
    wait_ready(c)
    assert c.kernel(kid)["state"] == "suspended"
    assert execute(c, kid, "print(w * 2)")["stdout"].strip() == "10"


# -- records that are not adopted ------------------------------------------------------------


def _plant_record(root: Path, template: dict[str, Any], **changes: Any) -> str:
    kid = str(uuid.uuid4())
    rec = {**json.loads(json.dumps(template)), "kernel_id": kid, **changes}
    path = root / ".parked" / f"{kid}.json"
    path.write_text(json.dumps(rec))
    path.chmod(0o600)
    return kid


def test_invalid_records_are_not_adopted(tmp_path: Path, servers: list[Server]) -> None:
    hub = {"JUPYTERHUB_USER": "alice"}
    a, root, good = server_with_kernel(tmp_path, servers, "v = 1", extra_env=hub)
    stop_with(a, signal.SIGTERM)
    template = records(root)[good]
    assert template["hub_user"] == "alice"

    other_uid = _plant_record(root, template, uid=os.geteuid() + 4242)
    other_user = _plant_record(root, template, hub_user="bob")
    other_server = _plant_record(root, template, hub_server_name="gpu")
    no_spec = _plant_record(root, template, kernel_name="no-such-kernelspec")
    missing = _plant_record(
        root,
        template,
        sessions=[{"id": str(uuid.uuid4()), "path": "lost.ipynb", "name": "lost.ipynb",
                   "type": "notebook"}],
    )  # fmt: skip
    # Another user's image, smaller than the damaged one: it must not take the checksum
    # budget (adopt_verify_bytes) that the damaged one needs to be refused at adoption.
    plant_image(root, other_uid, os.urandom(40000))
    damaged = _plant_record(root, template)
    pages = plant_image(root, damaged, os.urandom(65536)) / "pages-1.img"
    with open(pages, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    old = _plant_record(
        root, template, provisioner={**template["provisioner"], "cedana_suspended_at": 1.0}
    )
    # Its image made a day and more ago on this boot's clock, which retention counts.
    manifest = plant_image(root, old) / "manifest.json"
    now = stamp()
    assert now.boottime is not None
    made = Stamp(1.0, now.boot_id, now.boottime - 86400 - 60)
    manifest.write_text(
        json.dumps({**json.loads(manifest.read_text()), "created_clock": made.to_json()})
    )
    garbled = str(uuid.uuid4())
    (root / ".parked" / f"{garbled}.json").write_text('{"format": 1, "kernel_id": ')

    b = start_server(
        tmp_path / "b",
        "--SuspendPolicy.retention=86400",
        # The small planted images are verified before adoption; the real one is not.
        "--KernelParking.adopt_verify_bytes=100000",
        checkpoint_root=root,
        extra_env=hub,
    )
    servers.append(b)
    assert listed(b) == {good}
    assert b.api("GET", "api/sessions") == (200, [])
    log = b.log.read_text()

    def said(kid: str, why: str) -> bool:
        return any(
            f"parked kernel {kid} not adopted: " in ln and why in ln for ln in log.splitlines()
        )

    assert said(other_uid, f"parked by uid {os.geteuid() + 4242}")
    assert said(other_user, "parked by Hub user 'bob', not 'alice'")
    assert said(other_server, "belongs to named server 'gpu'")
    assert said(no_spec, "kernelspec 'no-such-kernelspec' is gone")
    assert said(missing, "image is missing; the record and its sessions were removed")
    assert said(damaged, "checksum mismatch in pages-1.img")
    assert said(old, "longer than SuspendPolicy.retention")
    assert said(garbled, "does not parse")
    assert "1 parked image(s) of 0.0" in log and "sizes checked now" in log
    left = {p.stem for p in (root / ".parked").glob("*.json")}
    # The adopted kernel's record stays while it is suspended.
    assert left == {good, other_uid, other_user, other_server, no_spec, damaged, garbled}
    assert (root / damaged).is_dir() and not (root / old).exists()

    # A restore that fails after adoption: state failed with the reason, image kept.
    image = root / good
    victim = max(image.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    status, err = b.api("POST", f"api/cedana/kernels/{good}/resume")
    assert status == 500 and "checksum" in err["message"], err
    k = b.kernel(good)
    assert k["state"] == "failed" and "checksum" in k["reason"]
    assert (image / "manifest.json").is_file()


# -- dumps at once -------------------------------------------------------------------------


async def test_kernels_sharing_a_working_directory_are_dumped_at_once(
    tmp_path: Path, criu_hold: Any
) -> None:
    """Kernels sharing a working directory (parked together, or suspended together by
    the policy) are dumped at the same time. CRIU's parasite makes the mount point of a
    /proc, `proc.crtools`, in the working directory of the init it dumps: each init works
    in a private directory of its own, never in the kernels' one, where a `proc.crtools`
    (what a dump of a task working there holds while it runs) does not get in the way."""
    config = Config()
    config.CheckpointEngine.checkpoint_root = str(tmp_path / "checkpoints")
    config.CheckpointEngine.criu_path = str(criu_hold.wrapper)
    shared = tmp_path / "notebooks"
    (shared / "proc.crtools").mkdir(parents=True)
    kms = []
    try:
        for k in range(2):
            kms.append(await start_kernel(config, shared))
            await run(kms[-1].test_client, f"import os; k = {k}")
        inits = {os.readlink(f"/proc/{km.provisioner.pid}/cwd") for km in kms}
        assert len(inits) == len(kms) and str(shared) not in inits

        criu_hold.close_gate("dump")
        suspends = [asyncio.ensure_future(km.provisioner.suspend()) for km in kms]
        # Both dumps are in flight together: were dumps run one at a time, the second
        # would not start while the first waits at the gate.
        await criu_hold.wait_waiting("dump", len(kms))
        criu_hold.open_gate("dump")
        await asyncio.gather(*suspends)
        assert all(km.provisioner.state.value == "suspended" for km in kms)

        for k, km in enumerate(kms):
            await km.provisioner.resume()
            await wait_iopub(km.test_client)
            _, out = await run(km.test_client, "print(k, os.getcwd())")
            assert out.strip() == f"{k} {shared}"
        assert [p.name for p in shared.iterdir()] == ["proc.crtools"]
    finally:
        criu_hold.open_gate("dump")
        for km in kms:
            await stop_kernel(km)
