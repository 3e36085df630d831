"""CRIU dump of a kernel's process tree into an image directory, whose files are received
(capture.py) or followed (integrity.py) as CRIU writes them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import SuspendFailed
from .capture import ImageCapture
from .incremental import DeltaResult, PageIndex
from .integrity import FollowingHasher
from .procmount import MOUNT_NS_ARGS, own_mount_ns

ProgressCallback = Callable[[str, int | None, int | None], None]


class DumpSettings(Protocol):
    """What a dump reads of the engine (engine.CheckpointEngine), declared here so that
    the engine depends on this module and not the other way round."""

    stream_dump: bool
    direct_image_writes: bool
    ghost_limit: int
    dump_timeout: float
    extra_dump_args: list[str]
    log: Any

    def plugin_dir(self) -> str: ...
    def criu_env(self) -> dict[str, str] | None: ...


@dataclass
class DumpResult:
    seconds: float  # CRIU's run
    sums: dict[str, tuple[int, list[int]]]  # page file -> (size, chunk CRCs), hashed meanwhile
    zero_bytes: int  # all-zero chunks of the page files made holes
    delta: DeltaResult | None = None  # an incremental image: what it holds, and its index


_LOG_WINDOW = 4096  # the end of a CRIU log read first
_LOG_WINDOW_MAX = 1 << 20  # then further back, while the parasite's lines fill it


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants: what a dump will roughly write."""
    from .proctree import process_tree

    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


def dir_bytes(path: Path) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def criu_errors(log: Path, limit: int = 3) -> str:
    """The lines of a CRIU log that say why it failed."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no CRIU log"
    errors = _errors(lines)
    return (
        "; ".join(_reasons(errors)[:limit])
        or "; ".join(errors[-limit:])
        or next((ln.strip() for ln in reversed(lines) if ln.strip()), "no output")
    )


def criu_reasons(log: Path, limit: int = 3) -> str:
    """The errors of a CRIU log that say why it failed ("": none does)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "; ".join(_reasons(_errors(lines))[:limit])


def _errors(lines: list[str]) -> list[str]:
    # The rlimit line is a harmless complaint about CRIU's own limit, never the reason.
    return [
        ln[ln.index("Error (") :].strip()
        for ln in lines
        if "Error (" in ln and "RLIMIT_NOFILE for self" not in ln
    ]


def _reasons(errors: list[str]) -> list[str]:
    # The first errors say why; the rest is CRIU unwinding ("exited, status=1",
    # "Restoring FAILED").
    noise = ("exited, status", "FAILED", "Unable to open fd")
    return [e.split("): ", 1)[-1] for e in errors if not any(n in e for n in noise)]


