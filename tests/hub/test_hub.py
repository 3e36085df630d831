"""A user's kernels through a real JupyterHub, with servers of non-root users whose
kernels live under the checkpoint agent: culled or stopped servers bring their kernels
back with all their state, users cannot reach each other's kernels or images, and a
killed server's kernels, suspended or running, come back too."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
from typing import Any

import pytest

from tests.hub.conftest import NONROOT_BIN, USERS, Hub, processes_mentioning, wait_for

pytestmark = [pytest.mark.hub, pytest.mark.criu]
USER, OTHER = USERS

STATE = """
import threading, time
import numpy as np
x = "kept through the Hub"
arr = np.arange(100_000, dtype=np.float64) * 2
counter = [0]
def tick():
    while True:
        counter[0] += 1
        time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
while counter[0] < 3:
    time.sleep(0.01)
before = counter[0]
print("ready")
"""
CHECK = """
start = counter[0]
time.sleep(0.3)
print(x, float(arr.sum()), counter[0] > start >= before)
"""
EXPECTED = f"kept through the Hub {float(sum(range(100_000)) * 2)} True"


def notebook_with_state(hub: Hub, user: str, path: str) -> dict[str, Any]:
    hub.start_server(user)
    session = hub.open_notebook(user, path)
    assert hub.execute(user, session["kernel"]["id"], STATE).strip() == "ready"
    return session


def assert_parked(hub: Hub, user: str, kernel_id: str) -> None:
    """No process of the kernel is left, its image is at the agent, and its record (what
    the next server adopts it from) in the user's checkpoint root."""
    wait_for("the kernel's processes to end", lambda: not processes_mentioning(kernel_id))
    found = hub.at_agent(user, kernel_id)
    assert found is not None and found["state"] == "dumped", found
    assert found["image"] is not None and found["image"]["bytes"] > 0, found
    record = hub.root(user) / ".parked" / f"{kernel_id}.json"
    assert json.loads(record.read_text())["kernel_id"] == kernel_id


def assert_adopted(hub: Hub, user: str, session: dict[str, Any], *others: dict[str, Any]) -> None:
    """The restarted server lists the same sessions and kernels (`session`'s suspended),
    and the next cell sees the earlier state."""
    kernel_id = session["kernel"]["id"]
    hub.start_server(user)
    sessions = hub.server(user, "GET", "/sessions").json()
    assert sorted((s["id"], s["kernel"]["id"], s["path"]) for s in sessions) == sorted(
        (s["id"], s["kernel"]["id"], s["path"]) for s in (session, *others)
    )
    state = hub.server(user, "GET", f"/cedana/kernels/{kernel_id}").json()
    assert state["state"] == "suspended", state
    assert hub.execute(user, kernel_id, CHECK).strip() == EXPECTED
    assert hub.server(user, "GET", f"/cedana/kernels/{kernel_id}").json()["state"] == "running"


def close_and_stop(hub: Hub, user: str, session: dict[str, Any]) -> None:
    """Close the notebook (its kernel shuts down: nothing is parked for the next test)."""
    kernel_id = session["kernel"]["id"]
    assert hub.server(user, "DELETE", f"/sessions/{session['id']}").status_code == 204
    hub.stop_server(user)
    assert hub.at_agent(user, kernel_id) is None
    assert not (hub.root(user) / ".parked" / f"{kernel_id}.json").exists()


def test_server_culled_by_the_idle_culler_brings_its_kernel_back(hub: Hub) -> None:
    session = notebook_with_state(hub, USER, "culled.ipynb")
    kernel_id = session["kernel"]["id"]
    hub.switch.touch()  # the idle culler starts looking now
    try:
        hub.wait_stopped(USER)
    finally:
        hub.switch.unlink()
    assert_parked(hub, USER, kernel_id)
    assert_adopted(hub, USER, session)
    close_and_stop(hub, USER, session)


def test_server_stopped_through_the_hub_api_brings_its_kernel_back(hub: Hub) -> None:
    session = notebook_with_state(hub, USER, "stopped.ipynb")
    hub.stop_server(USER)
    assert_parked(hub, USER, session["kernel"]["id"])
    assert_adopted(hub, USER, session)
    close_and_stop(hub, USER, session)


