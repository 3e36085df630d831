"""Checkpoint engine: CRIU for the process tree, on top of the checkpoint store.

One configurable instance per process (like jupyter_client's port cache), so the server
extension and every kernel provisioner agree on the binary, the options and the root.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_core.paths import jupyter_data_dir
from traitlets import Bool, Float, Integer, List, Unicode, default
from traitlets.config import SingletonConfigurable

from ..errors import EngineUnavailable
from ..package_files import BIN_DIR, NO_PLUGINS_DIR
from . import criucache
from .criu_restore import start_criu_restore, wait_criu_restore
from .dumping import DumpResult, ProgressCallback, criu_dump
from .incremental import PageIndex
from .procmount import dump_turn
from .store import CheckpointStore

MIN_CRIU = (4, 2)
# A server that is not root runs no CRIU: a CRIU that could checkpoint its kernels would
# need capabilities that every notebook of that user could then use.
NOT_ROOT = (
    "this server is not root; it checkpoints through the checkpoint agent "
    "(set CheckpointAgent.socket, see docs/agent.md)"
)


@dataclass
class EngineInfo:
    available: bool
    reason: str | None
    criu_path: str | None
    criu_version: str | None
    pidns: bool


class CheckpointEngine(SingletonConfigurable):
    """CRIU dump/restore of kernel process trees into the checkpoint store."""

    checkpoint_root = Unicode(
        help="Directory holding kernel checkpoint images (created 0700). It should be on a "
        "disk, not tmpfs: an image is as large as the kernel's memory."
    ).tag(config=True)

    @default("checkpoint_root")
    def _default_root(self) -> str:
        return os.path.join(jupyter_data_dir(), "cedana", "checkpoints")

    criu_path = Unicode(
        "",
        help="Path of the criu binary (4.2 or newer), run by a root server. Empty: the first "
        "of /usr/local/sbin/criu, /usr/sbin/criu and criu on PATH that is new enough. A "
        "server that is not root runs no CRIU: it checkpoints through the checkpoint agent "
        "(CheckpointAgent.socket).",
    ).tag(config=True)

    init_path = Unicode(
        "",
        help="Path of cedana-init, the PID-1 the kernel runs under. Empty: the copy shipped "
        "in the package.",
    ).tag(config=True)

    use_pid_namespace = Bool(
        True,
        help="Run each kernel in its own PID namespace when privileged (root), so that a "
        "restore never meets its old PID numbers taken by other processes.",
    ).tag(config=True)

    kernels_die_with_server = Bool(
        True,
        help="Terminate a kernel (running or restored) when the process that started it "
        "dies, e.g. a jupyter server killed with SIGKILL, as ipykernel does by itself for "
        "kernels not under cedana (it cannot here: a restored kernel has a new parent). "
        "Kernels at a checkpoint agent (CheckpointAgent.socket) are the agent's and outlive "
        "their server whatever this says: the next server attaches to them.",
    ).tag(config=True)

    lazy_restore = Bool(
        True,
        help="Resume a kernel before its memory is read: it runs as soon as CRIU has "
        "restored its processes, and its memory pages are loaded on demand and in the "
        "background (userfaultfd), each chunk checked against its checksum before the "
        "kernel sees it. Used where `criu check --feature uffd-noncoop` says it works; "
        "images without chunk checksums (format 1) and GPU checkpoints are restored whole.",
    ).tag(config=True)

    lazy_restore_min_bytes = Integer(
        128 << 20,
        help="Images smaller than this (bytes) are restored whole even where lazy restore "
        "works: reading them costs less than starting the page server and serving the first "
        "cell's page faults (measured on 2 cores: a 0.08 GB kernel's first output 0.17 s after "
        "the resume began when restored whole, 0.21-0.30 s lazily; about even at 0.25 GB). "
        "0: every image lazily.",
    ).tag(config=True)

    lazy_copy_threads = Integer(
        2,
        min=1,
        max=8,
        help="Threads that copy the memory read from the image into the kernels being "
        "lazily restored, each its own block, shared by the restores running at once: a "
        "restore's page server takes what is left of this when it starts, and at least one. "
        "A copy into memory new to the kernel mostly waits for the page to be given to it "
        "(on a VM: a fault on the host, long where the host has taken the guest's free "
        "memory back), and copies side by side overlap those waits: measured on 2 vCPUs, "
        "8 GB placed in 4.8-5.6 s by 2 threads (4.9-5.3 s by 4) against 11.5 s by one, and "
        "a lazily restored 8 GB kernel all in after 7.9 s against 9.9 s; with many restores "
        "at once each one's single copier overlaps with the others' already, and more "
        "would take the CPU their kernels need (docs/benchmarks.md).",
    ).tag(config=True)

    restore_read_ahead = Bool(
        True,
        help="At a resume, ask the disk at once for the pages of the kernel's libraries that "
        "CRIU copies on write as it restores (posix_fadvise WILLNEED, in a thread, while the "
        "image is checked): where the libraries have left the page cache, CRIU reads them "
        "one at a time otherwise (docs/benchmarks.md).",
    ).tag(config=True)

    pages_path = Unicode(
        "",
        help="Path of cedana-pages, the page server of lazy restores. Empty: the copy "
        "shipped in the package.",
    ).tag(config=True)

    keep_image_after_resume = Bool(
        False,
        help="Keep a kernel's checkpoint image on disk after a successful resume (it is "
        "replaced by the next suspend).",
    ).tag(config=True)

    keep_base = Bool(
        False,
        help="Keep a resumed kernel's image as the base of its next suspend, which then "
        "writes only the pages that changed (an incremental image on that base: "
        "docs/incremental.md); needs stream_dump. Off by default: on the 2-vCPU VM "
        "measured, a repeat suspend after a cell changing 1.5 % of a 1 GB kernel wrote "
        "0.02x the bytes but kept the kernel frozen as long as a whole one or longer "
        "(it reads and hashes all memory while frozen), and the base holds about the "
        "kernel's memory on disk while it runs (dropped first when the checkpoint budget "
        "or the disk needs room). Worth it where disk writes are scarce or costly, or "
        "where the hashing is fast (more cores).",
    ).tag(config=True)

    stream_dump = Bool(
        True,
        help="CRIU streams the image to the server as it dumps (criu dump --stream), which "
        "writes the page files with direct I/O, skipping all-zero chunks: no page cache is "
        "filled with the image, and less CPU is used. Where touching freed memory is costly "
        "(a VM whose host takes it back) large suspends are 2.5-3x faster (8 GB: 3.0-4.6 s "
        "against 9.6-12.7 s); where it is not, about even (docs/benchmarks.md). False: CRIU "
        "writes the files itself, through the page cache, and they are hashed as they grow.",
    ).tag(config=True)

    direct_image_writes = Bool(
        True,
        help="A streamed dump writes the page files with direct I/O (O_DIRECT). False: "
        "through the page cache, each range dropped from it once written back, so that a "
        "suspend holds a few tens of MB of it, not the image's size. On the VM measured "
        "the two were even (durable suspend, medians of 4: 1 GB 1.8 s through the page "
        "cache against 2.3 s direct, 4 GB 6.8 / 7.1 s, 8 GB 9.7 / 9.3 s; "
        "docs/benchmarks.md). A file system refusing O_DIRECT gets the page cache either way.",
    ).tag(config=True)

    ghost_limit = Integer(
        64 << 20,
        help="Largest deleted-but-open file CRIU copies into an image, in bytes.",
    ).tag(config=True)

    dump_timeout = Float(
        600.0, help="Seconds after which a CRIU dump is abandoned (the kernel keeps running)."
    ).tag(config=True)

    restore_timeout = Float(
        600.0, help="Seconds after which a CRIU restore is abandoned (the image is kept)."
    ).tag(config=True)

    ipython_history_in_memory = Bool(
        True,
        help="Start IPython kernels with their history in memory instead of the shared "
        "history.sqlite: a file another kernel writes while this one is suspended changes "
        "size, and CRIU then refuses the restore.",
    ).tag(config=True)

    extra_dump_args = List(
        Unicode(), help="Extra arguments for 'criu dump', e.g. ['--ext-unix-sk']."
    ).tag(config=True)

    extra_restore_args = List(Unicode(), help="Extra arguments for 'criu restore'.").tag(
        config=True
    )

    criu_plugin_dir = Unicode(
        "",
        help="Directory CRIU loads its plugins from (criu --libdir). Empty: none (a directory "
        "of the package without plugins); CRIU's default (/usr/lib/criu) and CRIU_LIBS_DIR "
        "are never used. In particular CRIU's cuda_plugin.so must not run: it "
        "would restore and unlock a kernel's GPU memory behind jupyter-cedana's back (GPU "
        "checkpointing is off while the directory holds it).",
    ).tag(config=True)

    gpu = Bool(
        True,
        help="Watch GPU use through NVML and checkpoint GPU memory through the CUDA driver "
        "when the machine has them; off: kernels are treated as CPU-only.",
    ).tag(config=True)

    _info: EngineInfo | None = None
    # Set when a checkpoint agent does this engine's work (the server's side of it says
    # whether the agent answers); this engine then runs no CRIU.
    probe_through: Callable[[], EngineInfo] | None = None
    _lazy_reason: str | None = None
    _lazy_probed = False
    _lazy_lock = threading.Lock()  # the server's warm-up and a first resume may race
    _store: CheckpointStore | None = None
    _monitor: Any = None
    _cuda: Any = None
    _cuda_started = False
    _criu_problem: tuple[str | None] | None = None

    def criu_env(self) -> dict[str, str] | None:
        """The environment of our CRIU runs (None: the server's, root's); the checkpoint
        agent's engine gives its CRIU a fixed one."""
        return None

    def criu_cache_problem(self) -> str | None:
        """Why CRIU probes the Linux kernel again on every run here (None: it need not).
        Looked at once: the start-up log and every /status (the sidebar polls it) say
        the same, and mounts do not change under a running server."""
        if self.probe_through is not None:
            return None  # the agent runs CRIU, with its own cache (agent-images.md)
        if self._criu_problem is None:
            self._criu_problem = (criucache.problem(),)
        return self._criu_problem[0]

    def gpu_monitor(self) -> Any:
        """The GpuMonitor shared by the policy and GPU checkpointing (None when off)."""
        if not self.gpu:
            return None
        if self._monitor is None:
            from ..gpu.monitor import GpuMonitor

            self._monitor = GpuMonitor(parent=self)
        return self._monitor

    async def cuda_checkpointer(self) -> Any:
        """The started CUDA checkpointer, or None when this machine cannot checkpoint GPU
        memory (no driver, driver older than r570, helper missing)."""
        if not self.gpu:
            return None
        if not self._cuda_started:
            from ..gpu.cuda import CudaCheckpointer

            self._cuda_started = True
            self._cuda = CudaCheckpointer(parent=self, monitor=self.gpu_monitor())
            try:
                await self._cuda.start()
            except Exception as e:
                self.log.warning("CUDA checkpoint helper failed to start: %s", e)
        if self._plugin_conflict() is not None:
            return None
        return self._cuda if self._cuda is not None and self._cuda.available else None

    def cuda_status(self) -> tuple[bool, str | None]:
        conflict = self._plugin_conflict()
        if conflict is not None:
            return False, conflict
        if self._cuda is None:
            return False, "CUDA checkpoint helper not started"
        return bool(self._cuda.available), self._cuda.reason

    def _plugin_conflict(self) -> str | None:
        if self.criu_plugin_dir and (Path(self.criu_plugin_dir) / "cuda_plugin.so").exists():
            return (
                f"CheckpointEngine.criu_plugin_dir ({self.criu_plugin_dir}) holds CRIU's "
                "cuda_plugin.so, which restores GPU memory by itself and breaks resume"
            )
        return None

    def plugin_dir(self) -> str:
        """The directory given to criu --libdir: the configured one, or one without plugins."""
        return self.criu_plugin_dir or str(NO_PLUGINS_DIR)

    async def close(self) -> None:
        if self._cuda is not None:
            await self._cuda.stop()
        if self._monitor is not None:
            self._monitor.close()

    @property
    def store(self) -> CheckpointStore:
        if self._store is None or str(self._store.root) != str(
            Path(self.checkpoint_root).expanduser().resolve()
        ):
            self._store = CheckpointStore(self.checkpoint_root)
        return self._store

    def init_binary(self) -> str:
        path = self.init_path or str(BIN_DIR / "cedana-init")
        if not os.access(path, os.X_OK):
            raise EngineUnavailable(
                f"cedana-init not found at {path}: reinstall jupyter-cedana (it builds native/)"
            )
        return path

    def pages_binary(self) -> str:
        return self.pages_path or str(BIN_DIR / "cedana-pages")

    def lazy_unsupported(self) -> str | None:
        """Why a lazy restore cannot be used here (None: it can); probed once."""
        if not self.lazy_restore:
            return "CheckpointEngine.lazy_restore is off"
        with self._lazy_lock:
            if not self._lazy_probed:
                from .lazy import ProbeFailed, unsupported_reason

                info = self.require()
                try:
                    self._lazy_reason = unsupported_reason(
                        info.criu_path or "criu", os.geteuid() != 0, self.pages_binary()
                    )
                except ProbeFailed as e:  # this restore goes whole; the next one asks again
                    self.log.warning("Restoring a kernel whole: %s", e)
                    return str(e)
                self._lazy_probed = True
                if self._lazy_reason:
                    self.log.warning("Restoring kernels whole: %s", self._lazy_reason)
        return self._lazy_reason

    async def warm_up(self) -> None:
        """Probe now what the first resume would otherwise probe (a `criu check` of a few
        tenths of a second, on the path to that kernel's first output)."""
        if self.probe().available and self.lazy_restore:
            with contextlib.suppress(EngineUnavailable):
                await asyncio.to_thread(self.lazy_unsupported)

    @property
    def pidns(self) -> bool:
        return self.use_pid_namespace and os.geteuid() == 0

    def probe(self, refresh: bool = False) -> EngineInfo:
        """Find a usable CRIU and say why not; cached, since it runs a subprocess."""
        if self.probe_through is not None:
            return self.probe_through()
        if self._info is not None and not refresh:
            return self._info
        if os.geteuid() != 0:
            self._info = EngineInfo(False, NOT_ROOT, None, None, False)
            return self._info
        candidates = (
            [self.criu_path]
            if self.criu_path
            else ["/usr/local/sbin/criu", "/usr/sbin/criu", shutil.which("criu") or ""]
        )
        reason = "criu not found (install CRIU 4.2 or newer: scripts/install-criu.sh)"
        info = EngineInfo(False, reason, None, None, self.pidns)
        for cand in filter(None, candidates):
            if not os.access(cand, os.X_OK):
                continue
            try:
                out = subprocess.run(
                    [cand, "--version"], capture_output=True, text=True, timeout=10
                ).stdout
            except (OSError, subprocess.SubprocessError) as e:
                info.reason = f"{cand} --version failed: {e}"
                continue
            m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
            if not m:
                info.reason = f"cannot read the version of {cand}"
                continue
            version = ".".join(g for g in m.groups() if g is not None)
            if (int(m.group(1)), int(m.group(2))) < MIN_CRIU:
                info.reason = (
                    f"{cand} is CRIU {version}; 4.2 or newer is needed on this kernel "
                    "(older versions fail to dump kernels with TCP sockets)"
                )
                continue
            info = EngineInfo(True, None, cand, version, self.pidns)
            break
        self._info = info
        return info

    def require(self) -> EngineInfo:
        info = self.probe()
        if not info.available:
            raise EngineUnavailable(f"Checkpointing is unavailable: {info.reason}")
        return info

    def base_args(self, info: EngineInfo) -> list[str]:
        return [info.criu_path or "criu"]

    def dump_command_prefix(self, owner: tuple[int, int] | None) -> list[str]:
        """What runs the dump's CRIU for the tree of `owner` (uid, gid): nothing here;
        the checkpoint agent's engine gives its CRIU the owner's real ids."""
        return []

    async def dump(
        self,
        pid: int,
        images: Path,
        progress: ProgressCallback | None = None,
        base: PageIndex | None = None,
        owner: tuple[int, int] | None = None,
    ) -> DumpResult:
        """Dumps run concurrently, except two whose CRIU would mount /proc in the same
        directory (procmount.py). On a `base`: an incremental image (incremental.py)."""
        async with dump_turn(pid):
            criu = [*self.dump_command_prefix(owner), *self.base_args(self.require())]
            return await criu_dump(self, criu, pid, images, progress, base)

    def start_restore(
        self, images: Path, work: Path, pidfile: Path, lazy: bool = False
    ) -> subprocess.Popen[bytes]:
        """Start `criu restore -d` of `images`, the tree left stopped (criu_restore.py)."""
        return start_criu_restore(self, self.base_args(self.require()), images, work, pidfile, lazy)

    async def wait_restored(
        self,
        proc: subprocess.Popen[bytes],
        work: Path,
        pidfile: Path,
    ) -> int:
        """Wait until CRIU reports the restored root's PID; raise with CRIU's reason if not."""
        return await wait_criu_restore(proc, work, pidfile, self.restore_timeout)


def kill_restore(proc: subprocess.Popen[bytes]) -> None:
    """Kill a `criu restore` and everything it forked. Killing CRIU alone orphans its
    half-restored tasks, which then spin on their dead parent's log forever."""
    from .proctree import process_tree

    # Kill below the keeper (cedana-init) until it exits by itself: it may fork CRIU only
    # after a first look, and once CRIU is gone it exits, having reaped (as subreaper,
    # without a PID namespace) the killed tasks it adopted. They hold the kernel's PIDs
    # until reaped, and a retry needs them back.
    deadline = time.monotonic() + 10
    while True:
        for pid in sorted(process_tree(proc.pid) - {proc.pid}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            proc.wait(0.05)
            return
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                break
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
