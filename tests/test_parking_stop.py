"""What a server stopping with kernels in the middle of something does to them: each is
parked, or shut down with the log saying so, never shut down while the log says it runs
on; a kernel whose memory is still coming in from its image when the deadline comes is
parked as it was at that checkpoint (its image and record are complete), not deleted;
and the stop waits for the suspends and resumes in flight together, within the deadline
that the spawners' kill is configured after. Real `jupyter server` processes, real
kernels, real CRIU; each operation is held at a named point.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.test_cli import Server, cedana
from tests.test_crash_recovery import held_lazy_restores
from tests.test_parking import (
    CriuGate,
    criu_gate,
    execute,
    gone,
    kernel_processes,
    leftovers,
    needs_root,
    records,
    server_with_kernel,
    servers,
    start_server,
    stop_with,
)

__all__ = ["criu_gate", "servers"]  # fixtures, used by name

pytestmark = pytest.mark.criu


def test_a_deadline_passed_mid_load_parks_the_kernel_at_its_checkpoint(
    tmp_path: Path, servers: list[Server]
) -> None:
    hold, lazy = held_lazy_restores(tmp_path)
    a, root, kid = server_with_kernel(
        tmp_path,
        servers,
        "import numpy as np; a = np.arange(4 << 20); x = 1",
        *lazy,
        "--KernelParking.deadline=2",
    )
    cedana(a, "suspend", kid)
    hold.touch()  # the resume's transfer holds: its memory never all comes in
    assert execute(a, kid, "x = 2; print(x)")["stdout"].strip() == "2"
    assert a.kernel(kid)["state"] == "running"
    watched = kernel_processes(a, [kid])

    # Its parking waits for its memory, past the deadline.
    log = stop_with(a, signal.SIGTERM)
    assert (
        f"kernel {kid} parked at its checkpoint (not parked within the deadline of 2 s "
        "while its memory was coming in from its image): it was stopped"
    ) in log, log[-4000:]
    assert "not parked (" not in log
    assert "parked 1 of 1 kernel(s)" in log
    assert gone(watched, timeout=60) == []
    assert set(records(root)) == {kid} and (root / kid / "manifest.json").is_file()
    assert leftovers(root) == []

    hold.unlink()
    b = start_server(tmp_path / "b", checkpoint_root=root)
    servers.append(b)
    k = b.kernel(kid)
    assert k["state"] == "suspended", k
    assert "what it did after that resume is lost" in (k["reason"] or ""), k
    assert execute(b, kid, "print(x, int(a.sum()))")["stdout"].strip() == (
        f"1 {sum(range(4 << 20))}"
    )


@needs_root
def test_a_deadline_passed_mid_restore_parks_the_kernel_as_it_was_suspended(
    tmp_path: Path, criu_hold: Any, servers: list[Server]
) -> None:
    a, root, kid = server_with_kernel(
        tmp_path,
        servers,
        "x = 41",
        f"--CheckpointEngine.criu_path={criu_hold.wrapper}",
        "--KernelParking.deadline=2",
    )
    cedana(a, "suspend", kid)
    criu_hold.arm("restore", "before")
    status, body = a.api("POST", f"api/cedana/kernels/{kid}/resume?wait=0")
    assert status == 202, body
    asyncio.run(criu_hold.wait_reached("restore", "before"))

    log = stop_with(a, signal.SIGTERM)  # the restore is held past the deadline
    assert (
        f"kernel {kid}: its restore was abandoned: not parked within the deadline of 2 s"
    ) in log, log[-4000:]
    assert "not parked (" not in log and "parked 1 of 1 kernel(s)" in log
    assert set(records(root)) == {kid} and (root / kid / "manifest.json").is_file()
    assert leftovers(root) == []

    b = start_server(tmp_path / "b", checkpoint_root=root)
    servers.append(b)
    k = b.kernel(kid)
    assert k["state"] == "suspended" and not k["reason"], k
    assert execute(b, kid, "print(x + 1)")["stdout"].strip() == "42"


@needs_root
def test_the_stop_waits_for_transitions_in_flight_together_within_the_deadline(
    tmp_path: Path, criu_gate: CriuGate, servers: list[Server]
) -> None:
    root = tmp_path / "checkpoints"
    a = start_server(
        tmp_path / "a", criu_gate.arg, "--KernelParking.deadline=2", checkpoint_root=root
    )
    servers.append(a)
    kids = [a.start_kernel(), a.start_kernel()]
    criu_gate.hold()  # no dump ends
    for kid in kids:
        status, body = a.api("POST", f"api/cedana/kernels/{kid}/suspend?wait=0")
        assert status == 202, body
    criu_gate.wait_dump()
    assert all(a.kernel(kid)["state"] == "suspending" for kid in kids)
    watched = kernel_processes(a, kids)

    t0 = time.monotonic()
    log = stop_with(a, signal.SIGTERM)
    took = time.monotonic() - t0
    # Waited for one after another, 30 s each, the stop outlasted every spawner's
    # deadline + 10 s; together, under the deadline, it ends seconds after it.
    assert took < 25, (took, log[-4000:])
    for kid in kids:
        assert f"kernel {kid} not parked (not parked within the deadline of 2 s)" in log
    assert gone(watched) == []
    assert records(root) == {} and leftovers(root) == []
