"""Hold `criu dump` or `criu restore` at a chosen point until the test says go, so a
test acts (restart, shutdown, cancel, time out) exactly while the operation is in flight.

A wrapper script stands in for criu (set CheckpointEngine.criu_path to it, or use the
`criu_hold` fixture in conftest.py). For an armed point it creates `reached-OP-POINT`
when there and waits until `release-OP-POINT` exists (saying "fail": criu fails). Points:

- dump/before:     nothing dumped yet, the kernel runs.
- dump/after:      CRIU has dumped and exited; the tree is left stopped (--leave-stopped)
                   while the engine still waits on the dump.
- restore/before:  nothing restored yet.
- restore/after:   the tree is restored (stopped) but its PID not yet reported, so the
                   engine still waits on the restore.

Every point is passed once per arming: `arm()` again to hold the next operation too.
To hold several operations at once, `close_gate(OP)`: every `criu OP` started while the
gate is closed waits before doing anything (`waiting(OP)` counts them) until `open_gate`.
Kill the operation (timeout, cancel) only while it is held: the wrapper runs the real
criu as its child at dump/after, and killing the wrapper then would orphan it.
"""

from __future__ import annotations

import asyncio
import shlex
import threading
import time
from pathlib import Path
from typing import Any

from jupyter_cedana.checkpoint.engine import CheckpointEngine

OPS = ("dump", "restore")
POINTS = ("before", "after")

_SCRIPT = r"""#!/bin/bash
# criu stand-in for tests (tests/criu_hold.py): holds dump/restore at armed points.
DIR=@DIR@
REAL=@REAL@
op=
for a in "$@"; do case "$a" in -*) ;; *) op=$a; break ;; esac; done
hold() {
  if [ -e "$DIR/arm-$op-$1" ]; then
    rm -f "$DIR/arm-$op-$1"
    : >"$DIR/reached-$op-$1"
    while [ ! -e "$DIR/release-$op-$1" ]; do sleep 0.01; done
    verdict=$(cat "$DIR/release-$op-$1")
    rm -f "$DIR/release-$op-$1"
    if [ "$verdict" = fail ]; then echo "criu_hold: criu $op failed" >&2; exit 1; fi
  fi
}
case "$op" in dump|restore) ;; *) exec "$REAL" "$@" ;; esac
if [ -e "$DIR/gate-$op" ]; then
  : >"$DIR/waiting-$op-$$"
  while [ -e "$DIR/gate-$op" ]; do sleep 0.01; done
  rm -f "$DIR/waiting-$op-$$"
fi
hold before
[ -e "$DIR/arm-$op-after" ] || exec "$REAL" "$@"
if [ "$op" = dump ]; then
  "$REAL" "$@"
  rc=$?
  hold after
  exit $rc
fi
# restore: CRIU stays in the foreground as the restored tree's parent, and the engine
# learns the tree's PID from --pidfile: hold that file back until released.
args=()
prev=
for a in "$@"; do
  if [ "$prev" = --pidfile ]; then pidfile=$a; a=$a.held; fi
  args+=("$a")
  prev=$a
done
rm -f "$pidfile.held"
"$REAL" "${args[@]}" &
criu=$!
while [ ! -s "$pidfile.held" ] && kill -0 $criu 2>/dev/null; do sleep 0.01; done
if [ -s "$pidfile.held" ]; then
  hold after
  mv "$pidfile.held" "$pidfile"
fi
wait $criu
"""


class CriuHold:
    """The wrapper, and the files that arm, observe and release its hold points."""

    def __init__(self, directory: Path, real_criu: str | None = None):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        real = real_criu or CheckpointEngine().probe().criu_path
        assert real, "no real criu to wrap"
        self.wrapper = self.dir / "criu"
        self.wrapper.write_text(
            _SCRIPT.replace("@DIR@", shlex.quote(str(self.dir))).replace(
                "@REAL@", shlex.quote(real)
            )
        )
        self.wrapper.chmod(0o755)

    def attach(self, engine: CheckpointEngine) -> None:
        """Make `engine` run criu through the wrapper."""
        engine.criu_path = str(self.wrapper)
        engine.probe(refresh=True)

    def _file(self, kind: str, op: str, point: str) -> Path:
        assert op in OPS and point in POINTS, (op, point)
        return self.dir / f"{kind}-{op}-{point}"

    def arm(self, op: str, point: str) -> None:
        """Hold the next `criu OP` at POINT."""
        self._file("reached", op, point).unlink(missing_ok=True)
        self._file("arm", op, point).touch()

    def reached(self, op: str, point: str) -> bool:
        return self._file("reached", op, point).exists()

    async def wait_reached(self, op: str, point: str, timeout: float = 120) -> None:
        """Wait until the held operation is at POINT (the bound only catches a hold that
        is never reached: the operation failed before it)."""
        deadline = time.monotonic() + timeout
        while not self.reached(op, point):
            if time.monotonic() > deadline:
                raise TimeoutError(f"criu {op} never reached {point}")
            await asyncio.sleep(0.01)

    def release(self, op: str, point: str, fail: bool = False) -> None:
        """Let the held operation go on, or (fail) exit as a failed criu would."""
        tmp = self._file("verdict", op, point)
        tmp.write_text("fail" if fail else "")
        tmp.rename(self._file("release", op, point))

    def close_gate(self, op: str) -> None:
        """Hold every `criu OP` started from now on before it does anything."""
        assert op in OPS, op
        (self.dir / f"gate-{op}").touch()

    def open_gate(self, op: str) -> None:
        """Let every operation waiting at the gate go on, and hold no more."""
        (self.dir / f"gate-{op}").unlink(missing_ok=True)

    def waiting(self, op: str) -> int:
        """How many `criu OP` wait at the closed gate now."""
        return len(list(self.dir.glob(f"waiting-{op}-*")))

    async def wait_waiting(self, op: str, count: int, timeout: float = 120) -> None:
        """Wait until `count` operations wait at the gate together (the bound only
        catches operations that never all get there)."""
        deadline = time.monotonic() + timeout
        while self.waiting(op) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.waiting(op)} criu {op} at the gate, not {count}")
            await asyncio.sleep(0.01)

    def disarm(self) -> None:
        """Release everything held and hold nothing more (test teardown)."""
        for op in OPS:
            self.open_gate(op)
            for point in POINTS:
                self._file("arm", op, point).unlink(missing_ok=True)
                if self.reached(op, point):
                    self.release(op, point)


