"""CPU kernels: suspend (done when the image is durable) and resume (lazy: first output,
all pages in), side by side with plain file I/O of the same bytes on the same disk.

For kernels holding about 0.1, 1, 4 and 8 GB (numpy arrays of random non-zero int64:
every page resident and incompressible), through the extension's own provisioner
(CedanaProvisioner.suspend() / resume()) and real CRIU, each repeat runs:

  suspend     `sync`, then suspend(): seconds until the image is durable (files, manifest
              and directories fsynced) and the kernel killed; beside it, a plain write +
              fsync (+ directory fsync) of the same byte count, and the same with
              O_DIRECT (the disk's own speed, as the page files are written), after the
              suspend in even repeats and before it in odd ones (whichever goes second
              finds the disk still busy with the first's gigabytes). Breakdown: CRIU freezing,
              CRIU memory dump (parasite + page transfer) and page write (stats-dump),
              checksum pass after the dump, fsync, kill; frozen = from CRIU's start
              (it freezes the tree at once) until the tree is gone.
  resume      drop caches, resume() (lazy where supported): first output = from calling
              resume() until the output of a cell that touches almost no memory arrived,
              after the gate's IOPub confirmation (kernel_info on a fresh shell socket every
              0.5 s, as jupyter_server's nudge()); all pages in = from calling resume()
              until the page server had loaded every page (its own end, whenever the
              bench asks); beside it, a cold plain read of the same bytes (written
              with O_DIRECT), before the resume in odd repeats and after it in even ones.
  touch-all   suspend, drop caches, resume, then at once a cell that reads every page of
              the array: seconds from resume() until its output arrived; the same with a whole
              (eager) restore, as before lazy restore.

Every value printed after a restore is checked against the one before the suspend.
Medians over the repeats; targets (DESIGN.md "Performance targets", issue 10) printed as
PASS/MISS with the ratio. Cold-cache steps need root (drop_caches).

Usage: python bench/suspend_bench.py [--sizes 0.1,1,4,8] [--repeat 3] [--root DIR]
                                     [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (
    GB,
    PROBE,
    SMALL,
    TOUCH_ALL,
    can_drop_caches,
    confirm_iopub,
    drop_caches,
    engine_at,
    fill,
    machine_info,
    med,
    output_of,
    plain_cold_read,
    plain_write_fsync,
    run,
    start_kernel,
    stop_kernel,
)

ROOT = Path(__file__).resolve().parent.parent
_DAEMON = re.compile(
    r"in (?P<s>[\d.]+) s: read (?P<read>[\d.]+) s, crc (?P<crc>[\d.]+) s \((?P<how>\w+)\), "
    r"copy (?P<copy>[\d.]+) s, (?P<faults>\d+) faults"
)


def page_server_log(prov: Any) -> dict[str, Any]:
    """The page server's own account of its last transfer (its log in the work dir)."""
    log = prov.engine.store.work_dir(prov.kernel_id_str) / "pages.log"
    try:
        m = _DAEMON.search(log.read_text())
    except OSError:
        return {}
    if not m:
        return {}
    return {
        "pages_s": float(m["s"]),
        "pages_read_s": float(m["read"]),
        "pages_crc_s": float(m["crc"]),
        "pages_copy_s": float(m["copy"]),
        "pages_faults": int(m["faults"]),
        "crc": m["how"],
    }


async def suspend_step(prov: Any, root: Path, plain_first: bool, guess: int) -> dict[str, Any]:
    """Suspend and a plain write+fsync of as many bytes, in turns first: right after
    gigabytes were written, the disk (its host's cache) may still be busy with them."""
    plain = root / "plain-io.bin"

    def plain_io(nbytes: int) -> tuple[float, float, float]:
        os.sync()
        write_s, durable_s = plain_write_fsync(plain, nbytes)
        plain.unlink()
        os.sync()
        _, direct_s = plain_write_fsync(plain, nbytes, direct=True)
        plain.unlink()
        return write_s, durable_s, direct_s

    if plain_first:
        write_s, plain_durable_s, direct_s = plain_io(guess)
    os.sync()  # no dirty pages of earlier steps: the same start as the plain write
    t = time.perf_counter()
    await prov.suspend(tier="disk")
    suspend_s = time.perf_counter() - t
    manifest = prov.engine.store.read_manifest(prov.kernel_id_str)
    image = int(manifest["total_bytes"])
    if not plain_first:
        write_s, plain_durable_s, direct_s = plain_io(image)
    b = prov.last_suspend_breakdown or {}
    return {
        "image_bytes": image,
        "zero_bytes": manifest.get("zero_bytes", 0),
        "suspend_s": suspend_s,
        # From calling suspend() until the image was durable: all but the kill after it.
        "durable_s": suspend_s - float(b.get("kill_s", 0.0)),
        "plain_write_s": write_s,
        "plain_write_fsync_s": plain_durable_s,
        "direct_write_fsync_s": direct_s,
        **{k: v for k, v in b.items() if isinstance(v, int | float)},
    }


