"""What bench/gpu_check.py runs inside the kernel, and the GPU-side tricks of the check.

Two implementations with the same surface: `TorchWorkload` (PyTorch tensors on a real
NVIDIA GPU) and `FakeWorkload` (the TEST-ONLY fake driver of tests/fakes: the kernel
registers itself as a CUDA process holding memory, its "tensors" are byte strings in
host memory), so that the check script itself can be run on a machine without a GPU.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path
from typing import Any

GB = 1e9

# ---- PyTorch (real GPU) -----------------------------------------------------------------

# Tensors are filled chunk by chunk from seeded generators, so verification regenerates
# each chunk and compares exactly, with one chunk of extra memory. Host memory is an
# arithmetic sequence (fast to fill and check on the CPU).
TORCH_SETUP = r"""
import os, torch
_DEV = {device!r}
_CH = 1 << 28  # int32 elements per chunk (1 GiB)
def _fill(t, seed):
    for i, c in enumerate(t.view(-1).split(_CH)):
        g = torch.Generator(device=t.device); g.manual_seed(seed * 100003 + i)
        c.random_(0, 2**31 - 1, generator=g)
def _same(t, seed):
    for i, c in enumerate(t.view(-1).split(_CH)):
        g = torch.Generator(device=t.device); g.manual_seed(seed * 100003 + i)
        ref = torch.empty_like(c).random_(0, 2**31 - 1, generator=g)
        if not torch.equal(c, ref):
            return False
        del ref
    return True
def _host_same(h):
    for i, c in enumerate(h.split(_CH)):
        ref = torch.arange(i * _CH, i * _CH + c.numel(), dtype=torch.int64) * 7 + 3
        if not torch.equal(c, ref):
            return False
    return True
tensors = []
for _s, _gb in enumerate({sizes!r}):
    _t = torch.empty(int(_gb * 1e9) // 4, dtype=torch.int32, device=_DEV)
    _fill(_t, _s + 1)
    tensors.append(_t)
host = torch.arange(int({host_gb} * 1e9) // 8, dtype=torch.int64) * 7 + 3
if _DEV == "cuda":
    torch.cuda.synchronize()
def verify():
    ok = all(_same(t, s + 1) for s, t in enumerate(tensors))
    x = torch.ones(1 << 20, device=_DEV) * 2
    new_work = float(x.sum().item()) == 2.0 * (1 << 20)
    return {{"tensors": ok, "host": _host_same(host), "new_cuda_work": new_work}}
print("READY", os.getpid(), torch.cuda.memory_reserved() if _DEV == "cuda" else 0)
"""

# A second CUDA process in the kernel's tree (what preflight must refuse).
TORCH_CHILD = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import torch, time; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize();"
    " print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
print("CHILD", child.pid, child.stdout.readline().decode().strip())
"""

STOP_CHILD = "child.kill(); child.wait(); print('CHILD-GONE')"


class TorchWorkload:
    fake = False

    def __init__(self, device: str = "cuda") -> None:
        self.device = device
        self._hog: Any = None

    def kernel_env(self) -> dict[str, str]:
        return {}

    def setup_code(self, sizes: list[float], host_gb: float) -> str:
        return TORCH_SETUP.format(device=self.device, sizes=sizes, host_gb=host_gb)

    def child_code(self) -> str:
        return TORCH_CHILD

    def hog(self, nbytes: int) -> None:
        """Take `nbytes` of GPU memory in this process (another tenant)."""
        import torch

        self._hog = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize()

    def release(self) -> None:
        import torch

        self._hog = None
        torch.cuda.empty_cache()


# ---- the TEST-ONLY fakes (no GPU) -------------------------------------------------------

# Registers a process as a CUDA process holding memory in the fake's state file (the
# fake libcuda rewrites that file under the same lock).
FAKE_REGISTER = r"""
import ctypes, fcntl, os, random, threading
def _register(pid, mem, gid=None):
    line = f"proc pid={pid} dev=0 mem={mem}"
    if gid:
        with open(f"/proc/{pid}/status") as f:
            ns = [l for l in f if l.startswith("NSpid:")][0].split()[-1]
        line += f" id={gid} nspid={ns}"
    with open(os.environ["CEDANA_FAKE_GPU_STATE"], "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line + "\n")
"""

FAKE_SETUP = r"""
def _restore_thread():
    ctypes.CDLL(None).prctl(15, b"cuda00001f00")  # the driver's thread: cuda<hex>
    threading.Event().wait()
threading.Thread(target=_restore_thread, daemon=True).start()
tensors = [random.Random(s + 1).randbytes(int(gb * 1e9)) for s, gb in enumerate({sizes!r})]
host = random.Random(999).randbytes(int({host_gb} * 1e9))
_register(os.getpid(), sum(len(t) for t in tensors), os.environ["CEDANA_FAKE_GPU_ID"])
def verify():
    ok = all(t == random.Random(s + 1).randbytes(len(t)) for s, t in enumerate(tensors))
    gid = os.environ["CEDANA_FAKE_GPU_ID"]
    with open(os.environ["CEDANA_FAKE_GPU_STATE"]) as f:
        me = [l for l in f if f" id={{gid}} " in l]
    running = bool(me) and (" state=" not in me[0] or " state=running " in me[0])
    return {{"tensors": ok, "host": host == random.Random(999).randbytes(len(host)),
            "new_cuda_work": running}}
print("READY", os.getpid(), sum(len(t) for t in tensors))
"""

FAKE_CHILD = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import sys, time; exec(sys.argv[1]); _register(os.getpid(), 1 << 26);"
    " print('up', flush=True); time.sleep(600)",
    _REGISTER_SRC], stdout=subprocess.PIPE)
print("CHILD", child.pid, child.stdout.readline().decode().strip())
"""


class FakeWorkload:
    """Drives the TEST-ONLY fake driver: its state file and libraries from tests/fakes."""

    fake = True

    def __init__(self, state: Path) -> None:
        self.state = state

    @staticmethod
    def create_world(state: Path, total: int) -> None:
        state.write_text(
            "driver version=580.95.05 cuda=13000\n"
            f"device index=0 uuid=GPU-00000000-1111-2222-3333-444444444444 total={total} "
            "reserved=0 name=NVIDIA H200 (fake)\n"
        )

    def kernel_env(self) -> dict[str, str]:
        # one identity per kernel: the fake matches a restored process by it
        return {"CEDANA_FAKE_GPU_ID": f"gpu-check-{uuid.uuid4().hex[:8]}"}

    def setup_code(self, sizes: list[float], host_gb: float) -> str:
        return FAKE_REGISTER + FAKE_SETUP.format(sizes=sizes, host_gb=host_gb)

    def child_code(self) -> str:
        return f"_REGISTER_SRC = {FAKE_REGISTER!r}\n" + FAKE_CHILD

    def _edit(self, keep: Any, add: str | None = None) -> None:
        with open(self.state, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            lines = [ln for ln in f.read().splitlines() if keep(ln)]
            if add:
                lines.append(add)
            f.seek(0)
            f.truncate()
            f.write("\n".join(lines) + "\n")

    def hog(self, nbytes: int) -> None:
        self._edit(lambda ln: True, f"proc pid={os.getpid()} dev=0 mem={nbytes}")

    def release(self) -> None:
        self._edit(lambda ln: not ln.startswith(f"proc pid={os.getpid()} "))
