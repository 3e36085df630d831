"""`criu dump` killed (SIGKILL: by the OOM killer, an admin, or the engine at its dump
timeout or a cancelled suspend) at each stage of a real dump, with its parasite inside a
process of the kernel included: the kernel runs on with its state, the suspend fails
saying so, nothing is left behind, and the next suspend and resume work.

What CRIU 4.2 leaves: killed while its parasite runs in a process, the parasite finds its
control socket closed and returns the thread to the kernel's code by itself (rt_sigreturn
to the frame CRIU saved), and Linux detaches the seized tasks as their tracer dies, so
none is left stopped; only the parasite's mapping stays in that process."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint.dumping import criu_errors, criu_last_step, criu_reasons
from jupyter_cedana.checkpoint.proctree import process_tree
from jupyter_cedana.errors import SuspendFailed
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import alive, kernel_pids, run, wait_iopub
from tests.criu_hold import DumpStages
from tests.test_provisioner import BOOKKEEPING

pytestmark = pytest.mark.criu

SETUP = r"""
import threading, time
import numpy as np
x = 41
arr = np.arange(2_000_000, dtype=np.float64)  # 16 MB: its pages fill any pipe CRIU has
ticks = [0]
def tick():
    while True:
        ticks[0] += 1
        time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
"""

CHECK = "before = ticks[0]; time.sleep(0.2); print(x + 1, float(arr.sum()), ticks[0] > before)"
CHECKED = f"42 {float(sum(range(2_000_000)))} True\n"


@pytest.fixture
def dump_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DumpStages]:
    stages = DumpStages(tmp_path / "dump-stages", monkeypatch)
    yield stages
    stages.disarm()


def threads(root: int) -> dict[int, tuple[str, int]]:
    """(state letter, tracer PID) of every thread of the tree rooted at `root`."""
    out = {}
    for pid in process_tree(root):
        for tid in os.listdir(f"/proc/{pid}/task"):
            fields = {}
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        key, _, value = line.partition(":")
                        fields[key] = value.split()
            except OSError:  # a thread that ended meanwhile
                continue
            out[int(tid)] = (fields["State"][0], int(fields["TracerPid"][0]))
    return out


def ns_pid(pid: int) -> int:
    """The PID of `pid` in its own PID namespace: the one CRIU names its images by."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("NSpid:")).split()[-1])


def parasite_in(pid: int) -> bool:
    """Whether CRIU's parasite is mapped in `pid` (compel maps it from a memfd it names)."""
    with open(f"/proc/{pid}/maps") as f:
        return "/memfd:CRIUMFD" in f.read()


def commands() -> dict[int, list[str]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().decode(errors="replace").split("\0")
            except OSError:
                pass
    return out


def criu_dumps(root: int) -> list[int]:
    """The CRIU processes dumping the tree rooted at `root` (CRIU's forked helpers carry
    its command line too); other tests' CRIUs run meanwhile and are left alone."""
    return [
        pid
        for pid, argv in commands().items()
        if "dump" in argv and any(a == "-t" and b == str(root) for a, b in itertools.pairwise(argv))
    ]


async def gone(pid: int, timeout: float = 60) -> None:
    """Until CRIU (`pid`) has exited: a zombie, or reaped."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"CRIU ({pid}) still runs"
        await asyncio.sleep(0.01)


async def scripts_ended(script: Path, timeout: float = 30) -> list[int]:
    """The processes still running `script` after up to `timeout` s (it ends once
    released)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p, argv in commands().items() if any(str(script) in a for a in argv)]
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.02)


# Where CRIU is killed: its own stages, and inside each process of the kernel's tree
# (cedana-init, PID 1 of the kernel's PID namespace, then the Python process); streaming
# the image to the server, or (stream_dump off) writing every file of it itself.
WHERE = [
    ("pre-dump", None, True),
    ("parasite", "init", True),
    ("parasite", "kernel", True),
    ("post-dump", None, True),
    ("post-dump", None, False),
]


