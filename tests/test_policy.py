"""SuspendPolicy decisions: pure functions of a kernel's facts."""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_cedana.server.policy import (
    KernelFacts,
    SuspendPolicy,
    retention_ended,
    retention_left,
    suspended_for,
)
from jupyter_cedana.timestamps import SuspendClock, stamp


def facts(**kw: Any) -> KernelFacts:
    base: dict[str, Any] = dict(
        kernel_id="k",
        kernelspec="python3",
        spec_metadata={},
        state="running",
        tier=None,
        execution_state="idle",
        idle_seconds=100.0,
        connections=1,
        gpu_memory_bytes=0,
        gpu_idle=True,
        keep_awake_seconds=0.0,
        suspended_seconds=0.0,
        managed=True,
    )
    base.update(kw)
    return KernelFacts(**base)


def test_idle_kernel_is_suspended_after_the_timeout() -> None:
    p = SuspendPolicy(idle_timeout=60)
    assert p.decide(facts(idle_seconds=59)).action is None
    assert p.decide(facts(idle_seconds=59)).due_in == 1
    d = p.decide(facts(idle_seconds=61))
    assert d.action == "disk" and d.due_in == 0


def test_busy_or_starting_kernels_are_left_alone() -> None:
    p = SuspendPolicy(idle_timeout=60)
    for state in ("busy", "starting"):
        assert p.decide(facts(execution_state=state, idle_seconds=1e6)).action is None


def test_kernelspec_metadata_overrides_the_timeout() -> None:
    p = SuspendPolicy(idle_timeout=60)
    long = facts(idle_seconds=100, spec_metadata={"cedana": {"idle_timeout": 3600}})
    assert p.decide(long).action is None
    assert p.decide(long).due_in == 3500
    short = facts(idle_seconds=11, spec_metadata={"cedana": {"idle_timeout": 10}})
    assert p.decide(short).action == "disk"
    never = facts(idle_seconds=1e6, spec_metadata={"cedana": {"exclude": True}})
    assert p.decide(never).action is None and "excluded" in (p.decide(never).reason or "")


def test_exclusions_and_reasons() -> None:
    p = SuspendPolicy(idle_timeout=60, excluded_kernelspecs=["ir"])
    d = p.decide(facts(kernelspec="ir", idle_seconds=1e6))
    assert d.action is None and "excluded" in (d.reason or "")
    d = p.decide(facts(managed=False, idle_seconds=1e6))
    assert d.action is None and "cedana-provisioner" in (d.reason or "")
    d = SuspendPolicy(idle_timeout=0).decide(facts(idle_seconds=1e6))
    assert d.action is None and "off" in (d.reason or "")


def test_connected_clients_and_keep_awake() -> None:
    p = SuspendPolicy(idle_timeout=60, suspend_connected=False)
    d = p.decide(facts(idle_seconds=100, connections=2))
    assert d.action is None and "connected" in (d.reason or "")
    assert p.decide(facts(idle_seconds=100, connections=0)).action == "disk"
    p = SuspendPolicy(idle_timeout=60)
    d = p.decide(facts(idle_seconds=100, keep_awake_seconds=30))
    assert d.action is None and d.due_in == 30


def test_gpu_thresholds() -> None:
    p = SuspendPolicy(idle_timeout=60, suspend_cpu_kernels=False, min_gpu_memory=1 << 30)
    assert "GPU" in (p.decide(facts(idle_seconds=100)).reason or "")
    small = facts(idle_seconds=100, gpu_memory_bytes=1 << 20)
    assert p.decide(small).action is None
    big = facts(idle_seconds=100, gpu_memory_bytes=2 << 30)
    assert p.decide(big).action == "disk"
    # GPU still in use: not idle by the GPU measure, whatever Jupyter says.
    assert (
        p.decide(facts(idle_seconds=100, gpu_memory_bytes=2 << 30, gpu_idle=False)).action is None
    )


def test_offload_tier_then_disk_then_retention() -> None:
    p = SuspendPolicy(idle_timeout=600, offload_timeout=60, retention=3600)
    gpu = dict(gpu_memory_bytes=4 << 30)
    assert p.decide(facts(idle_seconds=100, **gpu)).action == "offload"
    # A CPU kernel never goes to the offload tier.
    assert p.decide(facts(idle_seconds=100)).action is None
    offloaded = facts(state="suspended", tier="offload", idle_seconds=601, **gpu)
    assert p.decide(offloaded).action == "disk"
    on_disk = facts(state="suspended", tier="disk", suspended_seconds=3601)
    assert p.decide(on_disk).action == "shutdown"
    assert p.decide(facts(state="suspended", tier="disk", suspended_seconds=10)).due_in == 3590


