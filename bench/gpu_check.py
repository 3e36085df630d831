"""GPU check (issue 11): the GPU path on a real NVIDIA GPU, through the real provisioner,
the real native helper and real CRIU, in one time-boxed run.

Steps, each recorded (result or error) in the JSON written after every step:
  criu      `criu --version` and `criu check`: can CRIU work on this machine at all?
  env       machine, driver, GPU, persistence mode, host memory room, privileges
  driver    the helper's view of the driver; what cuCheckpointProcessGetState answers for
            a process that never used CUDA and for a pid that does not exist
  small     a kernel with --small-gb of GPU tensors: NVML attribution to the kernel,
            offload tier, disk tier, preflight refusing CUDA work in two processes,
            restore admission refusing while another process holds the memory (the
            image kept), then resuming once it is free
  big       a kernel with --sizes GB of GPU tensors and --host-gb of host memory:
            offload tier (GPU-freed throughput) and disk tier (resume to first output
            with the image in the page cache)
Each tier: GPU memory freed as NVML sees it and given back, every tensor equal after
resume, new CUDA work runs, timings.

  python bench/gpu_check.py --criu CRIU --out DIR       (scripts/gpu-bundle.sh makes a
                                                         bundle whose run.sh calls this)
  python bench/gpu_check.py --fake                      (no GPU: the TEST-ONLY fakes of
                                                         tests/fakes, tiny sizes)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchlib import confirm_iopub  # noqa: E402
from gpu_workloads import STOP_CHILD, FakeWorkload, TorchWorkload  # noqa: E402

GB = 1e9
FAKES = HERE.parent / "tests" / "fakes"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--criu", help="CRIU binary (4.2+) for the disk tier")
    ap.add_argument("--helper", help="native helper cedana-cuda (default: the package's)")
    ap.add_argument("--init", help="native cedana-init (default: the package's)")
    ap.add_argument("--small-gb", type=float, default=1.0, help="GPU GB of the small kernel")
    ap.add_argument("--sizes", default="17", help="GPU tensors of the big kernel, GB")
    ap.add_argument("--host-gb", type=float, default=4.0, help="host memory of the big kernel")
    ap.add_argument("--steps", default="criu,env,driver,small,big")
    ap.add_argument("--checkpoint-root", default=None, help="default: a temporary folder")
    ap.add_argument("--timeout", type=float, default=420.0, help="overall time box (s)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results"))
    ap.add_argument("--fake", action="store_true", help="run against the TEST-ONLY fakes")
    ap.add_argument("--fakes", default=str(FAKES), help="tests/fakes of a checkout (--fake)")
    ap.add_argument("--fake-state", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


class Report:
    """The JSON report, rewritten after every step so a time-out still leaves results."""

    def __init__(self, path: Path, deadline: float) -> None:
        self.path = path
        self.deadline = deadline
        self.data: dict[str, Any] = {"started": time.time(), "steps": {}}
        path.parent.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))

    async def step(self, name: str, fn: Callable[[], Awaitable[Any]], need: float = 20) -> Any:
        left = self.left()
        if left < need:
            self.data["steps"][name] = {"skipped": f"time box: {left:.0f} s left"}
            self.save()
            return None
        t0 = time.monotonic()
        print(f"[gpu-check] {name} ...", flush=True)
        try:
            result = await asyncio.wait_for(fn(), left)
            entry = {"ok": True, "s": round(time.monotonic() - t0, 3), "result": result}
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            entry = {
                "ok": False,
                "s": round(time.monotonic() - t0, 3),
                "error": f"{type(e).__name__}: {getattr(e, 'message', None) or e}",
                "traceback": traceback.format_exc(limit=6),
            }
            result = None
        self.data["steps"][name] = entry
        print(f"[gpu-check] {name}: {'ok' if entry['ok'] else entry['error']}", flush=True)
        self.save()
        return result


# ---- NVML, straight (not through the product) ---------------------------------------------


def nvml_snapshot(pids: set[int]) -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out: dict[str, Any] = {"free": 0, "held_by_pids": 0, "processes": []}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out["free"] += int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                mem = int(p.usedGpuMemory or 0)
                out["processes"].append({"gpu": i, "pid": int(p.pid), "memory": mem})
                if p.pid in pids:
                    out["held_by_pids"] += mem
        return out
    finally:
        pynvml.nvmlShutdown()


def _chars(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ---- the kernel under test ------------------------------------------------------------------


class Recorder:
    """Keeps what CudaCheckpointer.offload/restore return, whoever calls them."""

    def __init__(self) -> None:
        self.offloads: list[dict[str, Any]] = []
        self.restores: list[dict[str, Any]] = []
        from jupyter_cedana.gpu.cuda import CudaCheckpointer

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


class Kernel:
    def __init__(self, check: Check, sizes: list[float], host_gb: float) -> None:
        self.check, self.sizes, self.host_gb = check, sizes, host_gb
        self.km: Any = None
        self.kc: Any = None

    @property
    def prov(self) -> Any:
        return self.km.provisioner

    async def start(self) -> dict[str, Any]:
        from jupyter_client.manager import AsyncKernelManager
        from jupyter_client.provisioning import KernelProvisionerFactory

        KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
        self.km = AsyncKernelManager(kernel_name="python3", config=self.check.config)
        env = {**os.environ, **self.check.workload.kernel_env()}
        await self.km.start_kernel(env=env, cwd=str(self.check.workdir))
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=120)
        if not hasattr(self.prov, "suspend"):
            raise RuntimeError(f"the kernel runs under {type(self.prov).__name__}, not cedana's")
        t0 = time.monotonic()
        out, _ = await self.execute(self.check.workload.setup_code(self.sizes, self.host_gb), 600)
        return {"setup_s": round(time.monotonic() - t0, 3), "kernel_says": out.strip()}

    async def resume(self) -> float:
        """Resume, then wait for IOPub as the server's message gate does: a cell sent before
        the client's IOPub socket has reconnected to a restored kernel loses its output and
        its idle status (the check then waited for them until its time box ran out).
        Returns the seconds IOPub took."""
        await self.prov.resume()
        t0 = time.monotonic()
        await confirm_iopub(self.km, self.kc)
        return time.monotonic() - t0

    async def execute(self, code: str, timeout: float = 300) -> tuple[str, float | None]:
        """Run `code`; its stdout and the seconds until its first output."""
        t0 = time.monotonic()
        msg_id = self.kc.execute(code)
        out: list[str] = []
        first = None
        while True:
            msg = await self.kc.get_iopub_msg(timeout=timeout)
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

    async def first_output(self) -> float | None:
        """Seconds from sending a cell to its first output."""
        return (await self.execute("print('back')"))[1]

    async def verify(self) -> dict[str, Any]:
        import ast

        out, _ = await self.execute("print(verify())")
        return dict(ast.literal_eval(out.strip().splitlines()[-1]))

    def pids(self) -> set[int]:
        from jupyter_cedana.checkpoint.proctree import process_tree

        return process_tree(self.prov.pid)

    def python_pid(self) -> int:
        init = self.prov.pid
        return min(self.pids() - {init})

    def save_logs(self, label: str) -> None:
        """The kernel's output and any CRIU log of its image, before shutdown removes them."""
        store = self.prov.engine.store
        kid = self.km.kernel_id
        dest = self.check.report.path.parent / "logs"
        dest.mkdir(exist_ok=True)
        logs = [store.log_path(kid), *store.path(kid).glob("*.log")]
        logs += list(store.work_dir(kid).glob("*.log"))
        for log in logs:
            if log.is_file() and log.stat().st_size < 8 << 20:
                (dest / f"{label}-{log.name}").write_bytes(log.read_bytes())

    async def stop(self, label: str) -> None:
        if self.kc is not None:
            self.kc.stop_channels()
        if self.km is not None:
            try:
                self.save_logs(label)
            except OSError as e:
                print(f"[gpu-check] could not save the logs of {label}: {e}", flush=True)
            await self.km.shutdown_kernel(now=True)


