"""A repeat suspend after a small cell: what the options to find what changed cost here.

Part 1 (`--part hash`): per-core throughput of the hashes a content comparison could use,
over 64 KiB chunks and 4 KiB pages, next to a plain O_DIRECT write + fsync of the same
bytes on the checkpoint disk: whether reading and hashing all of a kernel's memory can be
much cheaper than writing it.

Part 2 (`--part kernel`): a real kernel of N GB (1 and 4 by default) with
CheckpointEngine.keep_base on. `--repeats` times (medians shown): suspended whole,
resumed, given a cell that changes a share of its array (1.5 % by default, one
contiguous slice), suspended again (a delta on the first image): both suspends' frozen
time and the bytes the disk wrote (from /proc/diskstats, not our counters; and the
process's own /proc/self/io), then a cold resume from that chain (first output, all
pages in) beside a plain cold read of as many bytes on the same disk; a cell's speed
before, while the kept base is indexed, and after. Then `--cycles` cycles of cell,
suspend, resume: the state after every resume, the disk the chain takes (blocks, each
hard-linked file once) against the kernel's memory; then shutdown, and whatever of the
kernel is left under the root. With --analyse, both images of each repeat are also
compared page by page at the same virtual address: how many 4 KiB pages and 64 KiB
address-aligned chunks really changed, against how many 64 KiB chunks of the page files
differ at the same file offset (what a comparison blind to addresses would write).

Needs root (CRIU). Results: printed, and as JSON with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (
    GB,
    SMALL,
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

PAGE = 4096
CHUNK = 64 << 10

HASHES = {
    "crc32": lambda b: zlib.crc32(b),
    "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "sha1": lambda b: hashlib.sha1(b).digest(),
    "md5": lambda b: hashlib.md5(b).digest(),
}


def hash_rate(fn: Any, buf: memoryview, unit: int, threads: int) -> float:
    """GB/s of `fn` over `buf` cut in `unit`s, on `threads` threads (hashlib lets go of
    the GIL for buffers over 2 KiB)."""
    n = len(buf) // unit
    parts = [range(i, n, threads) for i in range(threads)]

    def work(idx: range) -> None:
        for i in idx:
            fn(buf[i * unit : (i + 1) * unit])

    t = time.perf_counter()
    ts = [threading.Thread(target=work, args=(p,)) for p in parts]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return len(buf) / (time.perf_counter() - t) / GB


def part_hash(root: Path, mb: int) -> dict[str, Any]:
    m = mmap.mmap(-1, mb << 20)
    m.write(os.urandom(mb << 20))
    buf = memoryview(m)
    out: dict[str, Any] = {"bytes": mb << 20, "rates_gbps": {}}
    for name, fn in HASHES.items():
        for unit, uname in ((CHUNK, "64K"), (PAGE, "4K")):
            for threads in (1, 2):
                key = f"{name}/{uname}/{threads}t"
                out["rates_gbps"][key] = round(hash_rate(fn, buf, unit, threads), 3)
                print(f"  {key:22s} {out['rates_gbps'][key]:6.2f} GB/s", flush=True)
    copy = bytearray(len(buf))
    t = time.perf_counter()
    copy[:] = buf
    out["memcpy_gbps"] = round(len(buf) / (time.perf_counter() - t) / GB, 3)
    f = root / "plain.bin"
    _, s = plain_write_fsync(f, 1 << 30, direct=True)
    f.unlink()
    out["direct_write_fsync_gbps"] = round((1 << 30) / s / GB, 3)
    print(
        f"  memcpy {out['memcpy_gbps']:.2f} GB/s; O_DIRECT write+fsync "
        f"{out['direct_write_fsync_gbps']:.2f} GB/s",
        flush=True,
    )
    return out


def disk_written(path: Path) -> int:
    """Bytes the block device holding `path` has written since boot (its diskstats line,
    in 512-byte sectors): what really reached the disk, whoever wrote it."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    return int(stat[6]) * 512


