"""Park benchmark (issue 9): how long a real `jupyter server` takes to park N kernels
when it is stopped, against the stop deadlines of JupyterHub's spawners.

For N kernels (--kernels, default 1,5,10) each holding about --sizes GB (default 0.1,1;
a numpy int64 array, every page resident), started and filled through the server's REST
API and kernel websocket as a notebook would, this measures:

  park            the server's own "parked N of N kernel(s) in X s" (dump, checksum,
                  fsync of every image, record, detach), KernelParking.deadline set out
                  of the way (600 s) so that the whole park is timed
  stop            SIGTERM until the server process has exited (what a spawner waits for)
  adopt           a new server on the same root, from spawn until it answers HTTP
                  (adoption runs before it binds: records checked, images' checksums
                  verified, with a cold page cache when root can drop caches), next to
                  the same start on an empty root

and in the same run, on the same disk, for the same total byte count:

  write+fsync     os.write of the bytes in 8 MiB chunks into one file, then fsync

Spawner deadlines the stop is compared with: KubeSpawner's delete_grace_period (1 s by
default), Docker's stop timeout (10 s), KernelParking.deadline's default (20 s) and
LocalProcessSpawner's interrupt_timeout (30 s, SIGINT to SIGTERM).

Usage: python bench/park_bench.py [--kernels 1,5,10] [--sizes 0.1,1] [--concurrency 2]
                                  [--root DIR] [--json PATH] [--quick]
Writes bench/results/park.json by default. Needs root (CRIU), ~N x size of free RAM and
disk. Uses the tests' real-server helpers (tests/test_cli.py, tests/test_parking.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import GB, can_drop_caches, drop_caches, plain_write_fsync  # noqa: E402

from tests.test_cli import Server, start_server, stop_server, wait_ready  # noqa: E402
from tests.test_parking import execute, listed  # noqa: E402

IDLE_KERNEL_GB = 0.065  # an idle kernel with numpy imported
DEADLINES = {"kube 1 s": 1.0, "docker 10 s": 10.0, "default 20 s": 20.0, "local 30 s": 30.0}
PARKED_RE = re.compile(r"parked (\d+) of (\d+) kernel\(s\) in ([0-9.]+) s")


def write_fsync(directory: Path, nbytes: int) -> float:
    """Seconds until nbytes are written and durable, as a parked image must be."""
    path = directory / "plain-write.bin"
    took = plain_write_fsync(path, nbytes)[1]
    path.unlink()
    return took


def timed_start(base: Path, root: Path, *args: str) -> tuple[Server, float]:
    t0 = time.perf_counter()
    server = start_server(base, *args, checkpoint_root=root, wait=False)
    wait_ready(server, timeout=600)
    return server, time.perf_counter() - t0


def one(work: Path, size_gb: float, n: int, concurrency: int) -> dict[str, Any]:
    root = work / "checkpoints"
    a = start_server(
        work / "a",
        "--KernelParking.deadline=600",
        f"--KernelParking.concurrency={concurrency}",
        checkpoint_root=root,
    )
    try:
        kids = [a.start_kernel() for _ in range(n)]
        items = max(1, int((size_gb - IDLE_KERNEL_GB) * GB / 8))
        for kid in kids:
            out = execute(a, kid, f"import numpy as np; a = np.arange({items}, dtype=np.int64)")
            assert out["reply"]["status"] == "ok", out
    except BaseException:
        stop_server(a)
        raise
    os.sync()
    t0 = time.perf_counter()
    a.proc.send_signal(signal.SIGTERM)
    a.proc.wait(timeout=1200)
    stop_s = time.perf_counter() - t0
    log = a.log.read_text(errors="replace")
    m = PARKED_RE.search(log)
    assert m and m.group(1) == m.group(2) == str(n), log[-3000:]
    park_s = float(m.group(3))
    image_bytes = sum(
        json.loads((root / k / "manifest.json").read_text())["total_bytes"] for k in kids
    )

    write_s = write_fsync(root, image_bytes)

    cold = can_drop_caches()
    if cold:
        drop_caches()
    b, adopt_start_s = timed_start(work / "b", root, "--KernelParking.park_on_stop=False")
    try:
        assert listed(b) == set(kids)
        assert all(b.kernel(k)["state"] == "suspended" for k in kids)
    finally:
        stop_server(b)
    empty, empty_start_s = timed_start(work / "c", work / "empty")
    stop_server(empty)
    shutil.rmtree(root, ignore_errors=True)
    row = {
        "size_gb": size_gb,
        "kernels": n,
        "concurrency": concurrency,
        "image_bytes": image_bytes,
        "park_s": park_s,
        "stop_s": stop_s,
        "park_gb_per_s": image_bytes / GB / park_s,
        "write_fsync_s": write_s,
        "write_fsync_gb_per_s": image_bytes / GB / write_s,
        "park_vs_write": write_s / park_s,
        "adopt_start_s": adopt_start_s,
        "empty_start_s": empty_start_s,
        "adopt_cold_cache": cold,
        "fits": {name: stop_s <= limit for name, limit in DEADLINES.items()},
    }
    print(
        f"{n:>2} x {size_gb:g} GB (c={concurrency}): {image_bytes / GB:.2f} GB parked in "
        f"{park_s:.2f} s ({row['park_gb_per_s']:.2f} GB/s), stop {stop_s:.2f} s; "
        f"write+fsync {write_s:.2f} s ({row['write_fsync_gb_per_s']:.2f} GB/s, ratio "
        f"{row['park_vs_write']:.2f}); start with adoption {adopt_start_s:.2f} s vs empty "
        f"{empty_start_s:.2f} s; fits " + ", ".join(k for k, ok in row["fits"].items() if ok),
        flush=True,
    )
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| kernels x size | images | park | stop (SIGTERM→exit) | park GB/s | write+fsync "
        "| park / write+fsync | start with adoption | empty start | stop fits |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        fits = ", ".join(k for k, ok in r["fits"].items() if ok) or "none"
        lines.append(
            f"| {r['kernels']} x {r['size_gb']:g} GB (c={r['concurrency']}) "
            f"| {r['image_bytes'] / GB:.2f} GB | {r['park_s']:.2f} s | {r['stop_s']:.2f} s "
            f"| {r['park_gb_per_s']:.2f} | {r['write_fsync_s']:.2f} s "
            f"({r['write_fsync_gb_per_s']:.2f} GB/s) | {r['park_vs_write']:.2f} "
            f"| {r['adopt_start_s']:.2f} s | {r['empty_start_s']:.2f} s | {fits} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="1,5,10", help="kernel counts (comma-separated)")
    ap.add_argument("--sizes", default="0.1,1", help="kernel sizes in GB (comma-separated)")
    ap.add_argument("--concurrency", default="2", help="KernelParking.concurrency values")
    ap.add_argument("--root", help="work directory on the disk under test (default /var/tmp)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "park.json"))
    ap.add_argument("--quick", action="store_true", help="1 kernel of 0.1 GB (smoke)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("park_bench needs root (CRIU)", file=sys.stderr)
        return 2
    kernels = [1] if args.quick else [int(x) for x in args.kernels.split(",")]
    sizes = [0.1] if args.quick else [float(x) for x in args.sizes.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    base = Path(args.root) if args.root else Path("/var/tmp")
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="park-bench-", dir=base) as tmp:
        for size in sizes:
            for n in kernels:
                for c in levels:
                    work = Path(tmp) / f"{size:g}x{n}c{c}"
                    rows.append(one(work, size, n, c))
                    shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    df = subprocess.run(["df", "-h", str(base)], capture_output=True, text=True).stdout
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "load": os.getloadavg(),
        "df": df,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
