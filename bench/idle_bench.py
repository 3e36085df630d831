"""Resume after an idle while: the kernel's memory has gone back to the host.

On a VM whose balloon driver reports free pages (virtio-balloon free page reporting, as
on the machine of docs/benchmarks.md), memory a suspend frees goes back to the host
within seconds, and taking it again costs a host fault per page. A kernel resumed after
minutes of idleness pays that for every page it gets back; suspend_bench.py, resuming at
once, mostly does not. Each repeat, for a kernel of about N GB:

  lazy     suspend, wait IDLE s, drop caches, lazy resume(): first output (a cell touching
           almost nothing, after the gate's IOPub confirmation) and all pages in, with
           where the first output's wait went (checks before CRIU, CRIU, IOPub);
  whole    the same with a whole restore: first output (every page in by then);
  touch    suspend, wait IDLE s, then map as many bytes of fresh memory (4 KiB pages, as a
           restore gives them) and write one byte per page: the cost of taking that
           memory from the host, with no disk and no CRIU;
  read     wait IDLE s again, a plain cold read of as many bytes (the file written with
           O_DIRECT before the wait) into one reused buffer.

Lazy and whole alternate which goes first. Needs root (CRIU, drop_caches).

Usage: python bench/idle_bench.py [--sizes 1,8] [--repeat 2] [--idle 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (
    GB,
    can_drop_caches,
    drop_caches,
    engine_at,
    fill,
    machine_info,
    med,
    plain_read,
    plain_write_fsync,
    resume_after_idle,
    start_kernel,
    stop_kernel,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = mmap.PAGESIZE


def touch_fresh(nbytes: int) -> float:
    """Seconds to fault in `nbytes` of new anonymous memory, one write per 4 KiB page."""
    m = mmap.mmap(-1, nbytes)
    try:
        m.madvise(mmap.MADV_NOHUGEPAGE)  # a restore maps 4 KiB pages (UFFDIO_COPY, CRIU)
        view = memoryview(m).cast("B")
        t = time.perf_counter()
        for off in range(0, nbytes, PAGE):
            view[off] = 1
        took = time.perf_counter() - t
        view.release()
        return took
    finally:
        m.close()


async def baselines(km: Any, root: Path, nbytes: int, idle: float) -> dict[str, float]:
    prov = km.provisioner
    plain = root / "plain-io.bin"
    plain_write_fsync(plain, nbytes, direct=True)
    await prov.suspend(tier="disk")
    try:
        await asyncio.sleep(idle)
        touch_s = touch_fresh(nbytes)
        await asyncio.sleep(idle)
        drop_caches()
        read_s = plain_read(plain)
    finally:
        plain.unlink()
        await prov.resume()
        await prov.memory_loaded()
    return {"touch_fresh_s": touch_s, "plain_read_s": read_s}


async def bench_size(size: float, repeat: int, idle: float, root: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cedana-bench-work-"))
    km, kc = await start_kernel(root, work)
    rows: list[dict[str, Any]] = []
    try:
        await fill(kc, km.provisioner.pid, int(size * GB))
        print(f"\n== {size:g} GB kernel, resumed {idle:g} s after its suspend", flush=True)
        for i in range(repeat):
            r: dict[str, Any] = {"repeat": i}
            for lazy in (True, False) if i % 2 == 0 else (False, True):
                step = await resume_after_idle(km, kc, idle, lazy)
                r.update({f"{'lazy' if lazy else 'whole'}_{k}": v for k, v in step.items()})
            r.update(await baselines(km, root, r["lazy_image_bytes"], idle))
            rows.append(r)
            print(
                f"  [{i}] lazy: first output {r['lazy_first_output_s']:.3f} s (checks "
                f"{r['lazy_check_s']:.3f}, CRIU {r['lazy_restore_s']:.3f}, IOPub "
                f"{r['lazy_iopub_s']:.3f}), all in "
                f"{r['lazy_all_in_s']:.3f} s | whole: first output "
                f"{r['whole_first_output_s']:.3f} s | fresh memory touched "
                f"{r['touch_fresh_s']:.3f} s | plain cold read {r['plain_read_s']:.3f} s",
                flush=True,
            )
    finally:
        await stop_kernel(km, kc)
        shutil.rmtree(work, ignore_errors=True)
    keys = [k for k in rows[0] if k != "repeat" and isinstance(rows[0][k], float)]
    return {
        "size_gb": size,
        "image_bytes": rows[0]["lazy_image_bytes"],
        "idle_s": idle,
        **{k: med(rows, k) for k in keys},
        "cycles": rows,
    }


async def main_async(args: argparse.Namespace) -> int:
    if not can_drop_caches():
        print("needs root (CRIU, drop_caches)")
        return 2
    root = Path(args.root or tempfile.mkdtemp(prefix="cedana-bench-", dir="/var/tmp")).resolve()
    if await engine_at(root) is None:
        return 2
    machine = machine_info(root)
    results = []
    try:
        for size in [float(x) for x in args.sizes.split(",") if x.strip()]:
            results.append(await bench_size(size, args.repeat, args.idle, root))
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{'GB':>5} | {'lazy 1st':>8} {'checks':>7} {'CRIU':>7} {'IOPub':>7} {'all in':>8} | "
        f"{'whole':>8} | {'touch':>8} {'read':>8} | {'all in / touch':>14} {'all in / read':>13}"
    )
    for s in results:
        print(
            f"{s['size_gb']:>5g} | {s['lazy_first_output_s']:>8.3f} {s['lazy_check_s']:>7.3f} "
            f"{s['lazy_restore_s']:>7.3f} {s['lazy_iopub_s']:>7.3f} {s['lazy_all_in_s']:>8.3f} | "
            f"{s['whole_first_output_s']:>8.3f} | {s['touch_fresh_s']:>8.3f} "
            f"{s['plain_read_s']:>8.3f} | {s['lazy_all_in_s'] / s['touch_fresh_s']:>14.2f} "
            f"{s['lazy_all_in_s'] / s['plain_read_s']:>13.2f}"
        )
    machine["loadavg_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine, "args": vars(args), "results": results}
    out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,8", help="kernel sizes in GB (comma-separated)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds between suspend and resume")
    ap.add_argument("--root", help="checkpoint root (default: a fresh dir under /var/tmp)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "idle.json"))
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
