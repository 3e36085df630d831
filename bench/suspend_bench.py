"""Suspend/resume benchmark for CPU kernels, side by side with plain file I/O (issue 2).

For kernels holding about 0.1, 1 and 4 GB (numpy arrays of random non-zero int64, so
every page is resident and incompressible) this measures, through the extension's own
provisioner (CedanaProvisioner.suspend(tier="disk") / .resume()) and real CRIU:

  suspend         wall time of suspend(); throughput = image bytes / suspend seconds;
                  also CRIU dump only (manifest timings.dump_s) and checksum time
                  (timings.checksum_s), and the rest (commit, kill, port reservation)
  resume          wall time of resume(), with a cold page cache (sync; drop_caches
                  before it) and with a warm one (image still cached from the suspend);
                  split into verify (CRC of every image file) and CRIU restore
  first output    from calling resume() until an execute_request that prints from the
                  earlier state has delivered its stream output on IOPub; includes the
                  IOPub confirmation the server's message gate does first (a fresh shell
                  socket sends kernel_info_request every --nudge-interval s, 0.5 as
                  jupyter_server's nudge, until it has the reply and one IOPub message
                  arrived on the client's long-lived IOPub socket)

and in the same run, on the same disk (the checkpoint root), for the same byte count:

  plain write     os.write of the image's size in 8 MiB chunks, no fsync (CRIU does
                  not fsync its images either: like with like); also reported with fsync
  plain read      the same file read back with a cold page cache

Each size runs --repeat times (one kernel per size); medians are reported. Targets
(docs/benchmarks.md, DESIGN.md "Performance targets") are checked and printed as
PASS/MISS with the ratio. Cold-cache steps need root (drop_caches); without it they are
skipped and said so.

Usage: python bench/suspend_bench.py [--sizes 0.1,1,4] [--repeat 3] [--root DIR]
                                     [--json PATH] [--quick]
Writes bench/results/suspend.json by default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
CHUNK = 8 << 20
GATE_NUDGE_S = 0.5  # jupyter_server's nudge() retries kernel_info_request every 0.5 s

# --- timing hooks: instrumentation only, the package's behaviour is unchanged -----------

PHASES: dict[str, float] = {}


def _instrument() -> None:
    from jupyter_cedana.checkpoint import CheckpointStore
    from jupyter_cedana.engine import CheckpointEngine

    def timed(cls: type, name: str, key: str, is_async: bool) -> None:
        orig = getattr(cls, name)
        if is_async:

            async def wrapper(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await orig(*a, **kw)
                finally:
                    PHASES[key] = PHASES.get(key, 0.0) + time.perf_counter() - t

        else:

            def wrapper(*a: Any, **kw: Any) -> Any:  # type: ignore[misc]
                t = time.perf_counter()
                try:
                    return orig(*a, **kw)
                finally:
                    PHASES[key] = PHASES.get(key, 0.0) + time.perf_counter() - t

        setattr(cls, name, wrapper)

    timed(CheckpointStore, "verify", "verify_s", False)
    timed(CheckpointStore, "commit", "commit_s", False)
    timed(CheckpointStore, "remove", "remove_s", False)
    timed(CheckpointEngine, "start_restore", "restore_s", False)
    timed(CheckpointEngine, "wait_restored", "restore_s", True)


# --- machine helpers -----------------------------------------------------------------


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def sync() -> None:
    os.sync()


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def fs_type(path: Path) -> str:
    """The file system of the mount holding path, as /proc/self/mounts names it."""
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            mnt = parts[1]
            inside = str(path).startswith(mnt.rstrip("/") + "/") or str(path) == mnt
            if inside and len(mnt) >= len(best):
                best, kind = mnt, f"{parts[2]} on {parts[0]} ({mnt})"
    return kind


def machine_info(root: Path) -> dict[str, Any]:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    mem = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    from jupyter_cedana.engine import CheckpointEngine

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "mem_bytes": mem,
        "kernel": platform.release(),
        "df": run(["df", "-h", str(root)]),
        "fs_type": fs_type(root),
        "criu": CheckpointEngine.instance().probe().criu_version,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


# --- plain file I/O ------------------------------------------------------------------


def plain_write(path: Path, nbytes: int, buf: bytes) -> tuple[float, float]:
    """Seconds to write nbytes (no fsync), and seconds of the fsync after it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(buf)
        t = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, view[: min(left, len(buf))])
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        os.fsync(fd)
        fsync_s = time.perf_counter() - t
    finally:
        os.close(fd)
    return write_s, fsync_s


