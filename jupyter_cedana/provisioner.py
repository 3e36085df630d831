"""Kernel provisioner that launches kernels so they can be checkpointed, and suspends and
resumes them.

While a kernel is suspended it has no process, yet `poll()` says it is alive: the kernel
restarter would otherwise start a fresh kernel over the user's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.launcher import launch_kernel
from jupyter_client.provisioning import LocalProvisioner

from .engine import CheckpointEngine, kill_restore
from .errors import (
    CedanaError,
    CheckpointCorrupt,
    Conflict,
    InsufficientGpuMemory,
    NotCheckpointable,
    ResumeFailed,
    SuspendFailed,
)
from .proctree import process_tree

PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port")


class KernelState(str, enum.Enum):
    running = "running"
    suspending = "suspending"
    suspended = "suspended"
    resuming = "resuming"
    failed = "failed"


@dataclass
class Progress:
    phase: str
    fraction: float
    bytes_done: int | None = None
    bytes_total: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Listener = Callable[["CedanaProvisioner", str], None]


class CedanaProvisioner(LocalProvisioner):  # type: ignore[misc]
    """A LocalProvisioner whose kernels can be suspended to disk and resumed."""

    state: KernelState = KernelState.running
    tier: str | None = None
    reason: str | None = None
    progress: Progress | None = None
    suspended_at: float | None = None
    last_suspend_seconds: float | None = None
    last_resume_seconds: float | None = None
    checkpoint_bytes: int = 0
    gpu_memory_freed: int = 0

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._lock = asyncio.Lock()
        self._inflight: tuple[str, asyncio.Future[Any]] | None = None
        self._reserved: list[socket.socket] = []
        self._listeners: list[Listener] = []
        self._gpu_state: dict[str, Any] | None = None
        self._chores: set[asyncio.Future[Any]] = set()

    # -- plumbing -------------------------------------------------------------------------

    @property
    def engine(self) -> CheckpointEngine:
        return CheckpointEngine.instance(parent=self.parent)

    @property
    def kernel_id_str(self) -> str:
        return str(self.kernel_id)

    def add_listener(self, listener: Listener) -> None:
        """Called with (provisioner, what) on every state or progress change."""
        self._listeners.append(listener)

    def _notify(self, what: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(self, what)
            except Exception:  # a broken observer must not break a suspend
                self.log.exception("cedana listener failed")

    def _set_state(self, state: KernelState, reason: str | None = None) -> None:
        self.state = state
        self.reason = reason
        if state in (KernelState.running, KernelState.suspended, KernelState.failed):
            self.progress = None
        self._notify("state")

    def _set_progress(self, phase: str, done: int | None, total: int | None) -> None:
        fraction = min(1.0, done / total) if done is not None and total else 0.0
        self.progress = Progress(phase, fraction, done, total)
        self._notify("progress")

    @property
    def holds_image(self) -> bool:
        return self.state in (KernelState.suspended, KernelState.resuming) or (
            self.state == KernelState.failed and self.engine.store.exists(self.kernel_id_str)
        )

    # -- launch ---------------------------------------------------------------------------

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        engine = self.engine
        store = engine.store
        store.ensure_root()
        pidfile = store.root / f".{self.kernel_id_str}.pid"
        pidfile.unlink(missing_ok=True)
        wrapped = [engine.init_binary()]
        if engine.pidns:
            wrapped.append("--pidns")
        if engine.kernels_die_with_server:
            wrapped.append("--die-with-parent")
        if engine.ipython_history_in_memory and any("ipykernel" in part for part in cmd):
            cmd = [*cmd, "--HistoryManager.hist_file=:memory:"]
        wrapped += ["--pidfile", str(pidfile), "--", *cmd]

        kw = LocalProvisioner._scrub_kwargs(kwargs)
        env = dict(kw.pop("env", None) or os.environ)
        # ipykernel polls this PID and exits when it changes, which it does after a restore.
        env.pop("JPY_PARENT_PID", None)
        # A file only this kernel writes: a shared log that grows after a dump would make
        # CRIU refuse the restore ("has bad size").
        log_fd = os.open(
            store.log_path(self.kernel_id_str), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
        try:
            kw.update(stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, env=env)
            kw["independent"] = True
            self.process = launch_kernel(wrapped, **kw)
        finally:
            os.close(log_fd)
        self.pid = await self._read_pidfile(pidfile, self.process)
        self.pgid = None  # signals go to cedana-init, which forwards them to the kernel's group
        self.cwd = kwargs.get("cwd", Path.cwd())
        self.state = KernelState.running
        self.reason = None
        return self.connection_info

    @staticmethod
    async def _read_pidfile(pidfile: Path, proc: subprocess.Popen[bytes]) -> int:
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

    # -- Popen-like interface -------------------------------------------------------------

    @property
    def has_process(self) -> bool:
        return self.process is not None or self.holds_image

    async def poll(self) -> int | None:
        if self._offloaded_process_died():
            return self.process.poll() if self.process is not None else 0
        if self.state != KernelState.running or self.holds_image:
            return None
        if self.process is not None:
            return self.process.poll()
        return 0

    def _offloaded_process_died(self) -> bool:
        """An offloaded kernel keeps its process; when that dies the kernel is dead (there
        is no image to resume from), and poll() must say so for the restarter."""
        if self.tier != "offload" or self.state != KernelState.suspended:
            return False
        if self.process is None or self.process.poll() is None:
            return False
        self.log.warning("Offloaded kernel %s exited", self.kernel_id)
        self._gpu_state = None
        self.tier = None
        self._set_state(KernelState.running, reason="the offloaded kernel's process exited")
        return True

    async def wait(self) -> int | None:
        while await self.poll() is None:
            await asyncio.sleep(0.1)
        ret = 0
        if self.process is not None:
            ret = self.process.wait()
            self.process = None
        return ret

    async def send_signal(self, signum: int) -> None:
        if self.state != KernelState.running:
            if getattr(self.parent, "shutting_down", False):
                return  # shutdown interrupts first; there is nothing to interrupt
            raise Conflict(
                f"Kernel {self.kernel_id} is {self.state.value}: it cannot receive signal "
                f"{signal.Signals(signum).name} until it is resumed"
            )
        if not self.pid:
            return
        if signum == signal.SIGKILL and not self.engine.pidns:
            # Without a PID namespace, killing the init would orphan the kernel.
            for pid in sorted(process_tree(self.pid or 0), reverse=True):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            return
        with contextlib.suppress(ProcessLookupError):  # it exited: poll() will say so
            os.kill(self.pid, signum)

    async def kill(self, restart: bool = False) -> None:
        if self._discard_if_suspended():
            return
        await self._signal_quietly(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        if self._discard_if_suspended():
            return
        await self._signal_quietly(signal.SIGTERM)

    async def _signal_quietly(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, Conflict):
            await self.send_signal(signum)

    async def shutdown_requested(self, restart: bool = False) -> None:
        # A suspended kernel cannot answer the shutdown request: finish it here, so that
        # shutdown does not wait out the grace period.
        self._discard_if_suspended()
        await super().shutdown_requested(restart=restart)

    def _discard_if_suspended(self) -> bool:
        if self.state == KernelState.running or self._inflight is not None:
            return False
        self.log.info("Discarding the checkpoint of kernel %s", self.kernel_id)
        if self.tier == "offload" and self.pid:
            # An offloaded kernel keeps its process (GPU memory moved into host memory).
            self._kill_tree(self.pid)
            if self.process is not None:
                with contextlib.suppress(Exception):
                    self.process.wait(10)
        self.engine.store.remove(self.kernel_id_str)
        self._release_ports()
        self.process = None
        self._gpu_state = None
        self.tier = None
        self.checkpoint_bytes = 0
        self._set_state(KernelState.running)
        return True

    async def cleanup(self, restart: bool = False) -> None:
        self._release_ports()
        if not restart:
            store = self.engine.store
            with contextlib.suppress(Exception):
                store.remove(self.kernel_id_str)
        await super().cleanup(restart=restart)

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info.update(
            cedana_state=self.state.value,
            cedana_tier=self.tier,
            cedana_reason=self.reason,
            cedana_suspended_at=self.suspended_at,
            cedana_checkpoint_bytes=self.checkpoint_bytes,
        )
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.state = KernelState(provisioner_info.get("cedana_state", "running"))
        self.tier = provisioner_info.get("cedana_tier")
        self.reason = provisioner_info.get("cedana_reason")
        self.suspended_at = provisioner_info.get("cedana_suspended_at")
        self.checkpoint_bytes = provisioner_info.get("cedana_checkpoint_bytes", 0)
        if self.state == KernelState.suspended:
            self._reserve_ports()

    # -- ports ----------------------------------------------------------------------------

    def _ports(self) -> list[int]:
        info = getattr(self, "connection_info", None) or {}
        return [int(info[n]) for n in PORT_NAMES if info.get(n)]

    def _reserve_ports(self) -> None:
        """Hold the kernel's ports while it has no process, so no other program takes them
        and the restore can bind them again."""
        ip = (getattr(self, "connection_info", None) or {}).get("ip", "127.0.0.1")
        for port in self._ports():
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((ip, port))
                # Listening (not just bound) is what makes Linux refuse other binds, even
                # SO_REUSEADDR ones; queued client connections are reset when it closes.
                s.listen(1)
            except OSError as e:
                s.close()
                self.log.warning(
                    "Could not reserve port %s of kernel %s: %s", port, self.kernel_id, e
                )
                continue
            self._reserved.append(s)

    def _release_ports(self) -> None:
        for s in self._reserved:
            s.close()
        self._reserved = []

    # -- suspend / resume -----------------------------------------------------------------

    async def _once(self, kind: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """Run a transition under the kernel's lock; a concurrent request for the same
        transition waits for the running one and gets its result."""
        if self._inflight is not None and self._inflight[0] == kind:
            return await asyncio.shield(self._inflight[1])
        async with self._lock:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._inflight = (kind, fut)
            try:
                result = await work()
            except BaseException as e:
                fut.set_exception(e)
                # Nobody else may be waiting: retrieve the exception so asyncio stays quiet.
                fut.exception()
                raise
            else:
                fut.set_result(result)
                return result
            finally:
                self._inflight = None

    async def suspend(self, tier: str = "disk") -> dict[str, Any]:
        """Checkpoint the kernel (process tree and GPU memory) and free its resources."""
        if tier not in ("disk", "offload"):
            raise ValueError(f"unknown tier {tier!r}")
        return await self._once(f"suspend-{tier}", lambda: self._suspend(tier))

    async def resume(self) -> dict[str, Any]:
        """Restore a suspended kernel; on failure the image is kept and a retry may work."""
        return await self._once("resume", self._resume)

    async def _suspend(self, tier: str) -> dict[str, Any]:
        if self.state == KernelState.suspended and (self.tier == tier or tier == "offload"):
            raise Conflict(f"Kernel {self.kernel_id} is already suspended ({self.tier})")
        if self.state == KernelState.failed:
            raise Conflict(
                f"Kernel {self.kernel_id} failed to resume ({self.reason}); resume it first"
            )
        if self.state == KernelState.running and (not self.pid or await self.poll() is not None):
            raise Conflict(f"Kernel {self.kernel_id} is not running")
        if tier == "offload":
            return await self._offload()
        previous = self.state
        from_offload = previous == KernelState.suspended  # offloaded → disk
        self._set_state(KernelState.suspending)
        try:
            return await self._dump(from_offload=from_offload)
        except BaseException as e:
            if self.state == KernelState.suspending:
                self._set_state(previous, reason=getattr(e, "message", None) or str(e))
            raise

    async def _offload(self) -> dict[str, Any]:
        gpu = await self._gpu()
        if gpu is None:
            why = self.engine.cuda_status()[1] if self.engine.gpu else "CheckpointEngine.gpu is off"
            raise Conflict(f"GPU offload is unavailable: {why or 'no CUDA checkpoint support'}")
        self._set_state(KernelState.suspending)
        t0 = time.monotonic()
        try:
            result = await gpu.offload(process_tree(self.pid or 0), progress=self._gpu_progress)
            if not result:
                raise Conflict(f"Kernel {self.kernel_id} holds no GPU memory: nothing to offload")
        except BaseException as e:
            self._set_state(KernelState.running, reason=getattr(e, "message", None) or str(e))
            raise
        self._gpu_state = dict(result)
        self.tier = "offload"
        self.suspended_at = time.time()
        self.last_suspend_seconds = time.monotonic() - t0
        self.gpu_memory_freed = int((self._gpu_state or {}).get("bytes_freed", 0))
        self.checkpoint_bytes = 0
        self._set_state(KernelState.suspended)
        return self.summary()

    async def _gpu(self) -> Any:
        """The CUDA checkpointer when GPU checkpointing is possible here, else None."""
        return await self.engine.cuda_checkpointer()

    def _refuse_unsaved_gpu_memory(self, pids: set[int]) -> None:
        """Without CUDA checkpointing, a kernel holding GPU memory must not be dumped: the
        image would lack its GPU memory (preflight: e.g. a driver older than r570)."""
        monitor = self.engine.gpu_monitor()
        if monitor is not None and monitor.available and monitor.usage(pids):
            raise NotCheckpointable(
                "The kernel holds GPU memory but CUDA checkpointing is unavailable: "
                f"{self.engine.cuda_status()[1]}"
            )

    def _gpu_progress(self, phase: str, done: int | None, total: int | None) -> None:
        self._set_progress(phase, done, total)

    async def _dump(self, from_offload: bool) -> dict[str, Any]:
        engine = self.engine
        engine.require()
        store = engine.store
        kid = self.kernel_id_str
        t0 = time.monotonic()
        pids = process_tree(self.pid or 0)
        gpu_state = self._gpu_state if from_offload else None
        gpu = await self._gpu()
        if not from_offload and gpu is not None:
            gpu_state = await gpu.offload(pids, progress=self._gpu_progress) or None
        elif not from_offload:
            self._refuse_unsaved_gpu_memory(pids)
        tmp = store.begin(kid)
        stopped = False
        try:
            dump_s, sums = await engine.dump(self.pid or 0, tmp, progress=self._set_progress)
            stopped = True
            self._set_progress("verify", None, None)
            manifest = await asyncio.to_thread(
                store.commit,
                kid,
                tmp,
                {
                    "kernel_name": self._spec_name(),
                    "criu_version": engine.probe().criu_version,
                    "pidns": engine.pidns,
                    "ports": self._ports(),
                    "gpu": gpu_state,
                    "timings": {"dump_s": dump_s},
                },
                sums,
            )
        except BaseException as e:
            store.discard(tmp)
            if stopped:
                self._continue(pids)
            if gpu_state is not None and gpu is not None and not from_offload:
                with contextlib.suppress(Exception):
                    await gpu.restore(gpu_state, None, admission=False)
                gpu_state = None
            if isinstance(e, SuspendFailed | asyncio.CancelledError):
                raise
            raise SuspendFailed(f"Suspend of kernel {kid} failed: {e}") from e
        # The image is safe on disk: only now does the kernel's memory go.
        self._kill_tree(self.pid or 0)
        if self.process is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.process.wait, 10)
            self.process = None
        self._reserve_ports()
        self._gpu_state = gpu_state
        self.tier = "disk"
        self.suspended_at = time.time()
        self.last_suspend_seconds = time.monotonic() - t0
        self.checkpoint_bytes = int(manifest["total_bytes"])
        self.gpu_memory_freed = int((gpu_state or {}).get("bytes_freed", 0))
        self._set_state(KernelState.suspended)
        self.log.info(
            "Suspended kernel %s: %.1f MB in %.2f s",
            kid,
            self.checkpoint_bytes / 1e6,
            self.last_suspend_seconds,
        )
        return self.summary()

    def _spec_name(self) -> str | None:
        return getattr(self.parent, "kernel_name", None)

    @staticmethod
    def _continue(pids: set[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    async def _continue_restored(self, root: int, timeout: float = 10.0) -> None:
        """CRIU writes the pidfile while the restored tasks are still ptrace-stopped and
        stops them for good (SIGSTOP) only as it detaches: a SIGCONT sent before that is
        overtaken. Wait for the group stop of every task, continue, and make sure."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = process_tree(root)
            if pids and all(_proc_state(p) == "T" for p in pids):
                break
            await asyncio.sleep(0.005)
        else:
            self.log.warning("Restored kernel %s did not report stopped; continuing it", root)
        settle = time.monotonic() + 1.0
        while True:
            self._continue(process_tree(root))
            await asyncio.sleep(0.02)
            if time.monotonic() > settle or not any(
                _proc_state(p) == "T" for p in process_tree(root)
            ):
                break

    def _kill_tree(self, root: int) -> None:
        """SIGKILL a kernel tree: its PID-namespace init takes the namespace with it;
        without a namespace every process is killed, children first."""
        if not root:
            return
        targets = [root] if self.engine.pidns else sorted(process_tree(root), reverse=True)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def _resume(self) -> dict[str, Any]:
        if self.state == KernelState.running:
            raise Conflict(f"Kernel {self.kernel_id} is running, not suspended")
        if self.tier == "offload" and self.state == KernelState.suspended:
            return await self._resume_offload()
        engine = self.engine
        engine.require()
        store = engine.store
        kid = self.kernel_id_str
        previous = self.state
        self._set_state(KernelState.resuming)
        t0 = time.monotonic()
        try:
            manifest = store.check_sizes(kid)
            gpu_state = manifest.get("gpu") or self._gpu_state
            gpu, plan = await self._admit(gpu_state)
        except InsufficientGpuMemory as e:
            # Nothing was touched: the kernel stays suspended and a later resume may fit.
            self._set_state(previous, reason=e.message)
            raise
        except BaseException as e:
            self._fail_resume(kid, previous, e)
            raise self._as_resume_error(kid, e) from e
        # CRIU restores (leaving the tree stopped) while the checksums are verified: both
        # read the same pages, so a cold image is read from disk once, not twice.
        loop = asyncio.get_running_loop()
        self._set_progress("restore", 0, int(manifest["total_bytes"]) or None)

        def verified(done: int, total: int) -> None:
            loop.call_soon_threadsafe(self._set_progress, "restore", done, total)

        verify = asyncio.ensure_future(asyncio.to_thread(store.verify, kid, verified))
        proc: subprocess.Popen[bytes] | None = None
        pid: int | None = None
        try:
            images = store.path(kid)
            work = store.work_dir(kid)
            pidfile = work / "restored.pid"
            pidfile.unlink(missing_ok=True)
            self._release_ports()
            proc = engine.start_restore(images, work, pidfile)
            restored = asyncio.ensure_future(engine.wait_restored(proc, work, pidfile))
            # A checksum mismatch stops the restore at once, whatever CRIU is doing.
            await asyncio.wait({restored, verify}, return_when=asyncio.FIRST_EXCEPTION)
            if verify.done() and verify.exception() is not None:
                restored.cancel()
                with contextlib.suppress(BaseException):
                    await restored
                await verify
            pid = await restored
            await verify
            await self._continue_restored(pid)
            if gpu_state and gpu is not None:
                self._set_progress("gpu-restore", None, None)
                await gpu.restore(
                    gpu_state, process_tree(pid), admission=plan, progress=self._gpu_progress
                )
        except BaseException as caught:
            # Whatever was restored must not run on: its image or its GPU memory is wrong.
            err: BaseException = caught
            restored_pids = process_tree(pid) if pid is not None else set()
            if pid is not None:
                self._kill_tree(pid)
            if proc is not None:
                await asyncio.to_thread(kill_restore, proc)
            await _gone(restored_pids)
            with contextlib.suppress(BaseException):
                await verify
            damaged = None if verify.cancelled() else verify.exception()
            if isinstance(damaged, CheckpointCorrupt):
                err = damaged  # explains a CRIU failure better than CRIU does
            self._reserve_ports()
            self._fail_resume(kid, previous, err)
            raise self._as_resume_error(kid, err) from caught
        assert proc is not None and pid is not None
        self.process = proc
        self.pid = pid
        self._gpu_state = None
        self.last_resume_seconds = time.monotonic() - t0
        if not engine.keep_image_after_resume:
            # The kernel runs already; gigabytes of deletion need not delay its first output.
            doomed = store.detach_image(kid)
            if doomed is not None:
                self._background(asyncio.to_thread(shutil.rmtree, doomed, True))
            self.checkpoint_bytes = 0
        self.tier = None
        self.suspended_at = None
        self._set_state(KernelState.running)
        self.log.info("Resumed kernel %s in %.2f s (pid %s)", kid, self.last_resume_seconds, pid)
        return self.summary()

    def _background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _admit(self, gpu_state: dict[str, Any] | None) -> tuple[Any, Any]:
        """Restore admission, before anything is restored: the checkpointed GPU memory
        must fit on a GPU of the same model (a restore that runs out can hang for good)."""
        if not gpu_state:
            return None, True
        gpu = await self._gpu()
        if gpu is None:
            raise ResumeFailed(
                "This checkpoint holds GPU memory, but GPU checkpointing is unavailable here: "
                f"{self.engine.cuda_status()[1]}"
            )
        return gpu, await gpu.admit(gpu_state)

    def _fail_resume(self, kid: str, previous: KernelState, e: BaseException) -> None:
        reason = getattr(e, "message", None) or str(e) or type(e).__name__
        if isinstance(e, asyncio.CancelledError):
            self._set_state(previous, reason=reason)
        else:
            self._set_state(KernelState.failed, reason=reason)
        self.log.error("Resume of kernel %s failed: %s", kid, reason)

    @staticmethod
    def _as_resume_error(kid: str, e: BaseException) -> BaseException:
        if isinstance(e, CedanaError | asyncio.CancelledError):
            return e
        return ResumeFailed(f"Resume of kernel {kid} failed: {e}")

    async def _resume_offload(self) -> dict[str, Any]:
        gpu = await self._gpu()
        self._set_state(KernelState.resuming)
        t0 = time.monotonic()
        try:
            if gpu is None:
                raise ResumeFailed("GPU checkpoint support went away")
            await gpu.restore(self._gpu_state, None, progress=self._gpu_progress)
        except BaseException as e:
            self._set_state(KernelState.suspended, reason=getattr(e, "message", None) or str(e))
            raise
        self._gpu_state = None
        self.tier = None
        self.suspended_at = None
        self.last_resume_seconds = time.monotonic() - t0
        self._set_state(KernelState.running)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "tier": self.tier,
            "checkpoint_bytes": self.checkpoint_bytes,
            "last_suspend_seconds": self.last_suspend_seconds,
            "last_resume_seconds": self.last_resume_seconds,
            "gpu_memory_freed": self.gpu_memory_freed,
            "reason": self.reason,
        }


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


async def _gone(pids: set[int], timeout: float = 5.0) -> None:
    """Wait until killed processes have really exited (SIGKILL is not synchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_proc_state(p) not in ("?", "Z", "X") for p in pids):
        await asyncio.sleep(0.01)
