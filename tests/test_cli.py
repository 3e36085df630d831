"""`jupyter cedana` against a real `jupyter server` process, with real kernels and CRIU;
and a clean shutdown of such a server leaves no kernel process and no image behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.userserver import (
    SERVER_DIRS,
    JupyterServer,
    free_port,
    jupyter_env,
    launch,
    stop_server,
    wait_answering,
)

pytestmark = pytest.mark.criu

BIN = Path(sys.executable).parent
JUPYTER = str(BIN / "jupyter")


# -- a real server (tests/userserver.py) -------------------------------------------------------


class Server(JupyterServer):
    """A server of root's, from this virtualenv."""

    def server_log(self) -> str:
        return self.log_tail()


@contextlib.contextmanager
def children_sigint(ignored: bool = False) -> Iterator[None]:
    """Processes started inside get SIGINT's default action (or ignore it). A child
    inherits an ignored SIGINT, and this process's varies: a shell's `cmd &` starts the
    suite with it ignored, and libraries set it; a spawner's servers get the default."""
    previous = signal.signal(
        signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler
    )
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_server(
    base: Path,
    *extra_args: str,
    checkpoint_root: Path | None = None,
    extra_env: dict[str, str] | None = None,
    wait: bool = True,
    sigint_ignored: bool = False,
) -> Server:
    """A `jupyter server` subprocess with stdin not a terminal, as under a spawner."""
    dirs = {name: base / name for name in SERVER_DIRS}
    dirs["checkpoints"] = checkpoint_root or dirs["checkpoints"]
    for name in ("runtime", "root", "config", "data"):
        dirs[name].mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "JPY_"))}
    env.update(jupyter_env(dirs), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra_env or {})
    with children_sigint(ignored=sigint_ignored):
        server = launch(
            Server,
            JUPYTER,
            dirs,
            "--allow-root",
            # No automatic suspend: the tests decide when kernels are suspended.
            "--SuspendPolicy.idle_timeout=0",
            *extra_args,
            env=env,
            log=base / "server.log",
        )
    return wait_ready(server) if wait else server


def wait_ready(server: Server, timeout: float = 90) -> Server:
    """Until it answers, and has written the runtime file by which `jupyter cedana` finds it."""
    return wait_answering(
        server, timeout, ready=lambda: bool(list(server.runtime_dir.glob("jpserver-*.json")))
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("cli-server"))
    try:
        yield s
    finally:
        stop_server(s)


@pytest.fixture
def kernel(server: Server) -> Iterator[str]:
    kid = server.start_kernel()
    yield kid
    server.api("DELETE", f"api/kernels/{kid}")