def criu_last_step(log: Path) -> str:
    """What a CRIU log says CRIU was doing last: its last line, without the timestamp.

    The parasite logs there too, and goes on after CRIU is gone (it cures itself): its
    lines are skipped, however many of them end the log."""
    try:
        with open(log, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            window = _LOG_WINDOW
            while True:
                start = max(0, end - window)
                f.seek(start)
                lines = f.read(end - start).decode(errors="replace").splitlines()
                if start > 0 and lines:
                    lines = lines[1:]  # begins mid-line
                step = _last_criu_line(lines)
                if step is not None:
                    return step
                if start == 0 or window >= _LOG_WINDOW_MAX:
                    return "an empty CRIU log"
                window *= 4
    except OSError:
        return "no CRIU log"


def _last_criu_line(lines: list[str]) -> str | None:
    for line in reversed(lines):
        if line.startswith("(") and ")" in line:
            line = line[line.index(")") + 1 :]
        line = " ".join(line.split())
        if line and not line.startswith("pie: "):
            return line
    return None


def _exit_status(returncode: int) -> str:
    if returncode >= 0:
        return f"exit {returncode}"
    with contextlib.suppress(ValueError):
        return f"killed by {signal.Signals(-returncode).name}"
    return f"killed by signal {-returncode}"


async def criu_dump(
    engine: DumpSettings,
    criu: list[str],
    pid: int,
    images: Path,
    progress: ProgressCallback | None = None,
    base: PageIndex | None = None,
) -> DumpResult:
    """Dump the tree rooted at `pid` into `images`, leaving it stopped (not killed).

    The caller kills the tree once the image is committed, or continues it (SIGCONT)
    if anything after the dump fails: the kernel then runs on exactly as before.
    Returns the seconds CRIU took and the (size, chunk CRCs) of the page files, hashed
    while CRIU wrote them (with their zero chunks made holes). On a `base` (streaming
    only), the image written is a delta on it (incremental.py). `criu` is how CRIU is
    started (the engine's choice: its binary and options, and for the agent the owner's
    real ids), before the `dump` command.
    """
    expected = tree_rss(pid)
    stream = engine.stream_dump
    cmd = [
        *criu,
        "dump",
        # An explicit plugin directory: a distribution's cuda_plugin.so would otherwise
        # checkpoint, and at restore restore and unlock, the GPU state by itself.
        "--libdir",
        engine.plugin_dir(),
        "-t",
        str(pid),
        "-D",
        # Streaming, CRIU connects to a socket in it: relative, as sun_path is short.
        "." if stream else str(images),
        "-o",
        "dump.log",
        "-v4",
        "--tcp-close",
        "--leave-stopped",
        "--ghost-limit",
        str(engine.ghost_limit),
        "--file-locks",
        # A client connecting to a kernel port mid-dump must not fail the dump.
        "--skip-in-flight",
        *(MOUNT_NS_ARGS if own_mount_ns(pid) else ()),
        *(["--stream"] if stream else ()),
        *engine.extra_dump_args,
    ]
    engine.log.debug("running %s", " ".join(cmd))
    t0 = time.monotonic()
    hasher = (
        ImageCapture(images, direct=engine.direct_image_writes, base=base).start()
        if stream
        else FollowingHasher(images).start()
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=engine.criu_env(),
            cwd=images,
        )
    except BaseException:
        await asyncio.to_thread(hasher.finish)
        raise
    wait = asyncio.ensure_future(proc.wait())
    try:
        while True:
            done, _ = await asyncio.wait({wait}, timeout=0.2)
            if done:
                break
            if progress:
                progress("dump", dir_bytes(images), expected or None)
            limit = engine.dump_timeout  # the one this look applied, if it changes meanwhile
            if time.monotonic() - t0 > limit:
                proc.kill()
                await wait
                raise SuspendFailed(f"CRIU dump took longer than {limit:.0f} s")
    except asyncio.CancelledError:
        proc.kill()
        # The caller continues the tree once CRIU has let go of it (it may have
        # stopped it), so CRIU must be gone before this returns.
        await asyncio.shield(wait)
        raise
    finally:
        sums = await asyncio.to_thread(hasher.finish)
    stderr = (await proc.stderr.read()).decode(errors="replace") if proc.stderr else ""
    written = hasher.error if isinstance(hasher, ImageCapture) else None
    rc = proc.returncode or 0  # it has exited: set
    if rc != 0:
        st = os.statvfs(images)
        free = st.f_bavail * st.f_frsize
        full = free < (1 << 20)
        if rc < 0:
            # Killed (by the OOM killer, an admin): the errors in its log are complaints
            # it went on after, not why it stopped; where it stopped is what helps.
            why = f"it stopped at: {criu_last_step(images / 'dump.log')}"
        else:
            why = criu_errors(images / "dump.log")
        if written:  # CRIU failed because its pipes were closed on it: say why
            why = f"writing the image failed: {written}"
            # What CRIU adds, if anything; on a full disk, nothing: it failed for lack of
            # its pipes, and its log there is cut short, even mid-line.
            if rc > 0 and not full and (reasons := criu_reasons(images / "dump.log")):
                why += f" (CRIU: {reasons})"
        if "No space left" in why or full:
            # A full disk also swallows CRIU's own log, so say it from here.
            why = f"no space left on the checkpoint disk ({free} bytes free): {why}"
        raise SuspendFailed(f"CRIU dump failed ({_exit_status(rc)}): {why or stderr.strip()}")
    if written:
        raise SuspendFailed(f"Writing the image failed: {written}")
    delta = hasher.delta if isinstance(hasher, ImageCapture) else None
    return DumpResult(time.monotonic() - t0, sums, hasher.zero_bytes, delta)
