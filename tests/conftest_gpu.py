"""Fixtures for the GPU tests: build the TEST-ONLY fake driver libraries and the native
helper, and script the fakes through their shared state file.

How the fakes are loaded, through the product's real code paths:
- NVML: pynvml does CDLL("libnvidia-ml.so.1"). The fixture loads the fake by absolute
  path first; the dynamic loader then resolves pynvml's bare name to the library already
  loaded under that SONAME. Subprocesses get LD_LIBRARY_PATH instead.
- libcuda: the native helper dlopen()s $CEDANA_LIBCUDA (CudaCheckpointer.libcuda_path).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"
BUILD = FAKES / "build"
FAKE_LIBCUDA = BUILD / "libcuda.so.1"
FAKE_OLD_LIBCUDA = BUILD / "old-driver" / "libcuda.so.1"
FAKE_NVML = BUILD / "libnvidia-ml.so.1"
HELPER = ROOT / "native" / "cedana-cuda"

GiB = 1 << 30
UUID0 = "GPU-0a0a0a0a-1111-2222-3333-444444444400"
UUID1 = "GPU-0a0a0a0a-1111-2222-3333-444444444401"
UUID2 = "GPU-0a0a0a0a-1111-2222-3333-444444444402"
H100 = "NVIDIA H100 80GB HBM3"

# CUresult codes the tests inject
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_OPERATING_SYSTEM = 304
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_UNKNOWN = 999


@pytest.fixture(scope="session")
def gpu_build() -> dict[str, Path]:
    """Compile the fakes and the helper once per session (make is incremental)."""
    subprocess.run(["make", "-s", "-C", str(FAKES)], check=True)
    subprocess.run(["make", "-s", "-C", str(ROOT / "native"), "cedana-cuda"], check=True)
    return {"libcuda": FAKE_LIBCUDA, "old_libcuda": FAKE_OLD_LIBCUDA, "nvml": FAKE_NVML}


class FakeGpu:
    """The fakes' shared state file (format documented in tests/fakes/fakegpu_state.h)."""

    def __init__(self, path: Path):
        self.path = path
        self.log_path = Path(str(path) + ".log")

    # -- writing --
    def write(self, text: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text.strip() + "\n")
        os.replace(tmp, self.path)  # atomic for readers in other processes

    def add(self, kind: str, **kv: Any) -> None:
        self.write(self.path.read_text() + _line(kind, kv))

    def setup(
        self,
        devices: list[dict[str, Any]] | None = None,
        driver: str = "570.86.10",
        cuda: int = 12080,
    ) -> None:
        if devices is None:
            devices = [{"uuid": UUID0, "total": 80 * GiB, "name": H100}]
        lines = [_line("driver", {"version": driver, "cuda": cuda})]
        for i, d in enumerate(devices):
            lines.append(_line("device", {"index": i, "reserved": 0, **d}))
        self.write("".join(lines))

    def update(self, kind: str, match: dict[str, Any], **kv: Any) -> None:
        """Change fields of the records of `kind` whose fields equal `match`."""
        out = []
        for k, rec in self.records():
            if k == kind and all(str(rec.get(a)) == str(b) for a, b in match.items()):
                rec.update({a: str(b) for a, b in kv.items()})
            out.append(_line(k, rec))
        self.write("".join(out))

    # -- reading --
    def records(self, kind: str | None = None) -> list[tuple[str, dict[str, str]]]:
        out = []
        for raw in self.path.read_text().splitlines():
            parts = raw.split()
            if not parts or parts[0].startswith("#"):
                continue
            rec: dict[str, str] = {}
            for i, tok in enumerate(parts[1:], 1):
                key, _, val = tok.partition("=")
                if key == "name":
                    rec["name"] = " ".join([val, *parts[i + 1 :]])
                    break
                rec[key] = val
            if kind is None or parts[0] == kind:
                out.append((parts[0], rec))
        return out

    def proc(self, pid: int) -> dict[str, str]:
        for _, rec in self.records("proc"):
            if int(rec["pid"]) == pid:
                return rec
        raise KeyError(pid)

    def calls(self, kind: str = "cuda") -> list[str]:
        """Logged calls as 'op pid=N rc=N ...' (init calls left out)."""
        if not self.log_path.exists():
            return []
        lines = self.log_path.read_text().splitlines()
        return [
            line.split(" ", 1)[1]
            for line in lines
            if line.startswith(kind + " ") and not line.startswith(kind + " init")
        ]

    def ops(self, pid: int | None = None) -> list[str]:
        """Logged checkpoint-API operations (without the queries get_state and
        restore_tid), e.g. ['lock', 'checkpoint']."""
        out = []
        for c in self.calls():
            op, rest = c.split(" ", 1)
            if op in QUERIES or (pid is not None and f"pid={pid} " not in rest + " "):
                continue
            out.append(op if " rc=0" in rest else f"{op}!")
        return out

    def clear_log(self) -> None:
        self.log_path.unlink(missing_ok=True)

    def proc_by_id(self, gpu_id: str) -> dict[str, str]:
        """The record of the process marked CEDANA_FAKE_GPU_ID=gpu_id (its pid follows
        the process across a CRIU restore; see tests/fakes/fakegpu_state.h)."""
        for _, rec in self.records("proc"):
            if rec.get("id") == gpu_id:
                return rec
        raise KeyError(gpu_id)

    def mark(self, text: str) -> None:
        """Append `test TEXT` to the call log, to order test events among driver calls."""
        with open(self.log_path, "a") as f:
            f.write(f"test {text}\n")

    def timeline(self) -> list[str]:
        """Checkpoint-API operations (as in ops(), without queries) and test marks, in
        the order they happened."""
        if not self.log_path.exists():
            return []
        out = []
        for line in self.log_path.read_text().splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "test":
                out.append(rest)
            elif kind == "cuda":
                op, _, args = rest.partition(" ")
                if op != "init" and op not in QUERIES:
                    out.append(op if " rc=0" in f" {args}" else f"{op}!")
        return out


