"""Kernel provisioner that launches kernels so they can be checkpointed, and suspends and
resumes them. It composes what does the work: its Suspender (suspender.py), Resumer
(resumer.py) and LazyMemory (lazy_memory.py), which see it through handle.KernelHandle,
and its state machine (transitions.py).

While a kernel is suspended it has no process, yet `poll()` says it is alive: the kernel
restarter would otherwise start a fresh kernel over the user's work.

A kernel suspended to disk has a record (parkrecords.py) from before its image is
committed until the image goes (resumed, shut down): the provisioner holds it, locked, so
that whatever way this server ends, the next one on the same checkpoint root adopts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import LocalProvisioner

from ...checkpoint.engine import CheckpointEngine
from ...checkpoint.launch import output_tail
from ...checkpoint.proctree import process_tree
from ...errors import Conflict, EngineUnavailable
from ..adoption import claim_adoption
from .agent_kernel import AgentKernel
from .checkpoint_agent import CheckpointAgent, agent_for
from .gpu_steps import GpuMemory
from .kernel_tree import kill_tree
from .launching import launch_at_agent, launch_under_init, text_key
from .lazy_memory import LazyMemory
from .ports import PortHold
from .record import RecordHolder, adoption_record
from .resumer import Resumer
from .suspender import Suspender
from .transitions import KernelState, Listener, Progress, SuspendHook, TransitionMachine

__all__ = ["CedanaProvisioner", "KernelState", "Listener", "Progress"]


class CedanaProvisioner(LocalProvisioner):
    """A LocalProvisioner whose kernels can be suspended to disk and resumed."""

    # A Popen, or the kernel at the checkpoint agent (checkpoint_agent.AgentKernel).
    process: Any
    pid: int | None
    suspended_at: float | None = None
    last_suspend_seconds: float | None = None
    # Where the last suspend's time went (seconds), for benchmarks and logs.
    last_suspend_breakdown: dict[str, float] | None = None
    last_resume_breakdown: dict[str, Any] | None = None
    last_resume_seconds: float | None = None
    # time.monotonic() when the last lazily restored kernel's memory was all in.
    last_memory_in_at: float | None = None
    # time.time() of the last resume, and when the image it came from was taken.
    resumed_at: float | None = None
    image_taken_at: float | None = None
    # time.time() after which what the kernel did is lost: a lazy restore failed after
    # it ran, and it goes back to the image. Kept until a resume has all its memory in.
    work_lost_after: float | None = None
    checkpoint_bytes: int = 0
    gpu_memory_freed: int = 0
    # (kernel id, image bytes) -> None, or raises to refuse a dumped image before it is
    # committed (the checkpoint budget; set by the suspend manager).
    image_guard: Callable[[str, int], None] | None = None
    # Why nothing can checkpoint this kernel (it was launched without the agent), if so.
    not_checkpointable: str | None = None

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.machine = TransitionMachine(self, self.log, self.kernel_id)
        self.port_hold = PortHold(self.log, self.kernel_id)
        self.gpu_memory = GpuMemory(self.machine, self.log, self.kernel_id)
        self.suspender = Suspender(self)
        self.lazy_memory = LazyMemory(self)
        self.resumer = Resumer(self, self.lazy_memory)
        self._chores: set[asyncio.Future[Any]] = set()
        self._exit_told: Any = None  # the process whose exit was logged
        # Its park record: while suspended to disk (or failed with it); always at the agent.
        self.records = RecordHolder(
            lambda: self.engine.store, self.record, self.log, self.kernel_id
        )
        # The kernel at the checkpoint agent, when one is configured (checkpoint_agent.py).
        self.remote: AgentKernel | None = None
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

    # -- suspend and resume (suspender.py, resumer.py) ---------------------------------------

    async def suspend(self, tier: str = "disk") -> dict[str, Any]:
        """Checkpoint the kernel (process tree and GPU memory) and free its resources."""
        if tier not in ("disk", "offload"):
            raise ValueError(f"unknown tier {tier!r}")
        if self.not_checkpointable:
            raise EngineUnavailable(
                f"Kernel {self.kernel_id} cannot be suspended: the checkpoint agent did "
                f"not start it ({self.not_checkpointable})"
            )
        self._refuse_while_shutting_down()
        return await self.machine.once(f"suspend-{tier}", lambda: self.suspender.suspend(tier))

    async def resume(self) -> dict[str, Any]:
        """Restore a suspended kernel; on failure the image is kept and a retry may work."""
        self._refuse_while_shutting_down()
        return await self.machine.once("resume", self.resumer.resume)

    def _refuse_while_shutting_down(self) -> None:
        # A shutdown or restart aborts the transition in flight; none may start after it.
        if getattr(self.parent, "shutting_down", False):
            raise Conflict(
                f"Kernel {self.kernel_id} is not running: it is shutting down or restarting"
            )

    async def memory_loaded(self) -> None:
        """Returns once a lazily restored kernel's memory is all in (at once otherwise).
        A suspend waits for it: the image being loaded goes away then, and a new dump
        must not go with it."""
        await self.lazy_memory.loaded()

    @property
    def memory_loading(self) -> asyncio.Future[None] | None:
        """A lazy restore's memory still coming in from the image, or None."""
        return self.lazy_memory.loading

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

    # -- plumbing -------------------------------------------------------------------------

    @functools.cached_property
    def engine(self) -> CheckpointEngine:
        # Taken once: a kernel's images stay in the root it started with, even if the
        # process-wide engine is replaced later (tests do; parking reads the first one).
        return CheckpointEngine.instance(parent=self.parent)

    @property
    def kernel_id_str(self) -> str:
        return str(self.kernel_id)

    def spec_name(self) -> str | None:
        return getattr(self.parent, "kernel_name", None)

    def process_alive(self) -> bool:
        """Whether the kernel's process runs, as last seen (for a kernel at the agent, as
        the last poll learned: a suspend must not wait on the agent before it shows)."""
        return bool(self.pid) and self.process is not None and self.process.poll() is None

    def background(self, work: Awaitable[Any]) -> None:
        """Work that need not delay the kernel (cleanup() waits for it)."""
        task = asyncio.ensure_future(work)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

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
        self.process, self.pid = await launch_under_init(
            self.engine, self.kernel_id_str, cmd, LocalProvisioner._scrub_kwargs(kwargs)
        )
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
        meta = {"kernel_name": self.spec_name(), "connection_info": text_key(self.connection_info)}
        kw = LocalProvisioner._scrub_kwargs(kwargs)
        remote, self.pid, cwd = await launch_at_agent(
            agent, self.engine, self.kernel_id_str, cmd, kw, meta
        )
        self.remote = remote
        self.process = remote
        self.pgid = None
        self.cwd = cwd
        self.state = KernelState.running
        self.reason = None
        self.records.closed = False
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
        self.records.closed = False

    def refresh_agent_record(self) -> None:
        """Write the record once the transition in flight, if any, has ended."""
        inflight = self.machine.inflight

        async def after_transition() -> None:
            if inflight is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(inflight)
            await self.write_agent_record()

        self.background(after_transition())

    async def write_agent_record(self) -> None:
        """A kernel at the agent has its record while this server holds it, running or
        not: a server killed outright leaves it to the next one, which finds the kernel
        (running on, or dumped) at the agent. Without a record the kernel would run on
        with nobody to reach it; the agent suspends it when its grace period ends."""
        if self.remote is not None and self.state in (KernelState.running, KernelState.suspended):
            await self.records.keep_at_agent()

    # -- Popen-like interface -------------------------------------------------------------

    @property
    def has_process(self) -> bool:
        return self.process is not None or self.holds_image

    async def poll(self) -> int | None:
        # An offloaded kernel keeps its process at the agent too: asked, so that its death
        # is seen (gpu_memory.process_died) as for a running one.
        if self.remote is not None and (
            self.state == KernelState.running or self.gpu_memory.keeps_process()
        ):
            await self.remote.refresh()
            if self.remote.restore_failed is not None and self.process is self.remote:
                self.lazy_memory.failed_at_agent(self.remote.restore_failed)
        if self.gpu_memory.process_died(self.process):
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
            self.background(self.remote.discard())
        if self.gpu_memory.keeps_process() and self.pid:
            # An offloaded kernel keeps its process (GPU memory moved into host memory).
            kill_tree(self.pid, self.engine.pidns)
            if self.process is not None:
                with contextlib.suppress(Exception):
                    self.process.wait(10)
        self.engine.store.remove(self.kernel_id_str)
        self.records.close()
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
            self.records.close()
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
        return await adoption_record(
            km,
            text_key(km.get_connection_info() if km is not None else self.connection_info),
            await self.get_provisioner_info(),
            kernel_id=self.kernel_id_str,
            kernel_name=self.spec_name(),
            cwd=getattr(self, "cwd", None),
            at_agent=self.remote is not None,
            suspended_at=suspended_at,
        )

    def adopt_gpu_state(self, state: dict[str, Any] | None) -> None:
        """The GPU state an adopted kernel's image holds (its manifest's "gpu")."""
        self.gpu_memory.state = state


def _keep_agent_record(prov: Any, what: str) -> None:
    """A kernel at the agent that becomes running or suspended gets its record anew."""
    if what == "state" and prov.remote is not None:
        prov.refresh_agent_record()
