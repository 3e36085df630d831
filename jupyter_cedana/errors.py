"""Typed errors: each carries a machine-readable code and the HTTP status the API answers with."""

from __future__ import annotations


class CedanaError(Exception):
    """Base of every error the extension reports to a user."""

    code = "error"
    status = 500

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class NotFound(CedanaError):
    code = "not_found"
    status = 404


class InvalidId(CedanaError):
    code = "invalid_id"
    status = 404


class Conflict(CedanaError):
    """A transition the kernel's current state does not allow."""

    code = "conflict"
    status = 409


class BadRequest(CedanaError):
    code = "bad_request"
    status = 400


class EngineUnavailable(CedanaError):
    code = "engine_unavailable"
    status = 503


class SuspendFailed(CedanaError):
    code = "suspend_failed"
    status = 500


class ResumeFailed(CedanaError):
    code = "resume_failed"
    status = 500


class CheckpointCorrupt(ResumeFailed):
    code = "checkpoint_corrupt"


class NotCheckpointable(CedanaError):
    """The driver or CRIU cannot checkpoint this kernel (preflight refusal)."""

    code = "not_checkpointable"
    status = 409


class InsufficientStorage(CedanaError):
    """A dump would not fit in the checkpoint budget or on the checkpoint disk."""

    code = "insufficient_storage"
    status = 507


class InsufficientGpuMemory(CedanaError):
    """Restore admission: no GPU has room for the kernel's device memory."""

    code = "insufficient_gpu_memory"
    status = 503


class GpuError(CedanaError):
    """The CUDA driver or the native helper reported an error."""

    code = "gpu_error"
    status = 500


class InsufficientHostMemory(CedanaError):
    """The GPU offload would not fit in host memory (machine or cgroup limit)."""

    code = "insufficient_host_memory"
    status = 503
