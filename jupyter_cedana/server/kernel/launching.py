"""How a kernel is started so that it can be checkpointed: by a root server under
cedana-init (native/cedana-init.c), which reports the kernel's PID in a pidfile, with its
output in a file of its own; or by the checkpoint agent, under its own cedana-init."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from jupyter_client.launcher import launch_kernel

from ...checkpoint.engine import CheckpointEngine
from ...checkpoint.launch import check_executable, ipykernel_options, is_ipykernel
from .agent_kernel import AgentKernel
from .checkpoint_agent import CheckpointAgent


def text_key(connection_info: Any) -> dict[str, Any]:
    """The connection info with its key as text (as JSON and the agent take it)."""
    info = dict(connection_info)
    key = info.get("key", b"")
    info["key"] = key.decode() if isinstance(key, bytes) else str(key)
    return info


async def launch_under_init(
    engine: CheckpointEngine, kernel_id: str, cmd: list[str], kw: dict[str, Any]
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `cmd` with the (scrubbed) launch options `kw`; returns cedana-init's process
    and the PID it reports."""
    store = engine.store
    store.ensure_root()
    pidfile = store.root / f".{kernel_id}.pid"
    pidfile.unlink(missing_ok=True)
    wrapped = [engine.init_binary()]
    if engine.pidns:
        wrapped.append("--pidns")
    if engine.kernels_die_with_server:
        wrapped += ["--die-with-parent", "--parent-pid", str(os.getpid())]
    # The init leaves the user's directory for a private one of ours (cedana-init.c:
    # --chdir), where CRIU makes its /proc mount point.
    wrapped += ["--chdir", str(store.work_dir(kernel_id))]
    kw = dict(kw)
    env = dict(kw.pop("env", None) or os.environ)
    check_executable(cmd, env, kw.get("cwd"))
    cmd = ipykernel_options(cmd, history_in_memory=engine.ipython_history_in_memory)
    if is_ipykernel(cmd):
        # An interrupt while the kernel is still starting would kill it (Python's
        # default SIGINT handler, before ipykernel ignores SIGINT); it is lost
        # instead. A running cell is interrupted as before (cedana-init.c).
        wrapped.append("--ignore-sigint")
    wrapped += ["--pidfile", str(pidfile), "--", *cmd]
    # ipykernel polls this PID and exits when it changes, which it does after a restore.
    env.pop("JPY_PARENT_PID", None)
    # A file only this kernel writes: a shared log that grows after a dump would make
    # CRIU refuse the restore ("has bad size").
    log_fd = os.open(store.log_path(kernel_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        kw.update(stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, env=env)
        kw["independent"] = True
        process = launch_kernel(wrapped, **kw)
    finally:
        os.close(log_fd)
    return process, await read_pidfile(pidfile, process)


async def read_pidfile(pidfile: Path, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            text = pidfile.read_text().strip()
            if text:
                pidfile.unlink(missing_ok=True)
                return int(text)
        except (FileNotFoundError, ValueError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"cedana-init exited with {proc.returncode} before starting")
        await asyncio.sleep(0.01)
    raise RuntimeError("cedana-init did not report the kernel's PID in 30 s")


async def launch_at_agent(
    agent: CheckpointAgent,
    engine: CheckpointEngine,
    kernel_id: str,
    cmd: list[str],
    kw: dict[str, Any],
    meta: dict[str, Any],
) -> tuple[AgentKernel, int, str]:
    """The agent launches `cmd`, as this server's user; returns the kernel there, the PID
    of its init and its working directory. `meta` is what the agent keeps of it."""
    kw = dict(kw)
    env = dict(kw.pop("env", None) or os.environ)
    cwd = str(Path(kw.get("cwd") or Path.cwd()).resolve())
    check_executable(cmd, env, cwd)
    cmd = ipykernel_options(cmd, history_in_memory=engine.ipython_history_in_memory)
    remote = agent.kernel(kernel_id)
    meta = {**meta, "cwd": cwd}
    pid = await remote.launch(cmd, env, cwd, ignore_sigint=is_ipykernel(cmd), meta=meta)
    return remote, pid, cwd
