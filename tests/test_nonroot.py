"""Non-root servers, driven from root as the test users that scripts/setup.sh --test
creates (cedana-test, cedana-test2, both in group `cedana`): the capability-carrying criu
is only for its group, a user can checkpoint and restore only their own processes, and a
killed server takes its kernels and their orphans along."""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.engine import GRANTED_CRIU
from tests.test_parent_death import alive

pytestmark = [pytest.mark.criu, pytest.mark.root]

REPO = Path(__file__).resolve().parent.parent
NONROOT_PY = REPO / ".venv-nonroot" / "bin" / "python"
USER, OTHER = "cedana-test", "cedana-test2"


def _require_setup() -> None:
    try:
        pwd.getpwnam(USER), pwd.getpwnam(OTHER), grp.getgrnam("cedana")
    except KeyError:
        pytest.fail("test users missing: run scripts/setup.sh --test")
    if not NONROOT_PY.exists() or not os.access(GRANTED_CRIU, os.X_OK):
        pytest.fail("non-root set-up missing: run scripts/setup.sh --test")


def as_user(user: str, argv: list[str], **kw: Any) -> subprocess.Popen[str]:
    home = pwd.getpwnam(user).pw_dir
    env = {"HOME": home, "PATH": f"{NONROOT_PY.parent}:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.Popen(
        argv, user=user, group=user, extra_groups=["cedana"], env=env, cwd=REPO, text=True, **kw
    )