class Check:
    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        from traitlets.config import Config

        self.args, self.report = args, report
        self.rec = Recorder()
        tmp = Path(tempfile.mkdtemp(prefix="cedana-gpu-check-"))
        self.workdir = tmp / "work"
        self.workdir.mkdir()
        root = args.checkpoint_root or str(tmp / "checkpoints")
        self.workload: Any = (
            FakeWorkload(Path(args.fake_state)) if args.fake else TorchWorkload("cuda")
        )
        c = Config()
        c.CheckpointEngine.checkpoint_root = root
        if args.criu:
            c.CheckpointEngine.criu_path = args.criu
        if args.init:
            c.CheckpointEngine.init_path = args.init
        if args.helper:
            c.CudaCheckpointer.helper_path = args.helper
        if args.fake:
            c.CudaCheckpointer.libcuda_path = str(Path(args.fakes) / "build" / "libcuda.so.1")
        # a driver call that hangs must not eat the whole time box
        c.CudaCheckpointer.request_timeout = 120.0
        self.config = c
        self.criu_ok = True

    # ---- steps ----

    async def criu(self) -> dict[str, Any]:
        from jupyter_cedana.checkpoint.engine import CheckpointEngine

        engine = CheckpointEngine.instance(config=self.config)
        info = engine.probe()
        out: dict[str, Any] = {"engine": info.__dict__}
        if not info.criu_path:
            return out
        for name, argv in (("version", ["--version"]), ("check", ["check"])):
            r = subprocess.run([info.criu_path, *argv], capture_output=True, text=True, timeout=60)
            out[name] = {"rc": r.returncode, "output": (r.stdout + r.stderr)[-3000:]}
        self.criu_ok = bool(info.available)
        return out

    async def env(self) -> dict[str, Any]:
        import pynvml

        from jupyter_cedana.gpu.hostmem import host_room

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            gpu = {
                "driver": _chars(pynvml.nvmlSystemGetDriverVersion()),
                "name": _chars(pynvml.nvmlDeviceGetName(h)),
                "count": pynvml.nvmlDeviceGetCount(),
                "memory_total": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                "persistence_mode": _try(lambda: pynvml.nvmlDeviceGetPersistenceMode(h)),
                "mig": _try(lambda: pynvml.nvmlDeviceGetMigMode(h)),
            }
        finally:
            pynvml.nvmlShutdown()
        out: dict[str, Any] = {
            "kernel": platform.release(),
            "python": sys.version,
            "euid": os.geteuid(),
            "cpus": os.cpu_count(),
            "gpu": gpu,
            "host_room": _try(lambda: host_room().__dict__),
            "nvidia_proc": os.path.isdir("/proc/driver/nvidia/gpus"),
            "fake": self.args.fake,
        }
        if not self.args.fake:
            import torch

            out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda}
        return out

    async def driver(self) -> dict[str, Any]:
        from jupyter_cedana.checkpoint.engine import CheckpointEngine
        from jupyter_cedana.gpu.cuda_helper import CudaCallError

        engine = CheckpointEngine.instance(config=self.config)
        gpu = await engine.cuda_checkpointer()
        out: dict[str, Any] = {"status": engine.cuda_status(), "info": engine._cuda._info}
        if gpu is None:
            return out
        sleeper = subprocess.Popen(["sleep", "60"])
        gone = subprocess.Popen(["true"])
        gone.wait()
        try:
            for name, pid in (("no_cuda_process", sleeper.pid), ("no_such_pid", gone.pid)):
                try:
                    out[name] = {"get_state": await gpu.probe(pid)}
                except CudaCallError as e:
                    out[name] = {"get_state_error": [e.cuda_error, e.cuda_code, e.message]}
                try:
                    out[name]["restore_tid"] = (await gpu._op("restore_tid", pid)).get("tid")
                except CudaCallError as e:
                    out[name]["restore_tid_error"] = [e.cuda_error, e.cuda_code]
        finally:
            sleeper.kill()
            sleeper.wait()
        return out

    async def tier(self, k: Kernel, tier: str) -> dict[str, Any]:
        """Suspend into `tier`, resume, verify: what NVML saw, timings, results."""
        n_off, n_res = len(self.rec.offloads), len(self.rec.restores)
        before = nvml_snapshot(k.pids())
        t0 = time.monotonic()
        summary = await k.prov.suspend(tier=tier)
        suspend_s = time.monotonic() - t0
        during = nvml_snapshot(k.pids())
        t0 = time.monotonic()
        resume_error = None
        try:
            iopub_s = await k.resume()
        except Exception as e:
            # e.g. a driver on which the frozen restore (thaw) fails: say so, try unfrozen
            gpu = await k.prov.engine.cuda_checkpointer()
            if tier != "disk" or gpu is None or not gpu.restore_frozen:
                raise
            resume_error = f"{type(e).__name__}: {getattr(e, 'message', e)}"
            gpu.restore_frozen = False
            iopub_s = await k.resume()
        resume_s = time.monotonic() - t0 - iopub_s
        first = await k.first_output()
        check = await k.verify()
        after = nvml_snapshot(k.pids())
        off = self.rec.offloads[n_off] if len(self.rec.offloads) > n_off else {}
        res = self.rec.restores[n_res] if len(self.rec.restores) > n_res else {}
        gpu_bytes = int(off.get("memory_bytes") or 0)
        freed = during["free"] - before["free"]
        stop_s = (off.get("lock_s") or 0) + (off.get("checkpoint_s") or 0)
        ckpt = int(summary.get("checkpoint_bytes") or 0)
        return {
            "suspend_s": suspend_s,
            "lock_s": off.get("lock_s"),
            "checkpoint_s": off.get("checkpoint_s"),
            "gpu_bytes": gpu_bytes,
            "d2h_gb_s": off.get("gb_per_s"),
            "nvml_freed": freed,
            "nvml_freed_gb_s": freed / GB / stop_s if stop_s else None,
            "held_before": before["held_by_pids"],
            "held_while_suspended": during["held_by_pids"],
            "nvml_taken_back": during["free"] - after["free"],
            "held_after": after["held_by_pids"],
            "checkpoint_bytes": ckpt,
            "dump_gb_s": ckpt / GB / suspend_s if tier == "disk" and ckpt else None,
            "resume_s": resume_s,
            "resume_error_frozen": resume_error,
            "iopub_s": iopub_s,
            "restore_s": res.get("restore_s"),
            "h2d_gb_s": res.get("gb_per_s"),
            "first_output_after_resume_s": (
                resume_s + iopub_s + first if first is not None else None
            ),
            "verify": check,
            "summary": summary,
        }

    async def attribution(self, k: Kernel) -> dict[str, Any]:
        monitor = k.prov.engine.gpu_monitor()
        uses = [u.to_json() for u in monitor.usage(k.pids())]
        python = k.python_pid()
        nvml = nvml_snapshot(k.pids())
        return {
            "kernel_python_pid": python,
            "monitor": uses,
            "nvml": nvml,
            "attributed_to_kernel": any(python in u["pids"] for u in uses),
        }

    async def two_processes(self, k: Kernel) -> dict[str, Any]:
        from jupyter_cedana.errors import NotCheckpointable

        out, _ = await k.execute(self.workload.child_code(), 120)
        child = int(out.split()[1])
        monitor = k.prov.engine.gpu_monitor()
        for _ in range(300):  # until NVML lists the child
            if any(child in u.pids for u in monitor.usage(k.pids())):
                break
            await asyncio.sleep(0.1)
        result: dict[str, Any] = {"child": child, "kernel_says": out.strip()}
        try:
            await k.prov.suspend(tier="offload")
            result["refused"] = False
            await k.resume()
        except NotCheckpointable as e:
            result.update(refused=True, message=e.message, state=k.prov.state.value)
        finally:
            await k.execute(STOP_CHILD, 60)
        result["verify_after"] = await k.verify()
        return result

    async def admission(self, k: Kernel) -> dict[str, Any]:
        from jupyter_cedana.errors import InsufficientGpuMemory

        await k.prov.suspend(tier="disk")
        store = k.prov.engine.store
        manifest = store.read_manifest(k.km.kernel_id)
        need = int(manifest["gpu"]["memory_bytes"])
        free = nvml_snapshot(set())["free"]
        hog = max(0, free - need // 2)
        self.workload.hog(hog)
        result: dict[str, Any] = {"need": need, "free_before_hog": free, "hog": hog}
        try:
            await k.resume()
            result["refused"] = False
        except InsufficientGpuMemory as e:
            result.update(
                refused=True,
                message=e.message,
                state=k.prov.state.value,
                image_kept=store.exists(k.km.kernel_id),
            )
        finally:
            self.workload.release()
        if k.prov.state.value != "running":
            t0 = time.monotonic()
            await k.resume()
            result["resume_after_release_s"] = time.monotonic() - t0
        result["verify_after"] = await k.verify()
        return result

    async def kernel_steps(self, label: str, sizes: list[float], host_gb: float) -> None:
        k = Kernel(self, sizes, host_gb)
        try:
            r = self.report
            if await r.step(f"{label}.start", k.start, need=60) is None:
                return
            await r.step(f"{label}.attribution", lambda: self.attribution(k))
            await r.step(f"{label}.offload", lambda: self.tier(k, "offload"), need=45)
            if self.criu_ok:
                await r.step(f"{label}.disk", lambda: self.tier(k, "disk"), need=60)
            if label == "small":
                await r.step(f"{label}.two_processes", lambda: self.two_processes(k))
                if self.criu_ok:
                    await r.step(f"{label}.admission", lambda: self.admission(k), need=60)
        finally:
            await asyncio.wait_for(k.stop(label), 60)

    async def run(self) -> None:
        steps = self.args.steps.split(",")
        r = self.report
        for name in ("criu", "env", "driver"):
            if name in steps:
                await r.step(name, getattr(self, name), need=5)
        if "small" in steps:
            await self.kernel_steps("small", [self.args.small_gb], min(0.5, self.args.host_gb))
        if "big" in steps:
            sizes = [float(s) for s in self.args.sizes.split(",") if s]
            await self.kernel_steps("big", sizes, self.args.host_gb)
        from jupyter_cedana.checkpoint.engine import CheckpointEngine

        await CheckpointEngine.instance().close()


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def targets(data: dict[str, Any]) -> dict[str, Any]:
    steps = data["steps"]
    big_off = (steps.get("big.offload") or {}).get("result") or {}
    big_disk = (steps.get("big.disk") or {}).get("result") or {}
    tiers = [
        s["result"] for n, s in steps.items() if n.endswith((".offload", ".disk")) and s.get("ok")
    ]
    gb_s = big_off.get("nvml_freed_gb_s") or big_off.get("d2h_gb_s")
    first = big_disk.get("first_output_after_resume_s")
    return {
        "gpu_freed_gb_s": gb_s,
        "gpu_freed_ge_20_gb_s": None if gb_s is None else gb_s >= 20,
        "big_disk_first_output_s": first,
        "big_disk_first_output_le_4_s": None if first is None else first <= 4.0,
        "all_verified": bool(tiers) and all(all(t["verify"].values()) for t in tiers),
    }


def table(data: dict[str, Any]) -> str:
    cols = [
        ("step", "{}"), ("gpu_GB", "{:.2f}"), ("suspend_s", "{:.2f}"), ("lock_s", "{:.3f}"),
        ("ckpt_s", "{:.2f}"), ("freed_GB", "{:.2f}"), ("freed_GB/s", "{:.1f}"),
        ("resume_s", "{:.2f}"), ("h2d_GB/s", "{:.1f}"), ("1st_out_s", "{:.2f}"),
        ("back_GB", "{:.2f}"), ("verified", "{}"),
    ]  # fmt: skip
    lines = [" ".join(f"{n:>11}" for n, _ in cols)]
    for name, s in data["steps"].items():
        if not name.endswith((".offload", ".disk")):
            continue
        if not s.get("ok"):
            lines.append(f"{name:>11} {s.get('error') or s.get('skipped')}")
            continue
        r = s["result"]
        vals = {
            "step": name, "gpu_GB": r["gpu_bytes"] / GB, "suspend_s": r["suspend_s"],
            "lock_s": r["lock_s"], "ckpt_s": r["checkpoint_s"], "freed_GB": r["nvml_freed"] / GB,
            "freed_GB/s": r["nvml_freed_gb_s"], "resume_s": r["resume_s"],
            "h2d_GB/s": r["h2d_gb_s"], "1st_out_s": r["first_output_after_resume_s"],
            "back_GB": r["nvml_taken_back"] / GB,
            "verified": "ok" if all(r["verify"].values()) else f"FAIL {r['verify']}",
        }  # fmt: skip
        lines.append(
            " ".join(
                f"{(f.format(vals[n]) if vals.get(n) is not None else '-'):>11}" for n, f in cols
            )
        )
    return "\n".join(lines)


def fake_world(args: argparse.Namespace) -> None:
    """--fake: build the fakes, point every GPU library at them, and start over."""
    fakes = Path(args.fakes)
    subprocess.run(["make", "-s", "-C", str(fakes)], check=True)
    state = Path(tempfile.mkdtemp(prefix="cedana-fake-gpu-")) / "state"
    FakeWorkload.create_world(state, total=141 * 10**9)
    env = {
        **os.environ,
        "CEDANA_FAKE_GPU_STATE": str(state),
        "LD_LIBRARY_PATH": f"{fakes / 'build'}:{os.environ.get('LD_LIBRARY_PATH', '')}",
    }
    small = [] if "--small-gb" in sys.argv else ["--small-gb", "0.05"]
    big = [] if "--sizes" in sys.argv else ["--sizes", "0.2"]
    host = [] if "--host-gb" in sys.argv else ["--host-gb", "0.1"]
    argv = [sys.executable, __file__, *sys.argv[1:], *small, *big, *host]
    os.execve(sys.executable, [*argv, "--fake-state", str(state)], env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fake and not args.fake_state:
        fake_world(args)
    out = Path(args.out)
    report = Report(out / "gpu_check.json", time.monotonic() + args.timeout)
    report.data["args"] = vars(args)
    check = Check(args, report)
    asyncio.run(check.run())
    report.data["targets"] = targets(report.data)
    report.data["total_s"] = time.time() - report.data["started"]
    report.save()
    print(table(report.data))
    print("targets:", json.dumps(report.data["targets"]))
    print(f"wrote {report.path} ({report.data['total_s']:.0f} s)")
    return 0 if report.data["targets"]["all_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