@pytest.mark.parametrize(
    "stage, inside, stream",
    WHERE,
    ids=[(f"{s}-in-{i}" if i else s) + ("" if st else "-unstreamed") for s, i, st in WHERE],
)
async def test_criu_killed_mid_dump_leaves_the_kernel_running(
    kernel: Any,
    checkpoint_root: Path,
    dump_stages: DumpStages,
    stage: str,
    inside: str | None,
    stream: bool,
) -> None:
    kc, prov = kernel.test_client, kernel.provisioner
    reply, out = await run(kc, SETUP)
    assert reply["status"] == "ok", out
    init = prov.pid
    [python] = kernel_pids(kernel) - {init}
    prov.engine.stream_dump = stream
    dump_stages.attach(prov.engine)
    infected = {"init": init, "kernel": python}.get(inside or "")
    dump_stages.arm(stage, ns_pid(infected) if infected else None)
    suspend = asyncio.ensure_future(prov.suspend())
    await dump_stages.wait_reached(stage)

    # The dump is where the stage says.
    [criu] = criu_dumps(init)
    held = threads(init)
    tracers = {tracer for _, tracer in held.values()}
    assert tracers == ({0} if stage == "pre-dump" else {criu}), held
    assert {p for p in (init, python) if parasite_in(p)} == ({infected} if infected else set())

    os.kill(criu, signal.SIGKILL)
    await gone(criu)
    dump_stages.release(stage)
    with pytest.raises(SuspendFailed) as info:
        await suspend
    message = info.value.message
    # Where CRIU was: running the action script, or sending the pages it had read out.
    where = "page-xfer: " if infected else f"[{dump_stages.script}]"
    assert message.startswith(f"CRIU dump failed (killed by SIGKILL): it stopped at: {where}")
    assert prov.state == KernelState.running and prov.reason == message
    await runs_on(kernel, checkpoint_root, dump_stages, python, infected)


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_the_engine_killing_criu_with_its_parasite_inside_leaves_the_kernel_running(
    kernel: Any, checkpoint_root: Path, dump_stages: DumpStages, how: str
) -> None:
    """The engine kills CRIU itself when a dump outlasts CheckpointEngine.dump_timeout,
    and when the suspend is cancelled (a shutdown, a restart): here with CRIU's parasite
    inside the kernel's process."""
    kc, prov = kernel.test_client, kernel.provisioner
    reply, out = await run(kc, SETUP)
    assert reply["status"] == "ok", out
    init = prov.pid
    [python] = kernel_pids(kernel) - {init}
    dump_stages.arm("parasite", ns_pid(python))
    suspend = asyncio.ensure_future(prov.suspend())
    await dump_stages.wait_reached("parasite")
    [criu] = criu_dumps(init)
    assert parasite_in(python)

    timeout = prov.engine.dump_timeout
    if how == "timeout":
        prov.engine.dump_timeout = 0  # passed: the engine's next look kills CRIU
    else:
        suspend.cancel()
    await gone(criu)
    prov.engine.dump_timeout = timeout
    dump_stages.release("parasite")
    if how == "timeout":
        with pytest.raises(SuspendFailed) as info:
            await suspend
        assert info.value.message == "CRIU dump took longer than 0 s"
        assert prov.reason == info.value.message
    else:
        with pytest.raises(asyncio.CancelledError):
            await suspend
    assert prov.state == KernelState.running
    await runs_on(kernel, checkpoint_root, dump_stages, python, python)


async def runs_on(
    kernel: Any, checkpoint_root: Path, stages: DumpStages, python: int, infected: int | None
) -> None:
    """After a dump whose CRIU was killed: nothing is left, the kernel runs on as before,
    and its next suspend and resume work."""
    kc, prov = kernel.test_client, kernel.provisioner
    init = prov.pid
    # No CRIU, no action script, no partial image.
    assert criu_dumps(init) == []
    assert await scripts_ended(stages.script) == []
    assert [p.name for p in checkpoint_root.iterdir() if p.name not in BOOKKEEPING] == []

    # The same processes, no thread stopped or traced, the state intact.
    assert kernel_pids(kernel) == {init, python}
    after = threads(init)
    assert all(state not in "tT" and tracer == 0 for state, tracer in after.values()), after
    reply, out = await run(kc, CHECK)
    assert reply["status"] == "ok" and out == CHECKED, out
    # The parasite CRIU was killed in still lies mapped in the process (CRIU unmaps it as
    # it cures the task); it returned the thread to the kernel's code on its own. The next
    # dump takes those few pages along.
    assert {p for p in (init, python) if parasite_in(p)} == ({infected} if infected else set())

    await prov.suspend()
    assert prov.state == KernelState.suspended
    await prov.resume()
    await prov.memory_loaded()
    await wait_iopub(kc)
    reply, out = await run(kc, CHECK)
    assert reply["status"] == "ok" and out == CHECKED, out


def test_a_killed_criu_is_said_to_stop_where_its_log_ends(tmp_path: Path) -> None:
    """The parasite CRIU was killed in logs on as it cures itself: CRIU's own last line."""
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.000012) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: "
        "Operation not permitted\n"
        "(00.041234) page-xfer: \tp 0x55b8a15b6000 - 0x55b8a16b6000\n"
        "pie: 2: 2: new_sp=0x7f20188adec8 ip 0x7f2040126f36\n\n"
    )
    assert criu_last_step(log) == "page-xfer: p 0x55b8a15b6000 - 0x55b8a16b6000"
    assert criu_last_step(tmp_path / "none.log") == "no CRIU log"
    # CRIU's complaint about its own file limit is never why a run failed.
    assert criu_reasons(log) == ""
    assert criu_errors(log) == "pie: 2: 2: new_sp=0x7f20188adec8 ip 0x7f2040126f36"
    log.write_text(
        log.read_text() + "(00.05) Error (criu/page-xfer.c:123): page-xfer: Unable to spice "
        "data: Broken pipe\n(00.06) Error (criu/cr-dump.c:2100): Dumping FAILED.\n"
    )
    assert criu_reasons(log) == criu_errors(log) == "page-xfer: Unable to spice data: Broken pipe"


def test_a_killed_criu_is_found_behind_many_parasite_lines(tmp_path: Path) -> None:
    """The parasite may log far more than the end first read after CRIU is gone: CRIU's
    own last line is still what is said, never a line cut in half."""
    log = tmp_path / "dump.log"
    cure = "".join(f"(00.{i:04d}) pie: 2: curing step {i} with some detail\n" for i in range(3000))
    log.write_text(
        "(00.0100) Dumping pages of 4242\n"
        "(00.0200) page-xfer: p 0x55b8a15b6000 - 0x55b8a16b6000\n" + cure
    )
    assert log.stat().st_size > 64 * 1024
    assert criu_last_step(log) == "page-xfer: p 0x55b8a15b6000 - 0x55b8a16b6000"
    log.write_text(cure)
    assert criu_last_step(log) == "an empty CRIU log"
