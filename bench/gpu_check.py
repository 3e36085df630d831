"""GPU check on a real NVIDIA GPU (issue 4): offload and disk tiers end to end.

Starts a python3 kernel under the extension's provisioner, fills PyTorch tensors of
known content on the GPU (default 1 GB and 16 GB) and host memory (default 4 GB),
then for each tier (offload, disk): suspend -> check through NVML that the GPU memory
is free -> resume -> check every tensor and that new CUDA work runs. Prints a table
(lock, device->host GB/s, dump GB/s, restore, host->device GB/s, first-output latency)
and writes JSON. Timeboxed (default 450 s, under 8 minutes).

Runs without a package registry, from what it is given:
  python bench/gpu_check.py --wheels DIR --criu /opt/criu/sbin/criu \\
      --helper /opt/cedana/cedana-cuda [--init /opt/cedana/cedana-init]
next to a Python that has torch and pynvml. With --wheels, jupyter-cedana and its
dependencies are installed offline (pip --no-index) into a venv that sees the system's
site-packages (for torch), and the script re-runs itself there.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9

# Code run inside the kernel. Tensors are filled chunk by chunk from seeded generators,
# so verification can regenerate each chunk and compare exactly, one chunk of extra memory.
KERNEL_SETUP = r"""
import os, time, numpy as np, torch
_CH = 1 << 28  # int32 elements per chunk (1 GiB)
def _fill(t, seed):
    for i, c in enumerate(t.split(_CH)):
        g = torch.Generator(device=t.device); g.manual_seed(seed * 100003 + i)
        c.random_(0, 2**31 - 1, generator=g)
def _same(t, seed):
    for i, c in enumerate(t.split(_CH)):
        g = torch.Generator(device=t.device); g.manual_seed(seed * 100003 + i)
        ref = torch.empty_like(c).random_(0, 2**31 - 1, generator=g)
        if not torch.equal(c, ref):
            return False
        del ref
    return True
_sizes = {sizes!r}
tensors = []
for _s, _gb in enumerate(_sizes):
    _t = torch.empty(int(_gb * 1e9) // 4, dtype=torch.int32, device="cuda")
    _fill(_t, _s + 1)
    tensors.append(_t)
torch.cuda.synchronize()
host = np.arange(int({host_gb} * 1e9) // 8, dtype=np.int64) * 7 + 3
def verify():
    ok = all(_same(t, s + 1) for s, t in enumerate(tensors))
    host_ok = bool(host[-1] == (host.size - 1) * 7 + 3 and host[12345] == 12345 * 7 + 3)
    new_work = float((torch.ones(1 << 20, device="cuda") * 2).sum().item()) == 2.0 * (1 << 20)
    return {{"tensors": ok, "host": host_ok, "new_cuda_work": new_work}}
print("READY", os.getpid(), torch.cuda.memory_allocated())
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="GPU check: offload and disk suspend/resume of a PyTorch kernel.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--wheels", help="folder of wheels to install offline (jupyter-cedana + deps)")
    ap.add_argument("--venv", default="/tmp/cedana-gpu-check-venv", help="venv for --wheels")
    ap.add_argument("--criu", help="CRIU binary (4.2+) for the disk tier")
    ap.add_argument("--helper", help="native helper cedana-cuda (default: the package's)")
    ap.add_argument("--init", help="native cedana-init (default: the package's)")
    ap.add_argument("--sizes", default="1,16", help="GPU tensor sizes in GB (default 1,16)")
    ap.add_argument("--host-gb", type=float, default=4.0, help="host memory to fill (GB)")
    ap.add_argument("--tiers", default="offload,disk", help="tiers to check, in order")
    ap.add_argument("--checkpoint-root", default="/tmp/cedana-gpu-check-ckpt")
    ap.add_argument("--timeout", type=float, default=450.0, help="overall time box (s)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    ap.add_argument("--no-install", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def install_and_reexec(args: argparse.Namespace) -> None:
    """Offline install into a venv that also sees the system's torch and pynvml."""
    venv = Path(args.venv)
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True
        )
    subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            args.wheels,
            "jupyter-cedana",
        ],
        check=True,
    )
    os.execv(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:], "--no-install"])


