"""The kernel command line and environment a checkpointable launch needs, done so that
every kernel client sees what the stock LocalProvisioner would give it (options it passed
kept once, a missing executable raising FileNotFoundError at start)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def has_option(cmd: list[str], name: str) -> bool:
    """Whether `cmd` sets the traitlets option `--name` (as `--name=v` or `--name v`);
    IPython refuses an option given twice."""
    flag = f"--{name}"
    return any(part == flag or part.startswith(flag + "=") for part in cmd)


def is_ipykernel(cmd: list[str]) -> bool:
    return any("ipykernel" in part for part in cmd)


def ipykernel_options(cmd: list[str], *, history_in_memory: bool) -> list[str]:
    """Add our IPython options to an ipykernel command line, never over the client's own."""
    if history_in_memory and is_ipykernel(cmd) and not has_option(cmd, "HistoryManager.hist_file"):
        return [*cmd, "--HistoryManager.hist_file=:memory:"]
    return cmd


def check_executable(
    cmd: list[str], env: dict[str, str], cwd: str | os.PathLike[str] | None
) -> None:
    """Raise what Popen would if the kernel's executable cannot be run: the kernel is
    started by cedana-init, whose failed exec would otherwise look like a kernel that
    died at once."""
    exe = os.path.expanduser(cmd[0])
    if os.sep in exe:
        candidates = [Path(cwd or ".", exe)]
    else:
        candidates = [Path(d or ".", exe) for d in os.get_exec_path(env)]
    denied = None
    for path in candidates:
        if path.is_file():
            if os.access(path, os.X_OK):
                return
            denied = path
    if denied is not None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), exe)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), exe)


def output_tail(path: Path, limit: int = 4096) -> str:
    """The end of a kernel's stdout and stderr (its log file), for the server's log when
    it dies: launched by the stock provisioner, that output would be on the server's
    terminal."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
