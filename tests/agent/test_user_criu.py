"""The CRIU that dumps a user's kernel: real uid and gid the user's (so that it may read
the rlimits of the user's tasks without CAP_SYS_RESOURCE), effective ids root's. What the
user can do to it (signal it: kill(2) compares real uids) fails only their own dump;
what the user's kernel leaves in its files and environment does not steer it; and the
kernel-feature cache it needs is root's, and fresh at every start of the agent."""

from __future__ import annotations

import concurrent.futures
import os
import pwd
import stat
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.agent.criu import KDAT, AgentEngine, CriuSettings

from .checkpoint_fixtures import configured_agent, loose_kernels  # noqa: F401 (fixtures)
from .conftest import Agent
from .test_checkpoint_ops import assert_whole_tree_is, reconnect
from .test_criu_env import REAL_CRIU, Hostile, calls, recording_criu
from .test_launch import Kernel, launch

USER = "cedana-test"


def _status_ids(pid: int) -> dict[str, list[str]]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "CapEff"):
            out[key] = value.split()
    return out


class HeldCriu:
    """A root-owned criu that writes its pid, then runs CRIU with an action script that
    holds a dump at its post-dump point (the image written, the tree still stopped)
    until released. CRIU runs action scripts through `sh -c`, which, with a real uid
    that is not the effective one, drops to the real uid: the script is the user's, so
    its flags live in a directory the user can write."""

    def __init__(self, base: Path):
        user = pwd.getpwnam(USER)
        self.bindir = base / "held-bin"
        self.bindir.mkdir(mode=0o755)
        self.flags = base / "held-flags"
        self.flags.mkdir(mode=0o755)
        os.chown(self.flags, user.pw_uid, user.pw_gid)
        self.pidfile = self.bindir / "criu.pid"
        hold = self.bindir / "hold.sh"
        hold.write_text(
            textwrap.dedent(f"""\
            #!/bin/sh
            [ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0
            [ -e {self.flags}/release ] && exit 0
            touch {self.flags}/reached
            i=0
            while [ ! -e {self.flags}/release ] && [ $i -lt 1200 ]; do
                sleep 0.05; i=$((i + 1))
            done
            """)
        )
        self.criu = self.bindir / "criu"
        # -p: dash would otherwise drop to the real uid (setpriv's) before exec'ing CRIU.
        self.criu.write_text(
            textwrap.dedent(f"""\
            #!/bin/sh -p
            case " $* " in
            *" dump "*)
                echo $$ > {self.pidfile}
                exec {REAL_CRIU} "$@" --action-script {hold} ;;
            esac
            exec {REAL_CRIU} "$@"
            """)
        )
        for script in (hold, self.criu):
            os.chmod(script, 0o755)

    def wait_reached(self, dump: concurrent.futures.Future[Any], timeout: float = 120) -> int:
        """CRIU's pid once the dump is held at post-dump."""
        deadline = time.monotonic() + timeout
        while not (self.flags / "reached").exists():
            assert not dump.done(), dump.result()
            assert time.monotonic() < deadline, "the dump never reached post-dump"
            time.sleep(0.02)
        return int(self.pidfile.read_text())

    def release(self) -> None:
        (self.flags / "release").touch()


def _as(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", user, "--", *argv], capture_output=True, text=True, timeout=60, cwd="/"
    )


