"""`jupyter cedana gc`: remove the checkpoint images that no kernel of any running server
owns and no server can adopt, with the park records adoption refuses, saying why
(store_gc.py decides what is provably ours)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager

from ..checkpoint import store_gc
from ..checkpoint.store import CheckpointStore
from .serverclient import (
    EXIT_ERROR,
    EXIT_NO_SERVER,
    EXIT_OK,
    EXIT_USAGE,
    Client,
    CliError,
    Server,
    find_server,
    running_servers,
    same_url,
)
from .text import emit_json, human_bytes


def _resolved(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _owned_kernels(
    servers: list[Server], root: str, timeout: float
) -> tuple[set[str], list[str], int]:
    """Kernel ids of every server whose checkpoint root is `root`; the servers that could
    not be asked; how many servers share the root."""
    keep: set[str] = set()
    failed: list[str] = []
    sharing = 0
    for server in servers:
        client = Client(server, timeout=timeout)
        try:
            st = client.get("status")
        except CliError as e:
            if e.code == "no_extension":
                continue  # without jupyter-cedana a server owns no image
            failed.append(f"{server.label}: {e.message}")
            continue
        if _resolved(str(st.get("checkpoint_root", ""))) != root:
            continue
        sharing += 1
        try:
            keep.update(str(k["id"]) for k in client.get("kernels"))
        except CliError as e:
            failed.append(f"{server.label}: {e.message}")
    return keep, failed, sharing


def _kernelspecs(client: Client | None) -> store_gc.KernelspecKnown:
    """Whether a kernelspec exists, as this user's Jupyter finds kernelspecs here and as
    the server asked sees them (it may run in another environment): gone only when
    neither has it, unknown when neither can be asked."""
    names: set[str] = set()
    asked = False
    try:
        names |= set(KernelSpecManager().find_kernel_specs())
        asked = True
    except Exception:
        pass
    if client is not None:
        try:
            names |= set((client.get("../kernelspecs") or {}).get("kernelspecs") or {})
            asked = True
        except (CliError, AttributeError):
            pass

    def known(name: str) -> bool | None:
        return True if name in names else (False if asked else None)

    return known


def cmd_gc(args: argparse.Namespace) -> int:
    servers: list[Server] = []
    own: set[str] = set()
    client: Client | None = None
    if args.root:
        root = _resolved(args.root)
        servers = [s for s in running_servers() if s.url]
    else:
        selected = find_server(args.url, args.token)
        client = Client(selected, timeout=args.timeout or 30)
        root = _resolved(str(client.get("status")["checkpoint_root"]))
        # The selected server must answer; others sharing its root are asked below.
        own = {str(k["id"]) for k in client.get("kernels")}
        servers = [s for s in running_servers() if s.url and not same_url(s.url, selected.url)]
    if not Path(root).is_dir():
        if args.root:
            raise CliError(f"{root} is not a directory", EXIT_USAGE, "bad_root")
        # No kernel has been started with it yet, or the server runs on another machine.
        print(
            f"Nothing to remove: {root} does not exist here (a server on another machine "
            "is cleaned by running `jupyter cedana gc` there, as its user).",
            file=sys.stderr,
        )
        if args.json:
            emit_json({"checkpoint_root": root, "dry_run": bool(args.dry_run), "removed": []})
        return EXIT_OK
    keep, failed, sharing = _owned_kernels(servers, root, args.timeout or 30)
    if not args.root:
        keep |= own
        sharing += 1
    if failed and not args.force:
        raise CliError(
            "Cannot tell which kernels these servers own, so their images could be "
            "removed by mistake: "
            + "; ".join(failed)
            + ". Stop them, or pass --force to go on without them.",
            EXIT_NO_SERVER,
            "no_server",
        )
    store = CheckpointStore(root)
    found = store_gc.plan(store, keep, kernelspec_known=_kernelspecs(client))
    plan = found.remove
    if args.root and plan and not args.dry_run and not args.yes:
        images = sum(1 for p in plan if p.kind == "image")
        question = (
            f"Remove {images} checkpoint image(s) and {len(plan) - images} leftover(s) "
            f"({human_bytes(sum(p.bytes for p in plan))}) under {root}"
        )
        if sharing:
            question += f" (keeping the {len(keep)} kernel(s) of {sharing} running server(s))"
        if not sys.stdin.isatty():
            raise CliError(f"{question}? Refusing without --yes.", EXIT_USAGE, "not_confirmed")
        answer = input(f"{question}? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("Nothing removed.")
            return EXIT_OK
    removed, errors = (plan, []) if args.dry_run else store_gc.apply(plan)
    for error in errors:
        print(error, file=sys.stderr)
    if args.json:
        emit_json(
            {
                "checkpoint_root": root,
                "dry_run": bool(args.dry_run),
                "kept_kernels": sorted(keep),
                "removed": [item.to_json() for item in removed],
                "left_alone": [item.to_json() for item in found.foreign],
            }
        )
    else:
        if found.foreign:
            print(
                f"Left alone {len(found.foreign)} entr{'y' if len(found.foreign) == 1 else 'ies'}"
                f" under {root} that jupyter-cedana cannot prove it wrote "
                f"(e.g. {found.foreign[0].path.name}: {found.foreign[0].why}).",
                file=sys.stderr,
            )
        verb = "Would remove" if args.dry_run else "Removed"
        for item in removed:
            what = f"{item.kind} of kernel {item.kernel_id}" if item.kernel_id else item.kind
            why = f"; no server can adopt it: {item.why}" if item.why else ""
            print(f"{verb} {what}: {item.path} ({human_bytes(item.bytes)}){why}")
        if not removed:
            print(f"Nothing to remove under {root}.")
        else:
            total = human_bytes(sum(item.bytes for item in removed))
            print(f"{verb} {len(removed)} item(s), {total}.")
    return EXIT_OK if len(removed) == len(plan) else EXIT_ERROR
