"""Kernels launched by the agent: whose they are, what they can do, what they outlive.

Real ipykernel kernels for the test users, cells executed through jupyter_client, the
client run as the user through runuser."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.connect import write_connection_file

from .conftest import USER_PYTHON, Agent, read_reply, request_frame

STATUS_FIELDS = (
    "Uid",
    "Gid",
    "Groups",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
)


def status_of(text: str) -> dict[str, str]:
    fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return {k: fields[k].strip() for k in STATUS_FIELDS}


def kernel_argv(connection_file: Path) -> list[str]:
    return [USER_PYTHON, "-m", "ipykernel_launcher", "-f", str(connection_file)]


class Kernel:
    """A kernel launched for `user` through the agent, and a client of its channels."""

    def __init__(self, agent: Agent, user: str, env: dict[str, str] | None = None):
        self.agent = agent
        self.user = user
        self.id = str(uuid.uuid4())
        self.home = agent.user_dir(user)
        self.connection_file = self.home / f"kernel-{self.id}.json"
        write_connection_file(str(self.connection_file), ip="127.0.0.1")
        entry = pwd.getpwnam(user)
        os.chown(self.connection_file, entry.pw_uid, entry.pw_gid)
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(self.home), **(env or {})}
        self.client: BlockingKernelClient | None = None

    def launch_args(self) -> dict[str, Any]:
        return {
            "kernel_id": self.id,
            "argv": kernel_argv(self.connection_file),
            "env": self.env,
            "cwd": str(self.home),
        }

    def connect(self) -> BlockingKernelClient:
        client = BlockingKernelClient()
        client.load_connection_file(str(self.connection_file))
        # No heartbeat: on a loaded machine a kernel still importing misses its first
        # beats, and the client would call it dead. Its kernel_info reply is the proof.
        client.start_channels(hb=False)
        client.wait_for_ready(timeout=120)
        self.client = client
        return client

    def run(self, code: str) -> str:
        """Executes a cell; its stdout (an error's traceback fails the test)."""
        client = self.client or self.connect()
        out: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = client.execute_interactive(code, output_hook=hook, timeout=120)
        assert reply["content"]["status"] == "ok", "".join(out)
        return "".join(out)

    def close(self) -> None:
        if self.client is not None:
            self.client.stop_channels()


@pytest.fixture
def kernels(agent: Agent) -> Iterator[list[Kernel]]:
    made: list[Kernel] = []
    yield made
    for k in made:
        k.close()


def launch(agent: Agent, kernels: list[Kernel], user: str, **kw: Any) -> tuple[Kernel, int]:
    kernel = Kernel(agent, user, **kw)
    kernels.append(kernel)
    reply = agent.run_as(user, "launch", kernel.launch_args())
    assert reply["ok"], reply
    return kernel, reply["result"]["pid"]


def kernel_pid_of(init_pid: int) -> int:
    """The kernel's host pid: the init's only child (the init is the namespace's PID 1)."""
    children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


NO_CAPS = "0000000000000000"


def assert_dropped(status: dict[str, str], uid: int, gid: int) -> None:
    assert status["Uid"].split() == [str(uid)] * 4
    assert status["Gid"].split() == [str(gid)] * 4
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[field] == NO_CAPS, (field, status[field])
    assert status["NoNewPrivs"] == "1"


def test_kernel_runs_as_the_caller_with_no_capabilities(
    agent: Agent, kernels: list[Kernel]
) -> None:
    """Positive proof, from the host's /proc and from the kernel's own code."""
    entry = pwd.getpwnam("cedana-test")
    kernel, init_pid = launch(agent, kernels, "cedana-test")
    # The init built the namespace as root, then dropped to the user like the kernel
    # (CRIU with the user's real ids dumps the tree from it) ...
    init = status_of(Path(f"/proc/{init_pid}/status").read_text())
    assert_dropped(init, entry.pw_uid, entry.pw_gid)
    # ... and the kernel it runs is the user's, with nothing that could give root back.
    from_cell = status_of(kernel.run("print(open('/proc/self/status').read())"))
    host = status_of(Path(f"/proc/{kernel_pid_of(init_pid)}/status").read_text())
    assert host == from_cell
    assert_dropped(host, entry.pw_uid, entry.pw_gid)
    groups = sorted(int(g) for g in host["Groups"].split())
    assert groups == sorted({entry.pw_gid, *os.getgrouplist("cedana-test", entry.pw_gid)})
    # Its own PID namespace (PID 1 is the init) and the directory the caller asked for.
    ns = kernel.run("import os; print(os.getpid(), os.getppid(), os.getcwd())").split()
    assert ns == ["2", "1", str(kernel.home)]


def test_identity_fields_in_a_request_are_ignored(agent: Agent, kernels: list[Kernel]) -> None:
    """uid, gid, groups, user or pid in the request change nothing: identity is the socket's."""
    kernel = Kernel(agent, "cedana-test")
    kernels.append(kernel)
    args = {**kernel.launch_args(), "uid": 0, "gid": 0, "groups": [0], "user": "root", "pid": 1}
    reply = agent.run_as("cedana-test", "launch", args)
    assert reply["ok"], reply
    status = status_of(kernel.run("print(open('/proc/self/status').read())"))
    assert status["Uid"].split() == ["1001"] * 4
    assert "0" not in status["Groups"].split()


def test_launch_environment_drops_loader_and_criu_variables(
    agent: Agent, kernels: list[Kernel]
) -> None:
    hostile = {
        "LD_PRELOAD": "/tmp/evil.so",
        "LD_LIBRARY_PATH": "/tmp/evil",
        "LD_AUDIT": "/tmp/evil.so",
        "CRIU_LIBS_DIR": "/tmp/evil",
        "CRIU_CONFIG_FILE": "/tmp/evil.conf",
        "GCONV_PATH": "/tmp/evil",
        "GLIBC_TUNABLES": "glibc.malloc.check=3",
        "MALLOC_CHECK_": "3",
        "JPY_PARENT_PID": "1",
    }
    kept = {"MY_SETTING": "kept", "PYTHONUNBUFFERED": "1"}
    kernel, _ = launch(agent, kernels, "cedana-test", env={**hostile, **kept})
    seen = json.loads(kernel.run("import os, json; print(json.dumps(dict(os.environ)))"))
    assert not set(hostile) & set(seen), set(hostile) & set(seen)
    assert {k: seen.get(k) for k in kept} == kept


def test_cwd_is_entered_with_the_users_permissions(agent: Agent, kernels: list[Kernel]) -> None:
    """A directory root may enter but the user may not: the kernel does not start there."""
    kernel = Kernel(agent, "cedana-test")
    kernels.append(kernel)
    private = agent.base / "root-only"
    private.mkdir(mode=0o700)
    reply = agent.run_as("cedana-test", "launch", {**kernel.launch_args(), "cwd": str(private)})
    assert reply["ok"], reply
    waited = agent.run_as("cedana-test", "wait", {"kernel_id": kernel.id, "timeout": 60})
    assert waited["result"]["returncode"] == 127, waited
    log = agent.run_as("cedana-test", "log", {"kernel_id": kernel.id})["result"]["text"]
    assert f"{private}: Permission denied" in log


HOLD_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys
    from jupyter_cedana.agent.client import AgentClient

    async def main():
        agent = await AgentClient.connect(sys.argv[1])
        reply = await agent.launch(**json.loads(sys.argv[2]))
        print(json.dumps(reply), flush=True)
        # Holds the connection until killed, or closes it when told on stdin.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await agent.close()
        print("closed", flush=True)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("how", ["sigkill", "close", "sigterm"])
def test_kernel_outlives_its_client(agent: Agent, kernels: list[Kernel], how: str) -> None:
    """The server (here: a client process of the user) dies; the kernel runs on, and a new
    client of the same uid finds it and uses it, with its state."""
    kernel = Kernel(agent, "cedana-test")
    kernels.append(kernel)
    script = agent.base / "hold_client.py"
    script.write_text(HOLD_CLIENT)
    client = subprocess.Popen(
        [
            "runuser",
            "-u",
            "cedana-test",
            "--",
            USER_PYTHON,
            str(script),
            str(agent.socket_path),
            json.dumps(kernel.launch_args()),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    assert client.stdout is not None and client.stdin is not None
    launched = json.loads(client.stdout.readline())
    kernel.run("state = 6 * 7")
    if how == "sigkill":
        # The client is runuser's child: killed first, as the OOM killer would.
        for pid in [*_descendants(client.pid), client.pid]:
            os.kill(pid, signal.SIGKILL)
    elif how == "sigterm":
        client.terminate()
    else:
        client.stdin.write("close\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "closed"
    client.wait(timeout=30)
    if how == "close":
        assert client.returncode == 0
    elif how == "sigkill":
        # runuser itself, or runuser reporting its killed child (128 + 9), whichever died last.
        assert client.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
    listed = agent.run_as("cedana-test", "list")["result"]["kernels"]
    mine = [k for k in listed if k["kernel_id"] == kernel.id]
    assert mine == [
        {
            "kernel_id": kernel.id,
            "state": "running",
            "pid": launched["pid"],
            "returncode": None,
            "meta": None,
        }
    ]
    assert (
        agent.run_as("cedana-test", "poll", {"kernel_id": kernel.id})["result"]["returncode"]
        is None
    )
    # A new client of its channels (the restarted server's) finds the kernel's state.
    kernel.close()
    kernel.client = None
    assert kernel.run("print(state)").strip() == "42"


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += [int(child), *_descendants(int(child))]
    return out


def test_signal_poll_wait_release(agent: Agent, kernels: list[Kernel]) -> None:
    kernel, _ = launch(agent, kernels, "cedana-test")
    kernel.run("x = 1")
    user = "cedana-test"
    assert agent.run_as(user, "signal", {"kernel_id": kernel.id, "signum": signal.SIGINT})["ok"]
    kernel.run("x = 2")  # an interrupt with nothing running leaves the kernel alive
    # A signal cedana-init would not forward (a PID 1 gets none other from outside).
    stop = agent.run_as(user, "signal", {"kernel_id": kernel.id, "signum": signal.SIGSTOP})
    assert stop["error"]["code"] == "bad_request"
    busy = agent.run_as(user, "release", {"kernel_id": kernel.id})
    assert busy["error"]["code"] == "conflict"
    assert agent.run_as(user, "signal", {"kernel_id": kernel.id, "signum": signal.SIGKILL})["ok"]
    waited = agent.run_as(user, "wait", {"kernel_id": kernel.id, "timeout": 60})["result"]
    assert waited == {"returncode": 128 + signal.SIGKILL, "state": "exited"}
    assert agent.run_as(user, "release", {"kernel_id": kernel.id})["ok"]
    gone = agent.run_as(user, "poll", {"kernel_id": kernel.id})
    assert gone["error"]["code"] == "not_found"
    assert not (agent.state_dir / "kernels" / "1001" / kernel.id).exists()


def test_another_user_cannot_see_or_touch_the_kernel(agent: Agent, kernels: list[Kernel]) -> None:
    """cedana-test2 gets exactly what an id that never existed gets, for every op."""
    kernel, init_pid = launch(agent, kernels, "cedana-test")
    kernel.run("alive = True")
    unknown = str(uuid.uuid4())
    assert agent.run_as("cedana-test2", "list")["result"] == {"kernels": []}
    ops: list[tuple[str, dict[str, Any]]] = [
        ("poll", {}),
        ("signal", {"signum": signal.SIGKILL}),
        ("wait", {"timeout": 0}),
        ("log", {}),
        ("release", {}),
    ]
    for op, extra in ops:
        theirs = agent.run_as("cedana-test2", op, {"kernel_id": kernel.id, **extra})
        never = agent.run_as("cedana-test2", op, {"kernel_id": unknown, **extra})
        assert theirs["error"]["code"] == "not_found", (op, theirs)
        assert theirs["error"]["message"].replace(kernel.id, "ID") == never["error"][
            "message"
        ].replace(unknown, "ID")
    # Signals naming a pid (the kernel's, a root process's) are not a thing: still not found.
    for pid in (init_pid, kernel_pid_of(init_pid), 1, os.getpid(), agent.proc.pid):
        reply = agent.run_as(
            "cedana-test2", "signal", {"kernel_id": unknown, "pid": pid, "signum": 9}
        )
        assert reply["error"]["code"] == "not_found"
    reply = agent.run_as("cedana-test2", "signal", {"pid": 1, "signum": 9})
    assert reply["error"]["code"] == "bad_request"
    assert agent.proc.poll() is None
    assert kernel.run("print(alive)").strip() == "True"


def test_root_caller_gets_a_root_kernel(agent: Agent, kernels: list[Kernel]) -> None:
    """Root's own kernels keep root (as under a root server without the agent)."""
    kernel = Kernel(agent, "cedana-test")
    kernels.append(kernel)
    args = {
        **kernel.launch_args(),
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", str(kernel.connection_file)],
    }
    sock = agent.connect()
    sock.sendall(request_frame("launch", args))
    reply = read_reply(sock)
    assert reply is not None and reply["ok"], reply
    sock.close()
    assert status_of(kernel.run("print(open('/proc/self/status').read())"))["Uid"].split()[0] == "0"


NOTEBOOK_ATTEMPTS = """
import json, os, signal
from jupyter_cedana.agent.client import AgentClient
from jupyter_cedana.agent.protocol import AgentError

out = {}
async with await AgentClient.connect(SOCKET) as agent:
    out["uid"] = (await agent.hello())["uid"]
    out["listed"] = [k["kernel_id"] for k in await agent.list()]
    for name, args in [
        ("other", {"kernel_id": OTHER, "signum": 9}),
        ("pid", {"kernel_id": UNKNOWN, "pid": AGENT_PID, "signum": 9}),
        ("as_root", {"kernel_id": OTHER, "uid": 0, "signum": 9}),
    ]:
        try:
            await agent.request("signal", args)
            out[name] = "done"
        except AgentError as e:
            out[name] = e.code
try:
    # The namespace's init, the user's own: PID 1 ignores SIGKILL from inside its
    # namespace, so it lives on.
    os.kill(1, signal.SIGKILL)
    out["init"] = "signalled"
except PermissionError:
    out["init"] = "denied"
print(json.dumps(out))
"""


def test_notebook_code_cannot_reach_other_kernels_or_root(
    agent: Agent, kernels: list[Kernel]
) -> None:
    """The same refusals for a cell of cedana-test's kernel as for a client of cedana-test2:
    the kernel talks to the agent as 1001, and cannot kill its own init."""
    other, other_init = launch(agent, kernels, "cedana-test2")
    other.run("mine = 'cedana-test2'")
    kernel, init_pid = launch(agent, kernels, "cedana-test")
    code = (
        f"SOCKET = {str(agent.socket_path)!r}; OTHER = {other.id!r}; "
        f"UNKNOWN = {str(uuid.uuid4())!r}; AGENT_PID = {agent.proc.pid}\n" + NOTEBOOK_ATTEMPTS
    )
    seen = json.loads(kernel.run(code))
    assert seen == {
        "uid": 1001,
        "listed": [kernel.id],
        "other": "not_found",
        "pid": "not_found",
        "as_root": "not_found",
        "init": "signalled",
    }
    assert Path(f"/proc/{init_pid}").exists() and agent.proc.poll() is None
    assert other.run("print(mine)").strip() == "cedana-test2"
    assert Path(f"/proc/{other_init}").exists()
