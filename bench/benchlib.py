"""Shared pieces of the CPU benchmarks: machine facts, plain file I/O of the same bytes on
the same disk (the baseline every number is put beside), cache dropping, kernels under the
cedana provisioner, the message gate's IOPub confirmation, a memory sampler; and for the
runs against a real jupyter server (torture.py, chaos.py): the server, a notebook-like
websocket connection, the namespace hash, and the leftovers checks."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import mmap
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

GB = 1e9
CHUNK = 8 << 20
GATE_NUDGE_S = 0.5  # jupyter_server's nudge() retries kernel_info_request every 0.5 s

# A kernel holding `nbytes` of random non-zero int64 (every page resident, incompressible).
FILL = """
import numpy as np
_n = max(0, {nbytes} // 8)
a = np.random.default_rng(12345).integers(1, 2**62, size=_n, dtype=np.int64)
b = 7
"""
PROBE = "print(int(a[::512].sum() % 1000003), a.nbytes)"  # touches 1 page in 512
SMALL = "print(b * 6)"  # touches next to nothing
TOUCH_ALL = "print(int(a.sum() % 1000003))"  # reads every page of the array


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def fs_type(path: Path) -> str:
    from jupyter_cedana.checkpoint.criucache import mount_of

    found = mount_of(str(path))
    return f"{found[1]} on {found[2]} ({found[0]})" if found else "?"


def meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def machine_info(root: Path) -> dict[str, Any]:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    from jupyter_cedana.checkpoint.engine import CheckpointEngine

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "mem_bytes": meminfo().get("MemTotal", 0),
        "kernel": platform.release(),
        "df": run(["df", "-h", str(root)]),
        "fs_type": fs_type(root),
        "criu": CheckpointEngine.instance().probe().criu_version,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


async def engine_at(root: Path, **config: Any) -> Any:
    """The process's CheckpointEngine on checkpoint root `root`, with the CUDA helper
    started (or found missing) and the lazy-restore probe run once, as the server does
    at start, so that no suspend or resume pays for them; None, saying why, where CRIU
    cannot be used."""
    import sys

    from traitlets.config import Config

    from jupyter_cedana.checkpoint.engine import CheckpointEngine

    root.mkdir(parents=True, exist_ok=True)
    CheckpointEngine.clear_instance()
    c = Config()
    c.CheckpointEngine.checkpoint_root = str(root)
    for key, value in config.items():
        setattr(c.CheckpointEngine, key, value)
    engine = CheckpointEngine.instance(config=c)
    if not engine.probe().available:
        print(f"cannot benchmark: {engine.probe().reason}", file=sys.stderr)
        return None
    await engine.cuda_checkpointer()
    await engine.warm_up()
    return engine


def plain_write_fsync(path: Path, nbytes: int, direct: bool = False) -> tuple[float, float]:
    """Seconds to write nbytes in 8 MiB chunks, and until they and the directory entry are
    durable (write + fsync + directory fsync): a suspend's job without CRIU. `direct`:
    with O_DIRECT (no page cache), as the extension writes page files."""
    block = mmap.mmap(-1, CHUNK)  # page aligned, as O_DIRECT needs
    block.write(os.urandom(CHUNK))
    buf = memoryview(block)
    if direct:
        nbytes -= nbytes % 4096
    t = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(left, CHUNK)])
        write_s = time.perf_counter() - t
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return write_s, time.perf_counter() - t


def plain_read(path: Path) -> float:
    buf = bytearray(CHUNK)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t


def plain_cold_read(root: Path, nbytes: int, cold: bool) -> float:
    """A plain cold read of as many bytes, on the same disk; the file is written with
    O_DIRECT, so that the read does not reuse the page cache its writing just freed."""
    plain = root / "plain-io.bin"
    plain_write_fsync(plain, nbytes, direct=True)
    if cold:
        drop_caches()
    try:
        return plain_read(plain)
    finally:
        plain.unlink()


def parse_values(trait: Any, text: str) -> list[Any] | None:
    """The two values to compare, as the setting's type (bool: on/off, true/false)."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if len(words) != 2:
        return None
    if isinstance(trait.default_value, bool):
        truth = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
        vals = [truth.get(w.lower()) for w in words]
        return None if None in vals else vals
    try:
        vals = [type(trait.default_value)(w) for w in words]
        for v in vals:
            trait.validate(None, v)
    except Exception:
        return None
    return vals


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


async def start_kernel(root: Path, workdir: Path, **engine: Any) -> tuple[Any, Any]:
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_client.provisioning import KernelProvisionerFactory
    from traitlets.config import Config

    c = Config()
    c.CheckpointEngine.checkpoint_root = str(root)
    for key, value in engine.items():
        setattr(c.CheckpointEngine, key, value)
    KernelProvisionerFactory.instance().default_provisioner_name = "cedana-provisioner"
    km = AsyncKernelManager(kernel_name="python3", config=c)
    await km.start_kernel(cwd=str(workdir))
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=120)
    return km, kc