async def resume_step(
    km: Any, kc: Any, root: Path, image: int, cold: bool, plain_first: bool
) -> dict[str, Any]:
    """Resume and a plain cold read of as many bytes, in turns first: on a VM whose host
    takes back free memory (virtio-balloon free page reporting, as here), memory freed
    seconds ago costs 1-2 s per GB to touch again and memory freed just now almost
    nothing, so whichever runs second would find the pages the first freed."""
    prov = km.provisioner
    if plain_first:
        plain_read_s = plain_cold_read(root, image, cold)
    if cold:
        drop_caches()
    t0, t0_mono = time.perf_counter(), time.monotonic()
    await prov.resume()
    resume_s = time.perf_counter() - t0
    await confirm_iopub(km, kc)
    iopub_s = time.perf_counter() - t0
    arrived, out = await output_of(kc, SMALL)
    first_s = arrived - t0
    if out != "42":
        raise RuntimeError(f"unexpected output {out!r}")
    await prov.memory_loaded()
    # When the page server had every page in (not when we got round to asking).
    in_at = prov.last_memory_in_at  # None: restored whole, all in when resume() returned
    all_in_s = in_at - t0_mono if in_at is not None else resume_s
    row = {
        "resume_s": resume_s,
        "iopub_s": iopub_s - resume_s,
        "execute_s": first_s - iopub_s,
        "first_output_s": first_s,
        "all_in_s": all_in_s,
        **{f"resume_{k}": v for k, v in (prov.last_resume_breakdown or {}).items()},
    }
    if row.get("resume_lazy"):
        row.update(page_server_log(prov))
    row["plain_read_s"] = plain_read_s if plain_first else plain_cold_read(root, image, cold)
    return row


async def touch_all_step(km: Any, kc: Any, expect_sum: str, lazy: bool, cold: bool) -> float:
    """Resume, then at once a cell that reads all the array: seconds to its output."""
    prov = km.provisioner
    prov.engine.lazy_restore = lazy
    try:
        await prov.suspend(tier="disk")
        if cold:
            drop_caches()
        t0 = time.perf_counter()
        await prov.resume()
        await confirm_iopub(km, kc)
        arrived, out = await output_of(kc, TOUCH_ALL)
        took = arrived - t0
        await prov.memory_loaded()
    finally:
        prov.engine.lazy_restore = True
    if out != expect_sum:
        raise RuntimeError(f"state after resume differs: {out!r} != {expect_sum!r}")
    return took


async def bench_size(size_gb: float, repeat: int, root: Path, cold: bool) -> dict[str, Any]:
    from jupyter_cedana.checkpoint.dumping import tree_rss

    workdir = Path(tempfile.mkdtemp(prefix="cedana-bench-work-"))
    km, kc = await start_kernel(root, workdir)
    prov = km.provisioner
    rows: list[dict[str, Any]] = []
    try:
        expect = await fill(kc, prov.pid, int(size_gb * GB))
        expect_sum = (await run(kc, TOUCH_ALL)).strip()
        rss = tree_rss(prov.pid)
        print(f"\n== {size_gb:g} GB kernel: RSS {rss / GB:.3f} GB", flush=True)
        for i in range(repeat):
            r: dict[str, Any] = {"repeat": i}
            guess = rows[-1]["image_bytes"] if rows else rss
            r.update(await suspend_step(prov, root, i % 2 == 1, guess))
            r.update(await resume_step(km, kc, root, r["image_bytes"], cold, i % 2 == 1))
            if (await run(kc, PROBE)).strip() != expect:
                raise RuntimeError("state after resume differs")
            r["touch_all_lazy_s"] = await touch_all_step(km, kc, expect_sum, True, cold)
            r["touch_all_eager_s"] = await touch_all_step(km, kc, expect_sum, False, cold)
            rows.append(r)
            print(
                f"  [{i}] {r['image_bytes'] / GB:.3f} GB: durable {r['durable_s']:.3f} s, "
                f"with kill {r['suspend_s']:.3f} s "
                f"(plain write+fsync {r['plain_write_fsync_s']:.3f} s, O_DIRECT "
                f"{r['direct_write_fsync_s']:.3f} s, frozen "
                f"{r.get('frozen_s', 0):.3f} s) | first output {r['first_output_s']:.3f} s, "
                f"all in {r['all_in_s']:.3f} s (plain read {r['plain_read_s']:.3f} s) | "
                f"touch-all lazy {r['touch_all_lazy_s']:.3f} s, eager "
                f"{r['touch_all_eager_s']:.3f} s",
                flush=True,
            )
    finally:
        await stop_kernel(km, kc)
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(size_gb, rss, rows)