def plain_read(path: Path) -> tuple[float, int]:
    buf = bytearray(CHUNK)
    total = 0
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return time.perf_counter() - t, total


# --- kernel --------------------------------------------------------------------------


async def start_kernel(root: Path, workdir: Path) -> tuple[Any, Any]:
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_client.provisioning import KernelProvisionerFactory
    from traitlets.config import Config

    c = Config()
    c.CheckpointEngine.checkpoint_root = str(root)
    KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
    km = AsyncKernelManager(kernel_name="python3", config=c)
    await km.start_kernel(cwd=str(workdir))
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    return km, kc


async def run(kc: Any, code: str, timeout: float = 300) -> str:
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = await kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"kernel error: {''.join(out)}")
    return "".join(out)


FILL = """
import numpy as np, os
_n = max(0, {nbytes} // 8)
a = np.random.default_rng(12345).integers(1, 2**62, size=_n, dtype=np.int64)
a[::512] |= 1  # touch every page once more: resident, non-zero
"""
PROBE = "print(int(a[::512].sum() % 1000003), a.nbytes)"


async def confirm_iopub(km: Any, kc: Any, interval: float, timeout: float = 60) -> None:
    """The gate's IOPub confirmation, as jupyter_server's nudge() does it: kernel_info
    requests on a transient shell socket every `interval` s until a shell reply has come
    and an IOPub message arrived on the client's long-lived IOPub socket."""
    import zmq
    import zmq.asyncio

    shell = km.connect_shell()
    iopub = kc.iopub_channel.socket
    poller = zmq.asyncio.Poller()
    poller.register(shell, zmq.POLLIN)
    poller.register(iopub, zmq.POLLIN)
    got_reply = got_iopub = False
    deadline = time.monotonic() + timeout
    next_send = 0.0
    try:
        while not (got_reply and got_iopub):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError("IOPub did not come back")
            if now >= next_send:
                km.session.send(shell, "kernel_info_request")
                next_send = now + interval
            wait_ms = max(1, int((next_send - time.monotonic()) * 1000))
            events = dict(await poller.poll(wait_ms))
            if shell in events:
                await shell.recv_multipart()
                got_reply = True
            if iopub in events:
                await iopub.recv_multipart()
                got_iopub = True
    finally:
        shell.close(linger=0)


async def first_output(kc: Any, timeout: float = 120) -> tuple[float, str]:
    """Send PROBE; seconds until its stream output arrived (and its text)."""
    msg_id = kc.execute(PROBE)
    t = time.perf_counter()
    text = None
    deadline = time.monotonic() + timeout
    while text is None:
        msg = await kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            text = msg["content"]["text"]
    dt = time.perf_counter() - t
    # drain the reply and the idle status, untimed
    while True:
        reply = await kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    with contextlib.suppress(Exception):
        while True:
            await kc.get_iopub_msg(timeout=0.05)
    return dt, text


async def cycle(km: Any, kc: Any, expect: str, cold: bool, nudge: float) -> dict[str, Any]:
    """One suspend and resume; returns its timings."""
    prov = km.provisioner
    store = prov.engine.store
    sync()  # no dirty pages left over from earlier steps: same start as the plain write
    PHASES.clear()
    t = time.perf_counter()
    await prov.suspend(tier="disk")
    suspend_s = time.perf_counter() - t
    manifest = store.read_manifest(prov.kernel_id_str)
    timings = manifest["timings"]
    image = int(manifest["total_bytes"])
    commit_s = PHASES.get("commit_s", 0.0)
    if cold:
        drop_caches()
    PHASES.clear()
    t = time.perf_counter()
    await prov.resume()
    resume_s = time.perf_counter() - t
    await confirm_iopub(km, kc, nudge)
    confirm_s = time.perf_counter() - t
    exec_s, text = await first_output(kc)
    total_s = time.perf_counter() - t
    if text.strip() != expect:
        raise RuntimeError(f"state after resume differs: {text.strip()!r} != {expect!r}")
    return {
        "cold": cold,
        "nudge_interval_s": nudge,
        "image_bytes": image,
        "suspend_s": suspend_s,
        "provisioner_suspend_s": prov.last_suspend_seconds,
        "dump_s": timings["dump_s"],
        "checksum_s": timings["checksum_s"],
        "commit_other_s": commit_s - timings["checksum_s"],
        "suspend_other_s": suspend_s - timings["dump_s"] - commit_s,
        "resume_s": resume_s,
        "provisioner_resume_s": prov.last_resume_seconds,
        "verify_s": PHASES.get("verify_s", 0.0),
        "criu_restore_s": PHASES.get("restore_s", 0.0),
        "remove_s": PHASES.get("remove_s", 0.0),
        "iopub_confirm_s": confirm_s - resume_s,
        "execute_s": exec_s,
        "first_output_s": total_s,
    }


