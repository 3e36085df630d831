"""Kernel provisioner that launches kernels so they can be checkpointed, and suspends and
resumes them (the procedures are in checkpointing.py, the state machine in transitions.py).

While a kernel is suspended it has no process, yet `poll()` says it is alive: the kernel
restarter would otherwise start a fresh kernel over the user's work.

A kernel suspended to disk has a record (parkrecords.py) from before its image is
committed until the image goes (resumed, shut down): the provisioner holds it, locked, so
that whatever way this server ends, the next one on the same checkpoint root adopts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.launcher import launch_kernel
from jupyter_client.provisioning import LocalProvisioner
from traitlets import TraitError

from ...checkpoint.launch import check_executable, ipykernel_options, is_ipykernel, output_tail
from ...checkpoint.parkrecords import RECORD_FORMAT, server_facts
from ...checkpoint.proctree import process_tree
from ...errors import Conflict, EngineUnavailable
from ..adoption import claim_adoption
from .checkpoint_agent import AgentKernel, CheckpointAgent, agent_for
from .checkpointing import Checkpointing
from .gpu_steps import GpuMemory
from .ports import PortHold
from .record import RecordHolder
from .transitions import KernelState, Listener, Progress, SuspendHook, TransitionMachine

__all__ = ["CedanaProvisioner", "KernelState", "Listener", "Progress"]


class CedanaProvisioner(Checkpointing, LocalProvisioner):  # type: ignore[misc]
    """A LocalProvisioner whose kernels can be suspended to disk and resumed."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.machine = TransitionMachine(self, self.log, self.kernel_id)
        self.port_hold = PortHold(self.log, self.kernel_id)
        self.gpu_memory = GpuMemory(self.machine, self.log, self.kernel_id)
        self._chores: set[asyncio.Future[Any]] = set()
        self._exit_told: Any = None  # the process whose exit was logged
        # Its park record: while suspended to disk (or failed with it); always at the agent.
        self.records = RecordHolder(
            lambda: self.engine.store, self.record, self.log, self.kernel_id
        )
        # The kernel at the checkpoint agent, when one is configured (checkpoint_agent.py).
        self.remote: AgentKernel | None = None
        self._record_closed = False  # shut down: no record of it may be written again
        self.add_listener(_keep_agent_record)

    # -- its state, as the manager, the gate and parking see it (the machine's) -------------

    @property
    def state(self) -> KernelState:
        return self.machine.state

    @state.setter
    def state(self, value: KernelState) -> None:
        self.machine.state = value

    @property
    def tier(self) -> str | None:
        return self.machine.tier

    @tier.setter
    def tier(self, value: str | None) -> None:
        self.machine.tier = value

    @property
    def reason(self) -> str | None:
        return self.machine.reason

    @reason.setter
    def reason(self, value: str | None) -> None:
        self.machine.reason = value

    @property
    def progress(self) -> Progress | None:
        return self.machine.progress

    @property
    def transition_in_flight(self) -> str | None:
        return self.machine.transition_in_flight

    def add_listener(self, listener: Listener) -> None:
        """Called with (provisioner, what) on every state or progress change."""
        self.machine.add_listener(listener)

    def add_suspend_hook(self, hook: SuspendHook) -> None:
        """Awaited with (provisioner) before a running kernel is frozen, while it runs."""
        self.machine.add_suspend_hook(hook)

    def note_reason(self, reason: str | None) -> None:
        """Keep the kernel's state and say what is wrong with it (the sidebar shows it)."""
        self.machine.note_reason(reason)

    async def abort_transition(self, why: str) -> None:
        """End the suspend or resume in flight, if any (transitions.py)."""
        await self.machine.abort_transition(why)

    # -- plumbing -------------------------------------------------------------------------

    @property
    def holds_image(self) -> bool:
        if self.state in (KernelState.suspended, KernelState.resuming):
            return True
        if self.state != KernelState.failed:
            return False
        if self.remote is not None:
            return self.remote.has_image
        return self.engine.store.exists(self.kernel_id_str)

    # -- launch ---------------------------------------------------------------------------

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        adopted = await claim_adoption(self)  # a kernel parked by an earlier server: no launch
        if adopted is not None:
            return adopted
        agent = agent_for(self.parent)
        if agent is not None:
            try:
                return await self._launch_at_agent(agent, cmd, kwargs)
            except (EngineUnavailable, Conflict) as e:
                # No agent, or it refuses (its limit of kernels per user; this id in use
                # there, as when a client starts a second kernel under one manager): the
                # user gets a kernel all the same, one that cannot be suspended.
                self.log.warning("Kernel %s: %s; it runs uncheckpointed", self.kernel_id, e)
                return await self._launch_plain(cmd, kwargs, e.message)
        if os.geteuid() != 0:
            # Not root and no agent: nothing here can checkpoint (engine.py says why).
            return await self._launch_plain(cmd, kwargs, None)
        engine = self.engine
        store = engine.store
        store.ensure_root()
        pidfile = store.root / f".{self.kernel_id_str}.pid"
        pidfile.unlink(missing_ok=True)
        wrapped = [engine.init_binary()]
        if engine.pidns:
            wrapped.append("--pidns")
        if engine.kernels_die_with_server:
            wrapped += ["--die-with-parent", "--parent-pid", str(os.getpid())]
        # The init leaves the user's directory for a private one of ours (cedana-init.c:
        # --chdir), where CRIU makes its /proc mount point.
        wrapped += ["--chdir", str(store.work_dir(self.kernel_id_str))]
        kw = LocalProvisioner._scrub_kwargs(kwargs)
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

    async def _launch_plain(
        self, cmd: list[str], kwargs: dict[str, Any], why: str | None
    ) -> KernelConnectionInfo:
        """The kernel runs as the stock provisioner runs it: nothing can checkpoint it."""
        connection_info = await LocalProvisioner.launch_kernel(self, cmd, **kwargs)
        self.state = KernelState.running
        self.reason = None
        self.not_checkpointable = why
        return connection_info

    async def _launch_at_agent(
        self, agent: CheckpointAgent, cmd: list[str], kwargs: dict[str, Any]
    ) -> KernelConnectionInfo:
        """The agent launches the kernel, as this server's user, under its cedana-init."""
        kw = LocalProvisioner._scrub_kwargs(kwargs)
        env = dict(kw.pop("env", None) or os.environ)
        cwd = str(Path(kw.get("cwd") or Path.cwd()).resolve())
        check_executable(cmd, env, cwd)
        cmd = ipykernel_options(cmd, history_in_memory=self.engine.ipython_history_in_memory)
        remote = agent.kernel(self.kernel_id_str)
        info = dict(self.connection_info)
        key = info.get("key", b"")
        info["key"] = key.decode() if isinstance(key, bytes) else str(key)
        meta = {"kernel_name": self._spec_name(), "connection_info": info, "cwd": cwd}
        self.pid = await remote.launch(cmd, env, cwd, ignore_sigint=is_ipykernel(cmd), meta=meta)
        self.remote = remote
        self.process = remote
        self.pgid = None
        self.cwd = cwd
        self.state = KernelState.running
        self.reason = None
        self._record_closed = False
        await self.write_agent_record()
        return self.connection_info

    def attach_at_agent(self, remote: AgentKernel, pid: int | None) -> None:
        """Adoption: a kernel the agent holds for this uid becomes this one, running as
        `pid` (its init) or, with None, dumped there."""
        self.remote = remote
        if pid:
            remote.pid = pid
            self.process = remote
            self.pid = pid
        else:
            remote.has_image = True
            self.process = None
        self._record_closed = False

    def refresh_agent_record(self) -> None:
        """Write the record once the transition in flight, if any, has ended."""
        inflight = self.machine.inflight

        async def after_transition() -> None:
            if inflight is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(inflight)
            await self.write_agent_record()

        self._background(after_transition())

    async def write_agent_record(self) -> None:
        """A kernel at the agent has its record while this server holds it, running or
        not: a server killed outright leaves it to the next one, which finds the kernel
        (running on, or dumped) at the agent. Without a record the kernel would run on
        with nobody to reach it; the agent suspends it when its grace period ends."""
        if self.remote is None or self._record_closed:
            return
        if self.state not in (KernelState.running, KernelState.suspended):
            return
        try:
            self.records.hold(await self.record())
        except Exception as e:
            self.log.warning(
                "Kernel %s: its record could not be written (%s): a server killed now "
                "would not find it at the checkpoint agent again",
                self.kernel_id,
                e,
            )

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
        if self.remote is not None and self.state == KernelState.running:
            await self.remote.refresh()
            if self.remote.restore_failed is not None and self.process is self.remote:
                self._restore_failed_at_agent(self.remote.restore_failed)
        if self._offloaded_process_died():
            return self.process.poll() if self.process is not None else 0
        if self.state != KernelState.running or self.holds_image:
            return None
        if self.process is not None:
            code = self.process.poll()
            if code is not None and self._exit_told is not self.process:
                self._exit_told = self.process
                await self._tell_exit(code)
            return code
        return 0

    async def _tell_exit(self, code: int) -> None:
        """A kernel that dies unasked: its last output goes to the server's log."""
        if getattr(self.parent, "shutting_down", False):
            return
        if self.remote is not None:
            tail = await self.remote.output_tail()
        else:
            tail = output_tail(self.engine.store.log_path(self.kernel_id_str))
        self.log.warning(
            "Kernel %s exited with status %s. The end of its output:\n%s",
            self.kernel_id,
            code,
            tail or "(none)",
        )

    def _restore_failed_at_agent(self, cause: str) -> None:
        """The agent stopped the kernel, its memory not all restored, and kept its image:
        as a failed lazy restore here, the kernel is `failed` and the next cell resumes
        it from that image."""
        self.process = None
        self.pid = None
        self.port_hold.reserve(self.connection_info)
        self.work_lost_after = self.work_lost_after or self.resumed_at
        self.log.error("Kernel %s killed by the checkpoint agent: %s", self.kernel_id, cause)
        self.machine.set_state(KernelState.failed, reason=self._lost(cause))

    def _offloaded_process_died(self) -> bool:
        """An offloaded kernel keeps its process (so does one failed with its GPU state
        offloaded or lost); when that dies the kernel is dead (there is no image to resume
        from), and poll() must say so for the restarter."""
        if not self._keeps_process():
            return False
        if self.process is None or self.process.poll() is None:
            return False
        self.log.warning("Offloaded kernel %s exited", self.kernel_id)
        self.gpu_memory.forget()
        self.tier = None
        self.machine.set_state(KernelState.running, reason="the offloaded kernel's process exited")
        return True

    def _keeps_process(self) -> bool:
        """Not running, yet its process lives: offloaded, or failed by a GPU step."""
        if self.state == KernelState.failed:
            return self.tier == "offload" or self.gpu_memory.lost
        return self.state == KernelState.suspended and self.tier == "offload"

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
        if self.remote is not None:
            await self.remote.signal(signum)
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
        await self._abort_for_shutdown(restart)
        if self._discard_if_suspended():
            return
        await self._signal_quietly(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        await self._abort_for_shutdown(restart)
        if self._discard_if_suspended():
            return
        await self._signal_quietly(signal.SIGTERM)

    async def _signal_quietly(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, Conflict):
            await self.send_signal(signum)

    async def shutdown_requested(self, restart: bool = False) -> None:
        # A suspended kernel cannot answer the shutdown request: finish it here, so that
        # shutdown does not wait out the grace period.
        await self._abort_for_shutdown(restart)
        self._discard_if_suspended()
        await super().shutdown_requested(restart=restart)

    async def _abort_for_shutdown(self, restart: bool) -> None:
        """A shutdown or restart ends any suspend or resume in flight first: the old
        tree either runs on (and gets the shutdown) or is gone, and nothing it does
        later can touch the kernel started next."""
        await self.machine.abort_transition(
            "the kernel is restarting" if restart else "the kernel is shutting down"
        )

    def _discard_if_suspended(self) -> bool:
        if self.state == KernelState.running or self.machine.inflight is not None:
            return False
        self.log.info("Discarding the checkpoint of kernel %s", self.kernel_id)
        if self.remote is not None:
            self._background(self.remote.discard())
        if self._keeps_process() and self.pid:
            # An offloaded kernel keeps its process (GPU memory moved into host memory).
            self._kill_tree(self.pid)
            if self.process is not None:
                with contextlib.suppress(Exception):
                    self.process.wait(10)
        self.engine.store.remove(self.kernel_id_str)
        self._record_closed = True
        self.records.drop()
        self.port_hold.release()
        self.process = None
        self.gpu_memory.forget()
        self.tier = None
        self.checkpoint_bytes = 0
        self.machine.set_state(KernelState.running)
        return True

    async def cleanup(self, restart: bool = False) -> None:
        await self._abort_for_shutdown(restart)
        self._discard_if_suspended()
        self.port_hold.release()
        if self.remote is not None:
            await self.remote.release()
        if not restart:
            store = self.engine.store
            with contextlib.suppress(Exception):
                store.remove(self.kernel_id_str)
            self._record_closed = True
            self.records.drop()
        # An image being deleted in the background (after a resume) is not left half gone
        # by a server that stops right after.
        await asyncio.gather(*self._chores, return_exceptions=True)
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
            self.port_hold.reserve(self.connection_info)

    # -- the record of a suspended kernel --------------------------------------------------

    async def record(self, suspended_at: float | None = None) -> dict[str, Any]:
        """What the next server needs to adopt this kernel (parkrecords.py)."""
        km = self.parent
        info = dict(km.get_connection_info() if km is not None else self.connection_info)
        key = info.get("key", b"")
        info["key"] = key.decode() if isinstance(key, bytes) else str(key)
        provisioner = await self.get_provisioner_info()
        provisioner.pop("connection_info", None)  # saved once, above, with the key as text
        if suspended_at is not None:
            provisioner["cedana_suspended_at"] = suspended_at
        last = None
        with contextlib.suppress(TraitError):  # unset while the kernel is being launched
            last = getattr(km, "last_activity", None)
        facts = await server_facts(self.kernel_id_str)
        return {
            "format": RECORD_FORMAT,
            "kernel_id": self.kernel_id_str,
            "kernel_name": self._spec_name(),
            "connection_info": info,
            "provisioner": {"name": "cedana-provisioner", **provisioner},
            "last_activity": last.isoformat() if isinstance(last, dt.datetime) else None,
            "execution_state": getattr(km, "execution_state", None),
            "cwd": str(self.cwd) if getattr(self, "cwd", None) else None,
            "parked_at": time.time(),
            # Its kernel (running, or its image) is at the checkpoint agent, not here.
            "agent": self.remote is not None,
            **facts,
        }

    @property
    def memory_loading(self) -> asyncio.Future[None] | None:
        """A lazy restore's memory still coming in from the image, or None."""
        return self._loading

    def adopt_gpu_state(self, state: dict[str, Any] | None) -> None:
        """The GPU state an adopted kernel's image holds (its manifest's "gpu")."""
        self.gpu_memory.state = state


def _keep_agent_record(prov: Any, what: str) -> None:
    """A kernel at the agent that becomes running or suspended gets its record anew."""
    if what == "state" and prov.remote is not None:
        prov.refresh_agent_record()
