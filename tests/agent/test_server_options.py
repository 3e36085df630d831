"""What a jupyter server needs of the agent to launch, re-attach to and suspend kernels
through it: `meta` kept with a kernel (across agent restarts, dumps and restores, and
shown to its uid alone), `ignore_sigint` at launch, and the progress frames of a dump
and a restore.

Real agents, real kernels, real CRIU, real users (cedana-test, cedana-test2)."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from jupyter_cedana.agent.records import MAX_META
from tests.criu_hold import CriuHold

from . import test_restart
from .conftest import USER_PYTHON, Agent, read_reply, request_frame
from .test_launch import Kernel
from .test_restart import OTHER, ROOT, USER, Agents, kernels_of, reconnect

agents = test_restart.agents  # the fixture

SIGINT_MASK = 1 << (2 - 1)  # SigIgn's bit for signal 2


def server_meta(kernel: Kernel) -> dict[str, Any]:
    """What a server keeps: the kernel's name, connection info (its key included), cwd."""
    return {
        "kernel_name": "python3",
        "connection": json.loads(kernel.connection_file.read_text()),
        "cwd": str(kernel.home),
        "note": "ключ ✓",  # not ASCII: kept as given
    }


def poll(agent: Agent, user: str, kid: str) -> dict[str, Any]:
    reply = agent.run_as(user, "poll", {"kernel_id": kid})
    assert reply["ok"], reply
    return dict(reply["result"])


def assert_only_root_reads(path: Path, state_dir: Path) -> None:
    """`path` and every directory up to the state directory: root's, no access for others
    (the meta holds the kernel's key)."""
    st = os.stat(path)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    parent = path.parent
    while parent != state_dir:
        st = os.stat(parent)
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700, (parent, oct(st.st_mode))
        parent = parent.parent