async def cycle_retrying(
    km: Any, kc: Any, expect: str, cold: bool, nudge: float, failures: list[str]
) -> dict[str, Any]:
    """A failed suspend leaves the kernel running: record why and try again (twice)."""
    from jupyter_cedana.errors import SuspendFailed

    for attempt in range(3):
        try:
            return await cycle(km, kc, expect, cold, nudge)
        except SuspendFailed as e:
            failures.append(e.message if hasattr(e, "message") else str(e))
            print(f"  suspend failed (attempt {attempt + 1}), kernel kept running: {e}")
            if attempt == 2:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


async def bench_size(
    size_gb: float, repeat: int, root: Path, cold_ok: bool, fast_nudge: float | None
) -> dict[str, Any]:
    from jupyter_cedana.engine import tree_rss

    workdir = Path(tempfile.mkdtemp(prefix="cedana-bench-work-"))
    km, kc = await start_kernel(root, workdir)
    try:
        await run(kc, "import numpy as np, os")
        base = tree_rss(km.provisioner.pid)
        target = int(size_gb * GB)
        await run(kc, FILL.format(nbytes=max(8 << 20, target - base)))
        expect = (await run(kc, PROBE)).strip()
        rss = tree_rss(km.provisioner.pid)
        print(f"\n== {size_gb:g} GB kernel: RSS {rss / GB:.3f} GB (base {base / GB:.3f} GB)")
        buf = os.urandom(CHUNK)
        plain = root / "plain-io.bin"
        rows: list[dict[str, Any]] = []
        plains: list[dict[str, Any]] = []
        failures: list[str] = []
        variants = [(False, GATE_NUDGE_S)]
        if cold_ok:
            variants.append((True, GATE_NUDGE_S))
        if fast_nudge:
            variants.append((False, fast_nudge))
        for i in range(repeat):
            for cold, nudge in variants:
                r = await cycle_retrying(km, kc, expect, cold, nudge, failures)
                r["repeat"] = i
                rows.append(r)
                print(
                    f"  [{i}] suspend {r['suspend_s']:.3f}s (dump {r['dump_s']:.3f} "
                    f"crc {r['checksum_s']:.3f}) {r['image_bytes'] / GB:.3f} GB | "
                    f"{'cold' if cold else 'warm'} resume {r['resume_s']:.3f}s "
                    f"(verify {r['verify_s']:.3f} criu {r['criu_restore_s']:.3f}) "
                    f"iopub {r['iopub_confirm_s']:.3f}s first output {r['first_output_s']:.3f}s"
                    f" [nudge {nudge}s]",
                    flush=True,
                )
            # plain I/O of the same byte count, on the same disk, right after
            nbytes = rows[-1]["image_bytes"]
            sync()
            write_s, fsync_s = plain_write(plain, nbytes, buf)
            p: dict[str, Any] = {
                "repeat": i,
                "bytes": nbytes,
                "write_s": write_s,
                "fsync_s": fsync_s,
            }
            if cold_ok:
                drop_caches()
                read_s, got = plain_read(plain)
                assert got == nbytes
                p["read_cold_s"] = read_s
            plain.unlink()
            plains.append(p)
            print(
                f"  [{i}] plain write {nbytes / write_s / GB:.3f} GB/s "
                f"(+fsync {nbytes / (write_s + fsync_s) / GB:.3f} GB/s)"
                + (f", cold read {nbytes / p['read_cold_s'] / GB:.3f} GB/s" if cold_ok else ""),
                flush=True,
            )
    finally:
        kc.stop_channels()
        with contextlib.suppress(Exception):
            await km.shutdown_kernel(now=True)
        shutil.rmtree(workdir, ignore_errors=True)
    s = summarize(size_gb, rss, rows, plains)
    s["suspend_failures"] = failures
    return s


