"""Launching a kernel for a caller, and the ops on a launched kernel's process.

The kernel runs under cedana-init in its own PID and mount namespace, built as root;
then the namespace's init drops to the caller's uid, gid and groups (from the databases,
never from the request), loses every capability and sets no_new_privs before it forks
the kernel, which inherits all of it (cedana-init --user). The whole tree CRIU dumps is
then the caller's, which lets a CRIU with the caller's real ids read its rlimits where
root lacks CAP_SYS_RESOURCE (criu.py). A tree whose namespace the user built could not be
dumped by root CRIU, and one the user could build with capabilities would make the user
root.

The kernel is the agent's child, not the server's: a server that dies leaves it running,
and a new server of the same uid finds it with `list`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from ..package_files import BIN_DIR
from . import protocol
from .imagestore import ImageStore, manifest_meta
from .kernels import KernelRecord, State
from .protocol import AgentError
from .records import MAX_META, meta_size
from .service import Caller, Progress, Service, check_root_file

# Variables that steer the dynamic loader or libc of a process (cedana-init's watcher and
# init run as root with the request's environment) or CRIU (which the agent runs): none
# of them reaches a kernel. glibc drops the same list for setuid programs
# (sysdeps/generic/unsecvars.h); TMPDIR and TZDIR stay, the kernel legitimately uses them
# and no root code of ours reads them.
_DROP_PREFIXES = ("LD_", "CRIU_", "MALLOC_")
_DROP_NAMES = frozenset(
    {
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        # ipykernel exits when this PID changes, which it does after a restore.
        "JPY_PARENT_PID",
    }
)
# What reaches a kernel: cedana-init forwards these to the kernel's process group
# (cedana-init.c, `forwarded`); SIGKILL ends the init and with it the namespace. A PID 1
# receives no other signal from outside.
SIGNALS = frozenset(
    {
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGWINCH,
        signal.SIGCONT,
        signal.SIGALRM,
        signal.SIGKILL,
    }
)
FEATURES = ("gpu",)
MAX_ARGV = 256
MAX_LOG_REPLY = 256 * 1024
MAX_WAIT = 3600.0
START_TIMEOUT = 30.0
#: What `list` keeps of its reply's limit for all but the kernels' meta.
LIST_MARGIN = 128 * 1024


def clean_env(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in env.items() if not k.startswith(_DROP_PREFIXES) and k not in _DROP_NAMES
    }


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AgentError("bad_request", f"{what} must be a list of strings")
    if any("\0" in v for v in value):
        raise AgentError("bad_request", f"{what} must not hold NUL characters")
    return value


def _env(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise AgentError("bad_request", "env must be an object of strings")
    for k, v in value.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise AgentError("bad_request", f"bad environment variable name or value: {k!r}")
    return dict(value)


def _meta(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise AgentError("bad_request", "meta must be a JSON object")
    size = meta_size(value)
    if size > MAX_META:
        raise AgentError("bad_request", f"meta takes {size} bytes, more than {MAX_META}")
    return value


class Launcher:
    """The process ops (hello, launch, list, poll, signal, wait, release, log)."""

    def __init__(self, service: Service, init_binary: str | None = None):
        self.service = service
        self.kernels = service.kernels
        self.init_binary = init_binary or str(BIN_DIR / "cedana-init")
        self.kernels_dir = service.state_dir / "kernels"

    def register(self) -> None:
        check_root_file(Path(self.init_binary))
        for name in ("hello", "launch", "list", "poll", "signal", "release", "log"):
            self.service.register(name, getattr(self, f"op_{name}"))
        self.service.register("wait", self.op_wait, cancel_on_disconnect=True)

    def work_dir(self, uid: int, kernel_id: str) -> Path:
        return self.kernels_dir / str(uid) / kernel_id

    # -- ops ------------------------------------------------------------------------------

    async def op_hello(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        return {
            "version": protocol.VERSION,
            "uid": caller.uid,
            "gid": caller.gid,
            "groups": list(caller.groups),
            "ops": self.service.ops,
            # What this agent can do beyond its ops: "gpu", the kernels' GPU memory
            # checkpointed with their dumps (gpu_ops.py). An agent without it dumps a
            # GPU kernel's process alone, so a server must not ask it to.
            "features": list(FEATURES),
        }

    async def op_launch(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        # Only these fields are read: one that names a uid, a pid or anything else is
        # ignored, the caller's identity is the socket's.
        kernel_id = protocol.kernel_id(args)
        argv = _strings(args.get("argv"), "argv")
        if not argv or len(argv) > MAX_ARGV:
            raise AgentError("bad_request", f"argv must hold 1 to {MAX_ARGV} strings")
        env = clean_env(_env(args.get("env")))
        cwd = args.get("cwd", "/")
        if not isinstance(cwd, str) or not os.path.isabs(cwd) or "\0" in cwd:
            raise AgentError("bad_request", "cwd must be an absolute path")
        meta = _meta(args.get("meta"))
        ignore_sigint = args.get("ignore_sigint", False)
        if not isinstance(ignore_sigint, bool):
            raise AgentError("bad_request", "ignore_sigint must be true or false")
        work = self.work_dir(caller.uid, kernel_id)
        record = KernelRecord(
            uid=caller.uid,
            kernel_id=kernel_id,
            gid=caller.groups[0],
            groups=caller.groups,
            init_pid=0,
            process=None,
            state=State.restoring,  # not running until its pid is known
            argv=argv,
            cwd=cwd,
            work_dir=str(work),
            meta=meta,
        )
        self.kernels.reserve(record)
        try:
            await self._start(record, env, ignore_sigint)
        except BaseException:
            await record.close()
            self.kernels.remove(caller.uid, kernel_id)
            shutil.rmtree(work, ignore_errors=True)
            raise
        return {"kernel_id": kernel_id, "pid": record.init_pid}

    async def _start(self, record: KernelRecord, env: dict[str, str], ignore_sigint: bool) -> None:
        work = Path(record.work_dir)
        # Root's own directory (0700): the init's working directory, where CRIU mounts
        # its /proc during a dump, and the pidfile. Not the user's to write.
        work.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(mode=0o700)
        pidfile = work / "init.pid"
        cmd = [self.init_binary, "--pidns", "--chdir", str(work), "--pidfile", str(pidfile)]
        if record.uid != 0:
            # A root caller's kernel runs as root, as under a root server without the agent.
            cmd += ["--user", str(record.uid), "--gid", str(record.gid)]
            cmd += ["--groups", ",".join(map(str, record.groups)), "--cwd", record.cwd]
        if ignore_sigint:
            # An interrupt while ipykernel still starts would kill it (cedana-init.c).
            cmd.append("--ignore-sigint")
        cmd += ["--", *record.argv]
        process = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=record.output_target(),
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=record.cwd if record.uid == 0 else "/",
            # Its own session: a signal to the agent's group (a terminal's ^C) is not the
            # kernel's.
            start_new_session=True,
        )
        record.watch(process)
        record.init_pid = await _read_pidfile(pidfile, process)
        record.state = State.running

    async def op_list(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        kernels = [r.summary() for r in self.kernels.for_uid(caller.uid)]
        known = {k["kernel_id"] for k in kernels}
        for kid, manifest in ImageStore(self.service.state_dir).manifests(caller.uid).items():
            if kid not in known:
                kernels.append({"kernel_id": kid, "pid": None, **_unrecorded(manifest)})
        # 64 kernels with the largest meta would not fit in one reply: past a budget a
        # kernel's meta is left out (and said so), and `poll` gives it.
        budget = protocol.MAX_RESPONSE - LIST_MARGIN
        for entry in kernels:
            meta = entry.get("meta")
            size = meta_size(meta) if meta is not None else 0
            if size > budget:
                entry["meta"] = None
                entry["meta_omitted"] = True
            else:
                budget -= size
        return {"kernels": kernels}

    async def op_poll(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        kernel_id = protocol.kernel_id(args)
        record = self.kernels.get(caller.uid, kernel_id)
        if record is not None:
            return record.status()
        found = ImageStore(self.service.state_dir).manifests(caller.uid, only=kernel_id)
        if kernel_id not in found:
            raise AgentError("not_found", f"no kernel {kernel_id}")
        return _unrecorded(found[kernel_id])

    async def op_signal(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        record = self.kernels.lookup(caller.uid, protocol.kernel_id(args))
        signum = args.get("signum")
        if not isinstance(signum, int) or isinstance(signum, bool) or signum not in SIGNALS:
            raise AgentError(
                "bad_request",
                f"signum must be one of {sorted(SIGNALS)} (those cedana-init forwards, and "
                f"SIGKILL), not {signum!r}",
            )
        async with record.lock:
            record.send_signal(signum)
        return {}

    async def op_wait(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        record = self.kernels.lookup(caller.uid, protocol.kernel_id(args))
        timeout = args.get("timeout", 0)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout < 0:
            raise AgentError("bad_request", "timeout must be a number of seconds >= 0")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(record.exited.wait(), min(float(timeout), MAX_WAIT))
        return {"returncode": record.returncode, "state": record.state.value}

    async def op_release(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        kernel_id = protocol.kernel_id(args)
        record = self.kernels.lookup(caller.uid, kernel_id)
        if record.state != State.exited:
            raise AgentError(
                "conflict", f"kernel {kernel_id} is {record.state.value}: only an exited one"
            )
        self.kernels.remove(caller.uid, kernel_id)
        await record.close()
        shutil.rmtree(record.work_dir, ignore_errors=True)
        return {}

    async def op_log(self, caller: Caller, args: dict[str, Any], _: Progress) -> dict[str, Any]:
        record = self.kernels.lookup(caller.uid, protocol.kernel_id(args))
        nbytes = args.get("bytes", MAX_LOG_REPLY)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise AgentError("bad_request", "bytes must be an integer >= 0")
        data = record.log.tail(min(nbytes, MAX_LOG_REPLY))
        return {"text": data.decode(errors="replace"), "dropped": record.log.dropped}


def _unrecorded(manifest: dict[str, Any]) -> dict[str, Any]:
    """How `list` and `poll` show an image with no record (its record refused, a store
    restored from a backup): a suspended kernel all the same, which a restarted server
    must find; its meta is the copy its dump kept in the image's manifest."""
    return {
        "state": State.dumped.value,
        "returncode": None,
        "meta": manifest_meta(manifest),
        "note": "an image with no record: restore or discard it",
    }


async def _read_pidfile(pidfile: Path, process: asyncio.subprocess.Process) -> int:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            text = pidfile.read_text().strip()
            if text:
                return int(text)
        if process.returncode is not None:
            raise AgentError("failed", f"cedana-init exited with {process.returncode} at start")
        await asyncio.sleep(0.01)
    raise AgentError(
        "failed", f"cedana-init did not report the kernel's pid in {START_TIMEOUT:g} s"
    )