def cedana(
    server: Server, *args: str, env: dict[str, str] | None = None, check: int | None = 0
) -> subprocess.CompletedProcess[str]:
    """Run `jupyter cedana ARGS` as a user would, in the server's environment."""
    result = subprocess.run(
        [JUPYTER, "cedana", *args],
        env=env or server.env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    if check is not None:
        assert result.returncode == check, (
            f"jupyter cedana {' '.join(args)} exited {result.returncode}, expected {check}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}\nserver log:\n"
            f"{server.server_log()}"
        )
    return result


def row_of(output: str, kid: str) -> str:
    rows = [line for line in output.splitlines() if line.startswith(kid)]
    assert len(rows) == 1, output
    return rows[0]


def plant_image(root: Path, kid: str, payload: bytes = b"x" * 4096) -> Path:
    """An image directory as CheckpointStore.commit writes it (manifest with sizes and
    CRC-32 checksums), for a kernel that no server has."""
    d = root / kid
    d.mkdir(mode=0o700, parents=True)
    (d / "pages-1.img").write_bytes(payload)
    manifest = {
        "criu_version": "4.2.1",
        "format": 1,
        "kernel_id": kid,
        "created": time.time() - 3600,
        "host": socket.gethostname(),
        "files": {"pages-1.img": {"size": len(payload), "crc32": zlib.crc32(payload)}},
        "total_bytes": len(payload),
        "timings": {"checksum_s": 0.0},
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return d


def wait_state(server: Server, kid: str, state: str, timeout: float = 60) -> None:
    """Until the kernel is in `state` (after a --no-wait command)."""
    deadline = time.monotonic() + timeout
    while server.kernel(kid)["state"] != state:
        assert time.monotonic() < deadline, server.kernel(kid)
        time.sleep(0.1)


# -- list, status ---------------------------------------------------------------------------


def test_status(server: Server) -> None:
    out = cedana(server, "status").stdout
    assert "Checkpoint root:" in out
    assert str(server.checkpoint_root.resolve()) in out
    assert "available (CRIU 4." in out, out
    st = json.loads(cedana(server, "status", "--json").stdout)
    assert st["available"] is True
    assert st["agent_socket"] is None  # this server runs CRIU itself
    assert Path(st["checkpoint_root"]) == server.checkpoint_root.resolve()
    assert st["bytes_free"] > 0


def test_list_shows_running_kernel(server: Server, kernel: str) -> None:
    out = cedana(server, "list").stdout
    header = out.splitlines()[0].split()
    assert header[:3] == ["ID", "KERNELSPEC", "STATE"], out
    for column in ("IDLE", "GPU", "CHECKPOINT", "REASON"):
        assert column in header
    row = row_of(out, kernel).split()
    assert row[1:3] == ["python3", "running"], out
    listed = json.loads(cedana(server, "list", "--json").stdout)
    mine = [k for k in listed if k["id"] == kernel]
    assert len(mine) == 1 and mine[0]["state"] == "running"


# -- suspend, resume, keep-awake --------------------------------------------------------------


def test_suspend_list_resume(server: Server, kernel: str) -> None:
    out = cedana(server, "suspend", kernel).stdout
    assert f"Kernel {kernel} suspended (disk" in out, out
    assert (server.checkpoint_root / kernel / "manifest.json").is_file()

    row = row_of(cedana(server, "list").stdout, kernel)
    assert "suspended/disk" in row
    assert "MiB" in row or "KiB" in row, row  # the checkpoint size
    view = next(k for k in json.loads(cedana(server, "list", "--json").stdout) if k["id"] == kernel)
    assert view["state"] == "suspended" and view["checkpoint_bytes"] > 0

    # A unique prefix of the id is enough.
    out = cedana(server, "resume", kernel[:8]).stdout
    assert f"Kernel {kernel} resumed" in out, out
    assert server.kernel(kernel)["state"] == "running"
    assert "running" in row_of(cedana(server, "list").stdout, kernel)


def test_suspend_json_and_no_wait(server: Server, kernel: str) -> None:
    view = json.loads(cedana(server, "suspend", kernel, "--json").stdout)
    assert view["id"] == kernel and view["state"] == "suspended" and view["tier"] == "disk"
    out = cedana(server, "resume", kernel, "--no-wait").stdout
    assert kernel in out
    wait_state(server, kernel, "running")


def test_suspend_no_wait_and_tier(server: Server, kernel: str) -> None:
    out = cedana(server, "suspend", kernel, "--no-wait").stdout
    assert kernel in out
    wait_state(server, kernel, "suspended")
    assert "suspended/disk" in row_of(cedana(server, "list").stdout, kernel)
    cedana(server, "resume", kernel)

    # The tier reaches the server, which refuses it here (no GPU driver: nothing can be
    # offloaded) with the reason, instead of turning it into a disk suspend.
    result = cedana(server, "suspend", kernel, "--tier", "offload", "--json", check=None)
    assert result.returncode == 5, result  # 409: not possible in this state
    assert "offload is unavailable" in result.stderr, result.stderr
    assert server.kernel(kernel)["state"] == "running"
    assert cedana(server, "suspend", kernel, "--tier", "tape", check=2).stdout == ""


def test_keep_awake(server: Server, kernel: str) -> None:
    before = time.time()
    out = cedana(server, "keep-awake", kernel, "2h").stdout
    assert f"Kernel {kernel} is kept awake until" in out, out
    until = server.kernel(kernel)["keep_awake_until"]
    assert until is not None
    from datetime import datetime

    seconds = datetime.fromisoformat(until).timestamp() - before
    assert 7200 - 5 < seconds < 7200 + 60, until

    view = json.loads(cedana(server, "keep-awake", kernel, "90", "--json").stdout)
    assert view["keep_awake_until"] is not None

    assert "cleared" in cedana(server, "keep-awake", kernel, "0").stdout
    assert server.kernel(kernel)["keep_awake_until"] is None

    bad = cedana(server, "keep-awake", kernel, "soon", check=2)
    assert "not a duration" in bad.stderr


# -- errors ---------------------------------------------------------------------------------


def test_unknown_kernel(server: Server) -> None:
    kid = str(uuid.uuid4())
    status, expected = server.api("POST", f"api/cedana/kernels/{kid}/suspend")
    assert status == 404
    for command in (["suspend", kid], ["resume", kid], ["keep-awake", kid, "60"]):
        result = cedana(server, *command, check=4)
        assert expected["message"] in result.stderr, result.stderr
        assert result.stdout == ""
    err = json.loads(cedana(server, "resume", kid, "--json", check=4).stdout)
    assert err["code"] == "not_found" and err["status"] == 404
    # A malformed id is the server's 404 too.
    result = cedana(server, "suspend", "..%2F..", check=4)
    assert "Invalid kernel id" in result.stderr


def test_conflicts(server: Server, kernel: str) -> None:
    result = cedana(server, "resume", kernel, check=5)
    assert "is running, not suspended" in result.stderr
    cedana(server, "suspend", kernel)
    result = cedana(server, "suspend", kernel, check=5)
    assert "already suspended" in result.stderr
    err = json.loads(cedana(server, "suspend", kernel, "--json", check=5).stdout)
    assert err["code"] == "conflict"
    cedana(server, "resume", kernel)


def test_bad_token(server: Server) -> None:
    result = cedana(server, "list", "--url", server.url, "--token", "wrong", check=7)
    assert "jupyter cedana: error:" in result.stderr


def test_explicit_url_without_runtime_files(server: Server, tmp_path: Path) -> None:
    env = {**server.env, "JUPYTER_RUNTIME_DIR": str(tmp_path)}
    out = cedana(server, "status", "--url", server.url, "--token", server.token, env=env).stdout
    assert str(server.checkpoint_root.resolve()) in out
    # The token may also come from the environment, like jupyter_server's own.
    env["JUPYTER_TOKEN"] = server.token
    cedana(server, "list", "--url", server.url, env=env)


def test_no_server(server: Server, tmp_path: Path) -> None:
    env = {**server.env, "JUPYTER_RUNTIME_DIR": str(tmp_path)}
    result = cedana(server, "list", env=env, check=3)
    assert "No running Jupyter server found" in result.stderr
    assert str(tmp_path) in result.stderr
    result = cedana(server, "list", "--url", f"http://127.0.0.1:{free_port()}/", env=env, check=3)
    assert "Cannot reach" in result.stderr


# -- gc ------------------------------------------------------------------------------------


def test_gc_removes_only_unowned_images(server: Server, kernel: str) -> None:
    cedana(server, "suspend", kernel)
    live = server.checkpoint_root / kernel
    assert (live / "manifest.json").is_file()
    orphan_id = str(uuid.uuid4())
    orphan = plant_image(server.checkpoint_root, orphan_id)
    dead_tmp = server.checkpoint_root / f".{orphan_id}.tmp-999999999-1"
    dead_tmp.mkdir()
    # A dump in progress by a live process (here: this test) must survive.
    busy_tmp = server.checkpoint_root / f".{uuid.uuid4()}.tmp-{os.getpid()}-2"
    busy_tmp.mkdir()
    try:
        dry = cedana(server, "gc", "--dry-run").stdout
        assert f"Would remove image of kernel {orphan_id}" in dry, dry
        assert str(dead_tmp) in dry and str(busy_tmp) not in dry and kernel not in dry
        assert orphan.is_dir() and dead_tmp.is_dir()

        out = cedana(server, "gc").stdout
        assert f"Removed image of kernel {orphan_id}: {orphan}" in out, out
        assert kernel not in out
        assert not orphan.exists() and not dead_tmp.exists()
        assert busy_tmp.is_dir()
        assert (live / "manifest.json").is_file()

        report = json.loads(cedana(server, "gc", "--json").stdout)
        assert report["removed"] == [] and kernel in report["kept_kernels"]
        assert "Nothing to remove" in cedana(server, "gc").stdout

        # The kept image is intact: the kernel comes back from it.
        cedana(server, "resume", kernel)
        assert server.kernel(kernel)["state"] == "running"
    finally:
        busy_tmp.rmdir()


def test_gc_root_keeps_the_kernels_of_running_servers(server: Server, kernel: str) -> None:
    cedana(server, "suspend", kernel)
    orphan_id = str(uuid.uuid4())
    orphan = plant_image(server.checkpoint_root, orphan_id)
    out = cedana(server, "gc", "--root", str(server.checkpoint_root), "--yes").stdout
    assert orphan_id in out and not orphan.exists()
    assert (server.checkpoint_root / kernel / "manifest.json").is_file(), out
    cedana(server, "resume", kernel)


def test_gc_root_without_server(server: Server, tmp_path: Path) -> None:
    env = {**server.env, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    root = tmp_path / "old-checkpoints"
    ids = [str(uuid.uuid4()) for _ in range(2)]
    images = [plant_image(root, kid) for kid in ids]

    refused = cedana(server, "gc", "--root", str(root), env=env, check=2)
    assert "Refusing without --yes" in refused.stderr
    assert all(p.is_dir() for p in images)

    dry = cedana(server, "gc", "--root", str(root), "--dry-run", env=env).stdout
    assert all(kid in dry for kid in ids) and all(p.is_dir() for p in images)

    out = cedana(server, "gc", "--root", str(root), "--yes", env=env).stdout
    for kid, path in zip(ids, images, strict=True):
        assert f"Removed image of kernel {kid}" in out
        assert not path.exists()
    assert "Removed 2 item(s)" in out


def test_gc_pointed_at_the_wrong_root_removes_nothing(server: Server, tmp_path: Path) -> None:
    """A mistyped --root (here: a user's directory) must not lose anything: gc removes only
    what it can prove jupyter-cedana wrote, and says what it left alone."""
    env = {**server.env, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    (home / "project" / "data.csv").write_text("1,2,3")
    (home / "notes.txt").write_text("mine")
    foreign_id = str(uuid.uuid4())
    (home / foreign_id).mkdir()  # named like a kernel id, no manifest
    (home / foreign_id / "results.json").write_text("{}")
    (home / str(uuid.uuid4())).write_text("a file named like a kernel id")
    elsewhere = plant_image(tmp_path / "other-root", str(uuid.uuid4()))
    (home / elsewhere.name).symlink_to(elsewhere)  # a link to a real image elsewhere
    (home / ".logs").mkdir()
    (home / ".logs" / f"{foreign_id}.log").write_text("a log of the user's")
    old = time.time() - 7 * 86400
    for path in [home, *home.rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)

    def snapshot() -> dict[str, str]:
        found = {}
        for path in sorted([*home.rglob("*"), *elsewhere.rglob("*")]):
            kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
            found[str(path)] = kind + (":" + path.read_text() if kind == "file" else "")
        return found

    before = snapshot()
    result = cedana(server, "gc", "--root", str(home), "--yes", env=env)
    assert "Nothing to remove" in result.stdout, result.stdout
    assert "Left alone" in result.stderr and "cannot prove" in result.stderr
    report = json.loads(
        cedana(server, "gc", "--root", str(home), "--yes", "--json", env=env).stdout
    )
    assert report["removed"] == []
    left = {Path(e["path"]).name: e["why"] for e in report["left_alone"]}
    assert left[elsewhere.name] == "a symbolic link"
    assert "no manifest" in left[foreign_id]
    assert snapshot() == before
    assert not (home / ".jupyter-cedana").exists()


def test_status_reports_orphaned_images(server: Server) -> None:
    orphan_id = str(uuid.uuid4())
    orphan = plant_image(server.checkpoint_root, orphan_id, b"y" * 5000)
    try:
        out = cedana(server, "status").stdout
        assert "Orphaned images: 1 (4.9 KiB) belong to no kernel" in out, out
        st = json.loads(cedana(server, "status", "--json").stdout)
        assert st["budget"]["orphaned_kernel_ids"] == [orphan_id]
        assert st["budget"]["orphaned_bytes"] == 5000
    finally:
        shutil.rmtree(orphan)


# -- server shutdown -------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, str, str, str]]:
    """pid -> (ppid, state, start time, cmdline) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), fields[0], fields[19], cmdline)
    return table


def _descendants(table: dict[int, tuple[int, str, str, str]], root: int) -> set[int]:
    found, frontier = set(), {root}
    while frontier:
        kids = {pid for pid, row in table.items() if row[0] in frontier} - found
        found |= kids
        frontier = kids
    return found


def _alive(snapshot: dict[int, tuple[int, str, str, str]]) -> list[str]:
    """Processes of the snapshot still running (same pid and start time, not a zombie)."""
    now = _proc_table()
    return [
        f"{pid}: {row[3]}"
        for pid, row in snapshot.items()
        if pid in now and now[pid][2] == row[2] and now[pid][1] != "Z"
    ]


def test_server_shutdown_leaves_no_kernel_process_or_image(tmp_path: Path) -> None:
    # Without parking (tests/test_parking.py has the stop that parks them).
    server = start_server(tmp_path, "--KernelParking.park_on_stop=False")
    try:
        suspended, running = server.start_kernel(), server.start_kernel()
        cedana(server, "suspend", suspended)
        assert (server.checkpoint_root / suspended / "manifest.json").is_file()
        # Resume and suspend once more, so that a kernel restored by CRIU (under its
        # `criu restore` parent) is among those the shutdown must stop.
        cedana(server, "resume", suspended)
        cedana(server, "suspend", suspended)
        cedana(server, "suspend", running)
        cedana(server, "resume", running)
        assert server.kernel(suspended)["state"] == "suspended"
        assert server.kernel(running)["state"] == "running"

        table = _proc_table()
        ckpt = str(server.checkpoint_root)
        watched = {
            pid: row
            for pid, row in table.items()
            if pid != server.proc.pid
            and (
                suspended in row[3]
                or running in row[3]
                or ckpt in row[3]
                or pid in _descendants(table, server.proc.pid)
            )
        }
        kernel_procs = [row[3] for row in watched.values() if running in row[3]]
        assert any("ipykernel" in c for c in kernel_procs), watched
        assert any("criu restore" in c for c in kernel_procs), watched
        assert not any(suspended in row[3] and "ipykernel" in row[3] for row in watched.values())
    except BaseException:
        stop_server(server)
        raise

    status, _ = server.api("POST", "api/shutdown")
    assert status == 200
    try:
        server.proc.wait(timeout=90)
    finally:
        stop_server(server)
    assert server.proc.returncode == 0, server.server_log()

    deadline = time.monotonic() + 10
    while _alive(watched) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(watched) == [], server.server_log()

    left = sorted(p.name for p in server.checkpoint_root.iterdir())
    assert suspended not in left and running not in left, left
    assert not [n for n in left if ".tmp-" in n], left
    assert not [n for n in left if n.endswith(".pid")], left
    assert not [n for n in left if not n.startswith(".")], left  # no image of any kernel
    assert not list(server.runtime_dir.glob("jpserver-*.json"))


def test_list_says_what_waits_and_what_backs_off() -> None:
    from jupyter_cedana.cli.main import kernel_row

    base = {"id": "k", "name": "python3", "idle_seconds": 5, "gpus": [], "checkpoint_bytes": 0}
    queued = {**base, "state": "running", "queued": {"action": "suspend", "position": 2}}
    assert kernel_row(queued)[2] == "running, queued to suspend (#2)"
    stuck = {
        **base,
        "state": "running",
        "reason": "Not checkpointable: it holds a socket connected to a process outside",
        "backoff": {"failures": 1, "not_checkpointable": True},
    }
    row = kernel_row(stuck)
    assert row[2] == "running, not suspending" and row[-1].startswith("Not checkpointable")
    failing = {**base, "state": "running", "backoff": {"failures": 3, "not_checkpointable": False}}
    assert kernel_row(failing)[2] == "running, backing off"
