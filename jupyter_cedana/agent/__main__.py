"""`jupyter-cedana-agent` / `python -m jupyter_cedana.agent`: run the checkpoint agent."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys

from . import protocol
from .launch import Launcher
from .records import BadRecord
from .service import Limits, Service, UnsafeDirectory

DEFAULT_STATE_DIR = "/var/lib/jupyter-cedana-agent"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jupyter-cedana-agent",
        description="The checkpoint agent: launches, checkpoints and restores kernels for "
        "the uid of each caller on its Unix socket. Runs as root.",
    )
    p.add_argument("--socket", default=protocol.DEFAULT_SOCKET, help="Unix socket path")
    p.add_argument(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        help="root-owned directory for the kernels' working directories and images",
    )
    d = Limits()
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout,
        help="seconds a connection with nothing in flight may stay silent",
    )
    p.add_argument(
        "--frame-timeout",
        type=float,
        default=d.frame_timeout,
        help="seconds a request frame may take once its first byte came",
    )
    p.add_argument(
        "--max-connections", type=int, default=d.max_connections, help="open connections in total"
    )
    p.add_argument(
        "--max-connections-per-uid",
        type=int,
        default=d.max_connections_per_uid,
        help="open connections of one uid",
    )
    p.add_argument(
        "--max-kernels-per-uid",
        type=int,
        default=d.max_kernels_per_uid,
        help="kernels one uid may have at once",
    )
    p.add_argument(
        "--orphan-grace",
        type=float,
        default=d.orphan_grace,
        help="seconds a uid's running kernels may go without any connection of that uid "
        "before the agent suspends (dumps) them",
    )
    p.add_argument(
        "--kernels-on-stop",
        choices=("keep", "kill"),
        default="keep",
        help="what SIGTERM/SIGINT do to the kernels: keep them running for the next agent "
        "(a restart, an upgrade), or kill them",
    )
    p.add_argument(
        "--cedana-init",
        default=None,
        help="the kernels' init program (default: the one installed with jupyter-cedana)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def _register_optional(service: Service) -> None:
    # The checkpoint ops live in their own module; an agent without them still launches.
    try:
        ops = importlib.import_module("jupyter_cedana.agent.checkpoint_ops")
    except ImportError as e:
        if e.name != "jupyter_cedana.agent.checkpoint_ops":
            raise
        logging.getLogger("jupyter_cedana.agent").warning("no checkpoint ops: %s", e)
        return
    ops.register(service)


async def run(ns: argparse.Namespace) -> int:
    limits = Limits(
        idle_timeout=ns.idle_timeout,
        frame_timeout=ns.frame_timeout,
        max_connections=ns.max_connections,
        max_connections_per_uid=ns.max_connections_per_uid,
        max_kernels_per_uid=ns.max_kernels_per_uid,
        orphan_grace=ns.orphan_grace,
    )
    if not ns.orphan_grace > 0:
        print("jupyter-cedana-agent: --orphan-grace must be > 0", file=sys.stderr)
        return 2
    service = Service(ns.socket, ns.state_dir, limits)
    try:
        launcher = Launcher(service, ns.cedana_init)
        launcher.register()
        service.init_binary = launcher.init_binary
        _register_optional(service)
        await service.start()
    except (UnsafeDirectory, BadRecord) as e:
        print(f"jupyter-cedana-agent: {e}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # Ready: a supervisor (or a test) waits for this line rather than polling the socket.
    print(f"jupyter-cedana-agent: listening on {ns.socket}", flush=True)
    await stop.wait()
    await service.close(kill_kernels=ns.kernels_on_stop == "kill")
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return asyncio.run(run(ns))


if __name__ == "__main__":
    sys.exit(main())
