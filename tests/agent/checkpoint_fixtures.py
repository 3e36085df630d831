"""What the checkpoint-op tests share: an agent started with a checkpoint configuration
of root's (`<state>/checkpoint.json`), and kernels of such agents closed after the test."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import Agent, ended_after, run_agent, stop_agent, write_checkpoint_config

CAP_SYS_RESOURCE = 24


def root_lacks_sys_resource() -> bool:
    """Whether root here lacks CAP_SYS_RESOURCE (some containers drop it). The agent
    dumps a user's kernel without it (criu.py: CRIU with the user's real ids)."""
    with open("/proc/self/status") as f:
        eff = next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))
    return not eff & (1 << CAP_SYS_RESOURCE)


def agent_with(base: Path, config: dict[str, Any], env: dict[str, str] | None = None) -> Agent:
    write_checkpoint_config(base / "state", config)
    old = dict(os.environ)
    try:
        if env is not None:
            os.environ.update(env)
        return run_agent(base)
    finally:
        os.environ.clear()
        os.environ.update(old)


@pytest.fixture
def configured_agent(agent_base: Path) -> Iterator[Any]:
    """A factory: configured_agent(config, env=None) -> a running agent."""
    with ended_after(functools.partial(agent_with, agent_base), stop_agent) as make:
        yield make


@pytest.fixture
def loose_kernels() -> Iterator[list[Any]]:
    """Kernels (test_launch.Kernel) of an agent started by `configured_agent`, closed after."""
    made: list[Any] = []
    yield made
    for k in made:
        k.close()