def process_written() -> int:
    """Bytes this process (the capture writes the image) caused to reach storage, by the
    kernel's own accounting (/proc/self/io): what diskstats says, without the writes of
    whatever else runs on the machine."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def page_digests(images: Path) -> tuple[dict[tuple[int, int], bytes], list[bytes]]:
    """{(pid, vaddr): digest} of every present page, and the 64 KiB chunk digests of the
    page files in file order (all page files one after another)."""
    from jupyter_cedana.checkpoint.crimg import pagemap, pids

    by_addr: dict[tuple[int, int], bytes] = {}
    files_chunks: list[bytes] = []
    seen_files: set[str] = set()
    for pid in pids(images):
        for run_ in pagemap(images, pid):
            if not run_.present:
                continue
            with open(images / run_.pages_file, "rb") as f:
                f.seek(run_.offset)
                data = f.read(run_.pages * PAGE)
            for i in range(run_.pages):
                by_addr[(pid, run_.vaddr + i * PAGE)] = hashlib.blake2b(
                    data[i * PAGE : (i + 1) * PAGE], digest_size=16
                ).digest()
            if run_.pages_file not in seen_files:
                seen_files.add(run_.pages_file)
                with open(images / run_.pages_file, "rb") as f:
                    while block := f.read(CHUNK):
                        files_chunks.append(hashlib.blake2b(block, digest_size=16).digest())
    return by_addr, files_chunks


def compare(a: Any, b: Any) -> dict[str, int]:
    pa, ca = a
    pb, cb = b
    changed_pages = [k for k, d in pb.items() if pa.get(k) != d]
    chunks_b = {(pid, v // CHUNK) for pid, v in pb}
    changed_chunks = {(pid, v // CHUNK) for pid, v in changed_pages}
    offset_diff = sum(1 for i, d in enumerate(cb) if i >= len(ca) or ca[i] != d)
    return {
        "pages": len(pb),
        "pages_changed": len(changed_pages),
        "pages_new_address": sum(1 for k in pb if k not in pa),
        "addr_chunks": len(chunks_b),
        "addr_chunks_changed": len(changed_chunks),
        "file_chunks": len(cb),
        "file_chunks_differing_at_same_offset": offset_diff,
    }


def held_on_disk(path: Path) -> int:
    """Bytes the files under `path` take on the disk, each inode once (a chain's layers
    are hard links to the images they came from)."""
    seen: set[int] = set()
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
    return total


STATE = "import hashlib; print(hashlib.sha256(a.tobytes()).hexdigest())"
CELL_TIMED = (
    "import time as _t; _t0 = _t.perf_counter(); int(a.sum()); print(_t.perf_counter() - _t0)"
)


async def part_kernel(
    root: Path, size_gb: float, share: float, analyse: bool, repeats: int, cycles: int
) -> dict[str, Any]:
    """One kernel with CheckpointEngine.keep_base on. `repeats` times: a whole suspend,
    a resume, a cell changing `share` of the array, a second suspend (a delta on the
    first image): both suspends' frozen time and the bytes the disk wrote (diskstats,
    and the process's own accounting); then a cold resume from that chain (caches
    dropped): its first output and all pages in, beside a plain cold read of as many
    bytes on the same disk. Then `cycles` cycles of resume, cell, suspend: the state
    after every resume, the disk the chain takes against the kernel's memory. Then
    shutdown: nothing of the kernel left under the root."""
    from jupyter_cedana.checkpoint.dumping import tree_rss
    from jupyter_cedana.checkpoint.incremental import INDEX_NAME

    root.mkdir(parents=True, exist_ok=True)
    # The process's engine, configured before the kernel's provisioner takes it.
    if await engine_at(root, keep_base=True) is None:
        raise RuntimeError("CRIU cannot be used here")
    workdir = Path(tempfile.mkdtemp(prefix="cedana-incr-work-"))
    km, kc = await start_kernel(root, workdir, keep_base=True)
    prov = km.provisioner
    out: dict[str, Any] = {"size_gb": size_gb, "share": share, "repeats": [], "cycles": []}
    stopped = False
    try:
        await fill(kc, prov.pid, int(size_gb * GB))
        store = prov.engine.store
        kid = prov.kernel_id_str
        image = store.path(kid)
        out["memory_bytes"] = tree_rss(prov.pid)
        out["cell_s_before"] = float((await run(kc, CELL_TIMED)).strip())

        async def suspend(row: dict[str, Any], tag: str) -> Any:
            os.sync()
            w0, p0 = disk_written(root), process_written()
            t = time.perf_counter()
            s = await prov.suspend()
            took = time.perf_counter() - t
            os.sync()
            row[f"{tag}_disk_bytes"] = disk_written(root) - w0
            row[f"{tag}_process_bytes"] = process_written() - p0
            row[f"{tag}_suspend_s"] = round(took, 3)
            row[f"{tag}_frozen_s"] = round((prov.last_suspend_breakdown or {})["frozen_s"], 3)
            row[f"{tag}_image_bytes"] = s.get("checkpoint_bytes")
            if not analyse:
                return None
            return await asyncio.to_thread(page_digests, image)

        async def resume(expect: str) -> None:
            await prov.resume()
            await confirm_iopub(km, kc)  # the server's gate does it before any cell
            await prov.memory_loaded()
            if (await run(kc, STATE)).strip() != expect:
                raise RuntimeError("the state after a resume differs")

        async def indexed() -> float:
            t = time.monotonic()
            while not (image / INDEX_NAME).exists():  # made while the kernel runs
                if time.monotonic() > t + 600:
                    raise RuntimeError("the kept image was never indexed")
                await asyncio.sleep(0.1)
            return round(time.monotonic() - t, 3)

        for r in range(repeats):
            row: dict[str, Any] = {}
            # Each repeat starts whole: the image kept from the one before goes.
            doomed = store.detach_image(kid)
            if doomed is not None:
                shutil.rmtree(doomed)
            expect = (await run(kc, STATE)).strip()
            first = await suspend(row, "first")
            await prov.resume()
            await confirm_iopub(km, kc)
            await prov.memory_loaded()
            # A cell while the kept image is indexed (the base's one cost to cells).
            row["cell_s_indexing"] = float((await run(kc, CELL_TIMED)).strip())
            if (await run(kc, STATE)).strip() != expect:
                raise RuntimeError("the state after the first resume differs")
            row["index_s"] = await indexed()
            row["cell_s_with_base"] = float((await run(kc, CELL_TIMED)).strip())
            row["base_held_running"] = held_on_disk(image)
            cell = (
                f"_k = int(a.size * {share}); _o = (a.size // 7) * {r % 6 + 1}; "
                "a[_o:_o + _k] += 1; junk = 1"
            )
            await run(kc, cell)
            expect = (await run(kc, STATE)).strip()
            second = await suspend(row, "second")
            manifest = store.read_manifest(kid)
            row["second_is_delta"] = bool(manifest.get("base"))
            row["held_bytes"] = int(manifest.get("held_bytes") or manifest["total_bytes"])
            if analyse:
                row.update(compare(first, second))
            # A cold resume from the chain: first output, all pages in.
            drop_caches()
            t0, m0 = time.perf_counter(), time.monotonic()
            await prov.resume()
            await confirm_iopub(km, kc)
            arrived, text = await output_of(kc, SMALL)
            await prov.memory_loaded()
            if text != "42":
                raise RuntimeError(f"unexpected output {text!r}")
            in_at = prov.last_memory_in_at
            row["first_output_s"] = round(arrived - t0, 3)
            row["all_in_s"] = round(in_at - m0 if in_at is not None else arrived - t0, 3)
            row["plain_cold_read_s"] = round(plain_cold_read(root, row["held_bytes"], True), 3)
            if (await run(kc, STATE)).strip() != expect:
                raise RuntimeError("the state after the resume from the chain differs")
            row["frozen_ratio"] = round(row["second_frozen_s"] / row["first_frozen_s"], 3)
            row["disk_ratio"] = round(row["second_disk_bytes"] / row["first_disk_bytes"], 4)
            row["process_ratio"] = round(
                row["second_process_bytes"] / max(1, row["first_process_bytes"]), 4
            )
            row["all_in_vs_read"] = round(row["all_in_s"] / row["plain_cold_read_s"], 3)
            out["repeats"].append(row)
            print(f"  repeat {r + 1}: {json.dumps(row)}", flush=True)
            await indexed()
        if rows := out["repeats"]:
            # Without a base (keep_base off): what a cell pays after a resume for the
            # restore alone, right after it and once the base would have been indexed.
            prov.engine.keep_base = False
            doomed = store.detach_image(kid)
            if doomed is not None:
                shutil.rmtree(doomed)
            await prov.suspend()
            await prov.resume()
            await confirm_iopub(km, kc)
            await prov.memory_loaded()
            out["cell_s_no_base"] = float((await run(kc, CELL_TIMED)).strip())
            await asyncio.sleep(med(rows, "index_s") or 0)
            out["cell_s_no_base_later"] = float((await run(kc, CELL_TIMED)).strip())
            prov.engine.keep_base = True
            print(
                f"  cell without a base: {out['cell_s_no_base']:.3f} s, "
                f"later {out['cell_s_no_base_later']:.3f} s",
                flush=True,
            )
        for i in range(cycles):
            cell = (
                f"_k = int(a.size * {share}); _o = (a.size // 23) * {i % 22}; "
                "a[_o:_o + _k] += 1; junk = 1"
            )
            await run(kc, cell)
            expect = (await run(kc, STATE)).strip()
            memory = tree_rss(prov.pid)
            t = time.perf_counter()
            await prov.suspend()
            suspend_s = time.perf_counter() - t
            manifest = store.read_manifest(kid)
            depth = len(store.layers(kid, manifest))
            disk = held_on_disk(image)
            await resume(expect)  # raises if the state differs
            row = {
                "cycle": i + 1,
                "suspend_s": round(suspend_s, 3),
                "frozen_s": round((prov.last_suspend_breakdown or {})["frozen_s"], 3),
                "layers": depth,
                "disk_bytes": disk,
                "memory_bytes": memory,
                "disk_ratio": round(disk / memory, 3),
                "state_ok": True,
            }
            out["cycles"].append(row)
            print(f"  cycle {json.dumps(row)}", flush=True)
            await indexed()
        await stop_kernel(km, kc)
        stopped = True
        # Anything of the kernel's under the root but its log: image, chain, temporaries.
        left = [str(p.relative_to(root)) for p in root.rglob(f"*{kid}*") if p.suffix != ".log"]
        out["left_after_shutdown"] = left
    finally:
        if not stopped:
            await stop_kernel(km, kc)
        shutil.rmtree(workdir, ignore_errors=True)
    rows = out["repeats"]
    out["median"] = (
        {
            k: med(rows, k)
            for k in rows[0]
            if isinstance(rows[0][k], int | float) and not isinstance(rows[0][k], bool)
        }
        if rows
        else {}
    )
    if out["cycles"]:
        out["cycles_max_disk_ratio"] = max(c["disk_ratio"] for c in out["cycles"])
        out["cycles_state_ok"] = all(c["state_ok"] for c in out["cycles"])
    print(f"  median: {json.dumps(out['median'])}", flush=True)
    print(f"  left after shutdown: {out.get('left_after_shutdown')}", flush=True)
    return out


TABLE_HEAD = (
    "| GB | frozen 1st s | 2nd s | ratio | diskstats 1st GB | 2nd GB | ratio "
    "| process 1st GB | 2nd GB | ratio | 1st output s | all in s | plain cold read s "
    "| all in / read | cycles: max disk / memory, state |\n" + "| --- " * 15 + "|"
)


def table_row(r: dict[str, Any]) -> str:
    m = r["median"]
    cyc = (
        f"{r['cycles_max_disk_ratio']:.2f}, {len(r['cycles'])}/{len(r['cycles'])} right"
        if r.get("cycles")
        else "-"
    )
    return (
        f"| {r['size_gb']:g} | {m['first_frozen_s']:.2f} | {m['second_frozen_s']:.2f} "
        f"| {m['frozen_ratio']:.2f} | {m['first_disk_bytes'] / GB:.3f} "
        f"| {m['second_disk_bytes'] / GB:.3f} | {m['disk_ratio']:.3f} "
        f"| {m['first_process_bytes'] / GB:.3f} | {m['second_process_bytes'] / GB:.3f} "
        f"| {m['process_ratio']:.4f} | {m['first_output_s']:.2f} | {m['all_in_s']:.2f} "
        f"| {m['plain_cold_read_s']:.2f} | {m['all_in_vs_read']:.2f} | {cyc} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("hash", "kernel", "all"), default="all")
    ap.add_argument("--sizes", default="1,4", help="kernel sizes, GB (part kernel)")
    ap.add_argument(
        "--analyse",
        action="store_true",
        help="also compare both images page by page (reads and hashes both: slow)",
    )
    ap.add_argument("--share", type=float, default=0.015, help="share of the array a cell changes")
    ap.add_argument("--repeats", type=int, default=3, help="whole + delta suspends per size")
    ap.add_argument(
        "--cycles", type=int, default=0, help="then this many resume/cell/suspend cycles"
    )
    ap.add_argument("--hash-mb", type=int, default=256)
    ap.add_argument("--root", type=Path, default=None, help="checkpoint root (the disk tested)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="cedana-incr-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": machine_info(root)}
    try:
        if args.part in ("hash", "all"):
            print("== hashes, per core and on 2 threads, against the disk", flush=True)
            result["hash"] = part_hash(root, args.hash_mb)
        if args.part in ("kernel", "all"):
            result["kernel"] = []
            for size in (float(x) for x in args.sizes.split(",")):
                print(f"== {size:g} GB kernel, a cell changing {args.share:.1%}", flush=True)
                result["kernel"].append(
                    asyncio.run(
                        part_kernel(
                            root / "ckpt",
                            size,
                            args.share,
                            args.analyse,
                            args.repeats,
                            args.cycles,
                        )
                    )
                )
            print(TABLE_HEAD)
            for r in result["kernel"]:
                print(table_row(r))
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
