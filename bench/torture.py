"""Torture run: many kernels under a real jupyter server with jupyter-cedana, random
operations, and every kernel's namespace checked against the expected one after each.

    python bench/torture.py --kernels 20 --ops 1000 --json bench/results/torture.json

Operations (weights in OPS): a cell that changes state, suspend, resume, interrupt of a
running cell, restart, websocket reconnect, a page-reload-like reconnect (kernel_info +
comm_info, then gone), two connections sending at once, and an idle pause that lets the
policy suspend kernels by itself (short idle timeout). After each operation the kernel's
namespace hash is compared with the expected one. At the end every kernel is shut down
through the REST API and the run looks for leftovers: processes, listening ports, images.

Prints a summary and writes JSON; exit status 1 when anything was lost, leaked or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    HASH_CODE,
    Conn,
    Failure,
    Server,
    ns_hash,
    port_leaks,
    process_leaks,
    store_leftovers,
)

OPS = {
    "cell": 30,
    "suspend": 12,
    "resume": 6,
    "interrupt": 5,
    "restart": 3,
    "reconnect": 10,
    "reload": 10,
    "concurrent": 8,
    "idle": 2,
}


class Torture:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.expected: dict[str, dict[str, Any]] = {}
        self.ports: dict[str, list[int]] = {}
        self.counts: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.failure_examples: dict[str, str] = {}
        self.lost = 0
        self.wakeups = 0
        self.suspends_seen = 0
        self.workdir = Path(tempfile.mkdtemp(prefix="cedana-torture-", dir=args.workdir))
        self.server = Server(self.workdir, args.idle_timeout, args.check_interval)
        self.timeout = args.op_timeout

    def fail(self, kind: str, detail: str) -> None:
        self.failures[kind] += 1
        self.failure_examples.setdefault(kind, detail[:500])
        print(f"  FAIL {kind}: {detail[:200]}", flush=True)

    async def state(self, kid: str) -> str:
        status, view = await self.server.call("GET", f"/api/cedana/kernels/{kid}")
        return view["state"] if status == 200 else f"http-{status}"

    async def new_kernel(self) -> str:
        status, data = await self.server.call("POST", "/api/kernels", {"name": "python3"})
        if status != 201:
            raise RuntimeError(f"could not start a kernel: {status} {data}")
        kid = data["id"]
        self.expected[kid] = {}
        conn_file = self.server.runtime / f"kernel-{kid}.json"
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(conn_file.read_text())
            self.ports[kid] = [int(info[k]) for k in info if k.endswith("_port")]
        return kid

    async def check(self, kid: str, conn: Conn | None = None) -> None:
        own = conn is None
        conn = conn or await self.server.connect(kid)
        try:
            _reply, out = await conn.execute(HASH_CODE, self.timeout)
        finally:
            if own:
                conn.close()
        got = next((ln[3:] for ln in out.splitlines() if ln.startswith("NS=")), None)
        if got != ns_hash(self.expected[kid]):
            self.lost += 1
            self.fail("state_lost", f"{kid}: namespace hash {got} != expected; out={out!r}")
            # Re-base so one loss is not counted again at every later check.
            self.expected[kid] = {"_rebased": self.counts.total()}
            conn2 = await self.server.connect(kid)
            try:
                await conn2.execute(
                    "ns = globals().setdefault('ns', {}); ns.clear(); "
                    f"ns['_rebased'] = {self.counts.total()}",
                    self.timeout,
                )
            finally:
                conn2.close()

    def _assign(self) -> tuple[str, Any]:
        key = f"k{self.rng.randrange(50)}"
        value: Any = self.rng.choice(
            [self.rng.randrange(10**12), f"s{self.rng.randrange(10**6)}" * self.rng.randrange(1, 4)]
        )
        return key, value

    async def op_cell(self, kid: str) -> None:
        key, value = self._assign()
        conn = await self.server.connect(kid)
        try:
            reply, out = await conn.execute(
                f"ns = globals().setdefault('ns', {{}}); ns[{key!r}] = {value!r}", self.timeout
            )
            if reply.get("status") != "ok":
                raise Failure(f"cell failed: {reply.get('evalue')} {out}")
            self.expected[kid][key] = value
            await self.check(kid, conn)
        finally:
            conn.close()

    async def op_suspend(self, kid: str) -> None:
        status, data = await self.server.call("POST", f"/api/cedana/kernels/{kid}/suspend")
        if status == 200:
            self.suspends_seen += 1
        elif status in (409, 503, 507):  # 507: over the checkpoint budget or disk margin
            self.refused[f"suspend-{status}"] += 1
        else:
            raise Failure(f"suspend answered {status}: {data}")

    async def op_resume(self, kid: str) -> None:
        status, data = await self.server.call("POST", f"/api/cedana/kernels/{kid}/resume")
        if status == 409:
            self.refused["resume-409"] += 1
        elif status != 200:
            raise Failure(f"resume answered {status}: {data}")
        await self.check(kid)

    async def op_interrupt(self, kid: str) -> None:
        conn = await self.server.connect(kid)

        async def interrupt() -> None:
            status, data = await self.server.call("POST", f"/api/kernels/{kid}/interrupt")
            if status != 204:
                raise Failure(f"interrupt of a busy kernel answered {status}: {data}")

        try:
            reply, _ = await conn.execute(
                "import time\nfor _ in range(600): time.sleep(0.1)", self.timeout, interrupt
            )
            if reply.get("ename") != "KeyboardInterrupt":
                raise Failure(f"interrupted cell ended with {reply.get('status')} {reply}")
            await self.check(kid, conn)
        finally:
            conn.close()

    async def op_restart(self, kid: str) -> None:
        status, data = await self.server.call("POST", f"/api/kernels/{kid}/restart")
        if status != 200:
            raise Failure(f"restart answered {status}: {data}")
        self.expected[kid] = {}
        await self.check(kid)

    async def op_reconnect(self, kid: str) -> None:
        before = await self.state(kid)
        conn = await self.server.connect(kid)
        try:
            reply, _ = await conn.reply(conn.send("kernel_info_request", {}), self.timeout)
            if reply.get("status") != "ok":
                raise Failure(f"kernel_info after reconnect: {reply}")
        finally:
            conn.close()
        self._woke(kid, before, await self.state(kid))

    async def op_reload(self, kid: str) -> None:
        """What a page reload does: a new connection asks kernel_info and comm_info, and
        the page goes away before or after the answers."""
        before = await self.state(kid)
        conn = await self.server.connect(kid)
        info = conn.send("kernel_info_request", {})
        comm = conn.send("comm_info_request", {"target_name": "jupyter.widget"})
        if self.rng.random() < 0.5:
            await conn.replies([info, comm], self.timeout)
        conn.close()
        self._woke(kid, before, await self.state(kid))

    def _woke(self, kid: str, before: str, after: str) -> None:
        if before == "suspended" and after != "suspended":
            self.wakeups += 1
            self.fail("reconnect_woke_kernel", f"{kid}: {before} -> {after}")

    async def op_concurrent(self, kid: str) -> None:
        a, b = await self.server.connect(kid), await self.server.connect(kid)
        try:
            (ka, va), (kb, vb) = self._assign(), self._assign()
            if ka == kb:
                kb = kb + "b"
            ida = a.send(
                "execute_request",
                {
                    "code": f"ns = globals().setdefault('ns', {{}}); ns[{ka!r}] = {va!r}",
                    "silent": False,
                },
            )
            idb = b.send(
                "execute_request",
                {
                    "code": f"ns = globals().setdefault('ns', {{}}); ns[{kb!r}] = {vb!r}",
                    "silent": False,
                },
            )
            (ra, _), (rb, _) = await asyncio.gather(
                a.reply(ida, self.timeout), b.reply(idb, self.timeout)
            )
            if ra.get("status") != "ok" or rb.get("status") != "ok":
                raise Failure(f"concurrent cells: {ra.get('status')} {rb.get('status')}")
            self.expected[kid][ka] = va
            self.expected[kid][kb] = vb
            await self.check(kid, a)
        finally:
            a.close()
            b.close()

    async def op_idle(self, _kid: str) -> None:
        await asyncio.sleep(self.args.idle_timeout + 3 * self.args.check_interval)

    async def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.server.start()
        report: dict[str, Any] = {}
        try:
            await self.server.wait_ready()
            kernels = [await self.new_kernel() for _ in range(self.args.kernels)]
            for kid in kernels:
                await self.check(kid)
            names, weights = zip(*OPS.items(), strict=True)
            deadline = t0 + self.args.seconds if self.args.seconds else None
            for i in range(self.args.ops):
                if deadline and time.monotonic() > deadline:
                    break
                op = self.rng.choices(names, weights)[0]
                kid = self.rng.choice(kernels)
                self.counts[op] += 1
                if self.args.verbose:
                    print(f"[{i}] {op} {kid[:8]}", flush=True)
                try:
                    await asyncio.wait_for(getattr(self, f"op_{op}")(kid), self.timeout * 3)
                except Failure as e:
                    self.fail(op, f"{kid}: {e}")
                except TimeoutError:
                    self.fail(op, f"{kid}: timed out")
                except Exception as e:  # anything else is a finding too
                    self.fail(op, f"{kid}: {type(e).__name__}: {e}")
            ops_done = self.counts.total()
            for kid in kernels:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.check(kid), self.timeout * 2)
            shut = [await self.server.call("DELETE", f"/api/kernels/{kid}") for kid in kernels]
            bad_shutdowns = [s for s, _ in shut if s != 204]
            leaks = await self.leaks(kernels)
            report = {
                "kernels": self.args.kernels,
                "seed": self.args.seed,
                "operations": ops_done,
                "by_operation": dict(self.counts),
                "refused": dict(self.refused),
                "suspends": self.suspends_seen,
                "failures": dict(self.failures),
                "failure_examples": self.failure_examples,
                "states_lost": self.lost,
                "reconnect_wakeups": self.wakeups,
                "bad_shutdowns": len(bad_shutdowns),
                "leaked": leaks,
                "seconds": round(time.monotonic() - t0, 1),
            }
        finally:
            self.server.stop()
            report["leaked_after_stop"] = self.process_leaks()
            if not self.args.keep:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return report

    async def leaks(self, kernels: list[str]) -> dict[str, Any]:
        # SIGKILL is asynchronous: give the kernels' processes a moment to be reaped.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (self.process_leaks() or self.port_leaks()):
            await asyncio.sleep(0.5)
        images = store_leftovers(self.server.root)
        status, listed = await self.server.call("GET", "/api/kernels")
        return {
            "processes": self.process_leaks(),
            "ports": self.port_leaks(),
            "images": images,
            "kernels_listed": [k["id"] for k in listed or []] if status == 200 else status,
        }

    def process_leaks(self) -> list[str]:
        """Processes that belong to this run's kernels: their command line names this
        run's runtime dir or checkpoint root."""
        me = {os.getpid(), self.server.proc.pid if self.server.proc else -1}
        return process_leaks((str(self.server.runtime), str(self.server.root)), me)

    def port_leaks(self) -> list[int]:
        return port_leaks([p for ports in self.ports.values() for p in ports])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernels", type=int, default=20)
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=0, help="stop starting operations after this")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--idle-timeout", type=float, default=4.0, help="policy idle timeout (s)")
    p.add_argument("--check-interval", type=float, default=0.5)
    p.add_argument("--op-timeout", type=float, default=120.0, help="per request (s)")
    p.add_argument("--workdir", default=None, help="parent of the run's temporary directory")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def clean(report: dict[str, Any]) -> bool:
    leaked = report.get("leaked") or {}
    return (
        not report.get("failures")
        and report.get("states_lost", 1) == 0
        and report.get("bad_shutdowns", 1) == 0
        and not any(leaked.get(k) for k in ("processes", "ports", "images", "kernels_listed"))
        and not report.get("leaked_after_stop")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report = asyncio.run(Torture(args).run())
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = clean(report)
    print("CLEAN" if ok else "FOUND PROBLEMS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