KEYS = (
    "image_bytes",
    "zero_bytes",
    "suspend_s",
    "durable_s",
    "plain_write_s",
    "plain_write_fsync_s",
    "direct_write_fsync_s",
    "frozen_s",
    "before_dump_s",
    "dump_s",
    "criu_freezing_s",
    "criu_frozen_s",
    "criu_memdump_s",
    "criu_memwrite_s",
    "checksum_s",
    "fsync_s",
    "commit_s",
    "kill_s",
    "resume_s",
    "resume_check_s",
    "resume_restore_s",
    "resume_continue_s",
    "iopub_s",
    "execute_s",
    "first_output_s",
    "all_in_s",
    "plain_read_s",
    "pages_s",
    "pages_read_s",
    "pages_crc_s",
    "pages_copy_s",
    "pages_faults",
    "touch_all_lazy_s",
    "touch_all_eager_s",
)


def summarize(size_gb: float, rss: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    s: dict[str, Any] = {"size_gb": size_gb, "kernel_rss_bytes": rss, "repeats": len(rows)}
    for key in KEYS:
        s[key] = med(rows, key)
    # Ratios per repeat (side by side), then their median.
    # A suspend is done when its image is durable; the kill (the kernel's memory being
    # freed) comes after it and is shown on its own.
    s["suspend_vs_plain"] = med(
        [{"x": r["plain_write_fsync_s"] / r["durable_s"]} for r in rows], "x"
    )
    # The disk's own speed: the same bytes written with O_DIRECT, as the page files are.
    s["suspend_vs_direct"] = med(
        [{"x": r["direct_write_fsync_s"] / r["durable_s"]} for r in rows], "x"
    )
    s["all_in_vs_plain_read"] = med([{"x": r["all_in_s"] / r["plain_read_s"]} for r in rows], "x")
    s["touch_all_lazy_vs_eager"] = med(
        [{"x": r["touch_all_lazy_s"] / r["touch_all_eager_s"]} for r in rows], "x"
    )
    s["cycles"] = rows
    return s


def check_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, higher_is_better: bool) -> None:
        if value is None:
            return
        ok = value >= limit if higher_is_better else value <= limit
        out.append({"target": name, "value": value, "limit": limit, "pass": ok})

    for s in results:
        g = f"{s['image_bytes'] / GB:.2f} GB"
        add(f"{g}: suspend throughput / plain write+fsync >= 0.9", s["suspend_vs_plain"], 0.9, True)
        add(f"{g}: cold resume to first output < 0.5 s", s["first_output_s"], 0.5, False)
        add(f"{g}: all pages in / plain cold read <= 1.2", s["all_in_vs_plain_read"], 1.2, False)
        add(
            f"{g}: touch-all cell, lazy / whole restore <= 1.2",
            s["touch_all_lazy_vs_eager"],
            1.2,
            False,
        )
        if s["image_bytes"] < 0.25 * GB:
            add(f"{g}: suspend < 0.3 s", s["suspend_s"], 0.3, False)
    return out