def summarize(
    size_gb: float, rss: int, rows: list[dict[str, Any]], plains: list[dict[str, Any]]
) -> dict[str, Any]:
    image = med(rows, "image_bytes") or 0
    s: dict[str, Any] = {"size_gb": size_gb, "kernel_rss_bytes": rss, "image_bytes": image}
    for key in ("suspend_s", "dump_s", "checksum_s", "commit_other_s", "suspend_other_s"):
        s[key] = med(rows, key)  # every cycle suspends the same way
    s["suspend_gbps"] = image / s["suspend_s"] / GB
    s["dump_gbps"] = image / s["dump_s"] / GB
    s["write_gbps"] = statistics.median(p["bytes"] / p["write_s"] for p in plains) / GB
    s["write_fsync_gbps"] = (
        statistics.median(p["bytes"] / (p["write_s"] + p["fsync_s"]) for p in plains) / GB
    )
    if all("read_cold_s" in p for p in plains):
        s["read_cold_gbps"] = statistics.median(p["bytes"] / p["read_cold_s"] for p in plains) / GB
    for name, sel in (
        ("warm", lambda r: not r["cold"] and r["nudge_interval_s"] == GATE_NUDGE_S),
        ("cold", lambda r: r["cold"]),
        ("warm_fast_nudge", lambda r: not r["cold"] and r["nudge_interval_s"] != GATE_NUDGE_S),
    ):
        sub = [r for r in rows if sel(r)]
        if not sub:
            continue
        s[name] = {
            k: med(sub, k)
            for k in (
                "resume_s",
                "verify_s",
                "criu_restore_s",
                "remove_s",
                "iopub_confirm_s",
                "execute_s",
                "first_output_s",
            )
        }
        s[name]["nudge_interval_s"] = sub[0]["nudge_interval_s"]
        s[name]["n"] = len(sub)
    s["cycles"] = rows
    s["plain"] = plains
    return s


# --- targets -------------------------------------------------------------------------


def check_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, value: float, limit: float, higher_is_better: bool, unit: str) -> None:
        ok = value >= limit if higher_is_better else value <= limit
        out.append(
            {
                "target": name,
                "value": value,
                "limit": limit,
                "unit": unit,
                "ratio": value / limit if limit else None,
                "pass": ok,
            }
        )

    for s in results:
        g = f"{s['image_bytes'] / GB:.2f} GB"
        add(
            f"{g}: suspend throughput >= 90% of plain write (no fsync)",
            s["suspend_gbps"],
            0.9 * s["write_gbps"],
            True,
            "GB/s",
        )
        if "cold" in s and "read_cold_gbps" in s:
            bound = s["image_bytes"] / (s["read_cold_gbps"] * GB) + 0.3
            add(
                f"{g}: cold resume to first output <= size/plain read + 0.3 s",
                s["cold"]["first_output_s"],
                bound,
                False,
                "s",
            )
        if s["image_bytes"] < 0.25 * GB:
            add(f"{g}: ~100 MB kernel suspends in < 0.3 s", s["suspend_s"], 0.3, False, "s")
            for name in ("cold", "warm"):
                if name in s:
                    add(
                        f"{g}: first execute after {name} resume answered in < 0.5 s",
                        s[name]["first_output_s"],
                        0.5,
                        False,
                        "s",
                    )
    return out


