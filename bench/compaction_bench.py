"""Compaction of chains of incremental images (docs/incremental.md, *Compaction*): the disk a
kernel's checkpoint holds over many cycles, and the suspends' frozen time, with and
without compaction in the background.

A real kernel of N GB (1 by default) with CheckpointEngine.keep_base on, for each mode
(`off`: no compaction, a chain that would pass 1.2x the kernel's memory is replaced by a
whole image at the next suspend, as before; `on`: chains compacted in the background as
the server does, SuspendLimits.compact_chain_ratio 1.1): `--cycles` cycles of a cell
changing a share of its array (1.5 % by default, at another place each cycle), a
suspend, the kernel left suspended until the background work is done (a compaction, if
due), then a resume checked by the state of the array. Per cycle: the suspend's frozen
time, the chain's layers and the disk it holds (blocks, each hard-linked file once)
against the kernel's memory, right after the suspend and once the compaction is done,
and how long the compaction took.

Needs root (CRIU). Results: printed, and as JSON with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
    confirm_iopub,
    engine_at,
    fill,
    machine_info,
    run,
    start_kernel,
    stop_kernel,
)
from incremental_bench import STATE, held_on_disk


async def part_mode(
    root: Path, size_gb: float, share: float, cycles: int, on: bool
) -> dict[str, Any]:
    from jupyter_cedana.checkpoint.dumping import tree_rss
    from jupyter_cedana.checkpoint.incremental import INDEX_NAME
    from jupyter_cedana.server.kernel.compactor import compactor_for

    root.mkdir(parents=True, exist_ok=True)
    if await engine_at(root, keep_base=True) is None:
        raise RuntimeError("CRIU cannot be used here")
    workdir = Path(tempfile.mkdtemp(prefix="cedana-compaction-work-"))
    km, kc = await start_kernel(root, workdir, keep_base=True)
    prov = km.provisioner
    store = prov.engine.store
    compactor = compactor_for(store)
    compactor.ratio = 1.1 if on else 0.0  # as SuspendManager.compactor() sets it
    compactor.max_deltas = 0
    out: dict[str, Any] = {"size_gb": size_gb, "share": share, "compaction": on, "cycles": []}
    try:
        await fill(kc, prov.pid, int(size_gb * GB))
        kid = prov.kernel_id_str
        image = store.path(kid)
        for i in range(cycles):
            cell = (
                f"_k = int(a.size * {share}); _o = (a.size // 23) * {i % 22}; "
                "a[_o:_o + _k] += 1; junk = 1"
            )
            await run(kc, cell)
            expect = (await run(kc, STATE)).strip()
            memory = tree_rss(prov.pid)
            done = len(compactor.done)
            await prov.suspend()
            frozen = (prov.last_suspend_breakdown or {})["frozen_s"]
            manifest = store.read_manifest(kid)
            layers = len(store.layers(kid, manifest))
            disk = held_on_disk(image)
            t = time.monotonic()
            await compactor.idle()  # the kernel stays suspended meanwhile
            compacted = len(compactor.done) > done
            row = {
                "cycle": i + 1,
                "kind": "delta" if manifest.get("base") else "whole",
                "frozen_s": round(frozen, 3),
                "layers": layers,
                "disk_ratio": round(disk / memory, 3),
                "compacted": compacted,
                "compaction_s": round(compactor.done[-1][1].seconds, 2) if compacted else None,
                "waited_s": round(time.monotonic() - t, 2),
                "disk_ratio_after": round(held_on_disk(image) / memory, 3),
            }
            await prov.resume()
            await confirm_iopub(km, kc)
            await prov.memory_loaded()
            if (await run(kc, STATE)).strip() != expect:
                raise RuntimeError(f"the state after resume {i + 1} differs")
            row["state_ok"] = True
            out["cycles"].append(row)
            print(f"  cycle {json.dumps(row)}", flush=True)
            deadline = time.monotonic() + 600
            while not (image / INDEX_NAME).exists():  # the next suspend's base
                if time.monotonic() > deadline:
                    raise RuntimeError("the kept image was never indexed")
                await asyncio.sleep(0.1)
    finally:
        await compactor.stop()
        await stop_kernel(km, kc)
        shutil.rmtree(workdir, ignore_errors=True)
    rows = out["cycles"]
    deltas = [r["frozen_s"] for r in rows if r["kind"] == "delta"]
    wholes = [r["frozen_s"] for r in rows[1:] if r["kind"] == "whole"]
    out["summary"] = {
        "max_disk_ratio": max(r["disk_ratio"] for r in rows),
        "mean_disk_ratio_after": round(statistics.mean(r["disk_ratio_after"] for r in rows), 3),
        "whole_suspends_after_first": len(wholes),
        "delta_frozen_median_s": round(statistics.median(deltas), 3) if deltas else None,
        "whole_frozen_after_first_s": wholes,
        "compactions": sum(r["compacted"] for r in rows),
        "compaction_s": [r["compaction_s"] for r in rows if r["compacted"]],
        "state_ok": all(r["state_ok"] for r in rows),
    }
    print(f"  summary: {json.dumps(out['summary'])}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="kernel size, GB")
    ap.add_argument("--share", type=float, default=0.015, help="share of the array a cell changes")
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--root", type=Path, default=None, help="checkpoint root (the disk tested)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="cedana-compaction-bench-", dir="/var/tmp"))
    result: dict[str, Any] = {"machine": machine_info(root), "modes": []}
    try:
        for mode in args.modes.split(","):
            print(
                f"== compaction {mode}: {args.size:g} GB kernel, {args.cycles} cycles", flush=True
            )
            result["modes"].append(
                asyncio.run(
                    part_mode(
                        root / f"ckpt-{mode}", args.size, args.share, args.cycles, mode == "on"
                    )
                )
            )
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