@pytest.mark.root
def test_another_user_cannot_see_or_adopt_the_images(hub: Hub) -> None:
    assert OTHER is not None
    session = notebook_with_state(hub, USER, "private.ipynb")
    kernel_id = session["kernel"]["id"]
    hub.stop_server(USER)
    assert_parked(hub, USER, kernel_id)

    # The second user's server, even pointed at the first user's checkpoint root, lists
    # nothing and adopts nothing: the root is the first user's, 0700.
    hub.prepare(OTHER)
    hub.ensure_user(OTHER)
    r = hub.api(
        "POST",
        f"/users/{OTHER}/server",
        json={"checkpoint_root": str(hub.root(USER))},
    )
    assert r.status_code in (201, 202), r.text
    wait_for(f"{OTHER}'s server", lambda: (hub.server_model(OTHER) or {}).get("ready"))
    assert hub.server(OTHER, "GET", "/sessions").json() == []
    assert hub.server(OTHER, "GET", "/cedana/kernels").json() == []
    assert hub.server(OTHER, "GET", f"/kernels/{kernel_id}").status_code == 404
    assert hub.at_agent(OTHER, kernel_id) is None  # the agent answers each uid alone
    hub.stop_server(OTHER)

    assert_parked(hub, USER, kernel_id)
    assert_adopted(hub, USER, session)
    # Nor can the second user's token reach the first user's server.
    other_token = hub.token(OTHER)
    assert hub.server(USER, "GET", "/sessions", token=other_token).status_code in (403, 404)
    assert hub.server(USER, "GET", "/cedana/kernels", token=other_token).status_code in (403, 404)
    close_and_stop(hub, USER, session)


def test_server_killed_with_sigkill_brings_its_kernels_back(hub: Hub) -> None:
    """A killed server cannot park, and need not: its kernels live under the checkpoint
    agent, not under it. The running one runs on, the suspended one's image stays at the
    agent; both records stay in the checkpoint root, and the user's gc, run after such a
    crash, keeps them. The next server adopts both under their ids, with their sessions
    and state: the suspended one suspended, the running one running."""
    session = notebook_with_state(hub, USER, "killed.ipynb")
    suspended = session["kernel"]["id"]
    other = hub.open_notebook(USER, "other.ipynb")
    running = other["kernel"]["id"]
    assert hub.execute(USER, running, "y = 'still running'; print('ok')").strip() == "ok"
    r = hub.server(USER, "POST", f"/cedana/kernels/{suspended}/suspend")
    assert r.status_code == 200, r.text
    running_pids = processes_mentioning(running)
    assert running_pids

    os.kill(hub.server_pid(USER), signal.SIGKILL)
    hub.wait_stopped(USER)
    # Nothing of either kernel went with the server.
    assert all(p in processes_mentioning(running) for p in running_pids)
    assert (hub.at_agent(USER, running) or {}).get("state") == "running"
    at_rest = hub.at_agent(USER, suspended)
    assert at_rest is not None and at_rest["state"] == "dumped", at_rest
    for kid in (suspended, running):
        assert (hub.root(USER) / ".parked" / f"{kid}.json").is_file(), kid

    # The user's gc, as they would run it after such a crash, keeps both: recoverable.
    removed = gc(hub, USER, "--yes")
    assert not {k for _, k in removed} & {suspended, running}, removed
    for kid in (suspended, running):
        assert (hub.root(USER) / ".parked" / f"{kid}.json").is_file(), kid

    assert_adopted(hub, USER, session, other)
    state = hub.server(USER, "GET", f"/cedana/kernels/{running}").json()
    assert state["state"] == "running", state
    assert hub.execute(USER, running, "print(y)").strip() == "still running"
    assert all(p in processes_mentioning(running) for p in running_pids)  # the same process
    assert hub.server(USER, "DELETE", f"/sessions/{other['id']}").status_code == 204
    close_and_stop(hub, USER, session)
    assert hub.at_agent(USER, running) is None
    assert not (hub.root(USER) / ".parked" / f"{running}.json").exists()


def gc(hub: Hub, user: str, *args: str) -> set[tuple[str, str]]:
    home, root = pwd.getpwnam(user).pw_dir, str(hub.root(user))
    done = subprocess.run(
        [str(NONROOT_BIN / "jupyter-cedana"), "gc", "--json", "--root", root, *args],
        user=user,
        env={"HOME": home, "PATH": f"{NONROOT_BIN}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return {(i["kind"], i["kernel_id"]) for i in json.loads(done.stdout)["removed"]}
