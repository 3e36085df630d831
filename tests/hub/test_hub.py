"""A user's kernels through a real JupyterHub, with servers of non-root users: culled or
stopped servers bring their kernels back with all their state, users cannot reach each
other's images, and a killed server's suspended kernels come back too."""

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
    """No process of the kernel is left, and its image is on disk."""
    wait_for("the kernel's processes to end", lambda: not processes_mentioning(kernel_id))
    manifest = hub.root(user) / kernel_id / "manifest.json"
    assert manifest.is_file(), sorted(p.name for p in hub.root(user).iterdir())
    assert json.loads(manifest.read_text())["kernel_id"] == kernel_id


def assert_adopted(hub: Hub, user: str, session: dict[str, Any]) -> None:
    """The restarted server lists the same session and kernel, suspended, and the next
    cell sees the earlier state."""
    kernel_id = session["kernel"]["id"]
    hub.start_server(user)
    sessions = hub.server(user, "GET", "/sessions").json()
    assert [(s["id"], s["kernel"]["id"], s["path"]) for s in sessions] == [
        (session["id"], kernel_id, session["path"])
    ]
    state = hub.server(user, "GET", f"/cedana/kernels/{kernel_id}").json()
    assert state["state"] == "suspended", state
    assert hub.execute(user, kernel_id, CHECK).strip() == EXPECTED
    assert hub.server(user, "GET", f"/cedana/kernels/{kernel_id}").json()["state"] == "running"


def close_and_stop(hub: Hub, user: str, session: dict[str, Any]) -> None:
    """Close the notebook (its kernel shuts down: nothing is parked for the next test)."""
    assert hub.server(user, "DELETE", f"/sessions/{session['id']}").status_code == 204
    hub.stop_server(user)
    assert not (hub.root(user) / session["kernel"]["id"]).exists()


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
    hub.stop_server(OTHER)

    assert_parked(hub, USER, kernel_id)
    assert_adopted(hub, USER, session)
    # Nor can the second user's token reach the first user's server.
    other_token = hub.token(OTHER)
    assert hub.server(USER, "GET", "/sessions", token=other_token).status_code in (403, 404)
    assert hub.server(USER, "GET", "/cedana/kernels", token=other_token).status_code in (403, 404)
    close_and_stop(hub, USER, session)


def test_server_killed_with_sigkill_brings_its_suspended_kernel_back(hub: Hub) -> None:
    """A killed server cannot park: its running kernels die with it (their watcher sees
    it go). A suspended kernel's image and record were committed at its suspend: gc
    leaves them, and the next server adopts the kernel with its session and state."""
    session = notebook_with_state(hub, USER, "killed.ipynb")
    suspended = session["kernel"]["id"]
    running = hub.open_notebook(USER, "other.ipynb")["kernel"]["id"]
    r = hub.server(USER, "POST", f"/cedana/kernels/{suspended}/suspend")
    assert r.status_code == 200, r.text
    assert processes_mentioning(running)

    os.kill(hub.server_pid(USER), signal.SIGKILL)
    hub.wait_stopped(USER)
    wait_for("the running kernel to die", lambda: not processes_mentioning(running))
    assert not (hub.root(USER) / running / "manifest.json").exists()
    assert (hub.root(USER) / suspended / "manifest.json").is_file()
    assert (hub.root(USER) / ".parked" / f"{suspended}.json").is_file()

    # The user's gc, as they would run it after such a crash, keeps it: it is recoverable.
    assert ("image", suspended) not in gc(hub, USER, "--yes")
    assert (hub.root(USER) / suspended / "manifest.json").is_file()

    assert_adopted(hub, USER, session)
    close_and_stop(hub, USER, session)
    assert not (hub.root(USER) / ".parked" / f"{suspended}.json").exists()


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