def print_tables(results: list[dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    def f(v: float | None, w: int = 7, p: int = 3) -> str:
        return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"

    print(
        f"\n{'image':>6} | {'durable':>7} {'w+fsync':>7} {'ratio':>5} {'direct':>7} {'ratio':>5} "
        f"{'+kill':>7} {'frozen':>7} | "
        f"{'1st out':>7} {'all in':>7} {'read':>7} {'ratio':>5} | {'touch L':>7} "
        f"{'touch E':>7} {'ratio':>5}"
    )
    print(
        f"{'GB':>6} | {'s':>7} {'s':>7} {'>=0.9':>5} {'s':>7} {'':>5} {'s':>7} {'s':>7} | "
        f"{'<0.5 s':>7} {'s':>7} "
        f"{'s':>7} "
        f"{'<=1.2':>5} | {'s':>7} {'s':>7} {'<=1.2':>5}"
    )
    for s in results:
        print(
            f"{s['image_bytes'] / GB:>6.2f} | {f(s['durable_s'])} {f(s['plain_write_fsync_s'])} "
            f"{f(s['suspend_vs_plain'], 5, 2)} {f(s['direct_write_fsync_s'])} "
            f"{f(s['suspend_vs_direct'], 5, 2)} {f(s['suspend_s'])} {f(s['frozen_s'])} | "
            f"{f(s['first_output_s'])} "
            f"{f(s['all_in_s'])} {f(s['plain_read_s'])} {f(s['all_in_vs_plain_read'], 5, 2)} | "
            f"{f(s['touch_all_lazy_s'])} {f(s['touch_all_eager_s'])} "
            f"{f(s['touch_all_lazy_vs_eager'], 5, 2)}"
        )
    print(
        "\nSuspend breakdown (s): CRIU freezing, memory dump (parasite + transfer), page "
        "write, checksum after dump, fsync, kill"
    )
    print(
        "Resume breakdown (s): checks before CRIU, CRIU restore, continue; page server "
        "read, crc, copy (summed over its threads), faults"
    )
    for s in results:
        print(
            f"{s['image_bytes'] / GB:>6.2f} | {f(s['criu_freezing_s'])} {f(s['criu_memdump_s'])} "
            f"{f(s['criu_memwrite_s'])} {f(s['checksum_s'])} {f(s['fsync_s'])} "
            f"{f(s['kill_s'])} | {f(s['resume_check_s'])} {f(s['resume_restore_s'])} "
            f"{f(s['resume_continue_s'])} | {f(s['pages_read_s'])} {f(s['pages_crc_s'])} "
            f"{f(s['pages_copy_s'])} {f(s['pages_faults'], 7, 0)}"
        )
    print("\nTargets:")
    for t in targets:
        print(
            f"  {'PASS' if t['pass'] else 'MISS'}  {t['target']}: {t['value']:.3f} "
            f"(limit {t['limit']:.3f})"
        )


async def main_async(args: argparse.Namespace) -> int:
    if args.quick:
        args.sizes, args.repeat = "0.1", 1
    sizes = [float(x) for x in args.sizes.split(",") if x.strip()]
    root = Path(args.root or tempfile.mkdtemp(prefix="cedana-bench-", dir="/var/tmp")).resolve()
    engine = await engine_at(root, stream_dump=not args.no_stream)
    if engine is None:
        return 2
    print(f"lazy restore: {engine.lazy_unsupported() or 'yes'}")
    cold = can_drop_caches()
    if not cold:
        print("not root: caches are not dropped (warm-cache numbers)")
    machine = machine_info(root)
    print(
        f"checkpoint root {root} ({machine['fs_type']}); {machine['nproc']} CPUs, "
        f"{machine['mem_bytes'] / GB:.1f} GB RAM, kernel {machine['kernel']}, "
        f"CRIU {machine['criu']}"
    )
    results = []
    try:
        for size in sizes:
            results.append(await bench_size(size, args.repeat, root, cold))
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    targets = check_targets(results)
    print_tables(results, targets)
    machine["loadavg_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine, "args": vars(args), "results": results, "targets": targets}
    out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.1,1,4,8", help="kernel sizes in GB (comma-separated)")
    ap.add_argument("--repeat", type=int, default=3, help="repeats per size")
    ap.add_argument(
        "--no-stream",
        action="store_true",
        help="CRIU writes the image files itself (CheckpointEngine.stream_dump = False)",
    )
    ap.add_argument("--root", help="checkpoint root (default: a fresh dir under /var/tmp)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "suspend.json"))
    ap.add_argument("--quick", action="store_true", help="0.1 GB only, 1 repeat (CI smoke)")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
