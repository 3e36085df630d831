"""The CRIU the agent runs: its argv, environment and working directory are the agent's
own, whatever a user puts in an environment or a home directory; and the agent refuses a
CRIU, plugin directory or state that a user could change.

Each steering input is also shown to work on a plain CRIU (the control), so that the
agent's test could fail."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
from traitlets import TraitError

from jupyter_cedana.agent.criu import FIXED_PATH, AgentEngine, CriuSettings, check_root_only

from .checkpoint_fixtures import configured_agent, loose_kernels  # noqa: F401 (fixtures)
from .conftest import Agent
from .test_checkpoint_ops import ROOT, launch_root, reconnect
from .test_launch import Kernel

REAL_CRIU = "/usr/local/sbin/criu"

MARKER_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char comm[64] = {0};
    int fd = open("/proc/self/comm", O_RDONLY);
    if (fd >= 0) { if (read(fd, comm, sizeof comm - 1) < 0) comm[0] = 0; close(fd); }
    FILE *f = fopen(MARKER, "a");
    if (f) { fprintf(f, "%d %s", (int)getpid(), comm); fclose(f); }
}
"""


class Hostile:
    """What cedana-test can prepare: a library of theirs whose constructor leaves a
    marker, a CRIU config file, a ~/.criu/default.conf, a plugin directory, a kdat cache
    (a FIFO: whoever opens it to read would hang), all in a directory of theirs."""

    def __init__(self, base: Path):
        user = pwd.getpwnam("cedana-test")
        self.dir = base / "home-cedana-test"
        self.dir.mkdir(exist_ok=True)
        self.marker = self.dir / "marker.txt"
        self.lib = self.dir / "libmark.so"
        subprocess.run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                f'-DMARKER="{self.marker}"',
                "-o",
                str(self.lib),
                "-x",
                "c",
                "-",
            ],
            input=MARKER_C,
            text=True,
            check=True,
        )
        self.plugins = self.dir / "plugins"
        self.plugins.mkdir()
        shutil.copy(self.lib, self.plugins / "evil.so")
        self.config_workdir = self.dir / "config-workdir"
        self.home_workdir = self.dir / "home-workdir"
        for d in (self.config_workdir, self.home_workdir):
            d.mkdir()
        self.config = self.dir / "criu.conf"
        self.config.write_text(f"work-dir {self.config_workdir}\n")
        (self.dir / ".criu").mkdir()
        (self.dir / ".criu" / "default.conf").write_text(f"work-dir {self.home_workdir}\n")
        os.mkfifo(self.dir / "criu.kdat")
        for path in [self.dir, *self.dir.rglob("*")]:
            os.lchown(path, user.pw_uid, user.pw_gid)

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": str(self.lib),
            "LD_LIBRARY_PATH": str(self.dir),
            "CRIU_LIBS_DIR": str(self.plugins),
            "CRIU_CONFIG_FILE": str(self.config),
            "HOME": str(self.dir),
            "XDG_RUNTIME_DIR": str(self.dir),
        }

    def criu_marks(self) -> list[str]:
        if not self.marker.exists():
            return []
        return [ln for ln in self.marker.read_text().splitlines() if ln.endswith("criu")]

    def steered(self) -> list[str]:
        return [str(p) for d in (self.config_workdir, self.home_workdir) for p in d.iterdir()]


