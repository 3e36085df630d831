"""Chaos run: a real jupyter server with N kernels (small ones and multi-GB ones) and a
random workload (cells, suspends, resumes), killed with SIGKILL at chosen points and
started again on the same checkpoint root, again and again.

    python bench/chaos.py --kills 100 --json bench/results/chaos.json

Kill points (--phases), each aimed by watching for the phase and killing once it is seen:

- random:    a moment while an operation (cell, suspend, resume) is in flight.
- dump:      a suspend's `criu dump` runs (its process is there, the kernel is seized).
- commit:    CRIU is done and the image is being checksummed, fsynced and renamed into
             place (the dump's temporary directory is there, CRIU has exited).
- lazy-load: a resumed kernel's pages are still served from its image (the page server
             of that image runs).
- park:      the server got SIGTERM and is parking its running kernels (a dump runs).
- adopt:     the next server is adopting the kernels the killed one left (it has logged
             adopting one of them and is not yet ready to serve); that start is killed too.
- gc:        `jupyter cedana gc` is running against the server when the server dies.

What each kill hit is read at the moment of the kill (processes, the store's directory,
the log), not assumed: the table counts kills by the phase they landed in.

After every restart: each kernel that was suspended, or whose suspend had committed (its
park record and image are on disk after the kill), must be listed again and answer with
the namespace it had (a hash computed in the kernel); each kernel that was running is
either back with its state or counted lost with the reason (kernels are children of the
server, so a running kernel ends with it). Nothing may be left behind: no process of a
lost kernel, no listening port of it, no record without its image, no image without its
record, and the disk budget must add up (GET /api/cedana/status against the images on
disk). At the end every kernel is shut down and the root must be empty after a gc.

Prints a table and writes JSON; exit status 1 when a suspended kernel was lost, anything
leaked, or the budget did not add up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    Failure,
    Server,
    machine_info,
    port_leaks,
    process_leaks,
    store_leftovers,
)

PHASES = ("random", "dump", "commit", "lazy-load", "park", "adopt", "gc")
POLL_S = 0.002

# The namespace hash, and for a big kernel a probe of its array (1 page in 512), so that
# its memory counts too.
HASH_CODE = (
    "import hashlib as _h; ns = globals().setdefault('ns', {}); "
    "_p = ('|%d' % int(a[::512].sum())) if 'a' in globals() else ''; "
    "print('NS=' + _h.sha256((repr(sorted(ns.items())) + _p).encode()).hexdigest())"
)
# Fast to make (no random generator), every page distinct and non-zero.
FILL = (
    "import numpy as np; a = np.arange({n}, dtype=np.int64); a *= 2654435761; "
    "a %= 2**61; a += 1; print('P=%d' % int(a[::512].sum()))"
)


def expected_hash(ns: dict[str, Any], probe: int | None) -> str:
    suffix = f"|{probe}" if probe is not None else ""
    return hashlib.sha256((repr(sorted(ns.items())) + suffix).encode()).hexdigest()


@dataclass
class Kernel:
    kid: str
    big: bool
    ns: dict[str, Any] = field(default_factory=dict)
    probe: int | None = None
    # Believed state: "running", or "suspended" once a suspend answered 200 (until a
    # resume or a cell).
    state: str = "running"
    # The namespace at its last committed suspend: what a kernel killed mid-lazy-load may
    # come back with (its server gave the checkpoint back and said what was lost).
    at_suspend: dict[str, Any] | None = None
    ports: list[int] = field(default_factory=list)


class Chaos:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="cedana-chaos-", dir=args.workdir))
        self.server = Server(
            self.workdir,
            idle_timeout=3600,  # no suspends by the policy: the run says when
            check_interval=1.0,
        )
        self.kernels: dict[str, Kernel] = {}
        self.timeout = args.op_timeout
        self.kills: list[dict[str, Any]] = []
        self.aimed: Counter[str] = Counter()
        self.hit: Counter[str] = Counter()
        self.recovered = 0
        self.recovered_rolled_back = 0
        self.lost_suspended: list[dict[str, Any]] = []
        self.lost_running: Counter[str] = Counter()
        self.running_back = 0
        self.leaks: list[dict[str, Any]] = []
        self.budget_mismatches: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.ops: Counter[str] = Counter()
        self.partials_seen: set[str] = set()  # partial dumps found after restarts
        self.restart_s: list[float] = []
        self.log_offset = 0
        # The kernel whose operation was in flight at the kill: whether it was resumed
        # (and so running, ending with the server) is not known from its answer.
        self.inflight: str | None = None
        self.dead: set[str] = set()  # kernels that ended with a killed server
        # Partial dumps left by earlier kills (until gc takes them): not a dump under way.
        self.stale: set[str] = set()

    # -- kernels and the workload ------------------------------------------------------

    def note(self, text: str) -> None:
        if self.args.verbose:
            stamp = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
            print(f"{stamp} {text}", flush=True)

    def fail(self, text: str) -> None:
        self.failures.append(text[:500])
        print(f"  FAIL {text[:300]}", flush=True)

    async def execute(self, kid: str, code: str) -> tuple[dict[str, Any], str]:
        conn = await self.server.connect(kid)
        try:
            return await conn.execute(code, self.timeout)
        finally:
            conn.close()

    async def new_kernel(self, big: bool) -> None:
        status, data = await self.server.call("POST", "/api/kernels", {"name": "python3"})
        if status != 201:
            raise Failure(f"could not start a kernel: {status} {data}")
        k = Kernel(data["id"], big)
        with contextlib.suppress(OSError, ValueError):
            info = json.loads((self.server.runtime / f"kernel-{k.kid}.json").read_text())
            k.ports = [int(info[p]) for p in info if p.endswith("_port")]
        if big:
            reply, out = await self.execute(k.kid, FILL.format(n=int(self.args.big_gb * 1e9) // 8))
            if reply.get("status") != "ok":
                raise Failure(f"fill failed: {out}")
            k.probe = int(next(ln[2:] for ln in out.splitlines() if ln.startswith("P=")))
        self.kernels[k.kid] = k
        self.note(f"kernel {k.kid[:8]} started ({'big' if big else 'small'})")

    async def top_up(self) -> None:
        bigs = sum(k.big for k in self.kernels.values())
        smalls = len(self.kernels) - bigs
        for _ in range(self.args.big - bigs):
            await self.new_kernel(True)
        for _ in range(self.args.kernels - self.args.big - smalls):
            await self.new_kernel(False)

    async def hash_of(self, kid: str) -> str | None:
        _reply, out = await self.execute(kid, HASH_CODE)
        return next((ln[3:] for ln in out.splitlines() if ln.startswith("NS=")), None)

    async def op_cell(self, k: Kernel) -> None:
        key = f"k{self.rng.randrange(20)}"
        value = self.rng.randrange(10**12)
        reply, out = await self.execute(
            k.kid, f"ns = globals().setdefault('ns', {{}}); ns[{key!r}] = {value!r}"
        )
        if reply.get("status") != "ok":
            raise Failure(f"cell failed: {out}")
        k.ns[key] = value
        k.state = "running"

    async def op_suspend(self, k: Kernel) -> None:
        status, data = await self.server.call("POST", f"/api/cedana/kernels/{k.kid}/suspend")
        if status == 200:
            k.state = "suspended"
            k.at_suspend = dict(k.ns)
        elif status not in (409, 503, 507):
            raise Failure(f"suspend answered {status}: {data}")

    async def op_resume(self, k: Kernel) -> None:
        status, data = await self.server.call("POST", f"/api/cedana/kernels/{k.kid}/resume")
        if status == 200:
            k.state = "running"
        elif status != 409:
            raise Failure(f"resume answered {status}: {data}")

    async def workload(self, count: int) -> None:
        ops = {"cell": 4, "suspend": 5, "resume": 1}
        names, weights = zip(*ops.items(), strict=True)
        for _ in range(count):
            op = self.rng.choices(names, weights)[0]
            k = self.rng.choice(list(self.kernels.values()))
            self.ops[op] += 1
            try:
                await asyncio.wait_for(getattr(self, f"op_{op}")(k), self.timeout)
            except (Failure, TimeoutError) as e:
                self.fail(f"{op} {k.kid}: {type(e).__name__}: {e}")

    # -- watching for a phase ------------------------------------------------------------

    def procs(self) -> list[tuple[int, str]]:
        """(pid, command line) of the live processes that name this run's root, or work
        in it (a streaming `criu dump` runs in its image directory, `-D .`)."""
        out = []
        root = str(self.server.root)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cwd = os.readlink(f"/proc/{entry}/cwd") if "criu" in cmd else ""
            except OSError:
                continue
            if state != "Z" and (root in cmd or cwd.startswith(root)):
                out.append((int(entry), cmd))
        return out

    def observe(self) -> dict[str, Any]:
        """What is under way in the store now, from the outside."""
        dumps, loads = [], []
        for _pid, cmd in self.procs():
            words = cmd.split()
            if "--holder-fd" in words:
                loads.append(cmd)
            elif words and words[0].endswith("criu") and "dump" in words:
                dumps.append(cmd)
        tmp = []
        if self.server.root.is_dir():
            tmp = [
                p.name
                for p in self.server.root.iterdir()
                if ".tmp-" in p.name and p.name not in self.stale
            ]
        return {"dumps": len(dumps), "loads": len(loads), "tmp": tmp, "load_cmds": loads}

    def phase_now(self, seen_dump: bool = False) -> str:
        o = self.observe()
        if o["dumps"]:
            return "dump"
        if o["tmp"] and seen_dump:
            return "commit"
        if o["loads"]:
            return "lazy-load"
        if o["tmp"]:
            return "dump-setup"  # a dump's directory made, CRIU not (yet) seen
        return "idle"

    async def until(self, test: Any, limit: float) -> bool:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if test():
                return True
            await asyncio.sleep(POLL_S)
        return False

    # -- one kill ------------------------------------------------------------------------

    def pick(self, want: str) -> Kernel | None:
        pool = [k for k in self.kernels.values() if k.state == want]
        bigs = [k for k in pool if k.big]
        return self.rng.choice(bigs or pool) if (bigs or pool) else None

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        async def quiet() -> None:
            with contextlib.suppress(Exception):
                await coro

        return asyncio.ensure_future(quiet())

    async def kill_at(self, aim: str) -> list[dict[str, Any]]:
        """Aim one kill (two for `adopt`: one before the start it kills) and return what
        each hit."""
        self.aimed[aim] += 1
        srv = self.server
        task: asyncio.Task[Any] | None = None
        detail: dict[str, Any] = {}
        hit = None
        if aim == "random":
            op = self.rng.choice(["cell", "suspend", "resume"])
            k = self.rng.choice(list(self.kernels.values()))
            task = self.spawn(getattr(self, f"op_{op}")(k))
            self.inflight = k.kid
            await asyncio.sleep(self.rng.uniform(0, 1.5))
            detail = {"op": op, "kernel": k.kid}
        elif aim in ("dump", "commit"):
            picked = self.pick("running")
            if picked is None:
                picked = self.rng.choice(list(self.kernels.values()))
                await self.op_cell(picked)
            k = picked
            task = self.spawn(self.op_suspend(k))
            seen = await self.until(lambda: self.observe()["dumps"] > 0, 60)
            if aim == "commit" and seen:
                await self.until(lambda: (o := self.observe())["dumps"] == 0 and bool(o["tmp"]), 60)
            detail = {"kernel": k.kid, "big": k.big, "criu_seen": seen}
            hit = self.phase_now(seen_dump=seen)
        elif aim == "lazy-load":
            # The big kernel: a small one's image is restored whole, with no page server.
            picked = next((k for k in self.kernels.values() if k.big), None)
            picked = picked or self.rng.choice(list(self.kernels.values()))
            if picked.state != "suspended":
                await self.op_suspend(picked)
            k = picked
            task = self.spawn(self.op_resume(k))
            self.inflight = k.kid
            await self.until(lambda: any(k.kid in c for c in self.observe()["load_cmds"]), 60)
            detail = {"kernel": k.kid, "big": k.big}
        elif aim == "park":
            if self.pick("running") is None:
                k = self.rng.choice(list(self.kernels.values()))
                await self.op_cell(k)
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGTERM)
            await self.until(
                lambda: self.observe()["dumps"] > 0 or srv.proc.poll() is not None, 120
            )
            hit = "park" if srv.proc.poll() is None and self.observe()["dumps"] else None
            if hit is None:
                hit = "park-done" if srv.proc.poll() is not None else "park-other"
        elif aim == "gc":
            env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(srv.runtime)}
            gc = subprocess.Popen(
                [sys.executable, "-m", "jupyter_cedana.cli", "gc"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            await asyncio.sleep(self.rng.uniform(0.05, 1.0))
            hit = "gc" if gc.poll() is None else "gc-done"
            srv.kill()
            out, _ = gc.communicate(timeout=120)
            detail = {"gc_exit": gc.returncode, "gc_output": out.decode()[-400:]}
        if hit is None:
            hit = self.phase_now()
        srv.kill()
        if task is not None:  # its request fails now that the server is gone
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 60)
        kill = {"aim": aim, "hit": hit, **detail}
        self.note(f"kill aimed at {aim}: hit {hit}")
        return [kill]

    # -- after a kill ---------------------------------------------------------------------

    def on_disk(self) -> tuple[set[str], set[str], list[str]]:
        """Kernel ids with a park record, with a committed image; partial images."""
        root = self.server.root
        records = {p.stem for p in (root / ".parked").glob("*.json")} if root.is_dir() else set()
        images = set()
        partial = []
        if root.is_dir():
            for p in root.iterdir():
                if p.name.startswith("."):
                    if ".tmp-" in p.name:
                        partial.append(p.name)
                elif (p / "manifest.json").is_file():
                    images.add(p.name)
        return records, images, partial

    async def start_server(self, kill_mid_adopt: bool = False) -> dict[str, Any] | None:
        """Start the server on the same root; `kill_mid_adopt`: kill it while it adopts
        (returns what that kill hit), else wait until it serves."""
        self.log_offset = self.server.log.stat().st_size if self.server.log.exists() else 0
        t = time.monotonic()
        self.server.start()
        if kill_mid_adopt:
            records, _, _ = self.on_disk()

            def adopting() -> bool:
                return "adopted parked kernel" in self.new_log() or (
                    self.server.proc is not None and self.server.proc.poll() is not None
                )

            if records:
                await self.until(adopting, 120)
            adopted = self.new_log().count("adopted parked kernel")
            self.server.kill()
            hit = "adopt" if 0 < adopted < len(records) else ("adopt-done" if adopted else "start")
            return {"aim": "adopt", "hit": hit, "adopted": adopted, "records": len(records)}
        await self.server.wait_ready(timeout=300)
        self.restart_s.append(time.monotonic() - t)
        return None

    def new_log(self) -> str:
        with open(self.server.log, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    async def after_kill(self, kill_no: int) -> None:
        records, images, partial = self.on_disk()
        # What must come back: what the run was told is suspended, and whatever suspend
        # committed (record and image on disk) even if its answer never came.
        must = {
            kid
            for kid, k in self.kernels.items()
            if k.state == "suspended" and kid != self.inflight
        }
        must |= records & images & set(self.kernels)
        self.inflight = None
        for kid in list(must):
            k = self.kernels[kid]
            if kid not in records or kid not in images:
                self.lost_suspended.append(
                    {
                        "kill": kill_no,
                        "kernel": kid,
                        "reason": "after the kill: record "
                        + ("present" if kid in records else "missing")
                        + ", image "
                        + ("present" if kid in images else "missing"),
                    }
                )
        await self.start_server()
        # Leftovers of the killed server: processes of its kernels, their ports.
        me = {os.getpid(), self.server.proc.pid if self.server.proc else -1}
        marks = (str(self.server.runtime), str(self.server.root))
        gone = [k for kid, k in self.kernels.items() if kid not in must]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            process_leaks(marks, me) or port_leaks([p for k in gone for p in k.ports])
        ):
            await asyncio.sleep(0.5)
        procs = process_leaks(marks, me)
        ports = port_leaks([p for k in gone for p in k.ports])
        records, images, partial = self.on_disk()
        self.stale = set(partial)
        self.partials_seen |= self.stale
        orphan_records = sorted(records - images)
        status, listed = await self.server.call("GET", "/api/kernels")
        listed_ids = {k["id"] for k in listed or []} if status == 200 else set()
        strangers = sorted(listed_ids - set(self.kernels))
        if procs or ports or orphan_records or strangers:
            self.leaks.append(
                {
                    "kill": kill_no,
                    "processes": procs,
                    "ports": ports,
                    "records_without_images": orphan_records,
                    "kernels_not_ours": strangers,
                }
            )
            self.fail(f"leak after kill {kill_no}: {self.leaks[-1]}")
        await self.check_budget(kill_no, images)
        # Every kernel that had to come back: listed, suspended, its state intact.
        for kid in sorted(must):
            k = self.kernels[kid]
            if kid not in listed_ids:
                if not any(x["kernel"] == kid for x in self.lost_suspended):
                    self.lost_suspended.append(
                        {"kill": kill_no, "kernel": kid, "reason": "not adopted by the next server"}
                    )
                self.fail(f"suspended kernel {kid} lost at kill {kill_no}")
                del self.kernels[kid]
                continue
            try:
                got = await asyncio.wait_for(self.hash_of(kid), self.timeout)
            except Exception as e:
                got = f"error: {type(e).__name__}: {e}"
            if got == expected_hash(k.ns, k.probe):
                self.recovered += 1
            elif k.at_suspend is not None and got == expected_hash(k.at_suspend, k.probe):
                # Killed after a resume (mid-lazy-load): back at its checkpoint, the cells
                # since said lost by the server; the run's namespace follows.
                self.recovered_rolled_back += 1
                k.ns = dict(k.at_suspend)
            else:
                self.lost_suspended.append(
                    {"kill": kill_no, "kernel": kid, "reason": f"state differs: {got}"}
                )
                self.fail(f"kernel {kid} came back with another state at kill {kill_no}")
                del self.kernels[kid]
                continue
            k.state = "running"
        for k in gone:
            if k.kid in listed_ids:
                self.running_back += 1
                continue
            self.lost_running["running kernel ended with its server (a child of it)"] += 1
            self.dead.add(k.kid)
            del self.kernels[k.kid]

    async def check_budget(self, kill_no: int, images: set[str]) -> None:
        """The server's budget against the images on disk: every byte of every image is
        counted as used by a kernel, none as an orphan, nothing stays reserved."""
        status, st = await self.server.call("GET", "/api/cedana/status")
        if status != 200:
            self.fail(f"status answered {status}")
            return
        on_disk = 0
        for kid in images:
            for dirpath, _dirs, files in os.walk(self.server.root / kid):
                for name in files:
                    with contextlib.suppress(OSError):
                        on_disk += os.lstat(os.path.join(dirpath, name)).st_size
        budget = st["budget"]
        held = 0
        for kid in images:
            with contextlib.suppress(OSError, ValueError):
                m = json.loads((self.server.root / kid / "manifest.json").read_text())
                held += int(m.get("held_bytes") or m.get("total_bytes") or 0)
        ok = (
            budget["used"] == held
            and budget["orphaned_images"] == 0
            and budget["reserved"] == 0
            and abs(on_disk - held) <= 64 * 1024 * max(1, len(images))
            and st["bytes_used"] >= on_disk
        )
        if not ok:
            self.budget_mismatches.append(
                {
                    "kill": kill_no,
                    "budget": budget,
                    "manifests_held_bytes": held,
                    "image_files_bytes": on_disk,
                    "bytes_used": st["bytes_used"],
                }
            )
            self.fail(f"budget does not add up after kill {kill_no}: {self.budget_mismatches[-1]}")

    # -- the run -------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        report: dict[str, Any] = {}
        machine = machine_info(self.server.root.parent)
        phases = [p for p in self.args.phases.split(",") if p]
        self.server.start()
        try:
            await self.server.wait_ready(timeout=300)
            plan: list[str] = []
            while len(self.kills) < self.args.kills:
                if self.args.seconds and time.monotonic() - t0 > self.args.seconds:
                    break
                await self.top_up()
                await self.workload(self.rng.randint(1, self.args.ops))
                if not plan:
                    plan = list(phases)
                    self.rng.shuffle(plan)
                aim = plan.pop()
                if aim in ("gc", "adopt"):
                    # These kills are about the suspended kernels: the big ones among
                    # them (a dump before the kill, not a refill after it).
                    for k in [k for k in self.kernels.values() if k.big]:
                        if k.state != "suspended":
                            await self.op_suspend(k)
                if aim == "adopt":
                    # Kill once (anywhere), then kill the start that adopts what is left:
                    # two kernels at least are suspended, so that one is adopted while
                    # another is still to be.
                    for k in [k for k in self.kernels.values() if not k.big][:2]:
                        if k.state != "suspended":
                            await self.op_suspend(k)
                    self.record(await self.kill_at("random"))
                    mid = await self.start_server(kill_mid_adopt=True)
                    assert mid is not None
                    self.aimed["adopt"] += 1
                    self.record([mid])
                else:
                    self.record(await self.kill_at(aim))
                await self.after_kill(len(self.kills))
                self.note(
                    f"after kill {len(self.kills)}: {len(self.kernels)} kernels, "
                    f"recovered {self.recovered}, lost suspended {len(self.lost_suspended)}"
                )
            # The end: every kernel shut down, then nothing may be left.
            for kid in list(self.kernels):
                with contextlib.suppress(Exception):
                    await self.server.call("DELETE", f"/api/kernels/{kid}")
            final = await self.final_leaks()
            report = self.report(t0, final)
            report["machine"] = machine
        finally:
            self.server.stop()
            report["leaked_after_stop"] = process_leaks(
                (str(self.server.runtime), str(self.server.root)), {os.getpid()}
            )
            if not self.args.keep:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return report

    def record(self, kills: list[dict[str, Any]]) -> None:
        for kill in kills:
            kill["no"] = len(self.kills) + 1
            self.kills.append(kill)
            self.hit[kill["hit"]] += 1

    async def final_leaks(self) -> dict[str, Any]:
        me = {os.getpid(), self.server.proc.pid if self.server.proc else -1}
        marks = (str(self.server.runtime), str(self.server.root))
        ports = [p for k in self.kernels.values() for p in k.ports]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (process_leaks(marks, me) or port_leaks(ports)):
            await asyncio.sleep(0.5)
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(self.server.runtime)}
        gc = subprocess.run(
            [sys.executable, "-m", "jupyter_cedana.cli", "gc"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        status, listed = await self.server.call("GET", "/api/kernels")
        # A kernel that ended with its server leaves its log and CRIU work directory; gc
        # takes them once they are GC_MIN_AGE old (they might be a starting kernel's).
        # Counted apart, once gc, asked as it will be then, says it takes each of them.
        from jupyter_cedana.checkpoint import store_gc
        from jupyter_cedana.checkpoint.store import CheckpointStore

        later = store_gc.plan(
            CheckpointStore(str(self.server.root)),
            set(),
            now=time.time() + store_gc.GC_MIN_AGE + 60,
        )
        aged = {
            f"{item.path.parent.name}/{item.path.name}"
            for item in later.remove
            if item.kernel_id in self.dead and item.kind in ("log", "work")
        }
        left = store_leftovers(self.server.root)
        return {
            "processes": process_leaks(marks, me),
            "ports": port_leaks(ports),
            "store": [x for x in left if x not in aged],
            "left_for_gc_of_dead_kernels": len([x for x in left if x in aged]),
            "kernels_listed": [k["id"] for k in listed or []] if status == 200 else status,
            "gc_output": (gc.stdout + gc.stderr)[-600:],
        }

    def report(self, t0: float, final: dict[str, Any]) -> dict[str, Any]:
        return {
            "kills": len(self.kills),
            "seed": self.args.seed,
            "kernels": self.args.kernels,
            "big_kernels": self.args.big,
            "big_gb": self.args.big_gb,
            "aimed": dict(self.aimed),
            "hit": dict(self.hit),
            "operations": dict(self.ops),
            "recovered_suspended": self.recovered,
            "recovered_at_checkpoint": self.recovered_rolled_back,
            "running_back": self.running_back,
            "lost_suspended": self.lost_suspended,
            "lost_running": dict(self.lost_running),
            "leaks": self.leaks,
            "partial_images_after_restart": len(self.partials_seen),
            "budget_mismatches": self.budget_mismatches,
            "failures": self.failures,
            "final_leaks": final,
            "restart_s_median": sorted(self.restart_s)[len(self.restart_s) // 2]
            if self.restart_s
            else None,
            "kill_log": self.kills,
            "seconds": round(time.monotonic() - t0, 1),
        }


def clean(report: dict[str, Any]) -> bool:
    final = report.get("final_leaks") or {}
    return (
        report.get("kills", 0) > 0
        and not report.get("lost_suspended")
        and not report.get("leaks")
        and not report.get("budget_mismatches")
        and not report.get("failures")
        and not any(final.get(k) for k in ("processes", "ports", "store", "kernels_listed"))
        and not report.get("leaked_after_stop")
    )


def table(report: dict[str, Any]) -> str:
    lines = ["| kill landed in | kills |", "| --- | ---: |"]
    for phase, n in sorted(report["hit"].items(), key=lambda x: -x[1]):
        lines.append(f"| {phase} | {n} |")
    lines.append(f"| **total** | **{report['kills']}** |")
    lost_running = sum(report["lost_running"].values())
    reasons = "; ".join(f"{n}: {r}" for r, n in report["lost_running"].items()) or "none"
    final = report["final_leaks"]
    leaked = len(report["leaks"]) + sum(
        len(final.get(k) or []) for k in ("processes", "ports", "store")
    )
    lines += [
        "",
        "| outcome | kernels |",
        "| --- | ---: |",
        "| suspended (or committed) kernels back with their exact state | "
        f"{report['recovered_suspended']} |",
        "| back at their checkpoint (woken at the kill; the server said what was lost) | "
        f"{report['recovered_at_checkpoint']} |",
        f"| **suspended kernels lost** | **{len(report['lost_suspended'])}** |",
        f"| running kernels lost ({reasons}) | {lost_running} |",
        f"| running kernels back | {report['running_back']} |",
        "| leaks (processes, ports, records without images, at restarts and at the end) | "
        f"{leaked} |",
        f"| restarts where the budget did not add up | {len(report['budget_mismatches'])} |",
        "| logs and work directories of lost kernels, left for gc (taken at 10 min) | "
        f"{final.get('left_for_gc_of_dead_kernels', 0)} |",
    ]
    return "\n".join(lines)


def merged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' reports as one (counts added, lists joined), for one table."""
    out: dict[str, Any] = {}
    for r in reports:
        for key in ("kills", "recovered_suspended", "recovered_at_checkpoint", "running_back"):
            out[key] = out.get(key, 0) + r[key]
        for key in ("hit", "lost_running"):
            counts = Counter(out.get(key, {}))
            counts.update(r[key])
            out[key] = dict(counts)
        for key in ("lost_suspended", "leaks", "budget_mismatches"):
            out[key] = out.get(key, []) + r[key]
        final = out.setdefault("final_leaks", {})
        for key in ("processes", "ports", "store"):
            final[key] = final.get(key, []) + r["final_leaks"][key]
        left = "left_for_gc_of_dead_kernels"
        final[left] = final.get(left, 0) + r["final_leaks"].get(left, 0)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--kernels", type=int, default=5, help="kernels kept alive (N)")
    p.add_argument("--big", type=int, default=1, help="how many of them are big")
    p.add_argument("--big-gb", type=float, default=1.5, help="memory of a big kernel (GB)")
    p.add_argument("--ops", type=int, default=4, help="at most this many operations between kills")
    p.add_argument("--phases", default=",".join(PHASES), help="kill points, in turn (shuffled)")
    p.add_argument("--seconds", type=float, default=0, help="start no kill after this")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--op-timeout", type=float, default=300.0, help="per request (s)")
    p.add_argument("--workdir", default=None, help="parent of the run's temporary directory")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument(
        "--table",
        default=None,
        help="only print the table of these JSON reports (comma-separated: summed)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.table:
        print(table(merged([json.loads(Path(f).read_text()) for f in args.table.split(",")])))
        return 0
    chaos = Chaos(args)
    report = asyncio.run(chaos.run())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(table(report))
    ok = clean(report)
    print("CLEAN" if ok else "FOUND PROBLEMS")
    if not ok:
        print(
            json.dumps(
                {
                    k: report[k]
                    for k in (
                        "lost_suspended",
                        "leaks",
                        "budget_mismatches",
                        "failures",
                        "final_leaks",
                    )
                    if k in report
                },
                indent=1,
            )[:6000]
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
