"""Suspend policy: when an idle kernel is suspended, and to which tier, and when a
suspended (or failed) kernel's retention ends.

Pure decisions over a snapshot of a kernel, so they can be tested without a server.

Retention deletes images, so a wall clock set forward must not end it. How long a kernel
has been suspended (`suspended_for`) is measured:

- within the boot it was suspended in, on CLOCK_BOOTTIME, which no one sets: a jump of
  the wall clock changes nothing;
- across a reboot, as this boot's uptime (CLOCK_BOOTTIME again) plus what the wall clock
  says of the time before this boot, believed up to half the retention: a machine may
  boot with its clock wrong, so after a reboot every kernel is kept at least half its
  retention, whatever the clock did; with a right clock, a kernel whose time was
  nearly up before the reboot is kept up to half its retention longer than asked;
- for a suspend time known only by the wall clock (e.g. from a park record), as the wall
  clock says, at least 0 and at most this boot's uptime plus half the retention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from traitlets import Bool, Float, Integer, List, Unicode
from traitlets.config import LoggingConfigurable

from ..timestamps import CLOCK, Clock, Stamp


@dataclass
class KernelFacts:
    """What the policy looks at, gathered by the manager on each check."""

    kernel_id: str
    kernelspec: str
    spec_metadata: dict[str, Any]
    state: str  # provisioner state: running, suspended, ...
    tier: str | None
    execution_state: str
    idle_seconds: float
    connections: int
    gpu_memory_bytes: int
    gpu_idle: bool
    keep_awake_seconds: float  # > 0 while a keep-awake is in force
    suspended_seconds: float  # retention time counted: since suspend (or failure)
    managed: bool  # started by cedana-provisioner
    extra_reasons: list[str] = field(default_factory=list)


@dataclass
class Decision:
    action: str | None  # "offload", "disk", "shutdown" or None
    reason: str | None  # why it cannot be suspended, or why it is being acted on
    due_in: float | None  # seconds until the next automatic action, if one is planned


def retention_left(retention: float, suspended_seconds: float) -> float | None:
    """Seconds a suspended kernel is still kept (<= 0: shut it down and delete its image);
    None: kept until a user shuts it down. The one retention rule, for the policy, the
    culler and adoption."""
    return retention - suspended_seconds if retention > 0 else None


#: The part of the retention that the wall clock may count, across a reboot, for the
#: time before it (see the module docstring).
BELIEVED_ACROSS_REBOOT = 0.5


def suspended_for(since: Stamp | float | None, retention: float, clock: Clock = CLOCK) -> float:
    """Seconds since `since` (a suspend), as retention counts them."""
    if since is None:
        return 0.0
    if not isinstance(since, Stamp):
        since = Stamp(float(since))
    up = clock.boottime()
    now_boot = clock.boot_id()
    if up is not None and since.boottime is not None and since.boot_id == now_boot:
        return max(0.0, up - since.boottime)
    wall = max(0.0, clock.wall() - since.wall)
    if up is None:
        return wall  # no boot clock here: the wall clock is all there is
    cap = BELIEVED_ACROSS_REBOOT * retention if retention > 0 else float("inf")
    if since.boot_id is not None and since.boot_id != now_boot and now_boot is not None:
        return up + min(max(0.0, wall - up), cap)  # surely suspended for all of this boot
    return min(wall, up + cap)


def retention_ended(
    retention: float, suspended_at: Stamp | float | None, clock: Clock = CLOCK
) -> bool:
    if not suspended_at or retention <= 0:
        return False
    left = retention_left(retention, suspended_for(suspended_at, retention, clock))
    return left is not None and left <= 0


class SuspendPolicy(LoggingConfigurable):
    """Idle timeouts, GPU thresholds, exclusions and retention for automatic suspend."""

    idle_timeout = Float(
        1800.0,
        help="Seconds a kernel must be idle (no execution, no messages) before it is "
        "suspended to disk. 0 disables automatic suspend; manual suspend still works. "
        "A kernelspec may override it with metadata {'cedana': {'idle_timeout': N}}.",
    ).tag(config=True)

    offload_timeout = Float(
        0.0,
        help="Seconds of idleness after which a kernel holding GPU memory is offloaded: its "
        "GPU memory is moved to host memory and the GPU freed while the process stays. "
        "It goes to disk when idle_timeout is reached. 0 disables the offload tier.",
    ).tag(config=True)

    check_interval = Float(
        30.0, help="Seconds between two checks of every kernel against the policy."
    ).tag(config=True)

    suspend_cpu_kernels = Bool(
        True,
        help="Also suspend idle kernels that hold no GPU memory (frees their host memory).",
    ).tag(config=True)

    min_gpu_memory = Integer(
        0,
        help="Bytes of GPU memory a kernel must hold to be worth suspending for its GPU; "
        "kernels below it are treated like CPU kernels (see suspend_cpu_kernels).",
    ).tag(config=True)

    gpu_utilization_threshold = Float(
        5.0,
        help="A kernel is GPU-idle when the GPU utilisation of its processes stays under "
        "this percentage for the whole gpu_utilization_window.",
    ).tag(config=True)

    gpu_utilization_window = Float(
        300.0, help="Seconds over which GPU utilisation must stay under the threshold."
    ).tag(config=True)

    excluded_kernelspecs = List(
        Unicode(),
        help="Kernelspec names never suspended automatically (manual suspend still works).",
    ).tag(config=True)

    suspend_connected = Bool(
        True,
        help="Whether kernels with connected clients (open notebooks) may be suspended. "
        "Resume is transparent, so this is on by default; jupyter_server's culler calls "
        "the same idea cull_connected.",
    ).tag(config=True)

    max_checkpoint_bytes = Integer(
        0,
        help="Most bytes all checkpoint images together may use. Each dump reserves its "
        "estimated size (the kernel's memory plus its GPU memory) before it starts, so "
        "concurrent suspends cannot overshoot it; a suspend that would go over it is "
        "refused (the kernel keeps running). Images that no kernel owns (left by a crash) "
        "do not count. 0: no limit but the disk (see SuspendLimits.min_free_disk_bytes).",
    ).tag(config=True)

    retention = Float(
        0.0,
        help="Seconds a suspended kernel is kept; after that it is shut down and its image "
        "deleted. Parked kernels (KernelParking) count from their suspend too: past it they "
        "are not adopted and their image is removed. A kernel whose resume failed counts "
        "from its suspend (or its failure) and is shut down too, its image with it. Time "
        "is counted on the boot clock, which a wall clock set forward does not move; "
        "across a reboot the wall clock may count at most half the retention for the time "
        "before it, so a kernel is kept at least half its retention after a reboot. 0 "
        "keeps them until a user shuts them down.",
    ).tag(config=True)

    def idle_timeout_for(self, facts: KernelFacts) -> float:
        meta = facts.spec_metadata.get("cedana") or {}
        try:
            return float(meta.get("idle_timeout", self.idle_timeout))
        except (TypeError, ValueError):
            return self.idle_timeout

    def why_not(self, facts: KernelFacts) -> str | None:
        """Why automatic suspend does not apply to this kernel at all, or None."""
        if not facts.managed:
            return "not started by cedana-provisioner (its kernelspec opts out)"
        meta = facts.spec_metadata.get("cedana") or {}
        if facts.kernelspec in self.excluded_kernelspecs or meta.get("exclude"):
            return f"kernelspec {facts.kernelspec!r} is excluded by policy"
        if self.idle_timeout_for(facts) <= 0 and self.offload_timeout <= 0:
            return "automatic suspend is off (idle_timeout = 0)"
        holds_gpu = facts.gpu_memory_bytes > 0 and facts.gpu_memory_bytes >= self.min_gpu_memory
        if not holds_gpu and not self.suspend_cpu_kernels:
            return "holds no GPU memory worth freeing (suspend_cpu_kernels is off)"
        if facts.extra_reasons:
            return "; ".join(facts.extra_reasons)
        return None

    def decide(self, facts: KernelFacts) -> Decision:
        if facts.state == "failed":
            # Its image stays for another resume; not forever (it holds the disk budget).
            left = retention_left(self.retention, facts.suspended_seconds)
            if left is None:
                return Decision(None, None, None)
            if left <= 0:
                return Decision("shutdown", "retention time of a failed kernel ended", 0)
            return Decision(None, None, left)
        if facts.state == "suspended":
            if facts.tier == "offload":
                remaining = self.idle_timeout_for(facts) - facts.idle_seconds
                if self.idle_timeout_for(facts) > 0 and remaining <= 0:
                    return Decision("disk", "offloaded kernel reached idle_timeout", None)
            left = retention_left(self.retention, facts.suspended_seconds)
            if left is not None:
                if left <= 0:
                    return Decision("shutdown", "retention time of a suspended kernel ended", 0)
                return Decision(None, None, left)
            return Decision(None, None, None)
        if facts.state != "running":
            return Decision(None, None, None)
        why = self.why_not(facts)
        if why:
            return Decision(None, why, None)
        # Everything below is a postponement, not a refusal: the kernel is suspendable.
        wait = max(0.0, facts.keep_awake_seconds)
        timeout = self.idle_timeout_for(facts)
        holds_gpu = facts.gpu_memory_bytes > 0 and facts.gpu_memory_bytes >= self.min_gpu_memory
        tier, limit = "disk", timeout
        offload_first = timeout <= 0 or self.offload_timeout < timeout
        if holds_gpu and self.offload_timeout > 0 and offload_first:
            tier, limit = "offload", self.offload_timeout
        if limit <= 0:
            return Decision(None, None, None)
        wait = max(wait, limit - facts.idle_seconds)
        if facts.execution_state not in ("idle",):
            return Decision(None, None, None)
        if facts.connections and not self.suspend_connected:
            return Decision(None, "has connected clients (suspend_connected is off)", None)
        if holds_gpu and not facts.gpu_idle:
            return Decision(None, None, None)
        if wait > 0:
            return Decision(None, None, wait)
        return Decision(tier, f"idle for {facts.idle_seconds:.0f} s", 0)
