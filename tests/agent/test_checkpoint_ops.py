"""dump / restore / discard / images through a real agent, real CRIU, real users."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from jupyter_cedana.agent.imagecheck import root_exe, task_creds
from jupyter_cedana.checkpoint.proctree import process_tree

from . import test_launch
from .conftest import USER_PYTHON, Agent
from .test_launch import Kernel, assert_dropped, kernel_pid_of, launch, status_of

kernels = test_launch.kernels  # the fixture: kernels launched here, closed after

ROOT = "root"


def launch_root(agent: Agent, kernels: list[Kernel]) -> Kernel:
    """A root caller's kernel (root's requests go through the same client)."""
    kernel = Kernel(agent, "cedana-test")
    kernels.append(kernel)
    args = {
        **kernel.launch_args(),
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", str(kernel.connection_file)],
    }
    reply = agent.run_as(ROOT, "launch", args)
    assert reply["ok"], reply
    return kernel


def reconnect(kernel: Kernel) -> None:
    if kernel.client is not None:
        kernel.client.stop_channels()
        kernel.client = None


def test_root_kernel_dump_restore_keeps_state(agent: Agent, kernels: list[Kernel]) -> None:
    kernel = launch_root(agent, kernels)
    kernel.run("state = [41]")
    reply = agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    assert reply["result"]["bytes"] > 0
    listed = agent.run_as(ROOT, "images")["result"]["images"]
    assert [i["kernel_id"] for i in listed] == [kernel.id]
    reply = agent.run_as(ROOT, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    reconnect(kernel)
    assert kernel.run("print(state[0] + 1)").strip() == "42"
    # The image goes once its kernel runs again.
    assert agent.run_as(ROOT, "images")["result"]["images"] == []
    # Its stderr still reaches the agent's log: more than a pipe holds, which would
    # block the kernel if nobody read the restored pipe.
    kernel.run("import os\nfor _ in range(4): os.write(2, b'x' * 65536)\nos.write(2, b'END')")
    deadline = time.monotonic() + 30
    while not agent.run_as(ROOT, "log", {"kernel_id": kernel.id})["result"]["text"].endswith("END"):
        assert time.monotonic() < deadline, "the restored kernel's stderr did not arrive"
        time.sleep(0.1)


def test_root_kernel_lazy_restore(agent: Agent, kernels: list[Kernel]) -> None:
    kernel = launch_root(agent, kernels)
    kernel.run("import numpy; big = numpy.arange(4 << 20); total = int(big.sum())")
    assert agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})["ok"]
    reply = agent.run_as(ROOT, "restore", {"kernel_id": kernel.id, "lazy": True})
    assert reply["ok"], reply
    assert reply["result"]["lazy"] is True
    reconnect(kernel)
    assert kernel.run("print(int(big.sum()) == total, big[-1])").split() == [
        "True",
        str((4 << 20) - 1),
    ]
    # The image goes once all the memory is in.
    deadline = time.monotonic() + 60
    while agent.run_as(ROOT, "images")["result"]["images"]:
        assert time.monotonic() < deadline, "the image outlived the lazy restore"
        time.sleep(0.2)


def host_tree_status(init_pid: int) -> dict[int, dict[str, str]]:
    """/proc/TID/status of every task (thread) of the tree rooted at `init_pid`."""
    out = {}
    for pid in process_tree(init_pid):
        for tid in os.listdir(f"/proc/{pid}/task"):
            out[int(tid)] = status_of(Path(f"/proc/{pid}/task/{tid}/status").read_text())
    return out


# From a cell: every task of the kernel's PID namespace, as its own /proc shows them.
TREE_FROM_INSIDE = """
import json, os
out = {}
for p in filter(str.isdigit, os.listdir("/proc")):
    for t in os.listdir(f"/proc/{p}/task"):
        out[t] = open(f"/proc/{p}/task/{t}/status").read()
print(json.dumps(out))
"""


def assert_whole_tree_is(kernel: Kernel, init_pid: int, uid: int, gid: int) -> None:
    """Every task of the kernel's tree, its init included, runs as uid/gid with no
    capability in any set and no_new_privs: from the host's /proc and from notebook code."""
    host = host_tree_status(init_pid)
    assert init_pid in host and len(host) >= 2, host.keys()
    # The init dropped its ids without an exec after: not dumpable, so its /proc files
    # are root's and the kernel cannot ptrace it.
    assert os.stat(f"/proc/{init_pid}/environ").st_uid == 0
    for status in host.values():
        assert_dropped(status, uid, gid)
    inside = {
        int(t): status_of(text) for t, text in json.loads(kernel.run(TREE_FROM_INSIDE)).items()
    }
    assert 1 in inside and len(inside) == len(host), (inside.keys(), host.keys())
    for status in inside.values():
        assert_dropped(status, uid, gid)