def recording_criu(base: Path) -> tuple[Path, Path]:
    """A root-owned criu that records its argv, cwd and environment, then runs CRIU."""
    bindir = base / "bin"
    bindir.mkdir(mode=0o755)
    log = base / "criu-calls.log"
    script = bindir / "criu"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        {{ printf 'CALL'; for a in "$@"; do printf ' %s' "$a"; done; printf '\\n'
           printf 'CWD %s\\n' "$(pwd -P)"
           tr '\\0' '\\n' < /proc/$$/environ | sed 's/^/ENV /'; }} >> {log}
        exec {REAL_CRIU} "$@"
        """)
    )
    os.chmod(script, 0o755)
    return script, log


def calls(log: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in log.read_text().splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "CALL":
            out.append({"argv": rest.split(" "), "env": {}, "cwd": None})
        elif kind == "CWD":
            out[-1]["cwd"] = rest
        elif kind == "ENV":
            key, _, value = rest.partition("=")
            out[-1]["env"][key] = value
    return out


def test_plain_criu_is_steered_by_these_inputs(agent_base: Path) -> None:
    """The control: a CRIU run with the user's environment loads their library and their
    plugin, and follows their config file and their ~/.criu (without
    --no-default-config)."""
    hostile = Hostile(agent_base)
    env = {"PATH": FIXED_PATH, **hostile.env()}
    without_config_file = {k: v for k, v in env.items() if k != "CRIU_CONFIG_FILE"}
    for argv, run_env in (
        ([REAL_CRIU, "--no-default-config", "check", "-o", "c.log"], env),
        # CRIU_CONFIG_FILE, when set, is read instead of ~/.criu/default.conf.
        ([REAL_CRIU, "check", "-o", "c.log"], without_config_file),
    ):
        subprocess.run(argv, env=run_env, cwd="/", capture_output=True, timeout=60)
    assert hostile.criu_marks(), "LD_PRELOAD did not reach a plain CRIU"
    assert (hostile.config_workdir / "c.log").exists()
    assert (hostile.home_workdir / "c.log").exists()


def test_agent_criu_argv_env_and_cwd_are_fixed(
    agent_base: Path,
    configured_agent: Any,  # noqa: F811
    loose_kernels: list[Kernel],  # noqa: F811
) -> None:
    hostile = Hostile(agent_base)
    script, log = recording_criu(agent_base)
    agent: Agent = configured_agent({"criu_path": str(script)}, env=hostile.env())
    kernel = launch_root(agent, loose_kernels)
    kernel.run("x = 7")
    assert agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})["ok"]
    reply = agent.run_as(ROOT, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    reconnect(kernel)
    assert kernel.run("print(x * 6)").strip() == "42"

    runs = calls(log)
    actions = [
        next(a for a in c["argv"] if a in ("dump", "restore", "check", "--version")) for c in runs
    ]
    assert "dump" in actions and "restore" in actions
    plugin_dir = str(Path(__file__).resolve().parents[2] / "jupyter_cedana" / "criu_plugins")
    for run in runs:
        assert run["env"] == {
            "PATH": FIXED_PATH,
            "HOME": str(agent.state_dir),
            "LANG": "C",
            "LC_ALL": "C",
        }
        argv = run["argv"]
        assert argv[0] == "--no-default-config"
        if "dump" in argv or "restore" in argv:
            assert argv[argv.index("--libdir") + 1] == plugin_dir
        assert not any(str(hostile.dir) in a for a in argv)
        assert run["cwd"] == "/" or run["cwd"].startswith(str(agent.state_dir) + "/")
    assert hostile.criu_marks() == []
    assert hostile.steered() == []


def _user_owned_copy(agent_base: Path, name: str, source: str | None) -> Path:
    user = pwd.getpwnam("cedana-test")
    d = agent_base / f"user-{name}"
    d.mkdir()
    target = d / name
    if source is None:
        target.mkdir()
    else:
        shutil.copy(source, target)
    for p in (d, target):
        os.chown(p, user.pw_uid, user.pw_gid)
    return target


@pytest.mark.parametrize("what", ["criu_path", "plugin_dir"])
def test_agent_refuses_a_criu_or_plugin_dir_a_user_can_change(
    agent_base: Path,
    configured_agent: Any,  # noqa: F811
    loose_kernels: list[Kernel],  # noqa: F811
    what: str,
) -> None:
    target = _user_owned_copy(agent_base, what, REAL_CRIU if what == "criu_path" else None)
    agent: Agent = configured_agent({what: str(target)})
    kernel = launch_root(agent, loose_kernels)
    reply = agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})
    assert reply["error"]["code"] == "refused", reply
    assert "owned by uid 1001" in reply["error"]["message"]
    # Nothing ran: the kernel is still running, no image was written.
    assert kernel.run("print(1 + 1)").strip() == "2"
    assert not list((agent.state_dir / "images").glob("*/*-*"))


def test_group_writable_directory_above_is_refused(agent_base: Path) -> None:
    d = agent_base / "shared"
    d.mkdir()
    os.chmod(d, 0o775)
    inner = d / "criu"
    shutil.copy(REAL_CRIU, inner)
    with pytest.raises(Exception, match="writable by group or others"):
        check_root_only(inner, "criu binary")
    os.chmod(d, 0o755)
    assert check_root_only(inner, "criu binary") == str(inner)
    # A root-owned sticky directory above (like /tmp) is allowed.
    assert stat.S_IMODE(os.stat("/tmp").st_mode) & stat.S_ISVTX


def test_engine_takes_no_extra_criu_arguments(agent_base: Path) -> None:
    state = agent_base / "state"
    state.mkdir(mode=0o700)
    engine = AgentEngine(CriuSettings(state_dir=str(state)))
    for trait in ("extra_dump_args", "extra_restore_args"):
        with pytest.raises(TraitError):
            setattr(engine, trait, ["--libdir", "/tmp"])
    assert engine.base_args(engine.probe()) == [REAL_CRIU, "--no-default-config"]
    assert engine.criu_env()["PATH"] == FIXED_PATH