# -- stages inside a real `criu dump` -----------------------------------------------------

_ACTION_SCRIPT = r"""#!/bin/sh
# criu --action-script for tests (tests/criu_hold.py): holds criu dump at an armed action.
DIR=@DIR@
stage=$CRTOOLS_SCRIPT_ACTION
[ -e "$DIR/arm-$stage" ] || exit 0
rm -f "$DIR/arm-$stage"
: >"$DIR/reached-$stage"
while [ ! -e "$DIR/release-$stage" ]; do sleep 0.01; done
rm -f "$DIR/release-$stage"
"""

ACTION_STAGES = ("pre-dump", "post-dump")
DUMP_STAGES = ("pre-dump", "parasite", "post-dump")


class DumpStages:
    """Hold the real `criu dump` (no wrapper) at a stage of its own, so that a test acts
    (kills CRIU) exactly there. Stages, in the order CRIU passes them:

    - pre-dump:  CRIU runs its pre-dump action script: nothing is seized yet.
    - parasite:  CRIU opens the page map of the process `arm` names: every task of the
                 tree is seized (ptrace), and CRIU's parasite runs inside that process,
                 reading its memory out.
    - post-dump: CRIU runs its post-dump action script: every task is dumped and its
                 parasite gone, and the tree is still seized.

    The action stages are CRIU's own hooks (`--action-script`, which CRIU runs and waits
    for): `attach` adds the script to the engine's extra dump arguments. `parasite` holds
    the server's end of the streamed image (capture.py) in this process: its receiving
    thread stops when CRIU asks for the page map, and CRIU blocks writing the pages once
    their pipe (64 KiB) is full, before it cures the process. A process whose dumped pages
    fit in that pipe is let go meanwhile: the test checks that the parasite is there (a
    kernel's init dumps about 100 KiB, its Python process tens of MB).
    """

    def __init__(self, directory: Path, monkeypatch: Any):
        from jupyter_cedana.checkpoint import capture

        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.script = self.dir / "action-script"
        self.script.write_text(_ACTION_SCRIPT.replace("@DIR@", shlex.quote(str(self.dir))))
        self.script.chmod(0o755)
        self._armed: dict[str, str] = {}  # held stage -> the image it is held at
        self._reached: dict[str, threading.Event] = {}
        self._release: dict[str, threading.Event] = {}
        self._name = capture._request_name
        monkeypatch.setattr(capture, "_request_name", self._request_name)

    def attach(self, engine: CheckpointEngine) -> None:
        """Make `engine`'s dumps run the action script (`parasite` needs its dumps
        streamed too: CheckpointEngine.stream_dump, the default)."""
        engine.extra_dump_args = [*engine.extra_dump_args, "--action-script", str(self.script)]

    def arm(self, stage: str, pid: int | None = None) -> None:
        """Hold the next dump at `stage`; at `parasite`, in process `pid` (as CRIU numbers
        it: in the tree's PID namespace)."""
        assert stage in DUMP_STAGES, stage
        if stage in ACTION_STAGES:
            (self.dir / f"reached-{stage}").unlink(missing_ok=True)
            (self.dir / f"arm-{stage}").touch()
            return
        assert pid is not None, "in which process?"
        self._reached[stage] = threading.Event()
        self._release[stage] = threading.Event()
        self._armed[stage] = f"pagemap-{pid}.img"

    def _request_name(self, msg: bytes) -> str:
        name = self._name(msg)
        for stage, wanted in list(self._armed.items()):
            if wanted == name:
                del self._armed[stage]
                self._reached[stage].set()
                self._release[stage].wait()
        return name

    def reached(self, stage: str) -> bool:
        if stage in ACTION_STAGES:
            return (self.dir / f"reached-{stage}").exists()
        return stage in self._reached and self._reached[stage].is_set()

    async def wait_reached(self, stage: str, timeout: float = 120) -> None:
        """Wait until the dump is held at `stage` (the bound only catches a stage never
        reached: the dump failed before it)."""
        deadline = time.monotonic() + timeout
        while not self.reached(stage):
            if time.monotonic() > deadline:
                raise TimeoutError(f"criu dump never reached {stage}")
            await asyncio.sleep(0.01)

    def release(self, stage: str) -> None:
        """Let the held dump (or what is left of it) go on."""
        if stage in ACTION_STAGES:
            (self.dir / f"reached-{stage}").unlink(missing_ok=True)
            (self.dir / f"release-{stage}").touch()
        elif stage in self._release:
            self._release[stage].set()

    def disarm(self) -> None:
        """Release everything held and hold nothing more (test teardown)."""
        self._armed.clear()
        for stage in ACTION_STAGES:
            (self.dir / f"arm-{stage}").unlink(missing_ok=True)
            if self.reached(stage):
                self.release(stage)
        for event in self._release.values():
            event.set()