async def run(kc: Any, code: str, timeout: float = 600) -> str:
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = await kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"kernel error: {''.join(out)}")
    return "".join(out)


async def fill(kc: Any, pid: int, nbytes: int) -> str:
    """Make the kernel's memory about `nbytes`; returns PROBE's answer."""
    from jupyter_cedana.checkpoint.dumping import tree_rss

    await run(kc, "import numpy as np")
    base = tree_rss(pid)
    await run(kc, FILL.format(nbytes=max(8 << 20, nbytes - base)))
    return (await run(kc, PROBE)).strip()


async def confirm_iopub(km: Any, kc: Any, interval: float = GATE_NUDGE_S) -> None:
    """The gate's IOPub confirmation, as jupyter_server's nudge() does it: kernel_info
    requests on a transient shell socket every `interval` s until a shell reply has come
    and an IOPub message arrived on the client's long-lived IOPub socket."""
    import zmq
    import zmq.asyncio

    shell = km.connect_shell()
    iopub = kc.iopub_channel.socket
    poller = zmq.asyncio.Poller()
    poller.register(shell, zmq.POLLIN)
    poller.register(iopub, zmq.POLLIN)
    got_reply = got_iopub = False
    deadline = time.monotonic() + 120
    next_send = 0.0
    try:
        while not (got_reply and got_iopub):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError("IOPub did not come back")
            if now >= next_send:
                km.session.send(shell, "kernel_info_request")
                next_send = now + interval
            wait_ms = max(1, int((next_send - time.monotonic()) * 1000))
            events = dict(await poller.poll(wait_ms))
            if shell in events:
                await shell.recv_multipart()
                got_reply = True
            if iopub in events:
                await iopub.recv_multipart()
                got_iopub = True
    finally:
        shell.close(linger=0)


async def output_of(kc: Any, code: str, timeout: float = 600) -> tuple[float, str]:
    """Send `code`; the time.perf_counter() at which its first stream output arrived, and
    that output. Returns after the reply (untimed)."""
    msg_id = kc.execute(code)
    text = None
    deadline = time.monotonic() + timeout
    while text is None:
        msg = await kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text = msg["content"]["text"]
        elif msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
    arrived = time.perf_counter()
    while True:  # the reply and the idle status, untimed
        reply = await kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    while True:
        msg = await kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
        mine = msg["parent_header"].get("msg_id") == msg_id
        if mine and msg["content"].get("execution_state") == "idle":
            break
    return arrived, text.strip()


async def stop_kernel(km: Any, kc: Any) -> None:
    kc.stop_channels()
    with contextlib.suppress(Exception):
        await km.shutdown_kernel(now=True)


class MemorySampler:
    """Peaks of the machine's memory use while a step runs (every 50 ms): used memory
    (MemTotal - MemAvailable), page cache, dirty pages, swap used."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        m = meminfo()
        now = {
            "used": m.get("MemTotal", 0) - m.get("MemAvailable", 0),
            "cached": m.get("Cached", 0),
            "dirty": m.get("Dirty", 0) + m.get("Writeback", 0),
            "swap_used": m.get("SwapTotal", 0) - m.get("SwapFree", 0),
        }
        for k, v in now.items():
            self.peak[k] = max(self.peak.get(k, 0), v)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self._sample()
        self.start = dict(self.peak)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def oom_kills() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


async def gather_timed(coros: list[Any]) -> tuple[float, list[float]]:
    """Run coroutines at once: total seconds, and each one's seconds."""
    t0 = time.perf_counter()

    async def timed(c: Any) -> float:
        await c
        return time.perf_counter() - t0

    each = await asyncio.gather(*(timed(c) for c in coros))
    return time.perf_counter() - t0, list(each)