def nvml_snapshot(pids: set[int]) -> dict[str, Any]:
    """Free memory of every GPU and what `pids` hold, straight from NVML."""
    import pynvml

    pynvml.nvmlInit()
    out: dict[str, Any] = {"free": 0, "held": 0}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out["free"] += pynvml.nvmlDeviceGetMemoryInfo(h).free
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid in pids and p.usedGpuMemory:
                out["held"] += p.usedGpuMemory
    return out


class Recorder:
    """Wraps CudaCheckpointer.offload/restore to keep their timings, whoever calls them."""

    def __init__(self) -> None:
        self.offloads: list[dict[str, Any]] = []
        self.restores: list[dict[str, Any]] = []

    def install(self) -> None:
        from jupyter_cedana.cuda import CudaCheckpointer

        orig_offload, orig_restore = CudaCheckpointer.offload, CudaCheckpointer.restore
        rec = self

        async def offload(self: Any, *a: Any, **kw: Any) -> Any:
            r = await orig_offload(self, *a, **kw)
            rec.offloads.append(dict(r))
            return r

        async def restore(self: Any, *a: Any, **kw: Any) -> Any:
            r = await orig_restore(self, *a, **kw)
            rec.restores.append(dict(r))
            return r

        CudaCheckpointer.offload = offload  # type: ignore[method-assign]
        CudaCheckpointer.restore = restore  # type: ignore[method-assign]


async def execute(kc: Any, code: str, timeout: float) -> tuple[str, float | None]:
    """Run `code`; return its stdout and the seconds until the first output arrived."""
    t0 = time.monotonic()
    msg_id = kc.execute(code)
    out, first = [], None
    while True:
        msg = await kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            first = first if first is not None else time.monotonic() - t0
            out.append(msg["content"]["text"])
        elif kind == "error":
            raise RuntimeError("kernel error: " + "\n".join(msg["content"]["traceback"]))
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out), first


async def check(args: argparse.Namespace) -> dict[str, Any]:
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_client.provisioning import KernelProvisionerFactory
    from traitlets.config import Config

    from jupyter_cedana.proctree import process_tree

    deadline = time.monotonic() + args.timeout
    sizes = [float(s) for s in args.sizes.split(",") if s]
    rec = Recorder()
    rec.install()
    c = Config()
    c.CheckpointEngine.checkpoint_root = args.checkpoint_root
    if args.criu:
        c.CheckpointEngine.criu_path = args.criu
    if args.init:
        c.CheckpointEngine.init_path = args.init
    if args.helper:
        c.CudaCheckpointer.helper_path = args.helper
    KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
    km = AsyncKernelManager(kernel_name="python3", config=c)
    report: dict[str, Any] = {"sizes_gb": sizes, "host_gb": args.host_gb, "tiers": {}}
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        t = time.monotonic()
        out, _ = await execute(kc, KERNEL_SETUP.format(sizes=sizes, host_gb=args.host_gb), 300)
        report["setup_s"] = time.monotonic() - t
        print(out.strip())
        prov: Any = km.provisioner  # CedanaProvisioner
        for tier in [t for t in args.tiers.split(",") if t]:
            left = deadline - time.monotonic()
            if left < 60:
                report["tiers"][tier] = {"skipped": f"time box: {left:.0f} s left"}
                continue
            pids = process_tree(prov.pid)
            before = nvml_snapshot(pids)
            n_off = len(rec.offloads)
            t = time.monotonic()
            summary = await asyncio.wait_for(prov.suspend(tier=tier), left)
            suspend_s = time.monotonic() - t
            after = nvml_snapshot(pids)
            off = rec.offloads[n_off] if len(rec.offloads) > n_off else {}
            n_res = len(rec.restores)
            t = time.monotonic()
            await asyncio.wait_for(prov.resume(), deadline - time.monotonic())
            resume_s = time.monotonic() - t
            out, first = await execute(kc, "print(verify())", 300)
            # resume start -> first output of the first cell run after it
            first_output_s = resume_s + first if first is not None else None
            res = rec.restores[n_res] if len(rec.restores) > n_res else {}
            verified = ast.literal_eval(out.strip())  # the dict verify() printed
            ckpt_bytes = int(summary.get("checkpoint_bytes") or 0)
            report["tiers"][tier] = {
                "suspend_s": suspend_s,
                "resume_s": resume_s,
                "lock_s": off.get("lock_s"),
                "gpu_bytes": off.get("memory_bytes"),
                "d2h_gb_s": off.get("gb_per_s"),
                "gpu_freed_nvml": before["free"] and after["free"] - before["free"],
                "held_before": before["held"],
                "held_after": after["held"],
                "dump_gb_s": ckpt_bytes / GB / suspend_s if ckpt_bytes and tier == "disk" else None,
                "checkpoint_bytes": ckpt_bytes,
                "restore_s": res.get("restore_s"),
                "h2d_gb_s": res.get("gb_per_s"),
                "first_output_s": first_output_s,
                "first_output_after_execute_s": first,
                "verify": verified,
                "summary": summary,
            }
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
    return report


