"""`jupyter cedana`: list, suspend and resume the kernels of a running Jupyter server, and
remove checkpoint images that no kernel owns.

The server is found the way `jupyter server list` finds it (the `jpserver-*.json` files
in the Jupyter runtime directory), or given with `--url` and `--token`. Requests go to
the REST API under /api/cedana (docs/rest-api.yaml) with the server's token, through the
standard library's HTTP client. Requests carry `no_track_activity`, so that using this
tool does not count as user activity on the server (a JupyterHub may still cull it).

Exit status: 0 success, 1 other error, 2 usage, 3 no (usable) server, 4 kernel not found,
5 conflict with the kernel's state, 6 checkpointing unavailable, 7 not authorized.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
import urllib.parse
from collections.abc import Sequence
from typing import Any, NoReturn

from .._version import __version__
from .gc import cmd_gc
from .serverclient import EXIT_ERROR, EXIT_OK, EXIT_USAGE, ApiError, Client, CliError, find_server
from .text import emit_json, format_table, human_bytes, human_seconds, parse_duration


def _state(k: dict[str, Any]) -> str:
    state = str(k.get("state") or "?")
    if k.get("tier") and state in ("suspending", "suspended", "resuming"):
        state += f"/{k['tier']}"
    progress = k.get("progress")
    if isinstance(progress, dict) and state.startswith(("suspending", "resuming")):
        state += f" {float(progress.get('fraction') or 0) * 100:.0f}%"
    queued = k.get("queued")
    if isinstance(queued, dict):
        state += f", queued to {queued.get('action')} (#{queued.get('position')})"
    elif k.get("backoff"):
        state += ", not suspending" if k["backoff"].get("not_checkpointable") else ", backing off"
    return state


def kernel_row(k: dict[str, Any]) -> list[str]:
    gpu = sum(int(g.get("memory_bytes") or 0) for g in k.get("gpus") or [])
    ckpt = int(k.get("checkpoint_bytes") or 0)
    return [
        str(k.get("id", "")),
        str(k.get("name", "")),
        _state(k),
        human_seconds(k.get("idle_seconds")),
        human_bytes(gpu) if k.get("gpus") else "-",
        human_bytes(ckpt) if ckpt else "-",
        str(k.get("reason") or ""),
    ]


KERNEL_HEADERS = ["ID", "KERNELSPEC", "STATE", "IDLE", "GPU MEM", "CHECKPOINT", "REASON"]


# -- commands -----------------------------------------------------------------------------


def _kernel_path(kernel_id: str, action: str = "") -> str:
    path = "kernels/" + urllib.parse.quote(kernel_id, safe="")
    return f"{path}/{action}" if action else path


def resolve_kernel_id(client: Client, kernel_id: str) -> str:
    """A unique prefix of a kernel id stands for the id; anything else goes to the server
    as it is (which then says what is wrong with it)."""
    if len(kernel_id) >= 36:
        return kernel_id
    try:
        ids = [str(k.get("id")) for k in client.get("kernels")]
    except ApiError:
        return kernel_id
    if kernel_id in ids:
        return kernel_id
    matches = [i for i in ids if i.startswith(kernel_id)]
    if len(matches) > 1:
        raise CliError(
            f"Kernel id prefix {kernel_id!r} is ambiguous: {', '.join(sorted(matches))}",
            EXIT_USAGE,
            "ambiguous",
        )
    return matches[0] if matches else kernel_id


def cmd_list(args: argparse.Namespace, client: Client) -> int:
    kernels = client.get("kernels")
    if args.json:
        emit_json(kernels)
        return EXIT_OK
    if not kernels:
        print("No kernels.")
        return EXIT_OK
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 0
    print(format_table(KERNEL_HEADERS, [kernel_row(k) for k in kernels], width))
    return EXIT_OK


def _agent_origin(started: dict[str, Any] | None) -> str:
    """Where the agent came from, when a server started it (CheckpointAgent.start_agent)."""
    if not started:
        return ""
    by = (
        "this server"
        if started.get("by_this_server")
        else f"the jupyter server with pid {started.get('started_by')}"
    )
    return f" (pid {started.get('pid')}, started by {by}; log: {started.get('log')})"


def cmd_status(args: argparse.Namespace, client: Client) -> int:
    st = client.get("status")
    if args.json:
        emit_json(st)
        return EXIT_OK
    if st.get("available") and st.get("agent_socket"):
        engine = f"available, through the checkpoint agent at {st.get('agent_socket')}"
        engine += _agent_origin(st.get("agent_started"))
    elif st.get("available"):
        ns = "kernels in their own PID namespace" if st.get("root") else "no PID namespace"
        engine = f"available (CRIU {st.get('criu_version')}, {ns})"
    else:
        engine = f"unavailable: {st.get('reason')}"
    gpu = st.get("gpu") or {}
    if gpu.get("available"):
        devices = gpu.get("devices") or []
        names = ", ".join(
            f"{d.get('index')}: {d.get('name')} ({human_bytes(d.get('memory_total'))})"
            for d in devices
        )
        gpu_line = f"{len(devices)} GPU(s), driver {gpu.get('driver_version')}"
        if names:
            gpu_line += f" [{names}]"
        if gpu.get("checkpoint"):
            gpu_line += "; GPU memory checkpoint: yes"
        else:
            gpu_line += f"; GPU memory checkpoint: no ({gpu.get('reason')})"
    else:
        gpu_line = f"not available: {gpu.get('reason')}"
    rows = [
        ("Server", client.server.label),
        ("Checkpointing", engine),
        ("Checkpoint root", str(st.get("checkpoint_root"))),
        (
            "Storage",
            f"{human_bytes(st.get('bytes_used'))} used, {human_bytes(st.get('bytes_free'))} free",
        ),
        *_budget_rows(st.get("budget") or {}, st.get("queued") or {}),
        ("GPU", gpu_line),
        *(("Warning", w) for w in st.get("warnings") or []),
    ]
    for name, value in rows:
        print(f"{name + ':':<17}{value}")
    return EXIT_OK


def _budget_rows(budget: dict[str, Any], queued: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if budget.get("limit"):
        rows.append(
            (
                "Budget",
                f"{human_bytes(budget.get('used'))} of {human_bytes(budget.get('limit'))} "
                f"used, {human_bytes(budget.get('reserved'))} reserved by dumps under way",
            )
        )
    if budget.get("orphaned_images"):
        rows.append(
            (
                "Orphaned images",
                f"{budget['orphaned_images']} ({human_bytes(budget.get('orphaned_bytes'))}) "
                "belong to no kernel; `jupyter cedana gc` removes them",
            )
        )
    if queued.get("suspend") or queued.get("resume"):
        rows.append(
            (
                "Queued",
                f"{queued.get('suspend', 0)} suspend(s), {queued.get('resume', 0)} resume(s)",
            )
        )
    return rows


def cmd_suspend(args: argparse.Namespace, client: Client) -> int:
    kid = resolve_kernel_id(client, args.kernel_id)
    status, k = client.post(
        _kernel_path(kid, "suspend"),
        query={"tier": args.tier, "wait": "0" if args.no_wait else "1"},
        timeout=args.timeout if args.timeout else 3600,
    )
    if args.json:
        emit_json(k)
    elif status == 202 or k.get("state") == "suspending":
        print(f"Kernel {kid} is {_state(k)}; `jupyter cedana list` shows when it is done.")
    elif k.get("state") == "suspended":
        size = human_bytes(k.get("checkpoint_bytes")) if k.get("checkpoint_bytes") else "-"
        took = k.get("last_suspend_seconds")
        took_text = f" in {took:.2f} s" if isinstance(took, int | float) else ""
        print(f"Kernel {kid} suspended ({k.get('tier')}, {size}){took_text}.")
    else:
        # The suspend ended, but not in `suspended` (it failed and the kernel runs on).
        reason = k.get("reason") or "no reason given"
        print(f"Kernel {kid} is {_state(k)}: {reason}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def cmd_resume(args: argparse.Namespace, client: Client) -> int:
    kid = resolve_kernel_id(client, args.kernel_id)
    status, k = client.post(
        _kernel_path(kid, "resume"),
        query={"wait": "0" if args.no_wait else "1"},
        timeout=args.timeout if args.timeout else 3600,
    )
    if args.json:
        emit_json(k)
    elif status == 202 or k.get("state") == "resuming":
        print(f"Kernel {kid} is {_state(k)}; `jupyter cedana list` shows when it is done.")
    elif k.get("state") == "running":
        took = k.get("last_resume_seconds")
        took_text = f" in {took:.2f} s" if isinstance(took, int | float) else ""
        print(f"Kernel {kid} resumed{took_text}.")
    else:
        reason = k.get("reason") or "no reason given"
        print(f"Kernel {kid} is {_state(k)}: {reason}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def cmd_keep_awake(args: argparse.Namespace, client: Client) -> int:
    kid = resolve_kernel_id(client, args.kernel_id)
    _, k = client.post(_kernel_path(kid, "keep-awake"), body={"seconds": args.seconds})
    if args.json:
        emit_json(k)
    elif k.get("keep_awake_until"):
        until = dt.datetime.fromisoformat(k["keep_awake_until"]).astimezone()
        print(f"Kernel {kid} is kept awake until {until:%Y-%m-%d %H:%M:%S %Z}.")
    else:
        print(f"Kernel {kid}: keep-awake cleared.")
    return EXIT_OK


# -- entry point --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", help="URL of the Jupyter server (default: the first running server)"
    )
    common.add_argument(
        "--token",
        help="its token (default: the token of the running server at --url, or $JUPYTER_TOKEN)",
    )
    common.add_argument("--json", action="store_true", help="print JSON for machines")
    common.add_argument(
        "--timeout",
        type=float,
        default=0,
        help="seconds to wait for the server (default: 30; 3600 for suspend and resume)",
    )

    parser = argparse.ArgumentParser(
        prog="jupyter cedana",
        description="Suspend and resume the kernels of a running Jupyter server (jupyter-cedana).",
        epilog="Exit status: 0 ok, 1 error, 2 usage, 3 no usable server, 4 kernel not "
        "found, 5 conflict with the kernel's state, 6 checkpointing unavailable, "
        "7 not authorized.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sub.add_parser("list", parents=[common], help="the kernels and their suspend state")
    sub.add_parser("status", parents=[common], help="checkpointing, storage and GPU support")

    p = sub.add_parser("suspend", parents=[common], help="suspend a kernel now")
    p.add_argument("kernel_id", metavar="ID", help="kernel id (or a unique prefix)")
    p.add_argument(
        "--tier",
        choices=["disk", "offload"],
        default="disk",
        help="disk: checkpoint the whole process to disk (default); offload: move only "
        "its GPU memory to host memory",
    )
    p.add_argument("--no-wait", action="store_true", help="return while it is suspending")

    p = sub.add_parser("resume", parents=[common], help="resume a suspended kernel now")
    p.add_argument("kernel_id", metavar="ID", help="kernel id (or a unique prefix)")
    p.add_argument("--no-wait", action="store_true", help="return while it is resuming")

    p = sub.add_parser(
        "keep-awake", parents=[common], help="postpone automatic suspend of a kernel"
    )
    p.add_argument("kernel_id", metavar="ID", help="kernel id (or a unique prefix)")
    p.add_argument(
        "seconds",
        metavar="SECONDS",
        type=parse_duration,
        help="how long from now (90, 15m, 2h, 1d; 0 clears it)",
    )

    p = sub.add_parser(
        "gc",
        parents=[common],
        help="remove checkpoint images that no kernel owns",
        description="Remove checkpoint images (and leftovers of failed dumps) that no "
        "kernel of a running server owns. The kernels of every running server that "
        "shares the checkpoint root are kept.",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument(
        "--root",
        metavar="DIR",
        help="clean this checkpoint root instead of the server's; without a running "
        "server every image there is removed (asks first) except those of parked "
        "kernels, which the next server adopts. Only what jupyter-cedana can prove it "
        "wrote is removed (images with its manifest, its temporary names)",
    )
    p.add_argument("--yes", "-y", action="store_true", help="do not ask (with --root)")
    p.add_argument(
        "--force",
        action="store_true",
        help="go on when a running server cannot be asked which kernels it owns",
    )
    return parser


COMMANDS = {
    "list": cmd_list,
    "status": cmd_status,
    "suspend": cmd_suspend,
    "resume": cmd_resume,
    "keep-awake": cmd_keep_awake,
}


def _fail(e: CliError, as_json: bool) -> NoReturn:
    if as_json:
        emit_json({"code": e.code, "message": e.message, "status": getattr(e, "status", None)})
    print(f"jupyter cedana: error: {e.message}", file=sys.stderr)
    raise SystemExit(e.exit_code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "gc":
            return cmd_gc(args)
        server = find_server(args.url, args.token)
        client = Client(server, timeout=args.timeout or 30)
        return COMMANDS[args.command](args, client)
    except CliError as e:
        _fail(e, args.json)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
