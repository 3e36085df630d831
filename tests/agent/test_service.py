"""The agent's socket against bad clients: each is answered or cut off, and another
client's request is answered while the bad one is still held open. Real agent (root),
real sockets; the good client runs as cedana-test."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import time
from pathlib import Path

import pytest

from jupyter_cedana.agent import protocol
from jupyter_cedana.package_files import BIN_DIR

from .conftest import Agent, is_open, read_reply, request_frame, start_agent, wait_listening


def good_client_is_served(agent: Agent) -> float:
    """A request of another user answered while the bad client holds its connection;
    returns how long it took."""
    start = time.monotonic()
    reply = agent.run_as("cedana-test", "hello")
    elapsed = time.monotonic() - start
    assert reply == {"ok": True, "result": reply["result"]} and reply["result"]["uid"] == 1001
    return elapsed


def assert_cut_off(sock: socket.socket, code: str) -> str:
    reply = read_reply(sock)
    assert reply is not None and reply["ok"] is False, reply
    assert reply["error"]["code"] == code, reply
    assert read_reply(sock) is None, "the agent kept the connection open"
    return str(reply["error"]["message"])


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    "body,words",
    [
        (b"{not json", "not UTF-8 JSON"),
        (b"\xff\xfe{}", "not UTF-8 JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"v": 1, "id": "one", "op": "hello"}).encode(), "id must be an integer"),
    ],
)
def test_malformed_frame_is_answered_and_cut_off(agent: Agent, body: bytes, words: str) -> None:
    bad = agent.connect()
    bad.sendall(frame(body))
    good_client_is_served(agent)
    assert words in assert_cut_off(bad, "bad_request")


def test_oversized_frame_is_refused_from_its_header(agent: Agent) -> None:
    bad = agent.connect()
    # Only the header: the agent must not wait for (or read) the 64 KiB + 1 promised.
    bad.sendall(struct.pack(">I", protocol.MAX_REQUEST + 1))
    good_client_is_served(agent)
    assert str(protocol.MAX_REQUEST) in assert_cut_off(bad, "too_large")
    # The largest frame allowed is served.
    ok = agent.connect()
    padding = protocol.MAX_REQUEST - len(request_frame("hello", {"pad": ""})) + 4
    big = request_frame("hello", {"pad": "x" * padding})
    assert len(big) == protocol.MAX_REQUEST + 4
    ok.sendall(big)
    reply = read_reply(ok)
    assert reply is not None and reply["ok"], reply


@pytest.mark.parametrize("sent", ["half a header", "header and half a body"])
def test_slow_client_holds_only_its_own_connection(agent: Agent, sent: str) -> None:
    whole = request_frame("hello")
    bad = agent.connect()
    started = time.monotonic()
    bad.sendall(whole[:2] if sent == "half a header" else whole[: len(whole) // 2])
    # Served while the stalled frame is still being waited for.
    elapsed = good_client_is_served(agent)
    assert is_open(bad), "the slow client was cut off before its time"
    assert elapsed < agent.limits["frame-timeout"] + 30  # served, not stuck behind it
    message = assert_cut_off(bad, "timeout")
    assert time.monotonic() - started >= agent.limits["frame-timeout"]
    assert "within 2 s" in message


def test_flooding_uid_is_refused_past_its_limit(agent: Agent) -> None:
    limit = int(agent.limits["max-connections-per-uid"])
    held = [agent.connect() for _ in range(limit)]
    for i, sock in enumerate(held):  # each admitted: it answers
        sock.sendall(request_frame("hello", rid=i))
        reply = read_reply(sock)
        assert reply is not None and reply["ok"], reply
    extra = agent.connect()
    message = assert_cut_off(extra, "busy")
    assert f"{limit} connections" in message
    # Another uid is not affected by root's flood.
    good_client_is_served(agent)
    # The limit counts open connections: one closed, one more is admitted.
    held.pop().close()
    deadline = time.monotonic() + 30
    while True:
        again = agent.connect()
        again.sendall(request_frame("hello"))
        reply = read_reply(again)
        if reply is not None and reply["ok"]:
            break
        assert time.monotonic() < deadline, "a closed connection was never counted out"
    for sock in held:
        assert is_open(sock)


def test_total_connection_limit(agent_base: Path) -> None:
    proc = start_agent(agent_base, "--max-connections", "2", "--max-connections-per-uid", "2")
    try:
        wait_listening(proc)
        path = str(agent_base / "run" / "agent.sock")
        held = []
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(request_frame("hello"))
            assert read_reply(s) is not None
            held.append(s)
        agent = Agent(proc, agent_base, Path(path), agent_base / "state", {})
        reply = agent.run_as("cedana-test", "hello")
        assert reply["error"]["code"] == "busy"
        assert "too many connections" in reply["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_idle_connection_is_closed(agent_base: Path) -> None:
    proc = start_agent(agent_base, "--idle-timeout", "1")
    try:
        wait_listening(proc)
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(agent_base / "run" / "agent.sock"))
        s.sendall(request_frame("hello"))
        assert read_reply(s) is not None
        assert "idle for 1 s" in assert_cut_off(s, "timeout")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_request_errors_keep_the_connection(agent: Agent) -> None:
    sock = agent.connect()
    sock.sendall(request_frame("hello", v=2))
    reply = read_reply(sock)
    assert reply is not None and reply["error"]["code"] == "unsupported_version"
    sock.sendall(request_frame("format_disk", rid=2))
    reply = read_reply(sock)
    assert reply is not None and (reply["id"], reply["error"]["code"]) == (2, "unknown_op")
    sock.sendall(request_frame("poll", {"kernel_id": "../../etc"}, rid=3))
    reply = read_reply(sock)
    assert reply is not None and reply["error"]["code"] == "bad_request"
    # Pipelined requests: each reply carries its request's id.
    sock.sendall(request_frame("hello", rid=7) + request_frame("list", rid=8))
    replies = {r["id"]: r for r in (read_reply(sock), read_reply(sock)) if r is not None}
    assert set(replies) == {7, 8} and all(r["ok"] for r in replies.values())


def test_identity_is_the_sockets(agent: Agent) -> None:
    """hello reports the peer's credentials; a uid in the request is not read."""
    reply = agent.run_as("cedana-test2", "hello", {"uid": 0, "gid": 0})
    assert reply["ok"], reply
    assert (reply["result"]["uid"], reply["result"]["gid"]) == (1002, 1002)