def table(report: dict[str, Any]) -> str:
    cols = [
        ("tier", "{}"),
        ("lock_s", "{:.3f}"),
        ("d2h_gb_s", "{:.2f}"),
        ("dump_gb_s", "{:.2f}"),
        ("restore_s", "{:.3f}"),
        ("h2d_gb_s", "{:.2f}"),
        ("first_output_s", "{:.3f}"),
        ("freed_GB", "{:.2f}"),
        ("verify", "{}"),
    ]
    lines = [" ".join(f"{n:>14}" for n, _ in cols)]
    for tier, r in report["tiers"].items():
        if "skipped" in r:
            lines.append(f"{tier:>14} skipped: {r['skipped']}")
            continue
        vals = dict(r, tier=tier, freed_GB=(r.get("gpu_freed_nvml") or 0) / GB)
        vals["verify"] = "ok" if all((r.get("verify") or {"x": False}).values()) else "FAIL"
        lines.append(
            " ".join(
                f"{(fmt.format(vals[n]) if vals.get(n) is not None else '-'):>14}"
                for n, fmt in cols
            )
        )
    return "\n".join(lines)


def targets(report: dict[str, Any]) -> dict[str, bool | None]:
    off = report["tiers"].get("offload", {})
    disk = report["tiers"].get("disk", {})
    big = max(report["sizes_gb"]) >= 16 and report["host_gb"] >= 4
    return {
        "gpu_freed_at_20_gb_s": (off.get("d2h_gb_s") or 0) >= 20 if off.get("d2h_gb_s") else None,
        "disk_first_output_le_4s": (disk["first_output_s"] <= 4.0)
        if big and disk.get("first_output_s") is not None
        else None,
        "all_verified": all(
            all((r.get("verify") or {"x": False}).values())
            for r in report["tiers"].values()
            if "skipped" not in r
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wheels and not args.no_install:
        install_and_reexec(args)
    try:
        import pynvml
        import torch
    except ImportError as e:
        print(f"gpu_check needs torch and pynvml next to it: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    pynvml.nvmlInit()
    env = {
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "gpu": pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)),
        "torch": torch.__version__,
    }
    print(f"GPU check on {env['gpu']}, driver {env['driver']}, torch {env['torch']}")
    t0 = time.monotonic()
    report = asyncio.run(asyncio.wait_for(check(args), args.timeout + 60))
    report["env"] = env
    report["total_s"] = time.monotonic() - t0
    report["targets"] = targets(report)
    print(table(report))
    print("targets:", json.dumps(report["targets"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out} ({report['total_s']:.0f} s)")
    return 0 if report["targets"]["all_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
