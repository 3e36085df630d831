"""Cost of GpuMonitor.sample() for 100 kernels, next to a bare pynvml query loop.

Runs against the TEST-ONLY fake NVML (tests/fakes), so absolute times include the
fake's own cost (it re-reads its state file on every call); what this measures is
the monitor's overhead over the NVML calls it has to make anyway:
  baseline  - per GPU: compute processes + process utilisation + memory info (pynvml)
  sample    - GpuMonitor.sample() for 100 kernels (2 processes each), matched by PID
  fallback  - the same, but NVML's PIDs match nothing (another PID namespace): NSpid
              and /proc/PID/fd scans of all 200 processes

Usage: python bench/gpu_monitor_bench.py [--kernels 100] [--gpus 8] [--rounds 200]
Writes bench/results/gpu_monitor.json.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"
GiB = 1 << 30


def write_state(path: Path, gpus: int, kernels: list[list[int]], nvml_offset: int) -> None:
    lines = ["driver version=570.86.10 cuda=12080"]
    for i in range(gpus):
        lines.append(
            f"device index={i} uuid=GPU-00000000-0000-0000-0000-{i:012d} total={80 * GiB} "
            "reserved=0 name=NVIDIA H100 80GB HBM3"
        )
    for k, pids in enumerate(kernels):
        for j, pid in enumerate(pids):
            nvml_pid = pid + nvml_offset
            lines.append(f"proc pid={pid} nvml_pid={nvml_pid} dev={k % gpus} mem={(j + 1) * GiB}")
            lines.append(f"util pid={nvml_pid} dev={k % gpus} sm={(k * 7) % 100}")
    path.write_text("\n".join(lines) + "\n")


def timeit(fn, rounds: int) -> dict[str, float]:
    fn()  # warm up
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return {
        "mean_ms": statistics.fmean(times) * 1e3,
        "p50_ms": times[len(times) // 2] * 1e3,
        "p95_ms": times[int(len(times) * 0.95) - 1] * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=100)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_monitor.json"))
    args = ap.parse_args()

    subprocess.run(["make", "-s", "-C", str(FAKES)], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="cedana-gpu-bench-"))
    state = tmp / "state"
    os.environ["CEDANA_FAKE_GPU_STATE"] = str(state)
    # pynvml's CDLL("libnvidia-ml.so.1") then resolves to the already-loaded fake
    ctypes.CDLL(str(FAKES / "build" / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    sys.path.insert(0, str(ROOT))
    import pynvml

    from jupyter_cedana.gpu.monitor import GpuMonitor

    # real processes, so that the namespace fallback reads real /proc entries
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(args.kernels * 2)]
    try:
        kernels = [[procs[2 * k].pid, procs[2 * k + 1].pid] for k in range(args.kernels)]
        trees = {f"k{k}": set(p) for k, p in enumerate(kernels)}
        write_state(state, args.gpus, kernels, nvml_offset=0)

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(args.gpus)]

        def baseline() -> None:
            for h in handles:
                pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlDeviceGetProcessUtilization(h, 0)
                pynvml.nvmlDeviceGetMemoryInfo(h)

        mon = GpuMonitor()
        assert mon.available, mon.reason
        check = mon.sample(trees)
        assert all(len(v) == 1 for v in check.values()), "every kernel should hold one GPU"
        rows = {
            "baseline_pynvml_loop": timeit(baseline, args.rounds),
            "monitor_sample": timeit(lambda: mon.sample(trees), args.rounds),
        }
        # NVML PIDs from another namespace: nothing matches directly
        write_state(state, args.gpus, kernels, nvml_offset=1_000_000)
        rows["monitor_sample_ns_fallback"] = timeit(
            lambda: mon.sample(trees), max(10, args.rounds // 10)
        )
        rows["is_gpu_idle_x100"] = timeit(
            lambda: [mon.is_gpu_idle(k, 5.0) for k in trees], args.rounds
        )
    finally:
        for p in procs:
            p.kill()
            p.wait()

    base = rows["baseline_pynvml_loop"]["mean_ms"]
    print(f"GPU monitor sampling, {args.kernels} kernels x 2 processes, {args.gpus} fake GPUs")
    print(f"{'measurement':32} {'mean ms':>9} {'p50 ms':>9} {'p95 ms':>9} {'x baseline':>11}")
    for name, r in rows.items():
        print(
            f"{name:32} {r['mean_ms']:9.3f} {r['p50_ms']:9.3f} {r['p95_ms']:9.3f} "
            f"{r['mean_ms'] / base:11.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "kernels": args.kernels,
                "processes_per_kernel": 2,
                "gpus": args.gpus,
                "rounds": args.rounds,
                "nvml": "tests/fakes fake libnvidia-ml.so.1 (re-reads its state file per call)",
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
