"""cedana-init's --chdir, and which dumps wait for each other (procmount.py), with real
inits started as kernels are (in their own PID namespace as root)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.checkpoint.procmount import dump_turn, proc_mount_dir

pytestmark = pytest.mark.root  # a PID namespace needs CAP_SYS_ADMIN


class Init:
    """cedana-init running `sh -c 'pwd > CWD_FILE; exec sleep 600'` in `cwd`."""

    def __init__(self, tmp_path: Path, name: str, cwd: Path, *options: str):
        self.pidfile = tmp_path / f"{name}.pid"
        self.cwd_file = tmp_path / f"{name}.cwd"
        self.proc = subprocess.Popen(
            [
                CheckpointEngine().init_binary(),
                *options,
                "--pidfile",
                str(self.pidfile),
                "--",
                "sh",
                "-c",
                f"pwd > {self.cwd_file}; exec sleep 600",
            ],
            cwd=cwd,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not (self.pidfile.exists() and self.cwd_file.exists()):
            assert self.proc.poll() is None, self.proc.communicate()[1]
            assert time.monotonic() < deadline, "cedana-init did not start its command"
            time.sleep(0.01)
        self.pid = int(self.pidfile.read_text())

    def cwd(self) -> str:
        return os.readlink(f"/proc/{self.pid}/cwd")

    def command_cwd(self) -> str:
        return self.cwd_file.read_text().strip()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture
def inits(tmp_path: Path) -> Iterator[list[Init]]:
    started: list[Init] = []
    yield started
    for init in started:
        init.stop()


@pytest.mark.parametrize("pidns", [True, False])
def test_init_works_in_its_directory_and_its_command_in_the_callers(
    tmp_path: Path, inits: list[Init], pidns: bool
) -> None:
    user, private = tmp_path / "user", tmp_path / "private"
    user.mkdir()
    private.mkdir(mode=0o700)
    options = ["--pidns"] if pidns else []
    inits.append(Init(tmp_path, "k", user, *options, "--chdir", str(private)))
    assert inits[0].cwd() == str(private)
    assert inits[0].command_cwd() == str(user)


def test_init_refuses_a_directory_it_cannot_use_before_starting_anything(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "started"
    missing = tmp_path / "missing"
    proc = subprocess.run(
        [CheckpointEngine().init_binary(), "--chdir", str(missing), "--", "touch", str(marker)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 127
    assert str(missing) in proc.stderr and "No such file" in proc.stderr
    assert not marker.exists()


async def test_dumps_wait_only_for_one_mounting_proc_in_the_same_directory(
    tmp_path: Path, inits: list[Init]
) -> None:
    """Two inits working in one directory (kernels restored from images written before
    --chdir) take turns; one in its own directory does not wait; nor do trees in our PID
    namespace, for which CRIU uses the mounted /proc."""
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir()
    private.mkdir()
    a, b = Init(tmp_path, "a", shared, "--pidns"), Init(tmp_path, "b", shared, "--pidns")
    c = Init(tmp_path, "c", shared, "--pidns", "--chdir", str(private))
    d, e = Init(tmp_path, "d", shared), Init(tmp_path, "e", shared)
    inits += [a, b, c, d, e]
    assert proc_mount_dir(a.pid) == proc_mount_dir(b.pid) != proc_mount_dir(c.pid)
    assert proc_mount_dir(c.pid) is not None
    assert proc_mount_dir(d.pid) is None and proc_mount_dir(e.pid) is None
    assert proc_mount_dir(os.getpid()) is None

    entered: list[str] = []
    go = {name: asyncio.Event() for name in "abcde"}

    async def dump(name: str, pid: int) -> None:
        async with dump_turn(pid):
            entered.append(name)
            await go[name].wait()

    async def until_entered(name: str) -> None:
        deadline = time.monotonic() + 30  # catches a turn that never comes
        while name not in entered:
            assert time.monotonic() < deadline, f"{name} never got its turn: {entered}"
            await asyncio.sleep(0.01)

    tasks = [asyncio.ensure_future(dump("a", a.pid))]
    await until_entered("a")
    # Tasks run in the order they were made: b meets a's turn before c, d, e start.
    later = {"b": b, "c": c, "d": d, "e": e}
    tasks += [asyncio.ensure_future(dump(name, init.pid)) for name, init in later.items()]
    for name in "cde":
        await until_entered(name)
    assert "b" not in entered
    go["a"].set()
    await until_entered("b")
    for event in go.values():
        event.set()
    await asyncio.gather(*tasks)
