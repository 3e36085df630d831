"""A pytest plugin for the peer suites of scripts/conformance.sh run through a checkpoint
agent (CEDANA_TEST_AGENT_SOCKET): those suites make their kernel managers without our
configuration, so the agent is configured here, once, on the one CheckpointAgent that
every cedana-provisioner of the process uses, as a server's configuration would. Its own
directory keeps it apart from the suites' `tests` packages."""

from __future__ import annotations

import os
from typing import Any

from traitlets.config import Config

from jupyter_cedana.server.kernel.checkpoint_agent import CheckpointAgent


def pytest_configure(config: Any) -> None:
    socket = os.environ["CEDANA_TEST_AGENT_SOCKET"]
    CheckpointAgent.instance(config=Config({"CheckpointAgent": {"socket": socket}}))
