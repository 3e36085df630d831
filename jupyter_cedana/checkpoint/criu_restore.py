"""A kernel's `criu restore`: started under cedana-init's keeper with the tree left
stopped, and waited for until CRIU names the restored root (engine.py's start_restore
and wait_restored; the resume continues the tree once its image is known to be right)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

from ..errors import ResumeFailed
from .dumping import criu_errors
from .procmount import MOUNT_NS_ARGS

__all__ = ["RestoreSettings", "start_criu_restore", "wait_criu_restore"]


class RestoreSettings(Protocol):
    """What a restore reads of the engine (engine.CheckpointEngine), declared here so that
    the engine depends on this module and not the other way round."""

    kernels_die_with_server: bool
    extra_restore_args: list[str]
    log: Any

    def init_binary(self) -> str: ...
    def plugin_dir(self) -> str: ...
    def criu_env(self) -> dict[str, str] | None: ...


def start_criu_restore(
    engine: RestoreSettings,
    criu: list[str],
    images: Path,
    work: Path,
    pidfile: Path,
    lazy: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `criu restore -d` (`criu`: the command that runs CRIU) under cedana-init's
    keeper, a child subreaper that becomes the restored tree's parent once CRIU exits
    (reaping it, so the kernel never lingers as a zombie) and exits when the tree does:
    the returned process stands for the kernel. The tree is left stopped: the caller
    continues it (SIGCONT) once the image's checksums, verified meanwhile, are known to
    be right. `lazy`: the memory pages come from a page server listening in `work`
    (lazy.PageServer)."""
    keeper = [engine.init_binary(), "--keeper", str(pidfile)]
    if engine.kernels_die_with_server:
        keeper += ["--die-with-parent", "--parent-pid", str(os.getpid())]
    cmd = [
        *keeper,
        "--",
        *criu,
        "restore",
        "-d",
        "--libdir",
        engine.plugin_dir(),
        "-D",
        str(images),
        "-W",
        str(work),
        "-o",
        "restore.log",
        "-v4",
        "--tcp-close",
        "--file-locks",
        "--pidfile",
        str(pidfile),
        "--leave-stopped",
        *(["--lazy-pages"] if lazy else []),
        # The kernel's mount namespace (cedana-init --pidns): rooted at ours again.
        *(["--root", "/", *MOUNT_NS_ARGS] if any(images.glob("mountpoints-*.img")) else []),
        *engine.extra_restore_args,
    ]
    engine.log.debug("running %s", " ".join(cmd))
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=engine.criu_env(),
    )


async def wait_criu_restore(
    proc: subprocess.Popen[bytes], work: Path, pidfile: Path, timeout: float
) -> int:
    """Wait until CRIU reports the restored root's PID; raise with CRIU's reason if not,
    or once `timeout` seconds have passed."""
    t0 = time.monotonic()
    while True:
        try:
            text = pidfile.read_text().strip()
            if text:
                return int(text)
        except (FileNotFoundError, ValueError):
            pass
        rc = proc.poll()
        if rc is not None:
            # Let CRIU's own message explain; the image is left untouched.
            raise ResumeFailed(
                f"CRIU restore failed (exit {rc}): {criu_errors(work / 'restore.log')}"
            )
        if time.monotonic() - t0 > timeout:
            # The caller kills it (engine.kill_restore, in a thread: it waits for CRIU).
            raise ResumeFailed(f"CRIU restore took longer than {timeout:.0f} s")
        # Often: every resume waits for this, and its first output with it.
        await asyncio.sleep(0.005)
