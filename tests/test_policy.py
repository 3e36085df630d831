"""SuspendPolicy decisions: pure functions of a kernel's facts."""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_cedana.policy import KernelFacts, SuspendPolicy


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
