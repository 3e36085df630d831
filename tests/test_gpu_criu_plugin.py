"""CRIU's own CUDA plugin next to jupyter-cedana.

Distribution CRIU packages ship cuda_plugin.so; with NVIDIA's `cuda-checkpoint` on PATH
it checkpoints CUDA processes at dump and restores and unlocks them itself during
`criu restore`, after which our resume finds no checkpointed process. Here the plugin is
built from the CRIU source that scripts/install-criu.sh uses, put where CRIU finds
plugins when not told otherwise (CRIU_LIBS_DIR, which replaces /usr/lib/criu), and
`cuda-checkpoint` is the native helper under that name (its command line is
cuda-checkpoint's), talking to the TEST-ONLY fake driver. The plugin only acts when the
machine has an NVIDIA GPU (/proc/driver/nvidia/gpus) or CRIU is told to pretend one with
its fault injection CRIU_FAULT=138 (FI_PLUGIN_CUDA_FORCE_ENABLE), as here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from jupyter_cedana.checkpoint.engine import CheckpointEngine
from jupyter_cedana.errors import GpuError, NotCheckpointable
from jupyter_cedana.server.kernel.provisioner import KernelState
from tests.conftest import run

from .conftest_gpu import HELPER, ROOT, FakeGpu, fake_gpu, gpu_build
from .test_gpu_integration import (
    GPU_ID,
    KERNEL_GPU_MEM,
    _stop_gpu_helper,
    assert_kernel_answers,
    engine_config,
    gpu_kernel,
    libcuda,
    spy,
)

__all__ = [
    "_stop_gpu_helper",
    "engine_config",
    "fake_gpu",
    "gpu_build",
    "gpu_kernel",
    "libcuda",
    "spy",
]

pytestmark = pytest.mark.criu

PLUGINS = ROOT / "tests" / "fakes" / "build" / "criu-plugins"
FI_PLUGIN_CUDA_FORCE_ENABLE = "138"


@pytest.fixture(scope="session")
def cuda_plugin() -> Path:
    """CRIU's cuda_plugin.so, built once from CRIU's source (idempotent)."""
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-criu-cuda-plugin.sh"), str(PLUGINS)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"building CRIU's cuda plugin failed:\n{r.stdout}\n{r.stderr}"
    return PLUGINS / "cuda_plugin.so"


@pytest.fixture
def plugin_world(
    cuda_plugin: Path, spy: FakeGpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> FakeGpu:
    """A CRIU that would run its cuda plugin: plugin found, cuda-checkpoint on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cuda-checkpoint").symlink_to(HELPER)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("CRIU_LIBS_DIR", str(cuda_plugin.parent))
    monkeypatch.setenv("CRIU_FAULT", FI_PLUGIN_CUDA_FORCE_ENABLE)
    return spy


def plugin_calls(fake: FakeGpu) -> list[str]:
    return [c for c in fake.calls() if " by=cuda-checkpoint" in c]


async def test_cuda_plugin_present_does_not_break_resume(
    gpu_kernel: Any, plugin_world: FakeGpu, checkpoint_root: Path
) -> None:
    km = gpu_kernel
    prov = km.provisioner
    await run(km.test_client, "x = 41")
    await prov.suspend(tier="disk")
    dump_log = (checkpoint_root / km.kernel_id / "dump.log").read_text()
    assert "cuda_plugin: " not in dump_log  # the plugin logs with this prefix
    await prov.resume()
    assert prov.state == KernelState.running
    assert plugin_calls(plugin_world) == []  # cuda-checkpoint never ran
    (restore,) = [c for c in plugin_world.calls() if c.startswith("restore ")]
    assert " rc=0 by=cedana-cuda frozen=1" in restore
    assert plugin_world.proc_by_id(GPU_ID)["state"] == "running"
    await assert_kernel_answers(km, "print(x + 1)", "42")


async def test_control_the_plugin_acts_without_an_explicit_libdir(
    gpu_kernel: Any, plugin_world: FakeGpu, checkpoint_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same world with criu loading plugins from where the plugin is, as CRIU does by
    itself without --libdir (from CRIU_LIBS_DIR or /usr/lib/criu): the plugin takes the
    GPU restore over and ours finds nothing left to restore. This is what the test above
    would meet if the plugin directory were not explicit."""
    monkeypatch.setattr(CheckpointEngine, "plugin_dir", lambda self: os.environ["CRIU_LIBS_DIR"])
    km = gpu_kernel
    prov = km.provisioner
    await prov.suspend(tier="disk")
    assert "cuda_plugin: " in (checkpoint_root / km.kernel_id / "dump.log").read_text()
    with pytest.raises(GpuError, match="No checkpointed CUDA process"):
        await prov.resume()
    assert prov.state == KernelState.failed  # the image is kept
    # the plugin's own restore of the GPU memory, during `criu restore` (it may also fail
    # there: its restore thread is let run while CRIU's --leave-stopped SIGSTOP is due)
    restores = [c for c in plugin_calls(plugin_world) if c.startswith("restore ")]
    assert restores, plugin_world.calls()


async def test_plugin_dir_with_the_cuda_plugin_turns_gpu_checkpointing_off(
    gpu_kernel: Any, fake_gpu: FakeGpu, cuda_plugin: Path
) -> None:
    km = gpu_kernel
    prov = km.provisioner
    prov.engine.criu_plugin_dir = str(cuda_plugin.parent)
    available, why = prov.engine.cuda_status()
    assert available is False and "cuda_plugin.so" in (why or "")
    with pytest.raises(NotCheckpointable, match=r"cuda_plugin\.so"):
        await prov.suspend(tier="disk")
    assert prov.state == KernelState.running
    assert fake_gpu.timeline() == []
    assert fake_gpu.proc_by_id(GPU_ID)["mem"] == str(KERNEL_GPU_MEM)
