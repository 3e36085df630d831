"""The jupyter_server extension: wires the policy loop, the REST API, the message gate,
events and metrics into the running server."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from jupyter_client.provisioning import KernelProvisionerFactory
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from tornado import web
from traitlets import Bool, Unicode

from ..checkpoint.engine import CheckpointEngine
from .gate import KERNEL_ACTIONS, MessageGate
from .handlers import handlers
from .kernel.checkpoint_agent import agent_for, use_agent
from .manager import EVENT_SCHEMA_FILE, SuspendManager
from .parking import KernelParking
from .policy import SuspendPolicy
from .websocket import GatedWebsocketConnection


class CedanaApp(ExtensionApp):
    """Suspend idle kernels (process and GPU memory) to disk; resume them on demand."""

    name = "jupyter_cedana"
    load_other_extensions = True

    checkpoint_root = Unicode(
        "",
        help="Directory of checkpoint images; shorthand for CheckpointEngine.checkpoint_root "
        "(empty: that option's default).",
    ).tag(config=True)

    transparent_resume = Bool(
        True,
        help="Hold messages sent to a suspended kernel, resume it, and deliver them once "
        "its output channel is live. Needs the kernel websocket connection class; turn off "
        "if another extension must own it (users then resume kernels explicitly).",
    ).tag(config=True)

    default_provisioner = Bool(
        True,
        help="Make cedana-provisioner the default provisioner of local kernels, unless "
        "KernelProvisionerFactory.default_provisioner_name is configured. A kernelspec "
        "opts out with metadata {'kernel_provisioner': {'provisioner_name': "
        "'local-provisioner'}}.",
    ).tag(config=True)

    manager: SuspendManager | None = None
    parking: KernelParking | None = None
    _stopping: asyncio.Future[None] | None = None
    _warm_up: asyncio.Future[None] | None = None

    @property
    def _server(self) -> Any:
        assert self.serverapp is not None, "CedanaApp runs inside a jupyter server"
        return self.serverapp

    def _make_default_provisioner(self) -> None:
        configured = self._server.config.get("KernelProvisionerFactory", {})
        if "default_provisioner_name" in configured:
            return
        factory = KernelProvisionerFactory.instance(parent=self._server.kernel_manager)
        factory.default_provisioner_name = "cedana-provisioner"

    def initialize_settings(self) -> None:
        engine = CheckpointEngine.instance(parent=self.serverapp)
        if self.checkpoint_root:
            engine.checkpoint_root = self.checkpoint_root
        agent = use_agent(self.serverapp)
        if agent is not None:
            self.log.info(
                "jupyter-cedana: kernels run under the checkpoint agent at %s", agent.socket
            )
        info = engine.probe()
        if not info.available:
            self.log.warning("jupyter-cedana: checkpointing unavailable: %s", info.reason)
        elif why := engine.criu_cache_problem():
            self.log.warning(
                "jupyter-cedana: CRIU probes the Linux kernel again on every suspend and resume "
                "(~30 ms each): %s. See docs/deployment.md (a tmpfs on /run).",
                why,
            )
        policy = SuspendPolicy(parent=self.serverapp)
        if self.default_provisioner:
            self._make_default_provisioner()
        gpu_monitor = engine.gpu_monitor()
        if gpu_monitor is not None:
            gpu_monitor.utilization_window = policy.gpu_utilization_window
            if not gpu_monitor.available:
                self.log.info("jupyter-cedana: GPU monitoring off: %s", gpu_monitor.reason)
        event_logger = getattr(self.serverapp, "event_logger", None)
        if event_logger is not None:
            event_logger.register_event_schema(EVENT_SCHEMA_FILE)
        self.manager = SuspendManager(
            parent=self.serverapp,
            kernel_manager=self._server.kernel_manager,
            engine=engine,
            policy=policy,
            gpu_monitor=gpu_monitor,
            event_logger=event_logger,
        )
        self.settings["cedana_manager"] = self.manager
        if event_logger is not None:  # a restart is activity, with or without the gate
            event_logger.add_listener(
                schema_id=KERNEL_ACTIONS, listener=self.manager.on_kernel_action
            )
        self.parking = KernelParking(parent=self.serverapp, manager=self.manager)
        self.parking.install(self._server)
        if self.transparent_resume:
            self._install_gate()
        self._guard_culler()
        self._guard_interrupt()

    def _install_gate(self) -> None:
        # ExtensionApp copies the server's settings into self.settings before
        # initialize_settings and writes them all back after it: change them here.
        current = self.settings.get(
            "kernel_websocket_connection_class", self._server.kernel_websocket_connection_class
        )
        if current is not ZMQChannelsWebsocketConnection and not (
            isinstance(current, type) and issubclass(current, GatedWebsocketConnection)
        ):
            raise RuntimeError(
                f"jupyter-cedana needs ServerApp.kernel_websocket_connection_class to hold "
                f"messages for suspended kernels, but it is already {current!r} (set by "
                "configuration or another extension). Set CedanaApp.transparent_resume=False "
                "to run without transparent resume."
            )
        self._server.kernel_websocket_connection_class = GatedWebsocketConnection
        self.settings["kernel_websocket_connection_class"] = GatedWebsocketConnection
        assert self.manager is not None
        gate = MessageGate(self.manager, self.log)
        self.manager.add_suspend_guard(gate.busy)
        event_logger = getattr(self.serverapp, "event_logger", None)
        if event_logger is not None:
            event_logger.add_listener(schema_id=KERNEL_ACTIONS, listener=gate.on_kernel_action)
        self.settings["cedana_gate"] = gate
        if self.parking is not None:
            self.parking.replies = gate.replies

    def _guard_culler(self) -> None:
        """jupyter_server's culler must not shut down a suspended kernel before the
        retention time ends."""
        mkm = self._server.kernel_manager
        original = mkm.cull_kernel_if_idle
        manager = self.manager

        async def cull_kernel_if_idle(kernel_id: str) -> Any:
            if manager is not None and not manager.allows_cull(kernel_id):
                return None
            return await original(kernel_id)

        mkm.cull_kernel_if_idle = cull_kernel_if_idle  # type: ignore[method-assign]

    def _guard_interrupt(self) -> None:
        """A kernel that is not running has nothing to interrupt: say so with a 409 (the
        provisioner refuses the signal; jupyter_server would answer 500)."""
        mkm = self._server.kernel_manager
        original = mkm.interrupt_kernel
        manager = self.manager

        async def interrupt_kernel(kernel_id: str) -> Any:
            state = manager.state_of(kernel_id) if manager is not None else "running"
            if state not in ("running", "unknown"):
                raise web.HTTPError(
                    409,
                    f"Kernel {kernel_id} is {state}: nothing runs in it to interrupt. "
                    "It resumes by itself when it is sent a cell.",
                )
            return await original(kernel_id)

        mkm.interrupt_kernel = interrupt_kernel  # type: ignore[method-assign]

    def initialize_handlers(self) -> None:
        self.handlers.extend(handlers(""))

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        if self.manager is not None:
            if self.parking is not None:
                await self.parking.adopt()
            await self.manager.engine.cuda_checkpointer()
            self.manager.start()
            if agent_for(self.serverapp) is None:  # the agent's CRIU is warmed up there
                self._warm_up = asyncio.ensure_future(self.manager.engine.warm_up())

    async def stop_extension(self) -> None:
        # Runs before the server shuts its kernels down; a second stop waits for the first.
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        gate = self.settings.get("cedana_gate")
        if gate is not None:
            await gate.close()
        if self.manager is None:
            return
        deadline = self.parking.deadline if self.parking is not None else 20.0
        loop_stopped = asyncio.ensure_future(self.manager.stop(deadline))
        if self.parking is not None:
            await self.parking.park_all()
        await loop_stopped
        if self._warm_up is not None:
            with contextlib.suppress(Exception):
                await self._warm_up
        await self.manager.engine.close()
        agent = agent_for(self.serverapp)
        if agent is not None:  # a probe of it in flight would outlive the server's loop
            await agent.close()
