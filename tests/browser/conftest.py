"""Fixtures for the browser tests: a real `jupyter lab` and Debian's chromium.

The server runs as a subprocess of the venv's Python with a temp root, token,
free port and checkpoint root; chromium is driven by Playwright's sync API.

Environment:
- ``CEDANA_CHROMIUM``: the browser binary (default ``/usr/bin/chromium``).
- ``CEDANA_BROWSER_LAB_ARGS``: extra ``jupyter lab`` arguments (shell-split).
- ``CEDANA_BROWSER_HEADED=1``: show the browser.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("CEDANA_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
SERVER_START_TIMEOUT = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LabServer:
    """A running `jupyter lab` with helpers for its REST API."""

    url: str
    token: str
    root_dir: Path
    checkpoint_root: Path
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    def lab_url(self, path: str = "lab") -> str:
        return f"{self.url}{path}?token={self.token}"

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """Call the server's REST API; returns (status, JSON or None)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path.lstrip("/"),
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                text = resp.read().decode()
                return resp.status, json.loads(text) if text else None
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text

    def get(self, path: str) -> Any:
        status, body = self.request("GET", path)
        assert status == 200, f"GET {path}: {status} {body}"
        return body

    def kernel_of(self, notebook_path: str, timeout: float = 60) -> str:
        """The id of the kernel of a notebook's session, once it exists."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for session in self.get("api/sessions"):
                if session["path"] == notebook_path and session.get("kernel"):
                    return str(session["kernel"]["id"])
            time.sleep(0.25)
        raise AssertionError(f"no session for {notebook_path}")

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _lab_extension_installed() -> bool:
    """Whether JupyterLab will load our prebuilt extension."""
    from jupyter_core.paths import jupyter_path

    return any(
        (Path(p) / "labextensions" / "jupyter-cedana" / "package.json").exists()
        for p in jupyter_path()
    )


def _server_extension_present() -> bool:
    try:
        import jupyter_cedana
    except ImportError:
        return False
    return hasattr(jupyter_cedana, "_jupyter_server_extension_points")


@pytest.fixture(scope="package")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    if not _server_extension_present():
        pytest.fail("jupyter_cedana has no server extension (_jupyter_server_extension_points)")
    if not _lab_extension_installed():
        pytest.fail(
            "the jupyter-cedana labextension is not installed: run "
            "`pip install -e .` (or `jlpm build` + `jupyter labextension develop . --overwrite`)"
        )
    base = tmp_path_factory.mktemp("lab")
    root = base / "root"
    checkpoints = base / "checkpoints"
    settings = base / "settings"
    for d in (root, settings):
        d.mkdir()
    # No "Jupyter news?" toast to get in the way of the notifications we look for.
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))

    port = _free_port()
    token = "cedana-browser-test-token"
    log_path = base / "jupyter-lab.log"
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False",
        "--ServerApp.port_retries=0",
        f"--CedanaApp.checkpoint_root={checkpoints}",
        f"--CheckpointEngine.checkpoint_root={checkpoints}",
        *shlex.split(os.environ.get("CEDANA_BROWSER_LAB_ARGS", "")),
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    env = {
        **os.environ,
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = LabServer(
        url=f"http://127.0.0.1:{port}/",
        token=token,
        root_dir=root,
        checkpoint_root=checkpoints,
        log_path=log_path,
        proc=proc,
    )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                status, _ = server.request("GET", "api/status")
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not start:\n{server.log_tail()}")
            time.sleep(0.3)
        status, body = server.request("GET", "api/cedana/status")
        assert status == 200, (
            f"GET /api/cedana/status: {status} {body}: is the server extension enabled?\n"
            f"{server.log_tail()}"
        )
        if not body.get("available"):
            pytest.fail(f"checkpointing unavailable here: {body.get('reason')}")
        yield server
    finally:
        # Shut kernels down through the server so their images go too.
        try:
            server.request("POST", "api/shutdown")
            proc.wait(timeout=30)
        except Exception:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(log_path, ARTIFACTS / "jupyter-lab.log")


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("python playwright is not installed")
    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=os.environ.get("CEDANA_BROWSER_HEADED") != "1",
        )
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, lab_server: LabServer, request: pytest.FixtureRequest) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    console: list[str] = []
    pg.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
    pg.on("pageerror", lambda err: console.append(f"pageerror: {err}"))
    pg.set_default_timeout(30_000)
    try:
        yield pg
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        name = request.node.name
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            with contextlib.suppress(Exception):
                pg.screenshot(path=str(ARTIFACTS / f"failure-{name}.png"))
        (ARTIFACTS / f"console-{name}.log").write_text("\n".join(console))
        context.close()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(autouse=True)
def jp_asyncio_loop() -> Iterator[None]:
    """Replace pytest-jupyter's autouse loop fixture (from tests/conftest.py).

    Playwright's sync API runs its own event loop in this thread; pytest-jupyter's
    fixture would try to close that running loop after each test.
    """
    yield None


@pytest.fixture(autouse=True)
def jp_server_cleanup() -> Iterator[None]:
    """No in-process ServerApp here: the server is a subprocess."""
    yield None
