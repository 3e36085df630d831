"""Many kernels at once: a policy tick suspending 10 idle kernels, and a JupyterLab
workspace resuming 10 kernels, each through the provisioner API, with at most N
transitions running together (an asyncio.Semaphore stands for the server's concurrency
limit; N=1 is one by one).

For each N: suspend all 10 (each done when its image is durable), drop caches, then resume
all 10 and run a small cell in each (first output after the gate's IOPub confirmation),
then wait until every kernel's memory is in. Reported: total time, the slowest kernel's
time (from the start of the batch until that kernel was done), and the machine's memory
peaks while it ran (used = MemTotal - MemAvailable, page cache, dirty + writeback, swap,
OOM kills): suspending must not push the machine into swapping or the OOM killer.

--switch NAME --values A,B: every batch twice, with the CheckpointEngine setting NAME at
A and at B, alternating which goes first (e.g. lazy_copy_threads 4 against 1).

Usage: python bench/many_bench.py [--kernels 10] [--size 0.5] [--limits 1,2,4,10]
                                  [--repeat 2] [--switch NAME --values A,B] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
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
    MemorySampler,
    can_drop_caches,
    confirm_iopub,
    drop_caches,
    engine_at,
    fill,
    machine_info,
    oom_kills,
    output_of,
    parse_values,
    run,
    start_kernel,
    stop_kernel,
)

ROOT = Path(__file__).resolve().parent.parent


async def batch(kernels: list[tuple[Any, Any]], limit: int, step: Any) -> dict[str, Any]:
    """Run `step(km, kc)` for every kernel, at most `limit` at a time."""
    gate = asyncio.Semaphore(limit)
    t0 = time.perf_counter()
    done_at: list[float] = []
    own: list[float] = []

    async def one(km: Any, kc: Any) -> None:
        async with gate:
            t = time.perf_counter()
            await step(km, kc)
            own.append(time.perf_counter() - t)
            done_at.append(time.perf_counter() - t0)

    oom = oom_kills()
    with MemorySampler() as mem:
        await asyncio.gather(*(one(km, kc) for km, kc in kernels))
    return {
        "total_s": time.perf_counter() - t0,
        "slowest_done_s": max(done_at),
        "slowest_own_s": max(own),
        "median_own_s": statistics.median(own),
        "mem_start": mem.start,
        "mem_peak": mem.peak,
        "oom_kills": oom_kills() - oom,
    }


async def suspend(km: Any, kc: Any) -> None:
    await km.provisioner.suspend(tier="disk")


async def resume(km: Any, kc: Any) -> None:
    await km.provisioner.resume()
    await confirm_iopub(km, kc)
    _, out = await output_of(kc, SMALL)
    if out != "42":
        raise RuntimeError(f"unexpected output {out!r}")


async def loaded(km: Any, kc: Any) -> None:
    await km.provisioner.memory_loaded()


async def main_async(args: argparse.Namespace) -> int:
    root = Path(args.root or tempfile.mkdtemp(prefix="cedana-many-", dir="/var/tmp")).resolve()
    engine = await engine_at(root, stream_dump=not args.no_stream)
    if engine is None:
        return 2
    values: list[Any] = [None]
    if args.switch:
        trait = engine.traits().get(args.switch)
        got = parse_values(trait, args.values) if trait is not None else None
        if trait is None or not trait.metadata.get("config") or got is None:
            print(f"CheckpointEngine.{args.switch} does not take the two values {args.values!r}")
            return 2
        values = got
    cold = can_drop_caches()
    machine = machine_info(root)
    print(
        f"{args.kernels} kernels of {args.size:g} GB; lazy restore: "
        f"{engine.lazy_unsupported() or 'yes'}; {machine['nproc']} CPUs, "
        f"{machine['mem_bytes'] / GB:.1f} GB RAM"
    )
    workdir = Path(tempfile.mkdtemp(prefix="cedana-many-work-"))
    kernels: list[tuple[Any, Any]] = []
    expect: list[str] = []
    results: list[dict[str, Any]] = []
    try:
        for _ in range(args.kernels):
            km, kc = await start_kernel(root, workdir)
            kernels.append((km, kc))
            expect.append(await fill(kc, km.provisioner.pid, int(args.size * GB)))
        limits = [int(x) for x in args.limits.split(",")]
        for rep in range(args.repeat):
            for limit, value in (
                (limit, value)
                for limit in limits
                for value in (values if rep % 2 == 0 else values[::-1])
            ):
                if args.switch:
                    setattr(engine, args.switch, value)
                os.sync()
                s = await batch(kernels, limit, suspend)
                image = sum(km.provisioner.checkpoint_bytes for km, _ in kernels)
                if cold:
                    drop_caches()
                r = await batch(kernels, limit, resume)
                l_ = await batch(kernels, args.kernels, loaded)
                for (_km, kc), want in zip(kernels, expect, strict=True):
                    if (await run(kc, PROBE)).strip() != want:
                        raise RuntimeError("a kernel's state differs after resume")
                row = {
                    "limit": limit,
                    "value": None if value is None else str(value),
                    "repeat": rep,
                    "image_bytes": image,
                    "suspend": s,
                    "resume": r,
                    "all_in_after_resume_s": l_["total_s"],
                }
                results.append(row)
                print(
                    f"[{rep}] N={limit:>2}{'' if value is None else f' {args.switch}={value}'}:"
                    f" suspend total {s['total_s']:.2f} s, slowest "
                    f"{s['slowest_done_s']:.2f} s, peak used {s['mem_peak']['used'] / GB:.1f} GB "
                    f"cache {s['mem_peak']['cached'] / GB:.1f} GB dirty "
                    f"{s['mem_peak']['dirty'] / GB:.2f} GB swap {s['mem_peak']['swap_used']} "
                    f"oom {s['oom_kills']} | resume to first output total {r['total_s']:.2f} s,"
                    f" slowest {r['slowest_done_s']:.2f} s, peak used "
                    f"{r['mem_peak']['used'] / GB:.1f} GB cache "
                    f"{r['mem_peak']['cached'] / GB:.1f} GB | all in +{l_['total_s']:.2f} s",
                    flush=True,
                )
    finally:
        for km, kc in kernels:
            await stop_kernel(km, kc)
        shutil.rmtree(workdir, ignore_errors=True)
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)

    def medof(key: tuple[int, str | None], path: tuple[str, ...]) -> float:
        vals = []
        for row in results:
            if (row["limit"], row["value"]) == key:
                v: Any = row
                for p in path:
                    v = v[p]
                vals.append(v)
        return statistics.median(vals)

    print(
        f"\n{'N':>3}{f' {args.switch:>18}' if args.switch else ''} | "
        f"{'suspend total':>13} {'slowest':>8} {'peak used':>9} {'cache':>6} "
        f"{'dirty':>6} | {'resume total':>12} {'slowest':>8} {'peak used':>9} | {'all in':>6}"
    )
    summary = []
    for key in sorted({(r["limit"], r["value"]) for r in results}, key=str):
        row = {
            "limit": key[0],
            "value": key[1],
            "suspend_total_s": medof(key, ("suspend", "total_s")),
            "suspend_slowest_s": medof(key, ("suspend", "slowest_done_s")),
            "suspend_peak_used_gb": medof(key, ("suspend", "mem_peak", "used")) / GB,
            "suspend_peak_cache_gb": medof(key, ("suspend", "mem_peak", "cached")) / GB,
            "suspend_peak_dirty_gb": medof(key, ("suspend", "mem_peak", "dirty")) / GB,
            "resume_total_s": medof(key, ("resume", "total_s")),
            "resume_slowest_s": medof(key, ("resume", "slowest_done_s")),
            "resume_peak_used_gb": medof(key, ("resume", "mem_peak", "used")) / GB,
            "all_in_after_s": medof(key, ("all_in_after_resume_s",)),
        }
        summary.append(row)
        print(
            f"{key[0]:>3}{f' {key[1]:>18}' if args.switch else ''} | "
            f"{row['suspend_total_s']:>13.2f} {row['suspend_slowest_s']:>8.2f} "
            f"{row['suspend_peak_used_gb']:>9.1f} {row['suspend_peak_cache_gb']:>6.1f} "
            f"{row['suspend_peak_dirty_gb']:>6.2f} | {row['resume_total_s']:>12.2f} "
            f"{row['resume_slowest_s']:>8.2f} {row['resume_peak_used_gb']:>9.1f} | "
            f"{row['all_in_after_s']:>6.2f}"
        )
    swap = max(r[k]["mem_peak"]["swap_used"] for r in results for k in ("suspend", "resume"))
    ooms = sum(r[k]["oom_kills"] for r in results for k in ("suspend", "resume"))
    print(f"swap used at most {swap} bytes; OOM kills during the runs: {ooms}")
    machine["loadavg_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"machine": machine, "args": vars(args), "summary": summary, "runs": results}, indent=1
        )
    )
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=10)
    ap.add_argument("--size", type=float, default=0.5, help="GB per kernel")
    ap.add_argument("--limits", default="1,2,4,10", help="concurrency limits to compare")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--no-stream",
        action="store_true",
        help="CRIU writes the image files itself (CheckpointEngine.stream_dump = False)",
    )
    ap.add_argument("--switch", help="a CheckpointEngine setting to compare at two values")
    ap.add_argument("--values", default="on,off", help="its two values (comma-separated)")
    ap.add_argument("--root", help="checkpoint root (default: a fresh dir under /var/tmp)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "many.json"))
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
