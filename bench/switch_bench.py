"""One engine switch on and off, side by side: lazy resume to first output.

For each size, one kernel is suspended and resumed REPEAT times with the boolean
CheckpointEngine setting SWITCH on and as many times off, alternating which goes first.
Before each resume: IDLE s of waiting (0: none), then `drop_caches` (the image, and the
kernel's libraries too, as after a long idle on a busy machine). Each resume is timed to
its first output, and split as idle_bench.py does: the checks before CRIU, `criu
restore`, the gate's IOPub confirmation. Needs root (CRIU, drop_caches).

Usage: python bench/switch_bench.py [--switch restore_read_ahead] [--sizes 1,4]
       [--repeat 4] [--idle 0] [--json PATH]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (
    GB,
    can_drop_caches,
    engine_at,
    fill,
    machine_info,
    med,
    resume_after_idle,
    start_kernel,
    stop_kernel,
)

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("first_output_s", "check_s", "restore_s", "iopub_s")


async def bench_size(size: float, switch: str, repeat: int, idle: float, root: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix="cedana-bench-work-"))
    km, kc = await start_kernel(root, work)
    engine = km.provisioner.engine
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        await fill(kc, km.provisioner.pid, int(size * GB))
        print(f"\n== {size:g} GB kernel, {switch} on and off", flush=True)
        for i in range(repeat):
            for value in (True, False) if i % 2 == 0 else (False, True):
                setattr(engine, switch, value)
                r = await resume_after_idle(km, kc, idle, lazy=True)
                if not r["lazy"]:
                    raise RuntimeError("the resume was not lazy: nothing to compare")
                rows[value].append(r)
                print(
                    f"  [{i}] {switch}={value}: first output {r['first_output_s']:.3f} s "
                    f"(checks {r['check_s']:.3f}, CRIU {r['restore_s']:.3f}, IOPub "
                    f"{r['iopub_s']:.3f})",
                    flush=True,
                )
    finally:
        setattr(engine, switch, engine.traits()[switch].default_value)
        await stop_kernel(km, kc)
        shutil.rmtree(work, ignore_errors=True)
    return {
        "size_gb": size,
        **{f"{'on' if v else 'off'}_{k}": med(rows[v], k) for v in (True, False) for k in KEYS},
        "cycles": {"on": rows[True], "off": rows[False]},
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
    if trait is None or not isinstance(trait.default_value, bool):
        print(f"CheckpointEngine.{args.switch} is not a boolean setting")
        return 2
    machine = machine_info(root)
    results = []
    try:
        for size in [float(x) for x in args.sizes.split(",") if x.strip()]:
            results.append(await bench_size(size, args.switch, args.repeat, args.idle, root))
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nmedians (s), {args.switch} on / off")
    print(f"{'GB':>5} | {'first output':>15} | {'checks':>15} | {'CRIU':>15} | {'IOPub':>15}")
    for s in results:
        print(
            f"{s['size_gb']:>5g} | "
            + " | ".join(f"{s['on_' + k]:>6.3f} / {s['off_' + k]:<6.3f}".rjust(15) for k in KEYS)
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
    ap.add_argument("--switch", default="restore_read_ahead", help="a boolean engine setting")
    ap.add_argument("--sizes", default="1,4", help="kernel sizes in GB (comma-separated)")
    ap.add_argument("--repeat", type=int, default=4, help="resumes each way per size")
    ap.add_argument("--idle", type=float, default=0.0, help="seconds between suspend and resume")
    ap.add_argument("--root", help="checkpoint root (default: a fresh dir under /var/tmp)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "switch.json"))
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