def _no_dump_left(agent: Agent, kernel_id: str) -> None:
    """Neither an image nor a dump in progress (.KERNEL_ID.tmp-...) of the kernel."""
    left = [p for p in (agent.state_dir / "images" / "1001").iterdir() if kernel_id in p.name]
    assert left == [], left


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_user_stopping_or_killing_their_dump_s_criu_fails_only_that_dump(
    agent_base: Path,
    configured_agent: Any,  # noqa: F811
    loose_kernels: list[Kernel],  # noqa: F811
    how: str,
) -> None:
    """The user may signal the CRIU that dumps their kernel. Killed or stopped while it
    holds their tree stopped, with the image written, the dump fails with a clear
    error, the image is gone and the kernel runs on as it was; another user may not
    signal that CRIU at all."""
    held = HeldCriu(agent_base)
    config: dict[str, Any] = {"criu_path": str(held.criu)}
    if how == "stop":
        config["dump_timeout"] = 30
    agent: Agent = configured_agent(config)
    kernel, init_pid = launch(agent, loose_kernels, USER)
    kernel.run("state = [41]")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        dump = pool.submit(agent.run_as, USER, "dump", {"kernel_id": kernel.id}, 180)
        criu = held.wait_reached(dump)
        # The agent's CRIU: the user's real ids, root's effective ids and capabilities.
        ids = _status_ids(criu)
        assert ids["Uid"] == ["1001", "0", "0", "0"] and ids["Gid"] == ["1001", "0", "0", "0"]
        assert int(ids["CapEff"][0], 16) == int(_status_ids(os.getpid())["CapEff"][0], 16)
        other = _as("cedana-test2", "kill", "-0", str(criu))
        assert other.returncode != 0 and "not permitted" in other.stderr, other
        mine = _as(USER, "kill", "-KILL" if how == "kill" else "-STOP", str(criu))
        assert mine.returncode == 0, mine
        held.release()
        reply = dump.result()
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == "failed", reply
    if how == "kill":
        assert "killed by SIGKILL" in reply["error"]["message"], reply
    else:
        assert "took longer than 30 s" in reply["error"]["message"], reply
    assert not Path(f"/proc/{criu}").exists()
    _no_dump_left(agent, kernel.id)
    assert agent.run_as(USER, "images")["result"]["images"] == []
    polled = agent.run_as(USER, "poll", {"kernel_id": kernel.id})["result"]
    assert polled == {"returncode": None, "state": "running", "meta": None}
    assert kernel.run("print(state[0] + 1)").strip() == "42"
    # Nothing of it lingers: the next dump and restore work.
    reply = agent.run_as(USER, "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    reply = agent.run_as(USER, "restore", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    reconnect(kernel)
    assert kernel.run("print(state[0] + 1)").strip() == "42"
    assert init_pid != reply["result"]["pid"]


# Notebook code of cedana-test: everything CRIU could read from the user's side, in the
# kernel's working directory and home, which the kernel's environment also names.
PLANT = """
import os
d = os.getcwd()
os.makedirs(f"{d}/.criu", exist_ok=True)
os.makedirs(f"{d}/steered", exist_ok=True)
for conf in (f"{d}/.criu/default.conf", f"{d}/criu.conf"):
    with open(conf, "w") as f:
        f.write(f"work-dir {d}/steered\\nlibdir {d}/plugins\\n")
if not os.path.exists(f"{d}/criu.kdat"):
    os.mkfifo(f"{d}/criu.kdat")
print(os.environ.get("HOME") == d, os.environ.get("XDG_RUNTIME_DIR") == d)
"""


def test_user_kernel_files_do_not_steer_the_agent_s_criu(
    agent_base: Path,
    configured_agent: Any,  # noqa: F811
    loose_kernels: list[Kernel],  # noqa: F811
) -> None:
    """A CRIU whose real uid is the user's runs in secure-execution mode (AT_SECURE) and
    with the agent's environment: neither the user's library, plugins, configuration
    files, cache file, nor their kernel's environment reach it."""
    hostile = Hostile(agent_base)
    script, log = recording_criu(agent_base)
    # The recorder is a shell script: -p keeps dash from dropping to the real uid.
    script.write_text(script.read_text().replace("#!/bin/sh\n", "#!/bin/sh -p\n", 1))
    agent: Agent = configured_agent({"criu_path": str(script)}, env=hostile.env())
    home = str(agent.user_dir(USER))
    kernel, _ = launch(
        agent,
        loose_kernels,
        USER,
        env={**hostile.env(), "HOME": home, "XDG_RUNTIME_DIR": home},
    )
    assert kernel.run(PLANT).split() == ["True", "True"]
    kernel.run("x = 7")
    assert agent.run_as(USER, "dump", {"kernel_id": kernel.id})["ok"]
    reply = agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    reconnect(kernel)
    assert kernel.run("print(x * 6)").strip() == "42"
    assert_whole_tree_is(kernel, reply["result"]["pid"], 1001, 1001)

    runs = calls(log)
    dumps = [r for r in runs if "dump" in r["argv"]]
    assert dumps and any("restore" in r["argv"] for r in runs)
    for run in runs:
        assert run["env"] == {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(agent.state_dir),
            "LANG": "C",
            "LC_ALL": "C",
        }
        assert run["argv"][0] == "--no-default-config"
        assert not any(home in a or str(hostile.dir) in a for a in run["argv"])
    assert hostile.criu_marks() == [] and hostile.steered() == []
    assert os.listdir(Path(home) / "steered") == []


def test_dump_prefix_is_setpriv_with_the_owner_s_real_ids(agent_base: Path) -> None:
    state = agent_base / "state"
    state.mkdir(mode=0o700)
    engine = AgentEngine(CriuSettings(state_dir=str(state)))
    assert engine.dump_command_prefix((1001, 1001)) == [
        "/usr/bin/setpriv",
        "--ruid=1001",
        "--rgid=1001",
        "--clear-groups",
        "--",
    ]
    # Root's kernels, and the server's engine, dump with root's own ids.
    assert engine.dump_command_prefix((0, 0)) == []
    assert engine.dump_command_prefix(None) == []


def test_agent_writes_a_fresh_root_only_kdat_cache_at_start(
    configured_agent: Any,  # noqa: F811
) -> None:
    """What the agent finds at /run/criu.kdat (here a stale file: CRIU would load any
    file with the right magic numbers, for whatever kernel it was made) is replaced by a
    cache CRIU has just written."""
    stale = b"not a cache of this kernel"
    tmp = KDAT + ".test-stale"
    Path(tmp).write_bytes(stale)
    os.rename(tmp, KDAT)
    configured_agent({})
    st = os.stat(KDAT)
    # Renamed into place: no temporary file of the agent's is left.
    assert not [n for n in os.listdir(os.path.dirname(KDAT)) if n.startswith(".criu.kdat.agent")]
    assert st.st_uid == 0 and st.st_gid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    data = Path(KDAT).read_bytes()
    assert data != stale and len(data) > len(stale)
    # CRIU itself takes it: a dump with the user's real ids needs it.
    check = subprocess.run(
        [
            *("/usr/bin/setpriv", "--ruid=1001", "--rgid=1001", "--clear-groups", "--"),
            *(REAL_CRIU, "--no-default-config", "check", "-v4", "--log-file", "/dev/stderr"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert "Loaded kdat cache" in check.stderr, check.stderr[-2000:]
