"""The agent's image store: root's alone (a test user can neither read nor change it),
per-uid quota, and the credential check of an image before a restore."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.agent.imagecheck import ImageRefused, task_creds, verify_owner
from jupyter_cedana.agent.imagestore import ImageStore

from .checkpoint_fixtures import configured_agent, loose_kernels  # noqa: F401 (fixtures)
from .conftest import USER_PYTHON, Agent
from .test_checkpoint_ops import ROOT, launch_root
from .test_launch import Kernel

INIT = str(Path(__file__).resolve().parents[2] / "jupyter_cedana" / "bin" / "cedana-init")

ATTEMPTS = textwrap.dedent("""
    import json, os, sys
    images, mine, image = sys.argv[1:4]
    tries = {
        "list images": lambda: os.listdir(images),
        "list own dir": lambda: os.listdir(mine),
        "read manifest": lambda: open(os.path.join(image, "manifest.json")).read(),
        "write manifest": lambda: open(os.path.join(image, "manifest.json"), "a"),
        "create file": lambda: open(os.path.join(mine, "planted.img"), "w"),
        "plant directory": lambda: os.mkdir(os.path.join(mine, "f" * 32)),
        "plant link": lambda: os.symlink("/tmp", os.path.join(mine, "e" * 32)),
        "rename image": lambda: os.rename(image, image + "-moved"),
        "remove image": lambda: os.rmdir(image),
    }
    out = {}
    for name, attempt in tries.items():
        try:
            attempt()
            out[name] = "done"
        except OSError as e:
            out[name] = e.__class__.__name__
    print(json.dumps(out))
""")


def dumped_root_image(agent: Agent, kernels: list[Kernel]) -> tuple[Kernel, Path]:
    kernel = launch_root(agent, kernels)
    reply = agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})
    assert reply["ok"], reply
    return kernel, agent.state_dir / "images" / "0" / kernel.id


def test_store_is_roots_alone(
    configured_agent: Any,  # noqa: F811
    loose_kernels: list[Kernel],  # noqa: F811
) -> None:
    agent: Agent = configured_agent({})
    _, image = dumped_root_image(agent, loose_kernels)
    # cedana-test's own part of the store, as a dump of theirs makes it.
    mine = ImageStore(agent.state_dir).for_uid(1001).root
    theirs = mine / image.name
    os.rename(image, theirs)
    for path in [agent.state_dir / "images", mine, theirs, *theirs.rglob("*")]:
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == (0, 0), path
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        assert stat.S_IMODE(st.st_mode) == want, (path, oct(st.st_mode))
    paths = [str(agent.state_dir / "images"), str(mine), str(theirs)]
    # As the store is, and with the directories above the user's part opened for
    # traversal: each level keeps the user out by itself.
    for opened in ([], [agent.state_dir, agent.state_dir / "images"]):
        for d in opened:
            os.chmod(d, 0o711)
        out = subprocess.run(
            ["runuser", "-u", "cedana-test", "--", USER_PYTHON, "-c", ATTEMPTS, *paths],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        for d in opened:
            os.chmod(d, 0o700)
        results = json.loads(out.stdout)
        assert results and all(v == "PermissionError" for v in results.values()), results
    assert sorted(p.name for p in mine.iterdir()) == [theirs.name]


def test_quota_refuses_a_dump_and_the_kernel_runs_on(
    configured_agent: Any,  # noqa: F811
    loose_kernels: list[Kernel],  # noqa: F811
) -> None:
    agent: Agent = configured_agent({"quota_bytes": 4096})
    kernel = launch_root(agent, loose_kernels)
    kernel.run("y = 5")
    reply = agent.run_as(ROOT, "dump", {"kernel_id": kernel.id})
    assert reply["error"]["code"] == "refused", reply
    assert "quota of 4096 bytes" in reply["error"]["message"]
    assert kernel.run("print(y)").strip() == "5"
    images = agent.run_as(ROOT, "images")["result"]
    assert images["images"] == [] and images["used_bytes"] == 0
    assert images["quota_bytes"] == 4096


def test_credentials_of_a_real_image(
    configured_agent: Any,  # noqa: F811
    loose_kernels: list[Kernel],  # noqa: F811
) -> None:
    agent: Agent = configured_agent({})
    _, image = dumped_root_image(agent, loose_kernels)
    tasks = task_creds(image)
    assert len(tasks) >= 2  # the init and the kernel (and its threads)
    assert all(t.ids == dict.fromkeys(t.ids, 0) for t in tasks)
    assert any(any(t.caps["effective"]) for t in tasks)  # root's kernel keeps root's
    verify_owner(image, 0, 0, (0,), INIT)  # a root caller's own image
    with pytest.raises(ImageRefused, match="uid 0, not 1001"):
        verify_owner(image, 1001, 1001, (1001,), INIT)
    with pytest.raises(ImageRefused, match="not /usr/bin/other-init"):
        verify_owner(image, 0, 0, (0,), "/usr/bin/other-init")
    (image / "creds-1.img").write_bytes(b"")
    with pytest.raises(ImageRefused, match="creds-"):
        verify_owner(image, 0, 0, (0,), INIT)
