"""GPU monitor: per-kernel GPU memory and utilisation from NVML (pynvml).

Each kernel is a set of host PIDs (its process tree); NVML reports processes by PID,
matched to the trees by pids.py. The monitor keeps what that matching learns.

No driver, no GPU or no pynvml: `available` is False and `reason` says why; every
query then answers "no GPU use", so CPU kernels are unaffected.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from traitlets import Bool, Float, Unicode
from traitlets.config import LoggingConfigurable

from .pids import NvmlDevice, NvmlProcess, match_processes


@dataclass
class GpuUse:
    """What one kernel holds on one GPU."""

    index: int
    uuid: str
    memory_bytes: int
    utilization: float | None = None  # percent, averaged over the sliding window
    name: str = ""
    pids: list[int] = field(default_factory=list)  # host pids using this GPU
    # "pid", "nspid", "learned" (exact) or "devfile" (memory then approximate)
    matched_by: str = "pid"
    mps: bool = False  # the process is an MPS client

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class GpuMonitor(LoggingConfigurable):
    """Samples NVML and maps GPU use to kernels' process trees."""

    enabled = Bool(
        True, config=True, help="Use NVML to watch GPU memory and utilisation of kernels."
    )
    utilization_window = Float(
        60.0,
        config=True,
        help="Seconds of utilisation history a kernel must stay under the GPU threshold "
        "to count as GPU-idle.",
    )
    device_path_prefix = Unicode(
        "/dev/nvidia",
        config=True,
        help="Prefix of the per-GPU device files (/dev/nvidiaN), used to match processes "
        "to GPUs when NVML's PIDs belong to another PID namespace.",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.RLock()
        self._started = False
        self._nvml: Any = None
        self._reason: str | None = None
        self._driver_version: str | None = None
        self._devices: list[NvmlDevice] = []
        self._util_ts: dict[int, int] = {}  # device index -> last NVML sample timestamp (µs)
        # kernel id -> deque of (time, {uuid: utilisation or None})
        self._windows: dict[str, deque[tuple[float, dict[str, float | None]]]] = {}
        self._observed_since: dict[str, float] = {}
        self._last: dict[str, list[GpuUse]] = {}
        # NVML pid of another namespace -> (host pid, its start time), learned by elimination
        self._aliases: dict[int, tuple[int, str]] = {}

    # ---- set-up ----

    def _start(self) -> bool:
        """Load NVML once (through pynvml's own loader); False with a reason if impossible."""
        with self._lock:
            if self._started:
                return self._nvml is not None
            self._started = True
            if not self.enabled:
                self._reason = "GPU monitoring disabled (GpuMonitor.enabled = False)"
                return False
            try:
                import pynvml
            except ImportError:
                self._reason = "pynvml (nvidia-ml-py) is not installed"
                return False
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                self._reason = _init_reason(pynvml, e)
                self.log.info("GPU features off: %s", self._reason)
                return False
            try:
                self._driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
                count = pynvml.nvmlDeviceGetCount()
                devices = []
                for i in range(count):
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    minor: int | None
                    try:
                        minor = pynvml.nvmlDeviceGetMinorNumber(h)
                    except pynvml.NVMLError:
                        minor = None
                    try:
                        mig = bool(pynvml.nvmlDeviceGetMigMode(h)[0])
                    except pynvml.NVMLError:
                        mig = False  # not supported: a GPU without MIG
                    devices.append(
                        NvmlDevice(
                            index=i,
                            uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                            name=_text(pynvml.nvmlDeviceGetName(h)),
                            minor=minor,
                            handle=h,
                            mig=mig,
                        )
                    )
            except pynvml.NVMLError as e:
                self._reason = f"NVML error while listing GPUs: {e}"
                self.log.warning("GPU features off: %s", self._reason)
                return False
            if not devices:
                self._reason = "no NVIDIA GPU found"
                self.log.info("GPU features off: %s", self._reason)
                return False
            self._devices = devices
            self._nvml = pynvml
            self.log.info(
                "GPU monitor: driver %s, %d GPU(s): %s",
                self._driver_version,
                len(devices),
                ", ".join(f"{d.index}: {d.name}" for d in devices),
            )
            return True

    def close(self) -> None:
        """Shut NVML down (it stays loaded; a later call starts again)."""
        with self._lock:
            if self._nvml is not None:
                with contextlib.suppress(self._nvml.NVMLError):
                    self._nvml.nvmlShutdown()
            self._nvml = None
            self._started = False
            self._devices = []

    @property
    def available(self) -> bool:
        return self._start()

    @property
    def reason(self) -> str | None:
        """Why GPU features are off (None when available)."""
        self._start()
        return self._reason

    @property
    def driver_version(self) -> str | None:
        self._start()
        return self._driver_version

    # ---- devices ----

    def _memory(self, dev: NvmlDevice) -> tuple[int, int, int]:
        m = self._nvml.nvmlDeviceGetMemoryInfo(dev.handle)
        return int(m.total), int(m.used), int(m.free)

    def devices(self) -> list[dict[str, Any]]:
        """Every GPU with its memory now; [] when unavailable."""
        if not self._start():
            return []
        out = []
        with self._lock:
            for d in self._devices:
                try:
                    total, used, free = self._memory(d)
                except self._nvml.NVMLError as e:
                    self.log.warning("NVML memory query of GPU %s failed: %s", d.index, e)
                    continue
                out.append(
                    {
                        "index": d.index,
                        "uuid": d.uuid,
                        "name": d.name,
                        "memory_total": total,
                        "memory_used": used,
                        "memory_free": free,
                        "mig": d.mig,
                    }
                )
        return out

    def find_device(self, uuid: str) -> dict[str, Any] | None:
        """The device (as in devices()) with this UUID, or None."""
        for d in self.devices():
            if d["uuid"] == uuid:
                return d
        return None

    def free_memory(self, index: int) -> int:
        """Free bytes on GPU `index` (0 when unknown)."""
        if not self._start():
            return 0
        with self._lock:
            for d in self._devices:
                if d.index == index:
                    try:
                        return self._memory(d)[2]
                    except self._nvml.NVMLError:
                        return 0
        return 0

    # ---- processes and matching ----

    def _processes(self) -> list[NvmlProcess]:
        nv = self._nvml
        procs: list[NvmlProcess] = []
        for d in self._devices:
            for fn, mps in (
                (nv.nvmlDeviceGetComputeRunningProcesses, False),
                (nv.nvmlDeviceGetMPSComputeRunningProcesses_v3, True),
            ):
                try:
                    entries = fn(d.handle)
                except nv.NVMLError:
                    continue  # MPS list unsupported, GPU lost...: count what we can
                for p in entries:
                    mem = p.usedGpuMemory if p.usedGpuMemory is not None else 0
                    procs.append(NvmlProcess(d, int(p.pid), int(mem), mps))
        return procs

    def _utilization(self) -> dict[int, dict[int, float] | float]:
        """Per device: {nvml pid: sm %} from process samples since the last call, or the
        device's overall utilisation (a float) where per-process samples are unsupported."""
        nv = self._nvml
        out: dict[int, dict[int, float] | float] = {}
        for d in self._devices:
            last = self._util_ts.get(d.index, 0)
            try:
                samples = nv.nvmlDeviceGetProcessUtilization(d.handle, last)
            except nv.NVMLError as e:
                if e.value == nv.NVML_ERROR_NOT_FOUND:
                    out[d.index] = {}  # no process did GPU work since `last`
                    continue
                with contextlib.suppress(nv.NVMLError):
                    out[d.index] = float(nv.nvmlDeviceGetUtilizationRates(d.handle).gpu)
                continue
            per_pid: dict[int, list[int]] = {}
            for s in samples:
                per_pid.setdefault(int(s.pid), []).append(int(s.smUtil))
                self._util_ts[d.index] = max(self._util_ts.get(d.index, 0), int(s.timeStamp))
            out[d.index] = {pid: sum(v) / len(v) for pid, v in per_pid.items()}
        return out

    def _uses(
        self,
        matches: list[tuple[NvmlProcess, int | None, str]],
        util: dict[int, dict[int, float] | float] | None,
    ) -> tuple[list[GpuUse], dict[str, float | None]]:
        by_dev: dict[int, GpuUse] = {}
        util_now: dict[str, float | None] = {}
        for pu, host_pid, how in matches:
            u = by_dev.get(pu.dev.index)
            if u is None:
                u = by_dev[pu.dev.index] = GpuUse(
                    index=pu.dev.index,
                    uuid=pu.dev.uuid,
                    memory_bytes=0,
                    name=pu.dev.name,
                    matched_by=how,
                )
            u.memory_bytes += pu.memory
            u.mps = u.mps or pu.mps
            if how != "pid":
                u.matched_by = how
            if host_pid is not None and host_pid not in u.pids:
                u.pids.append(host_pid)
            if util is not None:
                dev_util = util.get(pu.dev.index)
                prev = util_now.get(pu.dev.uuid)
                if isinstance(dev_util, float):
                    val: float | None = dev_util  # device-level: conservative
                elif dev_util is None:
                    val = None
                else:
                    val = min(100.0, (prev or 0.0) + dev_util.get(pu.pid, 0.0))
                util_now[pu.dev.uuid] = val
        return sorted(by_dev.values(), key=lambda g: g.index), util_now

    # ---- public sampling API ----

    def usage(self, pids: set[int]) -> list[GpuUse]:
        """What these pids hold now, without touching any utilisation window."""
        if not self._start():
            return []
        with self._lock:
            try:
                procs = self._processes()
            except self._nvml.NVMLError as e:
                self.log.warning("NVML process query failed: %s", e)
                return []
            matches = match_processes(
                {"": set(pids)}, procs, self._aliases, self.device_path_prefix
            )[""]
            return self._uses(matches, None)[0]

    def sample(
        self, trees: dict[str, set[int]], now: float | None = None
    ) -> dict[str, list[GpuUse]]:
        """GPU use of each kernel (keys of `trees`); records utilisation into each
        kernel's sliding window. Kernels missing from `trees` are forgotten."""
        now = time.monotonic() if now is None else now
        if not self._start():
            return {k: [] for k in trees}
        with self._lock:
            try:
                procs = self._processes()
                util = self._utilization()
            except self._nvml.NVMLError as e:
                self.log.warning("NVML sampling failed: %s", e)
                return {k: [] for k in trees}
            matched = match_processes(trees, procs, self._aliases, self.device_path_prefix)
            for gone in set(self._windows) - set(trees):
                self.forget(gone)
            result: dict[str, list[GpuUse]] = {}
            for kid in trees:
                uses, util_now = self._uses(matched[kid], util)
                window = self._windows.setdefault(kid, deque())
                self._observed_since.setdefault(kid, now)
                window.append((now, util_now))
                while window and window[0][0] < now - self.utilization_window:
                    window.popleft()
                for u in uses:
                    vals = [v for _, e in window if (v := e.get(u.uuid)) is not None]
                    u.utilization = sum(vals) / len(vals) if vals else None
                self._last[kid] = uses
                result[kid] = uses
            return result

    def is_gpu_idle(
        self, kernel_id: str, threshold_percent: float, now: float | None = None
    ) -> bool:
        """True when the kernel holds no GPU, or its utilisation stayed under
        `threshold_percent` on every GPU for the whole window. Unknown utilisation
        (NVML gives none) does not count as busy."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._last.get(kernel_id):
                return True
            since = self._observed_since.get(kernel_id, now)
            if now - since < self.utilization_window:
                return False  # not watched long enough to say
            window = self._windows.get(kernel_id, ())
            for t, entry in window:
                if t < now - self.utilization_window:
                    continue
                for v in entry.values():
                    if v is not None and v >= threshold_percent:
                        return False
            return True

    def forget(self, kernel_id: str) -> None:
        """Drop a kernel's history (it was shut down, or its process was replaced)."""
        with self._lock:
            self._windows.pop(kernel_id, None)
            self._observed_since.pop(kernel_id, None)
            self._last.pop(kernel_id, None)

    def status(self) -> dict[str, Any]:
        """JSON for /api/cedana/status."""
        return {
            "available": self.available,
            "reason": self.reason,
            "driver_version": self.driver_version,
            "devices": self.devices(),
        }


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _init_reason(nv: Any, e: Any) -> str:
    value = getattr(e, "value", None)
    if value == nv.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "no NVIDIA driver (libnvidia-ml.so.1 not found)"
    if value == nv.NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVIDIA driver not loaded"
    if value == nv.NVML_ERROR_NO_PERMISSION:
        return "no permission to use the NVIDIA driver"
    return f"NVML initialisation failed: {e}"
