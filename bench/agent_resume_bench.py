"""A non-root server's cold resume through the checkpoint agent, side by side with a root
server's own (in-process CRIU), in one run.

Two real jupyter servers with the extension, started once for the whole run:

  root    a jupyter server as root, as without the agent: it runs CRIU itself, restores
          lazily (userfaultfd, its own page server).
  agent   a real agent (jupyter_cedana.agent) started as root on a private socket and
          state directory, and a jupyter server as an ordinary user (--user, default
          cedana-test; with --python, default .venv-nonroot) started with
          --CheckpointAgent.socket: its kernels are launched, dumped and restored (lazily)
          by the agent.

For each size (1 and 4 GB), each side gets one kernel filled with that many bytes of
random non-zero int64 (every page resident, incompressible), held open by a notebook-like
websocket. Then, `--repeat` times, interleaved (root, agent, root, agent, ...):

  suspend       `sync`, POST /api/cedana/kernels/ID/suspend (returns once suspended);
                then the image is looked for where that side keeps it (the server's
                checkpoint root, or the agent's store): a side that did not checkpoint
                where it should is an error, not a number.
  drop caches   so that the resume reads its image from the disk.
  first output  from sending a small cell (`print(b * 6)`) on the websocket until its
                output arrived: the transparent resume (the gate restores the kernel) and
                the cell. Lazy: whether the page server started for this resume (its log
                in the kernel's work directory was written after the cell was sent).
  all in        from sending the cell until the kernel's anonymous memory (RssAnon of its
                largest process, polled every 10 ms from the first output on) was back to
                98 % of what it held before the suspend; beside it, the page server's own
                time from its start until every page was in (its log). Throughput = image
                bytes / all in.

Every resume is checked: the cell prints 42 and a probe of the array gives the value it
gave before the suspend. Medians per side and size; the ratio agent / root of each
repeat's first output (then the median), and the target: the agent side's median first
output within 10 % of the root side's (ratio of medians <= 1.10).

Needs root (the agent, CRIU, drop_caches), the test user and its venv
(`scripts/setup.sh --test`), and per size about 2 x size of free RAM and of disk.

Usage: python bench/agent_resume_bench.py [--sizes 1,4] [--repeat 3] [--only root|agent]
                                          [--user cedana-test] [--python PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (
    FILL,
    GB,
    PROBE,
    SMALL,
    Conn,
    Server,
    can_drop_caches,
    drop_caches,
    machine_info,
    med,
    process_leaks,
)

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.10  # the agent side's first output over the root side's, at most
ALL_IN_SHARE = 0.98
IDLE_TIMEOUT = 86400  # the policy must not suspend a kernel on its own during the run
_PAGES_DONE = re.compile(r"in (?P<s>[\d.]+) s: read")
_LOG_TIME = re.compile(r"^\[\w (?P<t>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) ")


# -- the kernel's processes, seen from the host (root reads every /proc entry) ---------


def _rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0


def kernel_pid(kernel_id: str) -> int | None:
    """The host pid of the kernel's largest process: among the processes whose command
    line names its connection file (the kernel, and cedana-init above it), the one with
    the most anonymous memory. Found by name because a restore gives it a new pid."""
    mark = f"kernel-{kernel_id}.json".encode()
    best: tuple[int, int] | None = None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if mark in cmd:
            rss = _rss_anon(int(entry))
            if rss is not None and (best is None or rss > best[1]):
                best = (int(entry), rss)
    return best[0] if best else None


class AllInWatch(threading.Thread):
    """Polls the restored kernel's RssAnon every 10 ms until it is back to `share` of
    `target`: the perf_counter() at which it was first seen there (None on timeout)."""

    def __init__(self, kernel_id: str, target: int, timeout: float = 600):
        super().__init__(daemon=True)
        self.kernel_id = kernel_id
        self.target = target
        self.timeout = timeout
        self.at: float | None = None
        self.last = 0
        self._halt = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        pid = None
        while not self._halt.is_set() and time.monotonic() < deadline:
            rss = _rss_anon(pid) if pid is not None else None
            if rss is None:
                pid = kernel_pid(self.kernel_id)
                continue
            self.last = rss
            if rss >= ALL_IN_SHARE * self.target:
                self.at = time.perf_counter()
                return
            self._halt.wait(0.01)


# -- the agent, and a server run as another user ----------------------------------------


class Agent:
    """The checkpoint agent as root on a private socket and state directory. It refuses
    directories others can write, so its base is root's, 0755 (the user must reach the
    socket), under a sticky world-writable directory at most."""

    def __init__(self, parent: Path):
        self.base = Path(tempfile.mkdtemp(prefix="cedana-bench-agent-", dir=parent))
        os.chmod(self.base, 0o755)
        self.socket = self.base / "run" / "agent.sock"
        self.state = self.base / "state"
        self.log = self.base / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jupyter_cedana.agent",
                    "--socket",
                    str(self.socket),
                    "--state-dir",
                    str(self.state),
                    # Whatever the run leaves behind ends with the agent.
                    "--kernels-on-stop",
                    "kill",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "listening on" in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the agent did not start: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def image_dir(self, uid: int, kernel_id: str) -> Path:
        return self.state / "images" / str(uid) / kernel_id

    def work_dir(self, uid: int, kernel_id: str) -> Path:
        return self.state / "images" / str(uid) / ".work" / kernel_id

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


class UserServer(Server):
    """benchlib's Server, run as `user` with `python` (a venv that user can read), and
    its own directories owned by that user."""

    def __init__(self, workdir: Path, user: str, python: str, extra_args: list[str]):
        super().__init__(workdir, IDLE_TIMEOUT, 60, extra_args)
        self.user = pwd.getpwnam(user)
        self.python = python

    def start(self) -> None:
        for d in (self.workdir, self.workdir / "notebooks", self.runtime, self.root):
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, self.user.pw_uid, self.user.pw_gid)
            os.chmod(d, 0o700)
        env = {
            "HOME": self.user.pw_dir,
            "PATH": f"{Path(self.python).parent}:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "JUPYTER_RUNTIME_DIR": str(self.runtime),
        }
        cmd = [
            self.python,
            "-m",
            "jupyter_server",
            "--no-browser",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.workdir / 'notebooks'}",
            f"--CedanaApp.checkpoint_root={self.root}",
            f"--SuspendPolicy.idle_timeout={self.idle_timeout}",
            f"--SuspendPolicy.check_interval={self.check_interval}",
            *self.extra_args,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                user=self.user.pw_uid,
                group=self.user.pw_gid,
                extra_groups=[],  # a server on the agent needs no group but its own
            )


# -- one side: a server, where it keeps images, its kernels -----------------------------


class Side:
    def __init__(self, name: str, server: Server, agent: Agent | None, uid: int):
        self.name = name
        self.server = server
        self.agent = agent
        self.uid = uid
        self.kernels: list[str] = []

    def image_dir(self, kernel_id: str) -> Path:
        if self.agent is not None:
            return self.agent.image_dir(self.uid, kernel_id)
        return self.server.root / kernel_id

    def work_dir(self, kernel_id: str) -> Path:
        if self.agent is not None:
            return self.agent.work_dir(self.uid, kernel_id)
        return self.server.root / ".work" / kernel_id

    def where(self) -> str:
        return "the agent's store" if self.agent is not None else "the server's checkpoint root"

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.server.log.read_text(errors="replace")[-n:]
        return ""


async def execute(conn: Conn, code: str, timeout: float = 600) -> str:
    reply, out = await conn.execute(code, timeout)
    if reply.get("status") != "ok":
        raise RuntimeError(f"kernel error: {reply.get('ename')}: {reply.get('evalue')} {out}")
    return out.strip()


async def first_output(conn: Conn, code: str, timeout: float = 600) -> tuple[float, float, str]:
    """Send `code`: the perf_counter() when it was sent and when its first stream output
    arrived, and that output. Returns after the reply and the idle status (untimed)."""
    t0 = time.perf_counter()
    msg_id = conn.send("execute_request", {"code": code, "silent": False})
    arrived = None
    text = ""
    reply = None
    idle = False
    deadline = time.monotonic() + timeout
    while reply is None or not idle:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"no reply in {timeout:.0f} s")
        raw = await asyncio.wait_for(conn.ws.read_message(), left)
        if raw is None:
            raise RuntimeError("websocket closed")
        msg = json.loads(raw)
        if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream" and arrived is None:
            arrived = time.perf_counter()
            text = msg["content"]["text"]
        elif kind == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        elif kind == "execute_reply":
            reply = msg["content"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    if arrived is None:
        raise RuntimeError(f"no output: {reply}")
    return t0, arrived, text.strip()


async def start_kernel(side: Side, nbytes: int) -> tuple[str, Conn, str, int]:
    """A kernel of about `nbytes`, its open websocket, its probe value, its RssAnon."""
    status, data = await side.server.call("POST", "/api/kernels", {"name": "python3"})
    if status != 201:
        raise RuntimeError(f"{side.name}: starting a kernel answered {status}: {data}")
    kid = data["id"]
    side.kernels.append(kid)
    conn = await side.server.connect(kid)
    await execute(conn, "import numpy as np")
    pid = kernel_pid(kid)
    if pid is None:
        raise RuntimeError(f"{side.name}: kernel {kid}'s process not found")
    base = _rss_anon(pid) or 0
    await execute(conn, FILL.format(nbytes=max(8 << 20, nbytes - base)))
    expect = await execute(conn, PROBE)
    uid = os.stat(f"/proc/{pid}").st_uid
    if uid != side.uid:
        raise RuntimeError(f"{side.name}: the kernel runs as uid {uid}, not {side.uid}")
    return kid, conn, expect, _rss_anon(pid) or 0


def pages_seconds(work: Path, since: float, wait: float = 5) -> float | None:
    """The page server's own time until every page was in, from its log in the kernel's
    work directory, if that log was written by this resume (modified after `since`)."""
    log = work / "pages.log"
    deadline = time.monotonic() + wait
    while True:
        with contextlib.suppress(OSError):
            if log.stat().st_mtime >= since:
                m = _PAGES_DONE.search(log.read_text(errors="replace"))
                if m:
                    return float(m["s"])
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def resume_from_log(text: str, kernel_id: str, sent: float) -> dict[str, float | None]:
    """Where the wait went, by the server's own log of this resume (best effort: None
    where a line is missing): its restore's seconds, and when (after the cell was sent,
    wall clock, to the log's millisecond) the kernel was confirmed running and the held
    cell delivered to it."""
    restore_s = delivered_s = None
    for line in text.splitlines():
        if kernel_id not in line:
            continue
        m = re.search(r"Resumed kernel \S+ .*?in (?P<s>[\d.]+) s", line)
        if m:
            restore_s = float(m["s"])
        t = _LOG_TIME.match(line)
        if t and "runs: delivering" in line:
            at = datetime.datetime.strptime(t["t"], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            delivered_s = at - sent
    return {"restore_s": restore_s, "delivered_s": delivered_s}


async def cycle(
    side: Side, kid: str, conn: Conn, expect: str, rss_before: int, cold: bool
) -> dict[str, Any]:
    os.sync()  # no dirty pages of earlier steps in the suspend's way
    t = time.perf_counter()
    status, view = await side.server.call("POST", f"/api/cedana/kernels/{kid}/suspend")
    suspend_s = time.perf_counter() - t
    if status != 200 or (view or {}).get("state") != "suspended":
        raise RuntimeError(f"{side.name}: suspend answered {status}: {view}\n{side.log_tail()}")
    image = side.image_dir(kid)
    if not image.is_dir():
        raise RuntimeError(
            f"{side.name}: suspended, but no image in {side.where()} ({image})\n{side.log_tail()}"
        )
    image_bytes = int(view.get("checkpoint_bytes") or 0) or sum(
        f.stat().st_size for f in image.iterdir() if f.is_file()
    )
    if cold:
        drop_caches()
    log_from = side.server.log.stat().st_size
    since = time.time()
    t0, arrived, out = await first_output(conn, SMALL)
    watch = AllInWatch(kid, rss_before)
    watch.start()
    work = side.work_dir(kid)
    lazy = (work / "pages.log").exists() and (work / "pages.log").stat().st_mtime >= since
    if out != "42":
        raise RuntimeError(f"{side.name}: unexpected output {out!r}")
    await asyncio.to_thread(watch.join)
    all_in_s = watch.at - t0 if watch.at is not None else None
    pages_s = pages_seconds(work, since) if lazy else None
    if await execute(conn, PROBE) != expect:
        raise RuntimeError(f"{side.name}: the state after the resume differs")
    with open(side.server.log, "rb") as f:
        f.seek(log_from)
        logged = resume_from_log(f.read().decode(errors="replace"), kid, since)
    return {
        **logged,
        # Others' work on the machine moves these numbers: the load at each resume.
        "load1": os.getloadavg()[0],
        "image_bytes": image_bytes,
        "suspend_s": suspend_s,
        "first_output_s": arrived - t0,
        "all_in_s": all_in_s,
        "rss_anon_last": watch.last,
        "pages_s": pages_s,
        "lazy": lazy,
        "all_in_gbps": image_bytes / all_in_s / GB if all_in_s else None,
    }


async def shut_down(side: Side) -> None:
    """Kernels first: a server stopped with kernels would park them (dump them all)."""
    for kid in list(side.kernels):
        with contextlib.suppress(Exception):
            await side.server.call("DELETE", f"/api/kernels/{kid}")
        side.kernels.remove(kid)


KEYS = (
    "image_bytes",
    "suspend_s",
    "restore_s",
    "delivered_s",
    "first_output_s",
    "all_in_s",
    "pages_s",
    "all_in_gbps",
)


async def bench_size(sides: list[Side], size_gb: float, repeat: int, cold: bool) -> dict[str, Any]:
    held: dict[str, tuple[str, Conn, str, int]] = {}
    rows: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
    try:
        for side in sides:
            held[side.name] = await start_kernel(side, int(size_gb * GB))
            print(
                f"  {side.name}: kernel {held[side.name][0][:8]} holds "
                f"{held[side.name][3] / GB:.3f} GB anonymous",
                flush=True,
            )
        for i in range(repeat):
            for side in sides:
                kid, conn, expect, rss = held[side.name]
                r = await cycle(side, kid, conn, expect, rss, cold)
                r["repeat"] = i
                rows[side.name].append(r)
                print(
                    f"  [{i}] {side.name:>5}: image {r['image_bytes'] / GB:.3f} GB, suspend "
                    f"{r['suspend_s']:.2f} s | restore {fmt(r['restore_s'], 2)} s, delivered "
                    f"{fmt(r['delivered_s'])} s, first output {r['first_output_s']:.3f} s "
                    f"(lazy {r['lazy']}) | all in {fmt(r['all_in_s'])} s, page server "
                    f"{fmt(r['pages_s'])} s, {fmt(r['all_in_gbps'], 2)} GB/s | load "
                    f"{r['load1']:.1f}",
                    flush=True,
                )
    finally:
        for side in sides:
            if side.name in held:
                held[side.name][1].close()
            await shut_down(side)
    out: dict[str, Any] = {"size_gb": size_gb, "sides": {}}
    for name, rs in rows.items():
        out["sides"][name] = {
            "repeats": len(rs),
            "lazy_all": all(r["lazy"] for r in rs),
            **{k: med(rs, k) for k in KEYS},
            "cycles": rs,
        }
    if all(n in rows and rows[n] for n in ("root", "agent")):
        pairs = list(zip(rows["root"], rows["agent"], strict=True))
        out["first_output_ratio"] = med(
            [{"x": b["first_output_s"] / a["first_output_s"]} for a, b in pairs], "x"
        )
        a_med = out["sides"]["root"]["first_output_s"]
        b_med = out["sides"]["agent"]["first_output_s"]
        out["first_output_ratio_of_medians"] = b_med / a_med
        out["all_in_gbps_ratio"] = med(
            [
                {"x": b["all_in_gbps"] / a["all_in_gbps"]}
                for a, b in pairs
                if a["all_in_gbps"] and b["all_in_gbps"]
            ],
            "x",
        )
        out["met"] = out["first_output_ratio_of_medians"] <= TARGET and all(
            out["sides"][n]["lazy_all"] for n in ("root", "agent")
        )
    return out


def fmt(v: float | None, p: int = 3) -> str:
    return f"{v:.{p}f}" if v is not None else "-"


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        f"\n{'size':>5} {'side':>6} | {'image':>6} {'suspend':>7} | {'restore':>7} "
        f"{'deliver':>7} {'1st out':>7} {'lazy':>5} | {'all in':>7} {'pages':>7} {'GB/s':>5}"
    )
    print(
        f"{'GB':>5} {'':>6} | {'GB':>6} {'s':>7} | {'s':>7} {'s':>7} {'s':>7} {'':>5} | "
        f"{'s':>7} {'s':>7} {'':>5}"
    )
    for res in results:
        for name, s in res["sides"].items():
            image = s["image_bytes"] / GB if s["image_bytes"] else None
            print(
                f"{res['size_gb']:>5g} {name:>6} | {fmt(image):>6} {fmt(s['suspend_s'], 2):>7} | "
                f"{fmt(s['restore_s']):>7} {fmt(s['delivered_s']):>7} "
                f"{fmt(s['first_output_s']):>7} {s['lazy_all']!s:>5} | "
                f"{fmt(s['all_in_s']):>7} {fmt(s['pages_s']):>7} {fmt(s['all_in_gbps'], 2):>5}"
            )
        if "met" in res:
            print(
                f"{res['size_gb']:>5g} agent/root: first output "
                f"{res['first_output_ratio_of_medians']:.3f} x (of the medians; median of "
                f"the repeats' ratios {res['first_output_ratio']:.3f}), all-in throughput "
                f"{fmt(res['all_in_gbps_ratio'])} x: {'MET' if res['met'] else 'NOT MET'} "
                f"(first output <= {TARGET:.2f} x root's, both lazy)"
            )


async def main_async(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("needs root: the agent, CRIU and drop_caches", file=sys.stderr)
        return 2
    names = [args.only] if args.only else ["root", "agent"]
    sizes = [float(x) for x in args.sizes.split(",") if x.strip()]
    parent = Path(args.dir).resolve()
    run_dir = Path(tempfile.mkdtemp(prefix="cedana-bench-agent-resume-", dir=parent))
    os.chmod(run_dir, 0o755)  # the user's server works in a directory of its own below
    machine = machine_info(run_dir)
    cold = can_drop_caches()
    print(
        f"{machine['nproc']} CPUs, {machine['mem_bytes'] / GB:.1f} GB RAM, kernel "
        f"{machine['kernel']}, CRIU {machine['criu']}, disk {machine['fs_type']}"
    )
    sides: list[Side] = []
    agent: Agent | None = None
    started: list[int] = []
    results: list[dict[str, Any]] = []
    try:
        if "root" in names:
            server = Server(run_dir / "root", IDLE_TIMEOUT, 60)
            server.start()
            sides.append(Side("root", server, None, 0))
        if "agent" in names:
            agent = Agent(run_dir)
            agent.start()
            assert agent.proc is not None
            started.append(agent.proc.pid)
            uid = pwd.getpwnam(args.user).pw_uid
            userv = UserServer(
                run_dir / "agent",
                args.user,
                args.python,
                [f"--CheckpointAgent.socket={agent.socket}"],
            )
            userv.start()
            sides.append(Side("agent", userv, agent, uid))
        for side in sides:
            assert side.server.proc is not None
            started.append(side.server.proc.pid)
            try:
                await side.server.wait_ready()
            except RuntimeError as e:
                raise RuntimeError(f"{side.name}: {e}\n{side.log_tail()}") from e
        for size in sizes:
            print(f"\n== {size:g} GB", flush=True)
            results.append(await bench_size(sides, size, args.repeat, cold))
    finally:
        for side in sides:
            with contextlib.suppress(Exception):
                await shut_down(side)
            side.server.stop()
        if agent is not None:
            agent.stop()
        leaks = process_leaks((str(run_dir),), set(started) | {os.getpid()})
        for line in leaks:
            print(f"left behind, killed: {line}", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        if args.keep:
            print(f"kept {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    print_table(results)
    machine["loadavg_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine, "args": vars(args), "results": results}
    out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4", help="kernel sizes in GB (comma-separated)")
    ap.add_argument("--repeat", type=int, default=3, help="suspend/resume cycles per side")
    ap.add_argument("--only", choices=("root", "agent"), help="one side alone")
    ap.add_argument("--user", default="cedana-test", help="the agent side's server's user")
    ap.add_argument(
        "--python",
        default=str(ROOT / ".venv-nonroot" / "bin" / "python"),
        help="the agent side's server's python (a venv that user can read)",
    )
    ap.add_argument("--dir", default="/var/tmp", help="where the run's directories go (the disk)")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "agent_resume.json"))
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
