"""One engine setting at two values, side by side: durable suspend, lazy resume to first
output, all in.

For each size, one kernel is suspended and resumed REPEAT times with the CheckpointEngine
setting SWITCH at each of its VALUES (default: a boolean on and off), alternating which
goes first. Before each resume: IDLE s of waiting (0: none), then `drop_caches` (the
image, and the kernel's libraries too, as after a long idle on a busy machine). Each
suspend is timed until its image is durable (as suspend_bench.py), each
resume to its first output, split as idle_bench.py does (the checks before
CRIU, `criu restore`, the gate's IOPub confirmation), and to all pages in; beside each
pair, a plain cold read of as many bytes (turns first with the resumes: on a VM whose
host takes back free memory, whichever runs second finds the memory the first freed).
Needs root (CRIU, drop_caches).

Usage: python bench/switch_bench.py [--switch restore_read_ahead] [--values on,off]
       [--sizes 1,4] [--repeat 4] [--idle 0] [--json PATH]
       python bench/switch_bench.py --switch lazy_copy_threads --values 4,1 --sizes 4,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (
    GB,
    can_drop_caches,
    engine_at,
    fill,
    machine_info,
    med,
    parse_values,
    plain_cold_read,
    resume_after_idle,
    start_kernel,
    stop_kernel,
)

ROOT = Path(__file__).resolve().parent.parent
KEYS = (
    "first_output_s",
    "all_in_s",
    "all_in_vs_read",
    "check_s",
    "restore_s",
    "iopub_s",
    "durable_s",
)


async def bench_size(
    size: float, switch: str, values: list[Any], repeat: int, idle: float, root: Path
) -> dict:
    work = Path(tempfile.mkdtemp(prefix="cedana-bench-work-"))
    km, kc = await start_kernel(root, work)
    engine = km.provisioner.engine
    rows: dict[str, list[dict[str, Any]]] = {str(v): [] for v in values}
    try:
        await fill(kc, km.provisioner.pid, int(size * GB))
        print(f"\n== {size:g} GB kernel, {switch} = {values[0]} and {values[1]}", flush=True)
        for i in range(repeat):
            for value in values if i % 2 == 0 else values[::-1]:
                setattr(engine, switch, value)
                read_first = (i // 2) % 2 == 1
                nbytes = int(size * GB)
                read_s = plain_cold_read(root, nbytes, True) if read_first else None
                r = await resume_after_idle(km, kc, idle, lazy=True)
                if not r["lazy"]:
                    raise RuntimeError("the resume was not lazy: nothing to compare")
                if read_s is None:
                    read_s = plain_cold_read(root, r["image_bytes"], True)
                r["plain_read_s"] = read_s
                r["all_in_vs_read"] = r["all_in_s"] / read_s
                rows[str(value)].append(r)
                print(
                    f"  [{i}] {switch}={value}: suspend {r['durable_s']:.3f} s, "
                    f"first output {r['first_output_s']:.3f} s "
                    f"(checks {r['check_s']:.3f}, CRIU {r['restore_s']:.3f}, IOPub "
                    f"{r['iopub_s']:.3f}), all in {r['all_in_s']:.3f} s (plain cold read "
                    f"{read_s:.3f} s{', first' if read_first else ''})",
                    flush=True,
                )
    finally:
        setattr(engine, switch, engine.traits()[switch].default_value)
        await stop_kernel(km, kc)
        shutil.rmtree(work, ignore_errors=True)
    return {
        "size_gb": size,
        "values": [str(v) for v in values],
        **{f"{v}_{k}": med(rows[str(v)], k) for v in values for k in KEYS},
        "cycles": rows,
    }


async def main_async(args: argparse.Namespace) -> int:
    if not can_drop_caches():
        print("needs root (CRIU, drop_caches)")
        return 2
    root = Path(args.root or tempfile.mkdtemp(prefix="cedana-bench-", dir="/var/tmp")).resolve()
    engine = await engine_at(root)
    if engine is None:
        return 2
    trait = engine.traits().get(args.switch)
    values = parse_values(trait, args.values) if trait is not None else None
    if trait is None or not trait.metadata.get("config") or values is None:
        print(f"CheckpointEngine.{args.switch} does not take the two values {args.values!r}")
        return 2
    machine = machine_info(root)
    results = []
    try:
        for size in [float(x) for x in args.sizes.split(",") if x.strip()]:
            results.append(
                await bench_size(size, args.switch, values, args.repeat, args.idle, root)
            )
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    a, b = values
    print(f"\nmedians (s; all in / read: of the per-resume ratios), {args.switch} = {a} / {b}")
    heads = ("first output", "all in", "all in / read", "checks", "CRIU", "IOPub", "suspend")
    print(f"{'GB':>5} | " + " | ".join(f"{h:>15}" for h in heads))
    for s in results:
        print(
            f"{s['size_gb']:>5g} | "
            + " | ".join(f"{s[f'{a}_{k}']:>6.3f} / {s[f'{b}_{k}']:<6.3f}".rjust(15) for k in KEYS)
        )
    machine["loadavg_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"machine": machine, "args": vars(args), "results": results}, indent=1)
    )
    print(f"\nwrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", default="restore_read_ahead", help="a CheckpointEngine setting")
    ap.add_argument("--values", default="on,off", help="its two values (comma-separated)")
    ap.add_argument("--sizes", default="1,4", help="kernel sizes in GB (comma-separated)")
    ap.add_argument("--repeat", type=int, default=4, help="resumes each way per size")
    ap.add_argument("--idle", type=float, default=0.0, help="seconds between suspend and resume")
    ap.add_argument("--root", help="checkpoint root (default: a fresh dir under /var/tmp)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "switch.json"))
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
