"""Shared fixtures: real ipykernel kernels under the cedana provisioner, real CRIU."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import KernelProvisionerFactory
from jupyter_core.utils import ensure_event_loop
from traitlets.config import Config

from jupyter_cedana.agent.client import AgentClient
from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.server.kernel.checkpoint_agent import CheckpointAgent

pytest_plugins = ["pytest_jupyter.jupyter_server"]

# The socket of a checkpoint agent that scripts/test.sh started as root for its run as an
# ordinary user: then every server and kernel manager of the tests goes through it, as a
# JupyterHub user's server does, and the server runs no CRIU of its own.
AGENT_SOCKET = os.environ.get("CEDANA_TEST_AGENT_SOCKET", "")
IN_PROCESS_ONLY = (
    "looks at what exists only where the server runs CRIU itself (its checkpoint root's "
    "images, CRIU's options, host pids, GPU fakes); the checkpoint agent has its own "
    "tests (tests/agent/)"
)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> None:
    """Run `async def` fixtures on pytest-jupyter's event loop, the loop its server and
    async tests use (a second asyncio plugin would run them on another loop)."""
    func = fixturedef.func
    if getattr(func, "_on_jp_loop", False):
        return
    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        def agen_wrapper(*args: Any, **kwargs: Any) -> Any:
            loop = ensure_event_loop(prefer_selector_loop=True)
            gen = func(*args, **kwargs)
            yield loop.run_until_complete(gen.__anext__())
            with contextlib.suppress(StopAsyncIteration):
                loop.run_until_complete(gen.__anext__())

        agen_wrapper._on_jp_loop = True  # type: ignore[attr-defined]
        fixturedef.func = agen_wrapper
    elif inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        def coro_wrapper(*args: Any, **kwargs: Any) -> Any:
            loop = ensure_event_loop(prefer_selector_loop=True)
            return loop.run_until_complete(func(*args, **kwargs))

        coro_wrapper._on_jp_loop = True  # type: ignore[attr-defined]
        fixturedef.func = coro_wrapper


def pytest_runtest_setup(item: Any) -> None:
    # scripts/test.sh runs a subset again as an ordinary user, through a checkpoint agent.
    if item.get_closest_marker("root") and os.geteuid() != 0:
        pytest.skip("needs root")
    if AGENT_SOCKET and item.get_closest_marker("in_process"):
        pytest.skip(f"with a checkpoint agent: {IN_PROCESS_ONLY}")


def with_agent(config: Any) -> Config:
    """`config` (a Config or a dict of one), with the test run's agent where it has one."""
    c = Config(config)
    if AGENT_SOCKET:
        c.CheckpointAgent.socket = AGENT_SOCKET
        if "park_on_stop" not in c.KernelParking:
            # A server parks its kernels when it stops: with the agent their images would
            # pile up in the agent's store for the whole run (a root server's go with the
            # test's checkpoint root). The tests that park say so.
            c.KernelParking.park_on_stop = False
    return c


async def agent_kernel(kernel_id: str) -> dict[str, Any] | None:
    """What the test run's agent holds of this uid's kernel: its `list` entry, with
    `image` (the `images` entry) where it has an image; None if it has neither."""
    async with await AgentClient.connect(AGENT_SOCKET) as client:
        kernels = await client.list()
        images = (await client.images()).get("images") or []
    found = next((k for k in kernels if k.get("kernel_id") == kernel_id), None)
    image = next((i for i in images if i.get("kernel_id") == kernel_id), None)
    if found is None and image is None:
        return None
    return {**(found or {}), "image": image}


async def has_image(checkpoint_root: Path, kernel_id: str) -> bool:
    """Whether the kernel has a committed image: in the checkpoint root, or at the agent."""
    if AGENT_SOCKET:
        return ((await agent_kernel(kernel_id)) or {}).get("image") is not None
    return (checkpoint_root / kernel_id / "manifest.json").exists()


@pytest.fixture
def jp_configurable_serverapp(jp_configurable_serverapp: Any, jp_server_config: Any) -> Any:
    """pytest-jupyter's server factory, its servers given the test run's agent."""

    def make(*args: Any, config: Any = None, **kwargs: Any) -> Any:
        return jp_configurable_serverapp(
            *args, config=with_agent(jp_server_config if config is None else config), **kwargs
        )

    return make