def test_policy_offload_then_disk() -> None:
    gpu = 4 << 30
    policy = SuspendPolicy(offload_timeout=60, idle_timeout=600)
    d = policy.decide(facts(idle_seconds=10, gpu_memory_bytes=gpu))
    assert d.action is None and d.due_in == pytest.approx(50)
    assert policy.decide(facts(idle_seconds=61, gpu_memory_bytes=gpu)).action == "offload"
    # offloaded: to disk once idle_timeout is reached, not before
    offloaded = {"state": "suspended", "tier": "offload"}
    assert policy.decide(facts(idle_seconds=300, **offloaded, gpu_memory_bytes=gpu)).action is None
    assert (
        policy.decide(facts(idle_seconds=601, **offloaded, gpu_memory_bytes=gpu)).action == "disk"
    )
    # a kernel busy on the GPU is left alone; a CPU kernel skips the offload tier
    assert (
        policy.decide(facts(idle_seconds=61, gpu_idle=False, gpu_memory_bytes=gpu)).action is None
    )
    assert policy.decide(facts(idle_seconds=61, gpu_memory_bytes=0)).action is None
    assert policy.decide(facts(idle_seconds=601, gpu_memory_bytes=0)).action == "disk"
    # offload_timeout >= idle_timeout: straight to disk
    late = SuspendPolicy(offload_timeout=600, idle_timeout=600)
    assert late.decide(facts(idle_seconds=601, gpu_memory_bytes=gpu)).action == "disk"
    # a disk-suspended kernel is not touched again
    assert (
        policy.decide(
            facts(idle_seconds=9999, state="suspended", tier="disk", gpu_memory_bytes=gpu)
        ).action
        is None
    )


def test_retention_applies_to_failed_kernels_too() -> None:
    """A kernel whose resume failed keeps its image; past retention it is shut down and
    its image goes, as a suspended kernel's does, rather than hold the disk forever."""
    p = SuspendPolicy(retention=3600)
    assert p.decide(facts(state="failed", suspended_seconds=3601)).action == "shutdown"
    kept = p.decide(facts(state="failed", suspended_seconds=600))
    assert kept.action is None and kept.due_in == 3000
    forever = SuspendPolicy(retention=0).decide(facts(state="failed", suspended_seconds=1e9))
    assert forever.action is None and forever.due_in is None


class FakeClock:
    """The three clocks retention reads, set by the test."""

    def __init__(self, wall: float, boottime: float, boot_id: str = "boot-a"):
        self.wall_s, self.boottime_s, self.boot = wall, boottime, boot_id

    def wall(self) -> float:
        return self.wall_s

    def boottime(self) -> float:
        return self.boottime_s

    def boot_id(self) -> str | None:
        return self.boot

    def run(self, seconds: float) -> None:
        self.wall_s += seconds
        self.boottime_s += seconds

    def reboot(self, down: float, boot_id: str) -> None:
        self.wall_s += down
        self.boottime_s, self.boot = 0.0, boot_id


DAY = 86400.0


def test_a_wall_clock_set_forward_does_not_end_retention() -> None:
    clock = FakeClock(wall=1_800_000_000.0, boottime=5000.0)
    since = stamp(clock)
    clock.run(3600)
    clock.wall_s += 30 * DAY  # NTP, or an admin, sets the clock a month forward
    assert not retention_ended(DAY, since, clock)
    assert retention_left(DAY, suspended_for(since, DAY, clock)) == pytest.approx(DAY - 3600)
    clock.run(DAY - 3600 + 1)  # a day of real time since the suspend
    assert retention_ended(DAY, since, clock)


def test_a_reboot_with_a_clock_set_forward_leaves_half_the_retention() -> None:
    """Across a reboot only the wall clock spans the time the machine was down, and it may
    have been set wrong at boot: it may count up to half the retention for that time, so
    a kernel is kept at least half its retention after a reboot, whatever the clock did."""
    clock = FakeClock(wall=1_800_000_000.0, boottime=5000.0)
    since = stamp(clock)
    clock.run(600)
    clock.reboot(down=120, boot_id="boot-b")
    clock.wall_s += 365 * DAY  # the clock came up a year ahead
    clock.run(60)
    assert not retention_ended(DAY, since, clock)
    assert suspended_for(since, DAY, clock) == pytest.approx(DAY / 2 + 60)
    clock.run(DAY / 2 - 61)
    assert not retention_ended(DAY, since, clock)
    clock.run(2)
    assert retention_ended(DAY, since, clock)


def test_a_reboot_with_a_right_clock_counts_the_time_down() -> None:
    clock = FakeClock(wall=1_800_000_000.0, boottime=5000.0)
    since = stamp(clock)
    clock.run(3600)
    clock.reboot(down=4 * 3600, boot_id="boot-b")
    clock.run(60)
    # Less than half the retention: the wall clock is taken as it is.
    assert suspended_for(since, DAY, clock) == pytest.approx(5 * 3600 + 60)
    assert not retention_ended(DAY, since, clock)


def test_a_clock_set_back_never_adds_time() -> None:
    clock = FakeClock(wall=1_800_000_000.0, boottime=5000.0)
    since = stamp(clock)
    clock.run(600)
    clock.wall_s -= 10 * DAY
    assert suspended_for(since, DAY, clock) == pytest.approx(600)
    # A suspend time known only by the wall clock (e.g. an older park record) counts no
    # less than zero, and no more than this boot's uptime plus half the retention.
    assert suspended_for(clock.wall_s + 50, DAY, clock) == 0.0
    assert suspended_for(clock.wall_s - 100 * DAY, DAY, clock) == pytest.approx(5600 + DAY / 2)


def test_the_real_clock_reads() -> None:
    clock = SuspendClock()
    now = stamp(clock)
    assert now.boottime is not None and now.boottime > 0
    assert now.boot_id and now.boot_id == clock.boot_id()
    assert suspended_for(now, DAY, clock) == pytest.approx(0.0, abs=5.0)
