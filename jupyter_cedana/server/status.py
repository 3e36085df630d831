"""`GET /api/cedana/status`: what this server can checkpoint, where, and how much room is
left (docs/rest-api.yaml, schema Status)."""

from __future__ import annotations

from typing import Any

from ..checkpoint.engine import CheckpointEngine
from .agent_start import started_agent
from .limits import Budget, TransitionQueue


def server_status(
    engine: CheckpointEngine,
    gpu_monitor: Any,
    budget: Budget,
    queue: TransitionQueue,
    agent_socket: str | None = None,
    agent_features: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """`agent_socket`: the checkpoint agent's, when this server uses one, and
    `agent_features` what it said it can do."""
    info = engine.probe()
    usage = engine.store.usage()
    gpu: dict[str, Any] = {
        "available": False,
        "reason": "GPU monitor not loaded",
        "driver_version": None,
        "devices": [],
        "checkpoint": False,
    }
    if gpu_monitor is not None:
        gpu["available"] = bool(gpu_monitor.available)
        gpu["reason"] = gpu_monitor.reason
        gpu["driver_version"] = gpu_monitor.driver_version
        gpu["devices"] = gpu_monitor.devices() if gpu_monitor.available else []
    gpu["checkpoint"], cuda_reason = engine.cuda_status()
    if agent_socket:
        # The agent's driver, not this server's, checkpoints GPU memory: whether it can is
        # known at each dump (a GPU kernel it cannot checkpoint is refused, never dumped
        # without its GPU memory).
        gpu["checkpoint"] = "gpu" in agent_features
        cuda_reason = (
            None
            if gpu["checkpoint"]
            else "this checkpoint agent does not checkpoint GPU memory (an older version)"
        )
    if gpu["available"] and not gpu["checkpoint"]:
        gpu["reason"] = f"GPU memory cannot be checkpointed: {cuda_reason}"
    return {
        "available": info.available,
        "reason": info.reason,
        "criu_version": info.criu_version,
        "root": info.pidns,
        "agent_socket": agent_socket or None,
        "agent_started": started_agent(agent_socket) if agent_socket else None,
        "checkpoint_root": str(engine.store.root),
        "bytes_used": usage.bytes_used,
        "bytes_free": usage.bytes_free,
        "budget": budget.snapshot(),
        "queued": queue.counts(),
        "gpu": gpu,
        "warnings": _warnings(engine, info),
    }


def _warnings(engine: CheckpointEngine, info: Any) -> list[str]:
    """What slows checkpointing down here, for admins (the server logs it at start)."""
    out = []
    if info.available and (why := engine.criu_cache_problem()):
        out.append(
            f"CRIU probes the Linux kernel again on every suspend and resume (~30 ms): {why}"
        )
    return out