def test_user_kernel_dump_restore_as_the_user(agent: Agent, kernels: list[Kernel]) -> None:
    """Where root lacks CAP_SYS_RESOURCE too: the agent's CRIU dumps with the user's real
    ids a tree that is all the user's."""
    kernel, init_pid = launch(agent, kernels, "cedana-test")
    kernel.run("state = [41]")
    assert_whole_tree_is(kernel, init_pid, 1001, 1001)
    reply = agent.run_as("cedana-test", "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    assert not Path(f"/proc/{init_pid}").exists()
    # What the image check reads: the init's credentials are the user's as well.
    images = agent.state_dir / "images" / "1001" / kernel.id
    root, _ = root_exe(images)
    init = next(t for t in task_creds(images) if t.tid == root)
    assert set(init.ids.values()) == {1001} and init.no_new_privs == 1
    assert init.caps.keys() >= {"bounding", "permitted"}
    assert not any(any(words) for words in init.caps.values()), init.caps
    reply = agent.run_as("cedana-test", "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    reconnect(kernel)
    assert kernel.run("print(state[0] + 1)").strip() == "42"
    pid = kernel_pid_of(reply["result"]["pid"])
    assert_dropped(status_of(Path(f"/proc/{pid}/status").read_text()), 1001, 1001)
    assert_whole_tree_is(kernel, reply["result"]["pid"], 1001, 1001)
    assert agent.run_as("cedana-test", "images")["result"]["images"] == []


def test_user_kernel_lazy_restore(agent: Agent, kernels: list[Kernel]) -> None:
    kernel, _ = launch(agent, kernels, "cedana-test")
    kernel.run(
        "import hashlib; big = bytearray(range(256)) * (1 << 16); "
        "digest = hashlib.sha256(big).hexdigest()"
    )
    assert agent.run_as("cedana-test", "dump", {"kernel_id": kernel.id})["ok"]
    reply = agent.run_as("cedana-test", "restore", {"kernel_id": kernel.id, "lazy": True})
    assert reply["ok"], reply
    assert reply["result"]["lazy"] is True
    reconnect(kernel)
    assert kernel.run("print(hashlib.sha256(big).hexdigest() == digest, len(big))").split() == [
        "True",
        str(1 << 24),
    ]
    assert_whole_tree_is(kernel, reply["result"]["pid"], 1001, 1001)
    deadline = time.monotonic() + 60
    while agent.run_as("cedana-test", "images")["result"]["images"]:
        assert time.monotonic() < deadline, "the image outlived the lazy restore"
        time.sleep(0.2)


# Run as cedana-test2 with cedana-test's pids: what it could do to each of them.
OTHER_USER_PROBE = """
import json, os, sys
out = {}
for p in map(int, sys.argv[1:]):
    try:
        os.kill(p, 0)
        out[p] = "signal"
    except PermissionError:
        pass
    for name in ("environ", "mem"):
        try:
            open(f"/proc/{p}/{name}", "rb").read(1)
            out[p] = name
        except PermissionError:
            pass
    try:
        os.listdir(f"/proc/{p}/cwd")
        out[p] = "cwd"
    except PermissionError:
        pass
print(json.dumps(out))
"""


def test_another_user_cannot_touch_a_user_kernel_or_its_image(
    agent: Agent, kernels: list[Kernel]
) -> None:
    """cedana-test2 can neither act on cedana-test's dumped kernel through the agent nor
    signal or read the processes of it once restored."""
    kernel, _ = launch(agent, kernels, "cedana-test")
    kernel.run("secret = 'x' * 7")
    assert agent.run_as("cedana-test", "dump", {"kernel_id": kernel.id})["ok"]
    for op in ("restore", "discard", "dump"):
        reply = agent.run_as("cedana-test2", op, {"kernel_id": kernel.id})
        assert reply["error"]["code"] == "not_found", (op, reply)
    assert agent.run_as("cedana-test2", "images")["result"]["images"] == []
    reply = agent.run_as("cedana-test", "restore", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    tree = sorted(process_tree(reply["result"]["pid"]))
    out = subprocess.run(
        [
            "runuser",
            "-u",
            "cedana-test2",
            "--",
            USER_PYTHON,
            "-c",
            OTHER_USER_PROBE,
            *map(str, tree),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {}
    reconnect(kernel)
    assert kernel.run("print(secret)").strip() == "x" * 7


def test_another_user_gets_not_found(agent: Agent, kernels: list[Kernel]) -> None:
    kernel, init_pid = launch(agent, kernels, "cedana-test")
    for op in ("dump", "restore", "discard"):
        reply = agent.run_as("cedana-test2", op, {"kernel_id": kernel.id})
        assert reply["error"]["code"] == "not_found", (op, reply)
    assert agent.run_as("cedana-test2", "images")["result"]["images"] == []
    # Untouched: not stopped, not dumped.
    assert Path(f"/proc/{init_pid}/stat").read_text().rpartition(")")[2].split()[0] != "T"
    assert (
        agent.run_as("cedana-test", "poll", {"kernel_id": kernel.id})["result"]["returncode"]
        is None
    )


def _stopped_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"
    except FileNotFoundError:
        return True


def test_a_pid_in_a_request_dumps_nothing(agent: Agent, kernels: list[Kernel]) -> None:
    root_proc = subprocess.Popen(["sleep", "300"])
    try:
        kernel, _ = launch(agent, kernels, "cedana-test")
        for args in (
            {"kernel_id": "0" * 8, "pid": root_proc.pid},
            {"kernel_id": "0" * 8, "pid": 1},
            {"pid": root_proc.pid},
        ):
            reply = agent.run_as("cedana-test", "dump", args)
            assert reply["error"]["code"] in ("not_found", "bad_request"), reply
        reply = agent.run_as("cedana-test", "dump", {"kernel_id": "../../1"})
        assert reply["error"]["code"] == "bad_request", reply
        # The same from notebook code of cedana-test, on the agent's socket.
        code = textwrap.dedent(f"""
            import json
            from jupyter_cedana.agent.client import AgentClient
            async def main():
                c = await AgentClient.connect({str(agent.socket_path)!r})
                try:
                    await c.request("dump", {{"kernel_id": "1", "pid": {root_proc.pid}}})
                except Exception as e:
                    print(getattr(e, "code", type(e).__name__))
            await main()
        """)
        assert kernel.run(code).strip() == "not_found"
        assert not _stopped_or_gone(root_proc.pid)
        assert not any((agent.state_dir / "images").glob("*/*"))
    finally:
        root_proc.kill()
        root_proc.wait()


def test_foreign_image_refused_and_kept(agent: Agent, kernels: list[Kernel]) -> None:
    """An image in cedana-test's part of the store that is not theirs (here root's, put
    there by root: tasks of uid 0 with every capability) is refused, and kept."""
    kernel = launch_root(agent, kernels)
    assert agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})["ok"]
    images = agent.state_dir / "images"
    mine = images / "1001"
    mine.mkdir(mode=0o700, exist_ok=True)
    os.rename(images / "0" / kernel.id, mine / kernel.id)
    listed = agent.run_as("cedana-test", "images")["result"]["images"]
    assert [i["kernel_id"] for i in listed] == [kernel.id]
    reply = agent.run_as("cedana-test", "restore", {"kernel_id": kernel.id})
    assert reply["error"]["code"] == "refused", reply
    assert "uid 0, not 1001" in reply["error"]["message"]
    assert not (mine / kernel.id).exists()
    kept = list((agent.state_dir / "refused" / "1001").iterdir())
    assert len(kept) == 1 and (kept[0] / "manifest.json").exists()
    why = json.loads((kept[0] / "REFUSED.json").read_text())
    assert why["kernel_id"] == kernel.id and "uid 0" in why["reason"]
    after = agent.run_as("cedana-test", "images")["result"]
    assert after["images"] == [] and after["refused"] == [kept[0].name]


def test_discard_and_conflicts(agent: Agent, kernels: list[Kernel]) -> None:
    kernel = launch_root(agent, kernels)
    assert agent.run_as(ROOT, "restore", {"kernel_id": kernel.id})["error"]["code"] in (
        "not_found",
        "conflict",
    )
    assert agent.run_as(ROOT, "discard", {"kernel_id": kernel.id})["error"]["code"] in (
        "not_found",
        "conflict",
    )
    assert agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})["ok"]
    assert agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})["error"]["code"] == "conflict"
    assert agent.run_as(ROOT, "discard", {"kernel_id": kernel.id})["ok"]
    assert agent.run_as(ROOT, "images")["result"]["images"] == []
    assert agent.run_as(ROOT, "restore", {"kernel_id": kernel.id})["error"]["code"] == ("not_found")
