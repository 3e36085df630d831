"""What the checkpoint-op tests share: an agent started with a checkpoint configuration
of root's (`<state>/checkpoint.json`), and kernels of such agents closed after the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import LIMITS, Agent, start_agent, wait_listening

CAP_SYS_RESOURCE = 24


def root_lacks_sys_resource() -> bool:
    """Whether root here lacks CAP_SYS_RESOURCE (some containers drop it). The agent
    dumps a user's kernel without it (criu.py: CRIU with the user's real ids)."""
    with open("/proc/self/status") as f:
        eff = next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))
    return not eff & (1 << CAP_SYS_RESOURCE)


def agent_with(base: Path, config: dict[str, Any], env: dict[str, str] | None = None) -> Agent:
    state = base / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    (state / "checkpoint.json").write_text(json.dumps(config))
    os.chmod(state / "checkpoint.json", 0o600)
    extra = [
        arg
        for k, v in LIMITS.items()
        for arg in (f"--{k}", str(v if k.endswith("timeout") else int(v)))
    ]
    old = dict(os.environ)
    try:
        if env is not None:
            os.environ.update(env)
        proc = start_agent(base, *extra)
    finally:
        os.environ.clear()
        os.environ.update(old)
    wait_listening(proc)
    return Agent(proc, base, base / "run" / "agent.sock", state, LIMITS)


def stop(agent: Agent) -> str:
    agent.proc.send_signal(signal.SIGTERM)
    try:
        agent.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.proc.kill()
        agent.proc.wait()
    assert agent.proc.stderr is not None
    return agent.proc.stderr.read()


@pytest.fixture
def configured_agent(agent_base: Path) -> Iterator[Any]:
    """A factory: configured_agent(config, env=None) -> a running agent."""
    started: list[Agent] = []

    def make(config: dict[str, Any], env: dict[str, str] | None = None) -> Agent:
        a = agent_with(agent_base, config, env)
        started.append(a)
        return a

    yield make
    for a in started:
        stop(a)


@pytest.fixture
def loose_kernels() -> Iterator[list[Any]]:
    """Kernels (test_launch.Kernel) of an agent started by `configured_agent`, closed after."""
    made: list[Any] = []
    yield made
    for k in made:
        k.close()