def test_socket_and_state_dir_modes(agent: Agent) -> None:
    sock = os.stat(agent.socket_path)
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o666
    run_dir = os.stat(agent.socket_path.parent)
    assert (run_dir.st_uid, stat.S_IMODE(run_dir.st_mode)) == (0, 0o755)
    state = os.stat(agent.state_dir)
    assert (state.st_uid, stat.S_IMODE(state.st_mode)) == (0, 0o700)


def _refused(base: Path) -> str:
    proc = start_agent(base)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    return err


@pytest.mark.parametrize(
    "which,how",
    [
        ("run", "mode 0777"),
        ("run", "owned by cedana-test"),
        ("state", "mode 0770"),
        ("state", "owned by cedana-test"),
        ("state", "parent owned by cedana-test"),
    ],
)
def test_refuses_directories_writable_by_others(agent_base: Path, which: str, how: str) -> None:
    target = agent_base / which
    if how.startswith("parent"):
        parent = agent_base / "user-owned"
        parent.mkdir(mode=0o755)
        os.chown(parent, 1001, 1001)
        target = parent / "state"
        target.mkdir(mode=0o700)
        start = start_agent(agent_base, state_dir=target)
        _, err = start.communicate(timeout=60)
        assert start.returncode == 2, err
        assert str(parent) in err and "owned by uid 1001" in err
        return
    target.mkdir(mode=0o755 if which == "run" else 0o700)
    if how.startswith("mode"):
        os.chmod(target, int(how.split()[1], 8))
    else:
        os.chown(target, 1001, 1001)
    err = _refused(agent_base)
    assert str(target) in err and "writable by root only" in err
    assert not (agent_base / "run" / "agent.sock").exists()


def test_refuses_a_second_agent_on_the_same_socket(agent: Agent) -> None:
    err = _refused(agent.base)
    assert "an agent is serving" in err
    good_client_is_served(agent)


def _admitted(agent: Agent) -> bool:
    sock = agent.connect()
    sock.sendall(request_frame("hello"))
    reply = read_reply(sock)
    sock.close()
    return reply is not None and reply["ok"]


def test_waits_of_a_gone_client_are_dropped(agent: Agent) -> None:
    """A client that leaves `wait`s behind and reconnects cannot pile them up: they end
    with their connection, which then no longer counts against the uid's share."""
    kid = "0123abcd"
    sock = agent.connect()
    sock.sendall(request_frame("launch", {"kernel_id": kid, "argv": ["sleep", "3600"]}))
    reply = read_reply(sock)
    assert reply is not None and reply["ok"], reply
    limit = int(agent.limits["max-connections-per-uid"])
    held = [agent.connect() for _ in range(limit - 1)]
    for s in [sock, *held]:
        s.sendall(request_frame("wait", {"kernel_id": kid, "timeout": 3600}, rid=9))
        s.sendall(request_frame("hello", rid=10))  # answered: the wait is in flight
        answered = read_reply(s)
        assert answered is not None and answered["id"] == 10
    assert not _admitted(agent)  # the share is used up
    for s in [sock, *held]:
        s.close()
    deadline = time.monotonic() + 30
    while not _admitted(agent):
        assert time.monotonic() < deadline, "connections with a wait in flight stayed counted"
    # The kernel itself is untouched by its waiters' going.
    again = agent.connect()
    again.sendall(request_frame("poll", {"kernel_id": kid}))
    polled = read_reply(again)
    assert polled is not None and polled["result"] == {
        "returncode": None,
        "state": "running",
        "meta": None,
    }
    again.sendall(request_frame("signal", {"kernel_id": kid, "signum": 9}, rid=2))
    assert read_reply(again) is not None


@pytest.mark.parametrize("where", ["file", "directory"])
def test_refuses_an_init_program_users_can_replace(agent_base: Path, where: str) -> None:
    bin_dir = agent_base / "bin"
    bin_dir.mkdir(mode=0o755)
    init = bin_dir / "cedana-init"
    shutil.copy(_packaged_init(), init)
    os.chmod(init, 0o755)
    os.chown(init if where == "file" else bin_dir, 1001, 1001)
    proc = start_agent(agent_base, "--cedana-init", str(init))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "owned by uid 1001" in err
    assert str(init if where == "file" else bin_dir) in err


def _packaged_init() -> str:

    return str(BIN_DIR / "cedana-init")