async def resume_after_idle(km: Any, kc: Any, idle: float, lazy: bool) -> dict[str, Any]:
    """Suspend to disk (until durable), wait `idle` s, drop caches, resume (lazily or
    whole): the first output of a small cell and where its wait went, all pages in."""
    prov = km.provisioner
    prov.engine.lazy_restore = lazy
    try:
        os.sync()  # no dirty pages of earlier steps in the suspend's way
        t = time.perf_counter()
        await prov.suspend(tier="disk")
        suspend_s = time.perf_counter() - t
        kill_s = float((prov.last_suspend_breakdown or {}).get("kill_s", 0.0))
        image = int(prov.engine.store.read_manifest(prov.kernel_id_str)["total_bytes"])
        await asyncio.sleep(idle)
        drop_caches()
        t0, m0 = time.perf_counter(), time.monotonic()
        await prov.resume()
        resume_s = time.perf_counter() - t0
        await confirm_iopub(km, kc)
        confirmed = time.perf_counter()
        arrived, out = await output_of(kc, SMALL)
        await prov.memory_loaded()
    finally:
        prov.engine.lazy_restore = True
    if out != "42":
        raise RuntimeError(f"unexpected output {out!r}")
    in_at = prov.last_memory_in_at
    b = prov.last_resume_breakdown or {}
    return {
        "image_bytes": image,
        # From calling suspend() until the image was durable: all but the kill after it.
        "durable_s": suspend_s - kill_s,
        "resume_s": resume_s,
        # Where the wait for the first output goes: the checks before CRIU, CRIU, the
        # kernel's first answer (the gate's IOPub confirmation), the cell itself.
        "check_s": b.get("check_s"),
        "restore_s": b.get("restore_s"),
        "iopub_s": confirmed - t0 - resume_s,
        "first_output_s": arrived - t0,
        "all_in_s": in_at - m0 if in_at is not None else resume_s,
        "lazy": bool(b.get("lazy")),
    }


# -- a real jupyter server, and what a run leaves behind (torture.py, chaos.py) --------

HASH_CODE = (
    "import hashlib as _h; ns = globals().setdefault('ns', {}); "
    "print('NS=' + _h.sha256(repr(sorted(ns.items())).encode()).hexdigest())"
)


def ns_hash(ns: dict[str, Any]) -> str:
    return hashlib.sha256(repr(sorted(ns.items())).encode()).hexdigest()


class Failure(Exception):
    """Something a user would see as broken (not a refusal the API documents)."""