@pytest.fixture
def checkpoint_root(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def engine_config(checkpoint_root: Path) -> Config:
    c = Config()
    c.CheckpointEngine.checkpoint_root = str(checkpoint_root)
    # The tests' kernels are small (~0.1 GB), below the size from which an image is
    # restored lazily: here every one is, so that the lazy path meets every test.
    # tests/test_lazy.py and the server tests cover the default.
    c.CheckpointEngine.lazy_restore_min_bytes = 0
    return with_agent(c)


@pytest.fixture(autouse=True)
def _fresh_engine() -> Any:
    """The engine is a per-process singleton; each test configures its own. It is not
    cleared after the test: a server torn down after this fixture still parks its
    kernels with the engine it was configured with, not one on the default root."""
    CheckpointEngine.clear_instance()
    # Its connection belongs to the event loop of the test that opened it.
    CheckpointAgent.clear_instance()
    yield


@pytest.fixture
def criu_hold(tmp_path: Path) -> Any:
    """A criu wrapper that holds dump/restore mid-flight (tests/criu_hold.py); call
    `criu_hold.attach(engine)` to route an engine through it."""
    from tests.criu_hold import CriuHold

    if os.geteuid() != 0:
        # Without root the engine wants file capabilities on the criu it runs, and a
        # script cannot carry them.
        pytest.skip("the criu hold wrapper needs root")
    hold = CriuHold(tmp_path / "criu-hold")
    yield hold
    hold.disarm()


async def start_kernel(config: Config, cwd: Path) -> Any:
    """A python3 kernel under CedanaProvisioner started in `cwd`, with a ready client
    (`km.test_client`); end it with stop_kernel."""
    KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
    km = AsyncKernelManager(kernel_name="python3", config=config)
    await km.start_kernel(cwd=str(cwd), env={**os.environ, "CEDANA_TEST_VAR": "hello"})
    kc = km.client()
    kc.start_channels()
    km.test_client = kc  # type: ignore[attr-defined]
    try:
        await kc.wait_for_ready(timeout=60)
    except BaseException:
        await stop_kernel(km)
        raise
    return km


async def stop_kernel(km: Any) -> None:
    km.test_client.stop_channels()
    if await km.is_alive() or km.has_kernel:
        await km.shutdown_kernel(now=True)


@pytest.fixture
async def kernel(engine_config: Config, tmp_path: Path) -> AsyncIterator[Any]:
    """A started python3 kernel under CedanaProvisioner, with a ready client."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    km = await start_kernel(engine_config, workdir)
    try:
        yield km
    finally:
        await stop_kernel(km)
        if CheckpointAgent.initialized():  # a background probe, before this loop ends
            await CheckpointAgent.instance().close()


async def wait_iopub(kc: Any, timeout: float = 30) -> None:
    """Confirm IOPub is connected: kernel_info requests until a status message arrives
    (after a restore the client's SUB socket reconnects later than its DEALER)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kc.kernel_info()
        try:
            while True:
                msg = await kc.get_iopub_msg(timeout=0.2)
                if msg["msg_type"] == "status":
                    # drain what belongs to the probes
                    await asyncio.sleep(0.05)
                    while True:
                        try:
                            await kc.get_iopub_msg(timeout=0.05)
                        except Exception:
                            break
                    while True:
                        try:
                            await kc.get_shell_msg(timeout=0.05)
                        except Exception:
                            return
        except Exception:
            continue
    raise TimeoutError("IOPub did not come back")


async def run(kc: Any, code: str, timeout: float = 60) -> tuple[dict[str, Any], str]:
    """Execute code; return the reply content and everything printed to stdout."""
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = await kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return reply["content"], "".join(out)


def kernel_pids(km: Any) -> set[int]:
    from jupyter_cedana.checkpoint.proctree import process_tree

    return process_tree(km.provisioner.pid)


def stand_in_server(script: str, *args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Run `script` (a stand-in for a jupyter server) in a new Python; returns it and the
    JSON line it prints once its kernels are ready. The caller kills it."""
    server = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True
    )
    line = server.stdout.readline() if server.stdout else ""
    if not line:
        server.kill()
        server.wait()
        raise AssertionError("the stand-in server did not get its kernels ready")
    return server, json.loads(line)


async def exited(pids: Iterable[int], timeout: float = 60) -> list[int]:
    """Those of `pids` still in /proc after up to `timeout` s: a killed process lingers
    as a zombie until its parent (an init, a keeper) reaps it, which takes a moment."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if Path(f"/proc/{p}").exists()]
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone, also between open and read
        return False
