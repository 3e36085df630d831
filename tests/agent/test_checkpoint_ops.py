"""dump / restore / discard / images through a real agent, real CRIU, real users."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from . import test_launch
from .checkpoint_fixtures import needs_sys_resource
from .conftest import Agent
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


@needs_sys_resource
def test_user_kernel_dump_restore_as_the_user(agent: Agent, kernels: list[Kernel]) -> None:
    kernel, _ = launch(agent, kernels, "cedana-test")
    kernel.run("state = [41]")
    reply = agent.run_as("cedana-test", "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    reply = agent.run_as("cedana-test", "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    reconnect(kernel)
    assert kernel.run("print(state[0] + 1)").strip() == "42"
    pid = kernel_pid_of(reply["result"]["pid"])
    assert_dropped(status_of(Path(f"/proc/{pid}/status").read_text()), 1001, 1001)
    inside = kernel.run("print(open('/proc/self/status').read())")
    assert_dropped(status_of(inside), 1001, 1001)


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