def print_table(results: list[dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    hdr = (
        f"{'image':>8} {'suspend':>8} {'susp':>6} {'dump':>6} {'crc':>6} {'write':>6} "
        f"{'w+fsync':>7} {'s/w':>5} | {'cold rd':>7} {'resume':>7} {'verify':>7} "
        f"{'criu':>6} {'1st out':>7} {'bound':>6} | {'warm rs':>7} {'1st out':>7} "
        f"{'fast':>6}"
    )
    units = (
        f"{'GB':>8} {'s':>8} {'GB/s':>6} {'GB/s':>6} {'s':>6} {'GB/s':>6} {'GB/s':>7} "
        f"{'':>5} | {'GB/s':>7} {'cold s':>7} {'s':>7} {'s':>6} {'s':>7} {'s':>6} | "
        f"{'s':>7} {'s':>7} {'s':>6}"
    )
    print("\n" + hdr + "\n" + units)

    def f(v: float | None, w: int, p: int = 3) -> str:
        return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"

    for s in results:
        cold = s.get("cold", {})
        warm = s.get("warm", {})
        fast = s.get("warm_fast_nudge", {})
        bound = (
            s["image_bytes"] / (s["read_cold_gbps"] * GB) + 0.3 if "read_cold_gbps" in s else None
        )
        print(
            f"{s['image_bytes'] / GB:>8.3f} {f(s['suspend_s'], 8)} {f(s['suspend_gbps'], 6)} "
            f"{f(s['dump_gbps'], 6)} {f(s['checksum_s'], 6)} {f(s['write_gbps'], 6)} "
            f"{f(s['write_fsync_gbps'], 7)} {s['suspend_gbps'] / s['write_gbps']:>5.2f} | "
            f"{f(s.get('read_cold_gbps'), 7)} {f(cold.get('resume_s'), 7)} "
            f"{f(cold.get('verify_s'), 7)} {f(cold.get('criu_restore_s'), 6)} "
            f"{f(cold.get('first_output_s'), 7)} {f(bound, 6)} | {f(warm.get('resume_s'), 7)} "
            f"{f(warm.get('first_output_s'), 7)} {f(fast.get('first_output_s'), 6)}"
        )
    print("\nTargets:")
    for t in targets:
        print(
            f"  {'PASS' if t['pass'] else 'MISS'}  {t['target']}: {t['value']:.3f} {t['unit']}"
            f" vs {t['limit']:.3f} {t['unit']} (ratio {t['ratio']:.2f})"
        )


async def main_async(args: argparse.Namespace) -> int:
    from jupyter_cedana.engine import CheckpointEngine

    if args.quick:
        args.sizes, args.repeat = "0.1", 1
    sizes = [float(x) for x in args.sizes.split(",") if x.strip()]
    root = Path(args.root or tempfile.mkdtemp(prefix="cedana-bench-", dir="/var/tmp"))
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    CheckpointEngine.clear_instance()
    from traitlets.config import Config

    c = Config()
    c.CheckpointEngine.checkpoint_root = str(root)
    engine = CheckpointEngine.instance(config=c)
    info = engine.probe()
    if not info.available:
        print(f"cannot benchmark: {info.reason}", file=sys.stderr)
        return 2
    # Start (or fail to start) the CUDA helper once, so no suspend pays for it.
    await engine.cuda_checkpointer()
    _instrument()
    cold_ok = can_drop_caches()
    if not cold_ok:
        print("not root: cold-cache steps (plain read, cold resume) are skipped")
    machine = machine_info(root)
    print(
        f"checkpoint root {root} ({machine['fs_type']}); {machine['nproc']} CPUs, "
        f"{machine['mem_bytes'] / GB:.1f} GB RAM, kernel {machine['kernel']}, "
        f"CRIU {machine['criu']}"
    )
    results = []
    try:
        for size in sizes:
            rep = args.repeat if size < 2 or args.repeat_large is None else args.repeat_large
            results.append(await bench_size(size, rep, root, cold_ok, args.fast_nudge))
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    targets = check_targets(results)
    print_table(results, targets)
    machine["loadavg_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": machine,
                "root": str(root),
                "args": vars(args),
                "results": results,
                "targets": targets,
            },
            indent=1,
        )
    )
    print(f"\nwrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.1,1,4", help="kernel sizes in GB (comma-separated)")
    ap.add_argument("--repeat", type=int, default=3, help="repeats per size")
    ap.add_argument(
        "--repeat-large",
        type=int,
        default=None,
        help="repeats for sizes >= 2 GB (default: --repeat)",
    )
    ap.add_argument("--root", help="checkpoint root (default: a fresh dir under /var/tmp)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "suspend.json"))
    ap.add_argument(
        "--fast-nudge",
        type=float,
        default=0,
        help="also run a warm resume whose IOPub confirmation retries every this "
        "many seconds instead of 0.5 (0: skip)",
    )
    ap.add_argument("--quick", action="store_true", help="0.1 GB only, 1 repeat (CI smoke)")
    args = ap.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