def test_meta_is_kept_across_restarts_and_dumps_and_shown_to_its_uid_alone(
    agents: Agents,
) -> None:
    agent = agents.start()
    kernel = Kernel(agent, USER)
    agents.kernels.append(kernel)
    meta = server_meta(kernel)
    reply = agent.run_as(USER, "launch", {**kernel.launch_args(), "meta": meta})
    assert reply["ok"], reply
    assert kernels_of(agent, USER)[kernel.id]["meta"] == meta
    assert poll(agent, USER, kernel.id)["meta"] == meta
    assert kernel.id not in kernels_of(agent, OTHER)
    assert agent.run_as(OTHER, "poll", {"kernel_id": kernel.id})["error"]["code"] == "not_found"
    record = agent.state_dir / "records" / "1001" / f"{kernel.id}.json"
    assert json.loads(record.read_text())["meta"] == meta
    assert_only_root_reads(record, agent.state_dir)
    kernel.run("state = [41]")

    # The agent killed: the running kernel's meta comes back from its record.
    agent = agents.restart(agent)
    listed = kernels_of(agent, USER)[kernel.id]
    assert listed["state"] == "running" and listed["meta"] == meta
    assert kernel.id not in kernels_of(agent, OTHER)

    reply = agent.run_as(USER, "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    listed = kernels_of(agent, USER)[kernel.id]
    assert listed["state"] == "dumped" and listed["meta"] == meta
    manifest = agent.state_dir / "images" / "1001" / kernel.id / "manifest.json"
    assert json.loads(manifest.read_text())["meta"] == meta
    assert_only_root_reads(manifest, agent.state_dir)

    # Killed again while the kernel is dumped: still listed, with its meta.
    agent = agents.restart(agent)
    listed = kernels_of(agent, USER)[kernel.id]
    assert listed["state"] == "dumped" and listed["meta"] == meta
    assert poll(agent, USER, kernel.id)["meta"] == meta
    assert kernels_of(agent, OTHER) == {}

    reply = agent.run_as(USER, "restore", {"kernel_id": kernel.id, "lazy": False})
    assert reply["ok"], reply
    listed = kernels_of(agent, USER)[kernel.id]
    assert listed["state"] == "running" and listed["meta"] == meta
    # What the meta holds is what a server re-attaches with.
    reconnect(kernel)
    assert kernel.run("print(state[0] + 1)").strip() == "42"


def test_an_image_without_its_record_is_listed_with_the_meta_of_its_dump(
    agents: Agents,
) -> None:
    """A record lost (here: edited, so refused) leaves the image: `list` and `poll` show
    it as a dumped kernel with the meta its dump kept, and it restores with that meta."""
    agent = agents.start()
    kid = "0a1b2c3d-0000-4000-8000-00000000beef"
    meta = {"kernel_name": "sleeper", "connection": {"key": "secret-of-1001"}}
    home = agent.user_dir(USER)
    launch = {
        "kernel_id": kid,
        "argv": [USER_PYTHON, "-c", "import time; time.sleep(3600)"],
        "env": {"PATH": "/usr/bin:/bin"},
        "cwd": str(home),
        "meta": meta,
    }
    assert agent.run_as(USER, "launch", launch)["ok"]
    assert agent.run_as(USER, "dump", {"kernel_id": kid})["ok"]
    agents.kill(agent)
    record = agent.state_dir / "records" / "1001" / f"{kid}.json"
    edited = json.loads(record.read_text())
    edited["note"] = "edited by hand"
    record.write_text(json.dumps(edited))

    agent = agents.start()
    assert not record.exists()  # refused, kept aside
    listed = kernels_of(agent, USER)[kid]
    assert listed["state"] == "dumped" and listed["pid"] is None
    assert listed["meta"] == meta and "no record" in listed["note"]
    polled = poll(agent, USER, kid)
    assert polled["state"] == "dumped" and polled["meta"] == meta
    assert kernels_of(agent, OTHER) == {}
    assert agent.run_as(OTHER, "poll", {"kernel_id": kid})["error"]["code"] == "not_found"

    assert agent.run_as(USER, "restore", {"kernel_id": kid, "lazy": False})["ok"]
    listed = kernels_of(agent, USER)[kid]
    assert listed["state"] == "running" and listed["meta"] == meta and "note" not in listed
    assert json.loads(record.read_text())["meta"] == meta
    agent = agents.restart(agent)
    assert kernels_of(agent, USER)[kid]["meta"] == meta


def sleeper(agent: Agent, user: str, kid: str, **extra: Any) -> dict[str, Any]:
    return {
        "kernel_id": kid,
        "argv": ["/bin/sleep", "3600"],
        "env": {"PATH": "/usr/bin:/bin"},
        "cwd": str(agent.user_dir(user)),
        **extra,
    }


def test_bad_meta_and_ignore_sigint_are_refused_and_the_agent_serves_on(agent: Agent) -> None:
    kid = "0a1b2c3d-0000-4000-8000-0000000000b1"
    over = {"k": "a" * (MAX_META - len('{"k":""}') + 1)}  # one byte over, compact
    for extra in (
        {"meta": "a string"},
        {"meta": [1, 2]},
        {"meta": 7},
        {"meta": over},
        {"meta": {"k": "é" * (MAX_META // 2)}},  # within 16 Ki characters, over in bytes
        {"ignore_sigint": "yes"},
        {"ignore_sigint": 1},
        {"ignore_sigint": None},
    ):
        reply = agent.run_as(USER, "launch", sleeper(agent, USER, kid, **extra))
        assert reply["error"]["code"] == "bad_request", (extra, reply)
    assert kernels_of(agent, USER) == {}
    assert not (agent.state_dir / "records" / "1001" / f"{kid}.json").exists()
    # On one connection: the refusal leaves it open, and the next request is answered.
    sock = agent.connect()
    sock.sendall(request_frame("launch", sleeper(agent, ROOT, kid, meta=over), rid=1))
    refused = read_reply(sock)
    assert refused is not None and refused["error"]["code"] == "bad_request", refused
    assert "meta" in refused["error"]["message"]
    sock.sendall(request_frame("hello", rid=2))
    hello = read_reply(sock)
    assert hello is not None and hello["ok"] and hello["id"] == 2
    sock.close()
    # At the bound exactly, it is kept.
    full = {"k": "a" * (MAX_META - len('{"k":""}'))}
    reply = agent.run_as(USER, "launch", sleeper(agent, USER, kid, meta=full))
    assert reply["ok"], reply
    assert kernels_of(agent, USER)[kid]["meta"] == full
    assert agent.run_as(USER, "signal", {"kernel_id": kid, "signum": 9})["ok"]


def sig_ignored(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigIgn:")), 16)


def started_kernel(init_pid: int, program: str = "sleep") -> int:
    """The kernel's host pid (the init's only child) once it runs `program`."""
    deadline = time.monotonic() + 60
    while True:
        children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
        if len(children) == 1 and Path(f"/proc/{children[0]}/comm").read_text().strip() == program:
            return int(children[0])
        assert time.monotonic() < deadline, children
        time.sleep(0.01)


def test_ignore_sigint_starts_the_kernel_with_sigint_ignored(agent: Agent) -> None:
    ignoring = "0a1b2c3d-0000-4000-8000-0000000000c1"
    default = "0a1b2c3d-0000-4000-8000-0000000000c2"
    reply = agent.run_as(USER, "launch", sleeper(agent, USER, ignoring, ignore_sigint=True))
    assert reply["ok"], reply
    ignoring_pid = started_kernel(reply["result"]["pid"])
    reply = agent.run_as(USER, "launch", sleeper(agent, USER, default, ignore_sigint=False))
    assert reply["ok"], reply
    default_pid = started_kernel(reply["result"]["pid"])
    assert sig_ignored(ignoring_pid) & SIGINT_MASK
    assert not sig_ignored(default_pid) & SIGINT_MASK
    # An interrupt through the agent: the one that ignores it runs on, the other ends.
    for kid in (ignoring, default):
        assert agent.run_as(USER, "signal", {"kernel_id": kid, "signum": 2})["ok"]
    waited = agent.run_as(USER, "wait", {"kernel_id": default, "timeout": 60})["result"]
    assert waited["state"] == "exited"
    assert poll(agent, USER, ignoring)["state"] == "running"
    assert Path(f"/proc/{ignoring_pid}").exists()
    assert agent.run_as(USER, "signal", {"kernel_id": ignoring, "signum": 9})["ok"]


def frames_until(sock: Any, done: Any, what: str) -> list[dict[str, Any]]:
    """Progress frames read until one satisfies `done` (the reply must not come first)."""
    seen: list[dict[str, Any]] = []
    while True:
        frame = read_reply(sock, timeout=120)
        assert frame is not None and "progress" in frame, (what, frame, seen[-3:])
        seen.append(frame["progress"])
        if done(frame["progress"]):
            return seen


def wait_reached(hold: CriuHold, point: str) -> None:
    deadline = time.monotonic() + 120
    while not hold.reached("dump", point):
        assert time.monotonic() < deadline, f"the dump never reached {point}"
        time.sleep(0.01)


def test_dump_and_restore_send_progress_frames(agents: Agents) -> None:
    """A kernel holding 300 MiB, its dump held by the CRIU wrapper before CRIU starts and
    after CRIU wrote the image: frames come before CRIU wrote anything and as the image
    grows to its whole size, then the commit's frame, then the reply."""
    hold = CriuHold(agents.base / "criu-hold", "/usr/local/sbin/criu")
    agent = agents.start(config={"criu_path": str(hold.wrapper)})
    kernel, _ = agents.launch(agent, ROOT)
    kernel.run("blob = bytearray(b'\\x01') * (300 << 20)")
    hold.arm("dump", "before")
    hold.arm("dump", "after")
    sock = agent.connect()
    try:
        sock.sendall(request_frame("dump", {"kernel_id": kernel.id}, rid=5))
        first = frames_until(sock, lambda p: True, "held before CRIU")
        wait_reached(hold, "before")
        assert first[0]["phase"] == "dumping" and first[0]["done"] < 1 << 20
        assert first[0]["total"] > 300 << 20  # the tree's resident memory
        hold.release("dump", "before")
        # The whole image in a frame, read before the hold after CRIU is let go: sent
        # while CRIU wrote, or while it is held.
        grown = frames_until(sock, lambda p: p["done"] >= 300 << 20, "held after CRIU")
        wait_reached(hold, "after")
        assert {p["phase"] for p in grown} == {"dumping"}
        dones = [p["done"] for p in first + grown]
        assert dones == sorted(dones)
        hold.release("dump", "after")
        last: dict[str, Any] = {}
        while True:
            frame = read_reply(sock, timeout=120)
            assert frame is not None and frame["id"] == 5, frame
            if "progress" not in frame:
                break
            last = frame["progress"]
        assert frame["ok"], frame
        assert last["phase"] == "committing" and last["done"] == last["total"]
        assert last["done"] >= dones[-1] >= 300 << 20

        sock.sendall(request_frame("restore", {"kernel_id": kernel.id, "lazy": False}, rid=6))
        phases: list[str] = []
        while True:
            frame = read_reply(sock, timeout=120)
            assert frame is not None and frame["id"] == 6, frame
            if "progress" not in frame:
                break
            phases.append(frame["progress"]["phase"])
        assert frame["ok"], frame
        # The checksum pass, then CRIU.
        assert phases[-1] == "restoring" and set(phases[:-1]) == {"verifying"}, phases
    finally:
        hold.disarm()
        sock.close()
    reconnect(kernel)
    assert kernel.run("print(len(blob) >> 20, blob[-1])").strip() == "300 1"


def test_a_list_too_large_for_one_reply_leaves_meta_to_poll(agent: Agent) -> None:
    """64 kernels at the largest meta would pass the reply's limit: `list` leaves out the
    meta that does not fit (and says so), `poll` gives it."""
    count = 64
    ids = [f"0a1b2c3d-0000-4000-8000-{i:012x}" for i in range(count)]
    home = str(agent.user_dir(USER))
    sock = agent.connect()
    try:
        for i, kid in enumerate(ids):
            meta = {"i": i, "pad": "m" * (MAX_META - 64)}
            args = {"kernel_id": kid, "argv": ["/bin/sleep", "3600"], "cwd": home, "meta": meta}
            sock.sendall(request_frame("launch", args, rid=i + 1))
            reply = read_reply(sock)
            assert reply is not None and reply["ok"], reply
        sock.sendall(request_frame("list", rid=1000))
        listed = read_reply(sock)
        assert listed is not None and listed["ok"], listed
        entries = {k["kernel_id"]: k for k in listed["result"]["kernels"]}
        assert set(entries) == set(ids)
        kept = [k for k in entries.values() if k["meta"] is not None]
        left_out = [k for k in entries.values() if k.get("meta_omitted")]
        assert kept and left_out and len(kept) + len(left_out) == count
        assert all(k["meta"]["pad"] == "m" * (MAX_META - 64) for k in kept)
        missing = left_out[0]
        sock.sendall(request_frame("poll", {"kernel_id": missing["kernel_id"]}, rid=1001))
        polled = read_reply(sock)
        assert polled is not None and polled["result"]["meta"]["i"] == ids.index(
            missing["kernel_id"]
        )
    finally:
        for i, kid in enumerate(ids):
            sock.sendall(request_frame("signal", {"kernel_id": kid, "signum": 9}, rid=2000 + i))
            read_reply(sock)
        sock.close()
