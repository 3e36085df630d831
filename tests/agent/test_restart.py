"""The agent killed with SIGKILL at named points and started again on the same state
directory: its callers' kernels are theirs again (running ones answer with their state,
dumped ones restore with it), nobody else's, and records it did not write are refused.

Real agents, real kernels (jupyter_client), real CRIU, real users."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.agent.adopt import inits_in
from jupyter_cedana.agent.client import EXIT_UNKNOWN
from jupyter_cedana.agent.records import RecordStore, start_time
from tests.criu_hold import CriuHold

from .checkpoint_fixtures import root_lacks_sys_resource
from .conftest import USER_PYTHON, Agent, run_agent, stop_agent, write_checkpoint_config
from .test_launch import Kernel, kernel_argv

ROOT = "root"
USER = "cedana-test"
OTHER = "cedana-test2"


class Agents:
    """Agents started one after the other on one base directory (socket, state)."""

    def __init__(self, base: Path):
        self.base = base
        self.started: list[Agent] = []
        self.kernels: list[Kernel] = []
        self.loose_pids: list[int] = []  # inits no agent owns at the end of a test

    def start(self, *extra: str, config: dict[str, Any] | None = None) -> Agent:
        if config is not None:
            write_checkpoint_config(self.base / "state", config)
        agent = run_agent(self.base, *extra)
        self.started.append(agent)
        return agent

    def kill(self, agent: Agent) -> None:
        """SIGKILL: no record written, no kernel touched on the way out."""
        agent.proc.kill()
        agent.proc.wait()

    def restart(self, agent: Agent, *extra: str) -> Agent:
        self.kill(agent)
        return self.start(*extra)

    def launch(self, agent: Agent, user: str) -> tuple[Kernel, int]:
        kernel = Kernel(agent, USER if user == ROOT else user)
        self.kernels.append(kernel)
        args = kernel.launch_args()
        if user == ROOT:
            argv = [sys.executable, "-m", "ipykernel_launcher", "-f", str(kernel.connection_file)]
            args = {**args, "argv": argv}
        else:
            args = {**args, "argv": kernel_argv(kernel.connection_file)}
        reply = agent.run_as(user, "launch", args)
        assert reply["ok"], reply
        return kernel, reply["result"]["pid"]

    def close(self) -> None:
        for kernel in self.kernels:
            kernel.close()
        for agent in self.started:
            stop_agent(agent, timeout=60)
        for pid in self.loose_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def agents(agent_base: Path) -> Iterator[Agents]:
    made = Agents(agent_base)
    yield made
    made.close()


def kernels_of(agent: Agent, user: str) -> dict[str, dict[str, Any]]:
    reply = agent.run_as(user, "list")
    assert reply["ok"], reply
    return {k["kernel_id"]: k for k in reply["result"]["kernels"]}


def reconnect(kernel: Kernel) -> None:
    if kernel.client is not None:
        kernel.client.stop_channels()
        kernel.client = None


# Writes to the kernel's own descriptor 1 (ipykernel keeps a copy of the one it was given
# and captures fd 1 for the notebook): what an agent that died would answer with EPIPE.
WRITE_FD1 = (
    "import os, sys\n"
    "fd = getattr(sys.stdout, '_original_stdstream_copy', None) or 1\n"
    "print(os.write(fd, b'{text}\\n'))\n"
)


CLIENT_POLL = (
    "import asyncio, sys\n"
    "from jupyter_cedana.agent.client import AgentClient\n"
    "async def main():\n"
    "    async with await AgentClient.connect(sys.argv[1]) as c:\n"
    "        print(await c.poll(sys.argv[2]))\n"
    "asyncio.run(main())\n"
)


def log_of(agent: Agent, user: str, kernel: Kernel) -> str:
    reply = agent.run_as(user, "log", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    return str(reply["result"]["text"])


def test_running_kernel_is_owned_again_after_sigkill(agents: Agents) -> None:
    agent = agents.start()
    kernel, init_pid = agents.launch(agent, USER)
    kernel.run("state = 41")
    assert kernel.run(WRITE_FD1.format(text="before-restart")).strip() == "15"
    agents.kill(agent)
    # With no agent at all, the kernel writes to its stdout without error.
    assert kernel.run(WRITE_FD1.format(text="while-no-agent")).strip() == "15"
    agent = agents.start()
    mine = kernels_of(agent, USER)
    assert mine == {
        kernel.id: {
            "kernel_id": kernel.id,
            "state": "running",
            "pid": init_pid,
            "returncode": None,
            "meta": None,
        }
    }
    assert kernels_of(agent, OTHER) == {}
    assert agent.run_as(OTHER, "poll", {"kernel_id": kernel.id})["error"]["code"] == "not_found"
    polled = agent.run_as(USER, "poll", {"kernel_id": kernel.id})["result"]
    assert polled == {"returncode": None, "state": "running", "meta": None}
    reconnect(kernel)
    assert kernel.run("print(state + 1)").strip() == "42"
    assert kernel.run(WRITE_FD1.format(text="after-restart")).strip() == "14"
    out = log_of(agent, USER, kernel)
    assert out.index("before-restart") < out.index("while-no-agent") < out.index("after-restart")
    # The new agent owns it: a signal ends it, and it says its exit status is unknown
    # (it was not the new agent's child).
    assert agent.run_as(USER, "signal", {"kernel_id": kernel.id, "signum": 9})["ok"]
    waited = agent.run_as(USER, "wait", {"kernel_id": kernel.id, "timeout": 60})["result"]
    assert waited["state"] == "exited" and waited["returncode"] is None
    polled = agent.run_as(USER, "poll", {"kernel_id": kernel.id})["result"]
    assert polled["returncode_known"] is False and "unknown" in polled["note"]
    # The client a server uses says it is dead (not None, which would read as running).
    poll_cmd = ["runuser", "-u", USER, "--", USER_PYTHON, "-c", CLIENT_POLL]
    polled_by_client = subprocess.run(
        [*poll_cmd, str(agent.socket_path), kernel.id],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )
    assert polled_by_client.stdout.strip() == str(EXIT_UNKNOWN), polled_by_client.stderr
    assert not alive(init_pid)
    assert agent.run_as(USER, "release", {"kernel_id": kernel.id})["ok"]
    assert not (agent.state_dir / "records" / "1001" / f"{kernel.id}.json").exists()


@pytest.mark.parametrize(("user", "other", "uid"), [(ROOT, USER, 0), (USER, OTHER, 1001)])
def test_dumped_kernel_restores_after_sigkill(
    agents: Agents, user: str, other: str, uid: int
) -> None:
    agent = agents.start()
    kernel, _ = agents.launch(agent, user)
    kernel.run("state = [41]")
    reply = agent.run_as(user, "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    agent = agents.restart(agent)
    listed = kernels_of(agent, user)[kernel.id]
    assert listed["state"] == "dumped" and listed["pid"] is None
    assert [i["kernel_id"] for i in agent.run_as(user, "images")["result"]["images"]] == [kernel.id]
    assert kernels_of(agent, other) == {}
    assert agent.run_as(other, "restore", {"kernel_id": kernel.id})["error"]["code"] == "not_found"
    # Its output file grew since the dump: CRIU restores an append-only file regardless.
    with open(agent.state_dir / "output" / str(uid) / f"{kernel.id}.log", "ab") as f:
        f.write(b"written after the dump\n")
    reply = agent.run_as(user, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    reconnect(kernel)
    assert kernel.run("print(state[0] + 1)").strip() == "42"
    assert kernel.run(WRITE_FD1.format(text="restored")).strip() == "9"
    out = log_of(agent, user, kernel)
    assert out.index("written after the dump") < out.index("restored")
    # Restored by the second agent, owned by a third.
    agent = agents.restart(agent)
    assert kernels_of(agent, user)[kernel.id]["state"] == "running"
    reconnect(kernel)
    assert kernel.run("print(state[0] + 2)").strip() == "43"


@contextlib.contextmanager
def held_after_criu(hold: CriuHold, agent: Agent, op: str, args: dict[str, Any]) -> Iterator[None]:
    """Root's `op` request, whose CRIU run (`op`: "dump" or "restore") is held once CRIU
    has run, for as long as the block runs; the request is not waited for until then
    (the block may kill its agent)."""
    hold.arm(op, "after")
    client = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_cedana.agent.client",
            "--socket",
            str(agent.socket_path),
            op,
            json.dumps(args),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not hold.reached(op, "after"):
            assert time.monotonic() < deadline and client.poll() is None, client.communicate()
            time.sleep(0.05)
        yield
    finally:
        hold.release(op, "after")
        client.wait(timeout=60)


def test_sigkill_in_the_middle_of_a_dump(agents: Agents) -> None:
    """The agent dies while CRIU has dumped the kernel and left it stopped, before the
    image is committed: the next agent continues the kernel and drops the partial dump."""
    hold = CriuHold(agents.base / "criu-hold", "/usr/local/sbin/criu")
    agent = agents.start(config={"criu_path": str(hold.wrapper)})
    kernel, init_pid = agents.launch(agent, ROOT)
    kernel.run("state = [41]")
    with held_after_criu(hold, agent, "dump", {"kernel_id": kernel.id}):
        record = agent.state_dir / "records" / "0" / f"{kernel.id}.json"
        assert json.loads(record.read_text())["state"] == "dumping"
        agents.kill(agent)
        agent = agents.start(config={"criu_path": str(hold.wrapper)})
    assert kernels_of(agent, ROOT)[kernel.id] == {
        "kernel_id": kernel.id,
        "state": "running",
        "pid": init_pid,
        "returncode": None,
        "meta": None,
    }
    reconnect(kernel)
    assert kernel.run("print(state[0] + 1)").strip() == "42"
    assert agent.run_as(ROOT, "images")["result"]["images"] == []
    assert not list((agent.state_dir / "images" / "0").glob(f".{kernel.id}.tmp-*"))
    # And it can be dumped and restored as any other.
    assert agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})["ok"]
    assert agent.run_as(ROOT, "restore", {"kernel_id": kernel.id, "lazy": False})["ok"]
    reconnect(kernel)
    assert kernel.run("print(state[0] + 2)").strip() == "43"


def test_sigkill_in_the_middle_of_a_restore(agents: Agents) -> None:
    """The agent dies while CRIU has restored the kernel (left stopped) and before the
    agent took it: the next agent ends that half-restored tree and the image, kept until
    a restore completes, restores with the kernel's state."""
    hold = CriuHold(agents.base / "criu-hold", "/usr/local/sbin/criu")
    agent = agents.start(config={"criu_path": str(hold.wrapper)})
    kernel, _ = agents.launch(agent, ROOT)
    kernel.run("state = [41]")
    assert agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})["ok"]
    work = str(agent.state_dir / "kernels" / "0" / kernel.id)
    with held_after_criu(hold, agent, "restore", {"kernel_id": kernel.id, "lazy": False}):
        half = inits_in(work)
        assert len(half) == 1, half
        agents.kill(agent)
        agent = agents.start(config={"criu_path": str(hold.wrapper)})
        assert not alive(half[0])  # ended by the new agent before it listened
    assert kernels_of(agent, ROOT)[kernel.id]["state"] == "dumped"
    reply = agent.run_as(ROOT, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    reconnect(kernel)
    assert kernel.run("print(state[0] + 1)").strip() == "42"


def alive(pid: int) -> bool:
    """Running (or stopped), not gone nor a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _refused_reasons(state: Path) -> list[str]:
    return sorted(p.read_text() for p in (state / "refused-records").glob("*.reason"))


def test_edited_and_forged_records_are_refused(agents: Agents) -> None:
    agent = agents.start()
    kernel, init_pid = agents.launch(agent, USER)
    agents.loose_pids.append(init_pid)
    agents.kill(agent)
    path = agent.state_dir / "records" / "1001" / f"{kernel.id}.json"
    edited = json.loads(path.read_text())
    edited["argv"] = ["/bin/sh"]
    path.write_text(json.dumps(edited))
    # Signed with the agent's own key (root can), but naming a root process as the
    # user's kernel: refused by what the process is, not by the signature.
    decoy = subprocess.Popen(["sleep", "600"])
    try:
        store = RecordStore(agent.state_dir)
        forged = {k: v for k, v in edited.items() if k != "mac"}
        forged["kernel_id"] = "f" * 8
        forged["init"] = {"pid": decoy.pid, "start": start_time(decoy.pid)}
        forged["keeper"] = None
        store.save(forged)
        agent = agents.start()
        assert kernels_of(agent, USER) == {}
        assert kernels_of(agent, OTHER) == {}
        reasons = _refused_reasons(agent.state_dir)
        assert len(reasons) == 2, reasons
        assert any("signature does not match" in r for r in reasons), reasons
        assert any("not adopted" in r and "sleep" in r for r in reasons), reasons
        assert not path.exists()
        kept = sorted(p.name for p in (agent.state_dir / "refused-records").iterdir())
        assert any(n.startswith(f"1001-{kernel.id}.json.") for n in kept), kept
        # Nothing was done to either process.
        assert decoy.poll() is None and alive(init_pid)
    finally:
        decoy.kill()
        decoy.wait()


def test_after_a_reboot_running_kernels_are_gone_and_images_stay(agents: Agents) -> None:
    """A boot id other than this boot's (written as the agent would have, signed):
    the running kernel is reported exited, the dumped one stays restorable."""
    agent = agents.start()
    running, init_pid = agents.launch(agent, USER)
    agents.loose_pids.append(init_pid)
    dumped, _ = agents.launch(agent, ROOT)
    dumped.run("state = [41]")
    assert agent.run_as(ROOT, "dump", {"kernel_id": dumped.id})["ok"]
    agents.kill(agent)
    store = RecordStore(agent.state_dir)
    for uid, kid in ((1001, running.id), (0, dumped.id)):
        fields = json.loads(store.path(uid, kid).read_text())
        del fields["mac"]
        fields["boot_id"] = "00000000-0000-4000-8000-000000000000"
        store.save(fields)
    agent = agents.start()
    gone = agent.run_as(USER, "poll", {"kernel_id": running.id})["result"]
    assert gone["state"] == "exited" and gone["returncode_known"] is False
    assert "machine restarted" in gone["note"]
    assert kernels_of(agent, ROOT)[dumped.id]["state"] == "dumped"
    assert agent.run_as(ROOT, "restore", {"kernel_id": dumped.id, "lazy": False})["ok"]
    reconnect(dumped)
    assert dumped.run("print(state[0] + 1)").strip() == "42"


def _record(state: Path, uid: int, kid: str) -> dict[str, Any]:
    return dict(json.loads((state / "records" / str(uid) / f"{kid}.json").read_text()))


def _wait_record(
    state: Path, uid: int, kid: str, done: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """The record on disk once `done` holds: read as root, with no connection to the
    agent (one would count as the uid's client and restart the grace)."""
    deadline = time.monotonic() + timeout
    while True:
        record = _record(state, uid, kid)
        if done(record):
            return record
        assert time.monotonic() < deadline, record
        time.sleep(0.1)


HOLD_SCRIPT = (
    "import asyncio, sys\n"
    "from jupyter_cedana.agent.client import AgentClient\n"
    "async def main():\n"
    "    c = await AgentClient.connect(sys.argv[1])\n"
    "    print('connected', flush=True)\n"
    "    while True:\n"
    "        await c.hello()\n"
    "        await asyncio.sleep(1)\n"
    "asyncio.run(main())\n"
)


def hold_connection(agents: Agents, agent: Agent, user: str) -> subprocess.Popen[str]:
    """A client of `user` that stays connected (as a server does), until killed."""
    script = agents.base / "hold.py"
    script.write_text(HOLD_SCRIPT)
    python = sys.executable if user == ROOT else USER_PYTHON
    holder = subprocess.Popen(
        ["runuser", "-u", user, "--", python, str(script), str(agent.socket_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd="/",
        start_new_session=True,  # runuser and its child: killed together
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "connected"
    return holder


def drop(holder: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()


def test_orphaned_kernels_are_suspended_after_the_grace(agents: Agents) -> None:
    agent = agents.start("--orphan-grace", "2")
    # Connected while the kernels start: the grace runs from when the clients go.
    holders = [hold_connection(agents, agent, user) for user in (ROOT, USER)]
    try:
        root_kernel, _ = agents.launch(agent, ROOT)
        root_kernel.run("state = [41]")
        user_kernel, _ = agents.launch(agent, USER)
        user_kernel.run("state = [7]")
        assert _record(agent.state_dir, 0, root_kernel.id)["state"] == "running"
    finally:
        for holder in holders:
            drop(holder)
    # The kernels' own clients (jupyter_client) are not the agent's: they do not count.
    record = _wait_record(
        agent.state_dir,
        0,
        root_kernel.id,
        lambda r: r["state"] == "dumped" and bool(r["note"]),
        120,
    )
    assert record["note"].startswith("suspended: no client of uid 0")
    user = _wait_record(agent.state_dir, 1001, user_kernel.id, lambda r: bool(r["note"]), 180)
    if user["state"] == "dumped":
        assert user["note"].startswith("suspended")
    else:
        # Not dumpable here (root lacks CAP_SYS_RESOURCE): it runs on, and says why.
        assert root_lacks_sys_resource(), user
        assert user["state"] == "running" and "not suspended" in user["note"]
        reconnect(user_kernel)
        assert user_kernel.run("print(state[0])").strip() == "7"
    listed = kernels_of(agent, ROOT)[root_kernel.id]
    assert listed["state"] == "dumped" and "suspended" in listed["note"]
    reply = agent.run_as(ROOT, "restore", {"kernel_id": root_kernel.id, "lazy": False})
    assert reply["ok"], reply
    reconnect(root_kernel)
    assert root_kernel.run("print(state[0] + 1)").strip() == "42"


def test_a_connected_client_keeps_its_kernels_running(agents: Agents) -> None:
    """A client of the uid that stays connected holds off the grace; another uid's
    kernel, with no client, is acted on meanwhile."""
    agent = agents.start("--orphan-grace", "1")
    holder = hold_connection(agents, agent, USER)
    try:
        kernel, _ = agents.launch(agent, USER)
        kernel.run("x = 1")
        other, _ = agents.launch(agent, OTHER)
        _wait_record(agent.state_dir, 1002, other.id, lambda r: bool(r["note"]), 180)
        record = _record(agent.state_dir, 1001, kernel.id)
        assert record["state"] == "running" and record["note"] is None
        assert kernel.run("print(x)").strip() == "1"
    finally:
        drop(holder)
