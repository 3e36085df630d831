"""Incremental images at the agent (restore's `keep_base`, docs/incremental.md): a kernel's
image kept after a restore is the base of its next dump, which writes only what changed,
into the agent's own store; restores read the chain, whole and lazy.

A real agent as root, real CRIU, real kernels, clients as the real users cedana-test and
cedana-test2."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from . import checkpoint_fixtures, test_launch, test_restart
from .conftest import USER_PYTHON, Agent, stop_agent
from .servers_on_agent import eventually
from .test_launch import Kernel, launch
from .test_restart import Agents, kernels_of

kernels = test_launch.kernels  # the fixture: kernels launched here, closed after
agents = test_restart.agents  # the fixture: agents started one after the other
configured_agent = checkpoint_fixtures.configured_agent  # agents with a checkpoint.json
loose_kernels = checkpoint_fixtures.loose_kernels

USER, OTHER = "cedana-test", "cedana-test2"
UID = 1001
MB = 1 << 20
ARRAY_MB = 96

MAKE_ARRAY = f"""
import hashlib, numpy as np
a = np.random.default_rng(7).integers(0, 2**63, size={ARRAY_MB} * 2**20 // 8, dtype=np.int64)
print(hashlib.sha256(a.tobytes()).hexdigest())
"""
CHANGE_SLICE = "a[1000:3000] += 1  # 16 KB of 96 MB\nprint(hashlib.sha256(a.tobytes()).hexdigest())"
HASH = "print(hashlib.sha256(a.tobytes()).hexdigest())"


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["ok"], reply
    return dict(reply["result"])


def on_disk(path: Path) -> tuple[int, set[tuple[int, int]]]:
    """Blocks allocated under `path` (bytes), each file once, and the files' inodes: a
    measure of the disk the agent's own accounting does not take part in."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total, seen


def inode(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def apparent(*paths: Path) -> int:
    """Apparent bytes of the files under `paths`, each file once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for path in paths:
        for dirpath, _, files in os.walk(path):
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def kernel_paths(agent: Agent, kid: str) -> list[str]:
    """Everything under the agent's image store and kept bases that names the kernel."""
    found = []
    for top in (agent.state_dir / "images", agent.state_dir / "bases"):
        for dirpath, dirs, files in os.walk(top):
            found += [os.path.join(dirpath, n) for n in dirs + files if kid in n]
    return found


def images_of(agent: Agent, user: str) -> dict[str, Any]:
    return ok(agent.run_as(user, "images"))


def restore(agent: Agent, kernel: Kernel, **args: Any) -> dict[str, Any]:
    kernel.close()
    kernel.client = None
    return agent.run_as(USER, "restore", {"kernel_id": kernel.id, **args}, timeout=300)


def dump(agent: Agent, kernel: Kernel) -> dict[str, Any]:
    kernel.close()
    kernel.client = None
    return ok(agent.run_as(USER, "dump", {"kernel_id": kernel.id}, timeout=300))


def suspended_twice(agent: Agent, kernels: list[Kernel]) -> tuple[Kernel, str, dict[str, Any]]:
    """A kernel with a 96 MB array, dumped, restored with keep_base, a slice changed, and
    dumped again: (kernel, the array's hash after the change, the first dump's reply)."""
    kernel, _ = launch(agent, kernels, USER)
    kernel.run(MAKE_ARRAY)
    first = dump(agent, kernel)
    assert first["bytes"] > ARRAY_MB * MB and "delta" not in first, first
    assert ok(restore(agent, kernel, lazy=False, keep_base=True))["keep_base"] is True
    changed = kernel.run(CHANGE_SLICE).strip()
    return kernel, changed, first


def test_a_second_dump_is_a_delta_on_the_kept_base_and_restores_whole_and_lazy(
    agent: Agent, kernels: list[Kernel]
) -> None:
    kernel, changed, first = suspended_twice(agent, kernels)
    store = agent.state_dir / "images" / str(UID)
    bases = agent.state_dir / "bases" / str(UID)
    # While it runs, its image is only kept as a base: listed as one, not as an image.
    listed = images_of(agent, USER)
    assert listed["images"] == [], listed
    assert [b["kernel_id"] for b in listed["bases"]] == [kernel.id]
    assert listed["bases"][0]["held_bytes"] == first["held_bytes"]
    base_blocks, base_inodes = on_disk(bases / kernel.id)
    # Its page index, which the dump reads, and does not link into the chain.
    base_inodes.discard(inode(bases / kernel.id / "page-index.bin"))

    second = dump(agent, kernel)
    print(f"first dump {first['bytes']} bytes, second {second['bytes']} bytes: {second}")
    # The delta writes what the cell changed (and what the kernel touched to run it).
    assert second["bytes"] < first["bytes"] // 10, (first, second)
    assert second["held_bytes"] == first["bytes"] + second["bytes"]
    assert second["delta"]["in_parent_bytes"] > ARRAY_MB * MB * 9 // 10, second
    # The disk says the same: blocks of files the delta added, beside the base's own
    # files, which the chain holds through their links (none copied).
    held_blocks, held_inodes = on_disk(store / kernel.id)
    assert base_inodes <= held_inodes
    delta_blocks = held_blocks - on_disk(store / kernel.id / "base")[0]
    print(f"on disk: base {base_blocks} bytes, delta {delta_blocks} bytes")
    assert delta_blocks < base_blocks // 10, (delta_blocks, base_blocks)
    assert not (bases / kernel.id).exists()  # the base is in the chain now
    assert os.readlink(store / kernel.id / "parent") == "base"
    listed = images_of(agent, USER)
    (image,) = listed["images"]
    assert image["layers"] == 2 and image["held_bytes"] == second["held_bytes"], image
    assert listed["bases"] == []
    # The quota counts each file once: the base's files, linked into the chain, once.
    image_dirs = [e for d in (store, bases) if d.is_dir() for e in d.iterdir() if e.is_dir()]
    assert listed["used_bytes"] == apparent(*image_dirs), (listed, apparent(*image_dirs))
    # Beside the chain: its page index (28 bytes a page) and the restores' CRIU logs.
    assert second["held_bytes"] <= listed["used_bytes"] < second["held_bytes"] + 4 * MB
    (entry,) = [k for k in ok(agent.run_as(USER, "list"))["kernels"] if k["kernel_id"] == kernel.id]
    assert entry["state"] == "dumped" and entry["held_bytes"] == second["held_bytes"], entry

    # Another user can neither restore nor discard it, nor learn of it.
    for op in ("restore", "discard"):
        reply = agent.run_as(OTHER, op, {"kernel_id": kernel.id, "lazy": False})
        assert reply["error"]["code"] == "not_found", reply
    assert images_of(agent, OTHER)["images"] == []

    # Restored lazily from the chain (pages of both layers served), kept as a base again.
    restored = ok(restore(agent, kernel, lazy=True, keep_base=True))
    assert restored["lazy"] is True, restored
    assert kernel.run(HASH).strip() == changed
    assert eventually(lambda: images_of(agent, USER)["bases"] != [])
    (kept,) = images_of(agent, USER)["bases"]
    assert kept["layers"] == 2 and kept["held_bytes"] == second["held_bytes"], kept

    # A third dump: a delta on the two-layer chain; restored whole from three layers.
    kernel.run("a[5000:6000] -= 3")
    changed = kernel.run(HASH).strip()
    third = dump(agent, kernel)
    assert third["bytes"] < first["bytes"] // 10, third
    assert images_of(agent, USER)["images"][0]["layers"] == 3
    ok(restore(agent, kernel, lazy=False))
    assert kernel.run(HASH).strip() == changed
    # Without keep_base nothing is kept: the store holds nothing of the kernel but the
    # working directory of its restore (its CRIU logs), as before.
    assert [p for p in kernel_paths(agent, kernel.id) if ".work" not in p] == []
    assert images_of(agent, USER)["bases"] == []


def test_a_kernel_that_is_killed_drops_its_base(agent: Agent, kernels: list[Kernel]) -> None:
    kernel, _ = launch(agent, kernels, USER)
    kernel.run("x = bytearray(8 << 20)")
    dump(agent, kernel)
    ok(restore(agent, kernel, lazy=False, keep_base=True))
    bases = agent.state_dir / "bases" / str(UID)
    assert (bases / kernel.id / "manifest.json").is_file()
    assert images_of(agent, USER)["used_bytes"] > 8 << 20
    ok(agent.run_as(USER, "signal", {"kernel_id": kernel.id, "signum": signal.SIGKILL}))
    assert ok(agent.run_as(USER, "wait", {"kernel_id": kernel.id, "timeout": 30}))["state"] == (
        "exited"
    )
    assert eventually(lambda: not (bases / kernel.id).exists())
    assert eventually(lambda: [p for p in kernel_paths(agent, kernel.id) if ".work" not in p] == [])
    listed = images_of(agent, USER)
    assert listed["bases"] == [] and listed["used_bytes"] < 1 << 20, listed


def test_discard_removes_the_whole_chain(agent: Agent, kernels: list[Kernel]) -> None:
    kernel, _, _ = suspended_twice(agent, kernels)
    dump(agent, kernel)
    assert images_of(agent, USER)["images"][0]["layers"] == 2
    other = agent.run_as(OTHER, "discard", {"kernel_id": kernel.id})
    assert other["error"]["code"] == "not_found", other
    ok(agent.run_as(USER, "discard", {"kernel_id": kernel.id}))
    assert kernel_paths(agent, kernel.id) == []
    listed = images_of(agent, USER)
    assert listed["images"] == [] and listed["bases"] == [] and listed["used_bytes"] < 1 << 20


def test_a_damaged_base_chunk_fails_the_restore_and_keeps_the_images(
    live_agent: Agent, kernels: list[Kernel]
) -> None:
    agent = live_agent
    kernel, _, _ = suspended_twice(agent, kernels)
    second = dump(agent, kernel)
    base = agent.state_dir / "images" / str(UID) / kernel.id / "base"
    pages = max(base.glob("pages-*.img"), key=lambda p: p.stat().st_size)  # the array's
    where = f"base/{pages.name}"
    # One byte of a chunk that holds data (not a hole), in the middle of the array.
    with open(pages, "r+b") as f:
        offset = os.lseek(f.fileno(), pages.stat().st_size // 2, os.SEEK_DATA)
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    failed = restore(agent, kernel, lazy=False, keep_base=True)
    assert failed["error"]["code"] == "failed", failed
    assert where in failed["error"]["message"], failed
    status = ok(agent.run_as(USER, "poll", {"kernel_id": kernel.id}))
    assert status["state"] == "dumped", status
    (image,) = images_of(agent, USER)["images"]
    assert image["layers"] == 2 and image["held_bytes"] == second["held_bytes"], image
    assert pages.exists()

    # Lazily: the damaged chunk fails the restore before the kernel runs (if CRIU reads
    # it itself) or when it is served; then the kernel is stopped, its chain kept.
    lazy = restore(agent, kernel, lazy=True, keep_base=True)
    print("lazy restore of the damaged chain:", lazy)
    if lazy["ok"]:

        def stopped() -> bool:
            return ok(agent.run_as(USER, "poll", {"kernel_id": kernel.id}))["state"] == "dumped"

        assert eventually(stopped, 60)
        note = ok(agent.run_as(USER, "poll", {"kernel_id": kernel.id}))["note"]
        assert "could not all be restored" in note and where in note, note
    else:
        assert where in lazy["error"]["message"], lazy
    (image,) = images_of(agent, USER)["images"]
    assert image["layers"] == 2 and image["held_bytes"] == second["held_bytes"], image
    assert images_of(agent, USER)["bases"] == []


def test_the_servers_client_asks_to_keep_the_base_when_its_engine_does(
    agent: Agent, kernels: list[Kernel]
) -> None:
    """AgentKernel, as a server of cedana-test runs it: keep_base follows the engine's."""
    kernel, _ = launch(agent, kernels, USER)
    kernel.run("y = list(range(10))")
    dump(agent, kernel)
    script = textwrap.dedent(
        f"""
        import asyncio, json, sys
        from jupyter_cedana.checkpoint.engine import CheckpointEngine
        from jupyter_cedana.server.kernel.checkpoint_agent import CheckpointAgent

        async def main():
            agent = CheckpointAgent(socket={str(agent.socket_path)!r})
            agent.serve(CheckpointEngine(keep_base=sys.argv[1] == "on"))
            k = agent.kernel({kernel.id!r})
            await k.restore(lazy=False)
            print("restored", k.pid)
            print(json.dumps(await k.dump()))
            await agent.close()

        asyncio.run(main())
        """
    )
    bases = agent.state_dir / "bases" / str(UID) / kernel.id
    for setting in ("off", "on"):
        out = subprocess.run(
            ["runuser", "-u", USER, "--", USER_PYTHON, "-c", script, setting],
            capture_output=True,
            text=True,
            timeout=300,
            cwd="/",
        )
        assert "restored" in out.stdout, out.stderr
        assert not bases.exists()
        image = images_of(agent, USER)["images"][0]
        # Kept: the dump after the restore is a delta on it.
        assert image["layers"] == (2 if setting == "on" else 1), (setting, image)
        # The server counts what the checkpoint holds on disk, as a root server does.
        dumped = json.loads(out.stdout.splitlines()[-1])
        assert dumped["bytes"] == image["held_bytes"], (dumped, image)
        assert dumped["image_bytes"] == image["bytes"], (dumped, image)


def test_a_chain_whose_parent_link_leads_elsewhere_is_refused(
    agent: Agent, kernels: list[Kernel]
) -> None:
    kernel, _ = launch(agent, kernels, USER)
    kernel.run("x = bytearray(8 << 20)")
    dump(agent, kernel)
    ok(restore(agent, kernel, lazy=False, keep_base=True))
    kernel.run("x[:10] = b'0123456789'")
    assert "delta" in dump(agent, kernel)
    image = agent.state_dir / "images" / str(UID) / kernel.id
    # CRIU would read in-parent pages from wherever `parent` points, as root.
    elsewhere = agent.base / "elsewhere"
    elsewhere.mkdir()
    (image / "parent").unlink()
    (image / "parent").symlink_to(elsewhere)
    refused = restore(agent, kernel, lazy=False)
    assert refused["error"]["code"] == "refused", refused
    assert "parent link" in refused["error"]["message"], refused
    assert not image.exists()  # moved aside for the administrator, never restored
    assert images_of(agent, USER)["refused"] != []


def test_a_kept_base_outlives_an_agent_restart_and_goes_with_a_kernel_that_died_meanwhile(
    agents: Agents,
) -> None:
    agent = agents.start()
    lives, _ = agents.launch(agent, USER)
    dies, _ = agents.launch(agent, USER)
    for kernel in (lives, dies):
        kernel.run("z = bytearray(range(256)) * (32 << 12)")  # 32 MiB
        dump(agent, kernel)
        ok(restore(agent, kernel, lazy=False, keep_base=True))
    bases = agent.state_dir / "bases" / str(UID)
    indexed = [bases / k.id / "page-index.bin" for k in (lives, dies)]
    assert eventually(lambda: all(p.exists() for p in indexed))
    # The agent killed (its kernels run on), and one kernel dies while no agent runs.
    init = kernels_of(agent, USER)[dies.id]["pid"]
    agents.kill(agent)
    os.kill(init, signal.SIGKILL)
    # As if the agent had died before it indexed the base: the next agent indexes it.
    (bases / lives.id / "page-index.bin").unlink()
    agent = agents.start()
    listed = {k["kernel_id"]: k for k in ok(agent.run_as(USER, "list"))["kernels"]}
    assert listed[dies.id]["state"] == "exited" and "held_bytes" not in listed[dies.id]
    assert not (bases / dies.id).exists()
    assert listed[lives.id]["state"] == "running" and listed[lives.id]["held_bytes"] > 8 * MB
    # The living kernel's next dump is a delta on the base the last agent kept.
    assert not (bases / lives.id / "page-index.bin").exists()
    lives.run("z[:4] = b'abcd'")
    reply = dump(agent, lives)
    assert "delta" in reply and reply["bytes"] < reply["held_bytes"] // 2, reply


def test_the_quota_counts_chains_and_kept_bases(
    configured_agent: Any, loose_kernels: list[Kernel]
) -> None:
    # Measured on an agent without a quota to speak of, then set to 1.5 times the image:
    # a chain fits (its base counted once), a kept base and a whole image more do not.
    probe: Agent = configured_agent({})
    kernel, _ = launch(probe, loose_kernels, USER)
    kernel.run("w = bytearray(range(256)) * (64 << 12)")  # 64 MiB
    whole = dump(probe, kernel)["bytes"]
    ok(probe.run_as(USER, "discard", {"kernel_id": kernel.id}))
    stop_agent(probe)

    agent: Agent = configured_agent({"quota_bytes": whole * 3 // 2})
    kernel, _ = launch(agent, loose_kernels, USER)
    kernel.run("w = bytearray(range(256)) * (64 << 12)")
    dump(agent, kernel)
    ok(restore(agent, kernel, lazy=False, keep_base=True))
    kernel.run("w[:8] = b'12345678'")
    delta = dump(agent, kernel)
    assert "delta" in delta, delta
    listed = images_of(agent, USER)
    assert delta["held_bytes"] <= listed["used_bytes"] <= listed["quota_bytes"], listed
    # Restored, its chain is its kept base, in the quota: a whole image more does not fit.
    ok(restore(agent, kernel, lazy=False, keep_base=True))
    assert images_of(agent, USER)["used_bytes"] >= delta["held_bytes"]
    other, _ = launch(agent, loose_kernels, USER)
    other.run("v = bytearray(range(256)) * (64 << 12)")
    refused = agent.run_as(USER, "dump", {"kernel_id": other.id}, timeout=300)
    assert refused["error"]["code"] == "refused" and "quota" in refused["error"]["message"]
    assert other.run("print(len(v))").strip() == str(64 << 20)