QUERIES = ("get_state", "restore_tid")


def _line(kind: str, kv: dict[str, Any]) -> str:
    parts = [kind, *(f"{k}={v}" for k, v in kv.items() if k != "name")]
    if "name" in kv:
        parts.append(f"name={kv['name']}")  # runs to the end of the line
    return " ".join(parts) + "\n"


_nvml_preloaded: ctypes.CDLL | None = None


def _preload_fake_nvml() -> None:
    """Make pynvml's CDLL("libnvidia-ml.so.1") resolve to the fake (see module doc)."""
    global _nvml_preloaded
    if _nvml_preloaded is None:
        _nvml_preloaded = ctypes.CDLL(str(FAKE_NVML), mode=ctypes.RTLD_GLOBAL)
    import pynvml

    if pynvml.nvmlLib is None:
        return
    if pynvml.nvmlLib._name != "libnvidia-ml.so.1":  # pragma: no cover - defensive
        raise RuntimeError(f"pynvml loaded {pynvml.nvmlLib._name}, not the fake")


@pytest.fixture
def fake_gpu(
    gpu_build: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> FakeGpu:
    """A scripted fake GPU world with one H100 and no processes."""
    state = tmp_path / "gpu-state"
    monkeypatch.setenv("CEDANA_FAKE_GPU_STATE", str(state))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(BUILD))  # for subprocesses
    fake = FakeGpu(state)
    fake.setup()
    _preload_fake_nvml()
    return fake


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start real processes to stand for kernels; killed at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*argv: str, **kw: Any) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(list(argv or ("sleep", "600")), start_new_session=True, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def nspid(pid: int) -> int:
    """The innermost PID-namespace pid of `pid` (last field of NSpid)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    raise LookupError(pid)


def wait_for(pred: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.02)


def wait_tree(pid: int, size: int, timeout: float = 5.0) -> set[int]:
    """The process tree of `pid` once it has `size` processes (else whatever it is)."""
    from jupyter_cedana.checkpoint.proctree import process_tree

    tree: set[int] = set()

    def full() -> bool:
        nonlocal tree
        tree = process_tree(pid)
        return len(tree) == size

    wait_for(full, timeout)
    return tree