def run_as(user: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    p = as_user(user, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = p.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, p.returncode, out, None)


def user_dir(tmp_path: Path, user: str, name: str) -> Path:
    d = tmp_path / name
    d.mkdir(mode=0o700)
    shutil.chown(d, user, user)
    return d


class Host:
    """tests/kernel_host.py running as a test user."""

    def __init__(self, user: str, root: Path):
        self.proc = as_user(
            user,
            [str(NONROOT_PY), "-m", "tests.kernel_host", str(root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def ask(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"kernel host died (exit {self.proc.poll()})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory the test users can enter (pytest's tmp_path lies under a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="cedana-nonroot-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def hosts(shared_tmp: Path) -> Iterator[Any]:
    if os.geteuid() != 0:
        pytest.skip("drives other users' processes: needs root")
    _require_setup()
    started: list[Host] = []

    def start(user: str, root: Path | None = None) -> Host:
        h = Host(user, root or user_dir(shared_tmp, user, f"ckpt-{user}"))
        started.append(h)
        return h

    yield start
    for h in started:
        h.close()


def processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid and alive(int(entry)):
                    pids.append(int(entry))
            except FileNotFoundError:
                pass
    return pids


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_capable_criu_only_for_its_group() -> None:
    _require_setup()
    st = os.stat(GRANTED_CRIU)
    assert (st.st_uid, grp.getgrgid(st.st_gid).gr_name) == (0, "cedana")
    assert stat.S_IMODE(st.st_mode) == 0o750
    caps = subprocess.run(["getcap", GRANTED_CRIU], capture_output=True, text=True).stdout
    for cap in ("cap_checkpoint_restore", "cap_sys_ptrace", "cap_net_admin", "cap_setpcap"):
        assert cap in caps
    assert run_as(USER, [GRANTED_CRIU, "--version"]).returncode == 0
    outsider = subprocess.run(
        ["runuser", "-u", "nobody", "--", GRANTED_CRIU, "--version"],
        capture_output=True,
        text=True,
    )
    assert outsider.returncode != 0 and "Permission denied" in outsider.stderr


def test_nonroot_kernel_suspends_and_resumes(hosts) -> None:
    host = hosts(USER)
    k = host.ask("start")["kernel"]
    assert host.ask("run", kernel=k, code="import os; x = 41; print(os.geteuid())")[
        "out"
    ].strip() == str(pwd.getpwnam(USER).pw_uid)
    assert host.ask("suspend", kernel=k)["state"] == "suspended"
    assert host.ask("resume", kernel=k)["state"] == "running"
    assert host.ask("run", kernel=k, code="print(x + 1)")["out"].strip() == "42"


def test_a_user_cannot_checkpoint_or_restore_another_users_kernel(hosts, shared_tmp: Path) -> None:
    victim_root = user_dir(shared_tmp, USER, "victim")
    host = hosts(USER, victim_root)
    k = host.ask("start")
    host.ask("run", kernel=k["kernel"], code="secret = 'only mine'")

    # The second user holds the same capable criu, but CRIU refuses foreign processes.
    loot = user_dir(shared_tmp, OTHER, "loot")
    dump = run_as(
        OTHER,
        [
            GRANTED_CRIU,
            "dump",
            "--unprivileged",
            "-t",
            str(k["pid"]),
            "-D",
            str(loot),
            "--leave-running",
            "--tcp-close",
            "-o",
            "dump.log",
        ],
    )
    assert dump.returncode != 0
    assert not list(loot.glob("pages-*.img"))
    assert "only mine" in host.ask("run", kernel=k["kernel"], code="print(secret)")["out"]

    # Nor can it read the first user's images.
    assert host.ask("suspend", kernel=k["kernel"])["state"] == "suspended"
    assert run_as(OTHER, ["ls", str(victim_root / k["id"])]).returncode != 0
    resumed = host.ask("resume", kernel=k["kernel"])
    assert resumed.get("state") == "running", resumed
    assert "only mine" in host.ask("run", kernel=k["kernel"], code="print(secret)")["out"]


def test_a_copy_of_another_users_image_does_not_restore(shared_tmp: Path, request) -> None:
    """Even handed a copy, the second user cannot bring the first user's process back:
    restoring its credentials needs CAP_SETUID/CAP_SETGID, which nobody's criu has."""
    _require_setup()
    mine = user_dir(shared_tmp, USER, "mine")
    quiet = subprocess.DEVNULL
    sleeper = as_user(USER, ["setsid", "sleep", "1000"], stdin=quiet, stdout=quiet, stderr=quiet)
    request.addfinalizer(sleeper.kill)
    dump = run_as(
        USER,
        [
            GRANTED_CRIU,
            "dump",
            "--unprivileged",
            "-t",
            str(sleeper.pid),
            "-D",
            str(mine),
            "-o",
            "dump.log",
        ],
    )
    sleeper.wait()
    assert dump.returncode == 0, (mine / "dump.log").read_text()[-2000:]
    stolen = user_dir(shared_tmp, OTHER, "stolen")
    for img in mine.iterdir():
        shutil.copy(img, stolen)
        shutil.chown(stolen / img.name, OTHER, OTHER)
    restore = run_as(
        OTHER,
        [GRANTED_CRIU, "restore", "--unprivileged", "-D", str(stolen), "-d", "-o", "restore.log"],
    )
    assert restore.returncode != 0
    log = (stolen / "restore.log").read_text()
    assert re.search(r"setgroups|set real, effective and saved (user|group) ID", log), log
    # Its half-restored task is killed by CRIU (a zombie until reaped).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and processes_of(pwd.getpwnam(OTHER).pw_uid):
        time.sleep(0.1)
    assert processes_of(pwd.getpwnam(OTHER).pw_uid) == []
    assert not alive(sleeper.pid)


ORPHAN = (
    "import subprocess\n"
    "print(subprocess.run(['sh', '-c', 'setsid sleep 1000 >/dev/null 2>&1 & echo $!'],"
    " capture_output=True, text=True).stdout.strip())"
)


def test_kernels_and_their_orphans_die_with_a_killed_nonroot_server(hosts) -> None:
    host = hosts(USER)
    plain = host.ask("start")["kernel"]
    restored = host.ask("start")["kernel"]
    assert host.ask("suspend", kernel=restored)["state"] == "suspended"
    assert host.ask("resume", kernel=restored)["state"] == "running"
    doomed: list[int] = []
    for k in (plain, restored):
        orphan = int(host.ask("run", kernel=k, code=ORPHAN)["out"])
        tree = host.ask("tree", kernel=k)
        # Its shell exited: the orphan now belongs to the kernel's init, a subreaper
        # (after a restore too), not to the system's init.
        assert orphan in tree["pids"]
        assert parent_of(orphan) == tree["root"]
        doomed += [*tree["pids"], tree["keeper"], orphan]
    assert all(alive(p) for p in doomed)

    os.kill(host.proc.pid, signal.SIGKILL)
    host.proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p) for p in doomed):
        time.sleep(0.1)
    assert [p for p in doomed if alive(p)] == []