class Server:
    """A jupyter server subprocess with the extension, on a private runtime and root."""

    def __init__(
        self,
        workdir: Path,
        idle_timeout: float,
        check_interval: float,
        extra_args: list[str] | None = None,
    ):
        self.workdir = workdir
        self.root = workdir / "checkpoints"
        self.runtime = workdir / "runtime"
        self.token = uuid.uuid4().hex
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.idle_timeout = idle_timeout
        self.check_interval = check_interval
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "server.log"
        self.extra_args = list(extra_args or [])

    def start(self) -> None:
        (self.workdir / "notebooks").mkdir(parents=True, exist_ok=True)
        self.runtime.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(self.runtime)}
        cmd = [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.workdir / 'notebooks'}",
            f"--CedanaApp.checkpoint_root={self.root}",
            f"--SuspendPolicy.idle_timeout={self.idle_timeout}",
            f"--SuspendPolicy.check_interval={self.check_interval}",
            "--allow-root",
            *self.extra_args,
        ]
        # Appended to: a run that starts servers again on the same root keeps every log.
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    async def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter server exited; see {self.log}")
            with contextlib.suppress(Exception):
                status, _ = await self.call("GET", "/api/cedana/status")
                if status == 200:
                    return
            await asyncio.sleep(0.2)
        raise RuntimeError("jupyter server did not start")

    async def call(
        self, method: str, path: str, body: Any = None, timeout: float = 300
    ) -> tuple[int, Any]:
        req = HTTPRequest(
            self.url + path,
            method=method,
            headers={"Authorization": f"token {self.token}"},
            body=json.dumps(body or {}) if method == "POST" else None,
            request_timeout=timeout,
            allow_nonstandard_methods=True,
        )
        try:
            r = await AsyncHTTPClient().fetch(req)
            return r.code, json.loads(r.body) if r.body else None
        except HTTPClientError as e:
            data = None
            if e.response is not None and e.response.body:
                with contextlib.suppress(ValueError):
                    data = json.loads(e.response.body)
            return e.code, data

    async def connect(self, kernel_id: str) -> Conn:
        ws = await websocket_connect(
            HTTPRequest(
                f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels"
                f"?session_id={uuid.uuid4().hex}",
                headers={"Authorization": f"token {self.token}"},
            )
        )
        return Conn(ws)

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a crash would end it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Conn:
    """A notebook-like websocket connection (JSON protocol)."""

    def __init__(self, ws: WebSocketClientConnection):
        self.ws = ws
        self.session = uuid.uuid4().hex

    def send(self, msg_type: str, content: dict[str, Any], channel: str = "shell") -> str:
        msg_id = uuid.uuid4().hex
        msg = {
            "header": {
                "msg_id": msg_id,
                "msg_type": msg_type,
                "session": self.session,
                "username": "bench",
                "date": "",
                "version": "5.3",
            },
            "parent_header": {},
            "metadata": {},
            "content": content,
            "channel": channel,
            "buffers": [],
        }
        self.ws.write_message(json.dumps(msg))
        return msg_id

    async def reply(
        self, msg_id: str, timeout: float, on_busy: Any = None
    ) -> tuple[dict[str, Any], str]:
        """The reply to msg_id and its stdout, once the kernel went idle for it."""
        return (await self.replies([msg_id], timeout, on_busy))[msg_id]

    async def replies(
        self, msg_ids: list[str], timeout: float, on_busy: Any = None
    ) -> dict[str, tuple[dict[str, Any], str]]:
        """Replies and stdout of several requests, read together (their messages
        interleave), each done once the kernel went idle for it."""
        got: dict[str, dict[str, Any]] = {
            m: {"reply": None, "idle": False, "out": ""} for m in msg_ids
        }
        deadline = time.monotonic() + timeout
        while not all(g["reply"] is not None and g["idle"] for g in got.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure(f"no reply in {timeout:.0f} s: {got}")
            raw = await asyncio.wait_for(self.ws.read_message(), left)
            if raw is None:
                raise Failure("websocket closed")
            msg = json.loads(raw)
            g = got.get(str((msg.get("parent_header") or {}).get("msg_id")))
            if g is None:
                continue
            kind = msg["msg_type"]
            if kind.endswith("_reply"):
                g["reply"] = msg["content"]
            elif kind == "stream":
                g["out"] += msg["content"]["text"]
            elif kind == "status":
                state = msg["content"]["execution_state"]
                if state == "busy" and on_busy is not None:
                    await on_busy()
                    on_busy = None
                g["idle"] = g["idle"] or state == "idle"
        return {m: (g["reply"], g["out"]) for m, g in got.items()}

    async def execute(self, code: str, timeout: float, on_busy: Any = None) -> tuple[Any, str]:
        return await self.reply(
            self.send("execute_request", {"code": code, "silent": False}), timeout, on_busy
        )

    def close(self) -> None:
        self.ws.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_leaks(marks: tuple[str, ...], exclude: set[int]) -> list[str]:
    """Live processes (not zombies) whose command line names one of `marks` (a run's
    runtime dir, its checkpoint root), but for the pids in `exclude`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            continue
        if any(m in cmd for m in marks):
            found.append(f"{entry}: {cmd[:120]}")
    return found


def port_leaks(ports: list[int]) -> list[int]:
    """The ports of `ports` something still listens on (127.0.0.1)."""
    leaked = []
    for port in ports:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                leaked.append(port)
    return leaked


def store_leftovers(root: Path) -> list[str]:
    """What a checkpoint root holds besides its marker: image directories, and whatever is
    left inside its bookkeeping directories (the directories themselves are the store's)."""
    found: list[str] = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name == ".jupyter-cedana":  # the store's marker, not an image
                continue
            if p.name in (".logs", ".work", ".parked"):
                found += [f"{p.name}/{c.name}" for c in p.iterdir()]
            else:
                found.append(p.name)
    return found
