"""A stand-in Jupyter server for tests that need kernels of another user (run as that user
by tests/test_nonroot.py): real kernels under the cedana provisioner, driven line by line.

    python tests/kernel_host.py CHECKPOINT_ROOT

Reads one JSON command per line on stdin, answers one JSON line on stdout:
    {"op": "start"}                      -> {"kernel": N, "pid": ..., "watcher": ...}
    {"op": "run", "kernel": N, "code": C} -> {"status": ..., "out": "..."}
    {"op": "suspend" | "resume", "kernel": N} -> the provisioner's summary, or {"error": ...}
    {"op": "tree", "kernel": N}          -> {"root": init, "pids": [...], "keeper": ...}
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import KernelProvisionerFactory
from traitlets.config import Config

from jupyter_cedana.proctree import process_tree
from tests.conftest import run, wait_iopub


async def main(root: str) -> None:
    KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
    config = Config()
    config.CheckpointEngine.checkpoint_root = root
    kernels: list[tuple[AsyncKernelManager, Any]] = []
    loop = asyncio.get_running_loop()

    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "start":
            km = AsyncKernelManager(config=config)
            await km.start_kernel()
            kc = km.client()
            kc.start_channels()
            await kc.wait_for_ready(timeout=60)
            kernels.append((km, kc))
            return {"kernel": len(kernels) - 1, "id": km.kernel_id, "pid": km.provisioner.pid}
        km, kc = kernels[cmd["kernel"]]
        prov = km.provisioner
        if cmd["op"] == "run":
            await wait_iopub(kc)
            reply, out = await run(kc, cmd["code"])
            return {"status": reply["status"], "out": out}
        if cmd["op"] in ("suspend", "resume"):
            try:
                return await getattr(prov, cmd["op"])()
            except Exception as e:
                return {"error": str(e)}
        if cmd["op"] == "tree":
            keeper = prov.process.pid if prov.process is not None else None
            return {"root": prov.pid, "pids": sorted(process_tree(prov.pid or 0)), "keeper": keeper}
        return {"error": f"unknown op {cmd['op']}"}

    while line := await loop.run_in_executor(None, sys.stdin.readline):
        answer = await handle(json.loads(line))
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
