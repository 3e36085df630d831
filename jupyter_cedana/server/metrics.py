"""Prometheus metrics, served on jupyter_server's own /metrics (the default registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)

SUSPENDS = Counter("cedana_suspends_total", "Kernels suspended.", ["tier"])
RESUMES = Counter("cedana_resumes_total", "Kernels resumed.", ["tier"])
FAILURES = Counter("cedana_failures_total", "Failed suspends and resumes.", ["operation", "reason"])
SUSPEND_SECONDS = Histogram(
    "cedana_suspend_duration_seconds", "Time to suspend a kernel.", buckets=_BUCKETS
)
RESUME_SECONDS = Histogram(
    "cedana_resume_duration_seconds", "Time to resume a kernel.", buckets=_BUCKETS
)
CHECKPOINT_BYTES = Gauge("cedana_checkpoint_bytes", "Bytes of checkpoint images on disk.")
SUSPENDED_KERNELS = Gauge("cedana_suspended_kernels", "Kernels suspended now.")
GPU_MEMORY_FREED = Gauge(
    "cedana_gpu_memory_freed_bytes", "GPU memory freed now by suspended kernels."
)
GPU_SECONDS_RECLAIMED = Counter(
    "cedana_gpu_seconds_reclaimed_total",
    "GPU-seconds during which suspended kernels held no GPU they held before.",
)
