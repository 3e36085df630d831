"""Compaction at the agent (docs/incremental.md, *Through the checkpoint agent*): a chain
past compact_chain_ratio times its kernel's memory is folded in the background into one
whole image that takes its place; a restore or discard of the kernel cancels the fold
first; a fold cut short by the agent's death leaves a restorable image, and its leftover
goes at the next start.

A real agent as root, real CRIU, real kernels, clients as the real users cedana-test and
cedana-test2. Folds are held at a named step (compaction.HOLD_ENV), never timed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint import compaction

from . import checkpoint_fixtures, test_launch, test_restart
from .conftest import Agent, stop_agent
from .servers_on_agent import eventually
from .test_incremental_via_agent import (
    HASH,
    MAKE_ARRAY,
    MB,
    OTHER,
    UID,
    USER,
    dump,
    images_of,
    kernel_paths,
    ok,
    restore,
)
from .test_launch import Kernel, launch
from .test_restart import Agents

kernels = test_launch.kernels
agents = test_restart.agents
configured_agent = checkpoint_fixtures.configured_agent
loose_kernels = checkpoint_fixtures.loose_kernels

# A fifth of the 96 MB array: the delta on the whole base makes the chain hold about
# 1.2 times the kernel's memory, past the default ratio of 1.1.
CHANGE_FIFTH = "a[: len(a) // 5] += 1\nprint(hashlib.sha256(a.tobytes()).hexdigest())"


def image_of(agent: Agent, kid: str) -> dict[str, Any]:
    (image,) = [i for i in images_of(agent, USER)["images"] if i["kernel_id"] == kid]
    return image


def listed(agent: Agent, kid: str) -> dict[str, Any]:
    (entry,) = [k for k in ok(agent.run_as(USER, "list"))["kernels"] if k["kernel_id"] == kid]
    return entry


def temporaries(agent: Agent, kid: str) -> list[str]:
    store = agent.state_dir / "images" / str(UID)
    return sorted(p.name for p in store.iterdir() if p.name.startswith(f".{kid}."))


def chain_past_the_ratio(agent: Agent, kernels: list[Kernel]) -> tuple[Kernel, str, int]:
    """A kernel dumped whole, restored keeping its base, a fifth of its array changed:
    (kernel, the array's hash, the whole dump's bytes), before the second dump."""
    kernel, _ = launch(agent, kernels, USER)
    kernel.run(MAKE_ARRAY)
    whole = dump(agent, kernel)["bytes"]
    ok(restore(agent, kernel, lazy=False, keep_base=True))
    return kernel, kernel.run(CHANGE_FIFTH).strip(), whole


def folded(agent: Agent, kid: str) -> bool:
    return image_of(agent, kid)["layers"] == 1 and temporaries(agent, kid) == []


def test_a_chain_past_the_ratio_is_folded_and_restores_lazy_and_whole(
    agent: Agent, kernels: list[Kernel]
) -> None:
    kernel, changed, whole = chain_past_the_ratio(agent, kernels)
    second = dump(agent, kernel)
    assert "delta" in second and second["held_bytes"] > 1.1 * whole, (whole, second)
    assert eventually(lambda: folded(agent, kernel.id), 120)
    image = image_of(agent, kernel.id)
    print(f"chain held {second['held_bytes']} bytes; folded: {image}; whole dump {whole}")
    # One whole image again, holding about the kernel's memory (what a whole dump holds).
    assert abs(image["held_bytes"] - whole) < whole // 20, (image, whole)
    assert image["held_bytes"] < second["held_bytes"] - 10 * MB
    assert listed(agent, kernel.id)["held_bytes"] == image["held_bytes"]
    assert not (agent.state_dir / "images" / str(UID) / kernel.id / "base").exists()
    # cedana-test2 learns nothing of it and can do nothing to it.
    for op in ("restore", "discard"):
        reply = agent.run_as(OTHER, op, {"kernel_id": kernel.id, "lazy": False})
        assert reply["error"]["code"] == "not_found", reply
    assert images_of(agent, OTHER)["images"] == []

    # Lazily from the folded image, kept as a base: the next dump is a delta on it (the
    # fold kept the page index), and is folded again.
    assert ok(restore(agent, kernel, lazy=True, keep_base=True))["lazy"] is True
    assert kernel.run(HASH).strip() == changed
    changed = kernel.run(CHANGE_FIFTH).strip()
    third = dump(agent, kernel)
    assert "delta" in third and third["held_bytes"] > 1.1 * whole, third
    assert eventually(lambda: folded(agent, kernel.id), 120)
    # Whole.
    ok(restore(agent, kernel, lazy=False))
    assert kernel.run(HASH).strip() == changed
    assert [p for p in kernel_paths(agent, kernel.id) if ".work" not in p] == []


def test_a_restore_cancels_a_fold_held_mid_way_and_restores_the_chain(
    configured_agent: Any, loose_kernels: list[Kernel], tmp_path: Path
) -> None:
    holds = tmp_path / "holds"
    holds.mkdir()
    agent: Agent = configured_agent({}, env={compaction.HOLD_ENV: str(holds)})
    kernel, changed, _ = chain_past_the_ratio(agent, loose_kernels)
    (holds / "arm-folding").touch()
    second = dump(agent, kernel)
    assert eventually(lambda: (holds / "reached-folding").exists(), 120)
    assert [t for t in temporaries(agent, kernel.id) if ".tmp-" in t], temporaries(agent, kernel.id)
    # Another user's requests find nothing, and leave the fold where it is held.
    for op in ("restore", "discard", "free_ports"):
        reply = agent.run_as(OTHER, op, {"kernel_id": kernel.id, "lazy": False})
        assert reply["error"]["code"] == "not_found", reply
    image = image_of(agent, kernel.id)
    assert image["layers"] == 2 and image["held_bytes"] == second["held_bytes"], image
    assert temporaries(agent, kernel.id) != []

    # The restore cancels the fold (never released), then restores from the chain.
    ok(restore(agent, kernel, lazy=False, keep_base=True))
    assert kernel.run(HASH).strip() == changed
    assert temporaries(agent, kernel.id) == []
    # The chain was restored (kept as the base, two layers), not a folded image.
    (kept,) = images_of(agent, USER)["bases"]
    assert kept["layers"] == 2 and kept["held_bytes"] == second["held_bytes"], kept


def test_free_ports_waits_for_a_held_fold_to_stop_before_it_rewrites(
    configured_agent: Any, loose_kernels: list[Kernel], tmp_path: Path
) -> None:
    """`free_ports` rewrites the image: a fold held mid-way is stopped, and its
    temporary gone, before the rewrite starts, so the fold never swaps in an image made
    before the rewrite; the kernel restores from its chain with its state."""
    holds = tmp_path / "holds"
    holds.mkdir()
    agent: Agent = configured_agent({}, env={compaction.HOLD_ENV: str(holds)})
    kernel, changed, _ = chain_past_the_ratio(agent, loose_kernels)
    (holds / "arm-folding").touch()
    second = dump(agent, kernel)
    assert eventually(lambda: (holds / "reached-folding").exists(), 120)
    assert temporaries(agent, kernel.id) != []
    ok(agent.run_as(USER, "free_ports", {"kernel_id": kernel.id}))
    assert temporaries(agent, kernel.id) == []
    image = image_of(agent, kernel.id)
    assert image["layers"] == 2 and image["held_bytes"] == second["held_bytes"], image
    ok(restore(agent, kernel, lazy=False, keep_base=False))
    assert kernel.run(HASH).strip() == changed


def test_a_discard_cancels_a_held_fold_and_removes_everything(
    configured_agent: Any, loose_kernels: list[Kernel], tmp_path: Path
) -> None:
    holds = tmp_path / "holds"
    holds.mkdir()
    agent: Agent = configured_agent({}, env={compaction.HOLD_ENV: str(holds)})
    kernel, _, _ = chain_past_the_ratio(agent, loose_kernels)
    (holds / "arm-folding").touch()
    dump(agent, kernel)
    assert eventually(lambda: (holds / "reached-folding").exists(), 120)
    ok(agent.run_as(USER, "discard", {"kernel_id": kernel.id}))
    assert kernel_paths(agent, kernel.id) == []
    assert images_of(agent, USER)["images"] == []


def test_a_dump_that_needs_the_room_of_a_fold_in_progress_cancels_it(
    configured_agent: Any, loose_kernels: list[Kernel], tmp_path: Path
) -> None:
    # Sizes measured on an agent that folds nothing; then a quota with room for the
    # chain and its folded image, or for the chain and another kernel's image, not all.
    probe: Agent = configured_agent({"compact_chain_ratio": 0, "compact_chain_deltas": 0})
    kernel, _, whole = chain_past_the_ratio(probe, loose_kernels)
    chain = dump(probe, kernel)["held_bytes"]
    other, _ = launch(probe, loose_kernels, USER)
    other.run("x = 1")
    small = dump(probe, other)["bytes"]
    for k in (kernel, other):
        ok(probe.run_as(USER, "discard", {"kernel_id": k.id}))
    stop_agent(probe)

    holds = tmp_path / "holds"
    holds.mkdir()
    quota = chain + whole + small // 2
    agent: Agent = configured_agent({"quota_bytes": quota}, env={compaction.HOLD_ENV: str(holds)})
    kernel, changed, _ = chain_past_the_ratio(agent, loose_kernels)
    (holds / "arm-folded").touch()
    dump(agent, kernel)
    assert eventually(lambda: (holds / "reached-folded").exists(), 120)
    used = images_of(agent, USER)["used_bytes"]
    print(f"quota {quota}: chain {chain}, whole {whole}, small {small}; held mid-fold {used}")
    assert used + small > quota  # beside the folded image, the dump would not fit
    other, _ = launch(agent, loose_kernels, USER)
    other.run("x = 1")
    assert dump(agent, other)["bytes"] > 0
    assert temporaries(agent, kernel.id) == []
    assert image_of(agent, kernel.id)["layers"] == 2
    ok(restore(agent, kernel, lazy=False))
    assert kernel.run(HASH).strip() == changed


def test_no_fold_when_turned_off(configured_agent: Any, loose_kernels: list[Kernel]) -> None:
    agent: Agent = configured_agent({"compact_chain_ratio": 0, "compact_chain_deltas": 0})
    kernel, changed, _ = chain_past_the_ratio(agent, loose_kernels)
    dump(agent, kernel)
    # Nothing to wait for: a fold would have been scheduled before the dump's reply.
    assert images_of(agent, USER)["images"][0]["layers"] == 2
    assert temporaries(agent, kernel.id) == []
    ok(restore(agent, kernel, lazy=False))
    assert kernel.run(HASH).strip() == changed


@pytest.mark.parametrize("step", ["folding", "folded", "exchanged"])
def test_an_agent_killed_mid_fold_leaves_a_restorable_image_and_its_leftover_goes(
    agents: Agents, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    holds = tmp_path / "holds"
    holds.mkdir()
    monkeypatch.setenv(compaction.HOLD_ENV, str(holds))
    agent = agents.start()
    kernel, _ = agents.launch(agent, USER)
    kernel.run(MAKE_ARRAY)
    dump(agent, kernel)
    ok(restore(agent, kernel, lazy=False, keep_base=True))
    changed = kernel.run(CHANGE_FIFTH).strip()
    (holds / f"arm-{step}").touch()
    second = dump(agent, kernel)
    assert eventually(lambda: (holds / f"reached-{step}").exists(), 120)
    assert temporaries(agent, kernel.id) != []
    agents.kill(agent)
    monkeypatch.delenv(compaction.HOLD_ENV)
    agent = agents.start()
    # The leftover is gone at the start; the chain (before the exchange) or the folded
    # image (after it) is there, whole and restorable.
    assert temporaries(agent, kernel.id) == []
    image = image_of(agent, kernel.id)
    if step == "exchanged":
        assert image["layers"] == 1 and image["held_bytes"] < second["held_bytes"], image
    else:
        assert image["layers"] == 2 and image["held_bytes"] == second["held_bytes"], image
    ok(restore(agent, kernel, lazy=False))
    assert kernel.run(HASH).strip() == changed
