"""A real JupyterHub for the tests: jupyterhub from PyPI, configurable-http-proxy from npm
(scripts/setup-hub.sh), the dummy authenticator, LocalProcessSpawner starting
jupyterhub-singleuser as the non-root test users (scripts/setup-nonroot.sh), and
jupyterhub-idle-culler as a Hub service behind a switch (culler_switch.py). The users'
servers launch, suspend and resume their kernels through a real checkpoint agent: as
root, one this fixture starts; as an ordinary user (scripts/test.sh), the one of the run
(CEDANA_TEST_AGENT_SOCKET).

Tests talk to it as a browser would: the Hub's REST API and, through the proxy, the
single-user server's REST API and kernel websockets, with the user's own token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from tests.conftest import AGENT_SOCKET
from tests.test_cli import children_sigint

REPO = Path(__file__).resolve().parents[2]
# The servers' environment: as root, the virtualenv the test users can read
# (scripts/setup-nonroot.sh); as an ordinary user, this one.
NONROOT_BIN = REPO / ".venv-nonroot" / "bin" if os.geteuid() == 0 else Path(sys.executable).parent
PROXY = REPO / ".hub-node" / "node_modules" / ".bin" / "configurable-http-proxy"
# As root (CI), the Hub spawns servers as the two test users; run as an ordinary user
# (scripts/test.sh's non-root pass) it can only spawn that user's own server.
USERS: tuple[str, str | None] = (
    ("cedana-test", "cedana-test2")
    if os.geteuid() == 0
    else (pwd.getpwuid(os.geteuid()).pw_name, None)
)
WAIT = 180.0  # a bound on waits for slow starts, not an expectation

CONFIG = """
c = get_config()  # noqa
import os, pwd
base = {base!r}

c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.JupyterHub.db_url = "sqlite:///" + os.path.join(base, "jupyterhub.sqlite")
c.JupyterHub.cookie_secret_file = os.path.join(base, "cookie_secret")
c.JupyterHub.pid_file = os.path.join(base, "jupyterhub.pid")

c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allow_all = True
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [{singleuser!r}]
c.Spawner.environment = {{
    "PATH": {path!r},
    "JUPYTERHUB_SINGLEUSER_APP": "jupyter_server",
    # Server extensions these tests do not use stay off: a quicker start.
    "JUPYTER_CONFIG_PATH": os.path.join(base, "etc"),
}}
c.Spawner.notebook_dir = os.path.join(base, "work", "{{username}}")
c.Spawner.default_url = "/tree"
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180
# Notice a killed server within a second (the default is 30 s).
c.Spawner.poll_interval = 1


def pre_spawn_hook(spawner):
    # Each user's images in their own 0700 directory; an admin's start request may point
    # a server elsewhere (the isolation test points one user at another's root).
    root = spawner.user_options.get("checkpoint_root") or os.path.join(
        base, "ckpt", spawner.user.name
    )
    spawner.args = [
        "--CedanaApp.checkpoint_root=" + root,
        "--SuspendPolicy.idle_timeout=0",
        "--CheckpointAgent.socket=" + {agent_socket!r},
    ]


c.Spawner.pre_spawn_hook = pre_spawn_hook

c.JupyterHub.services = [
    {{"name": "cedana-tests", "api_token": {admin_token!r}}},
    {{
        "name": "idle-culler",
        "command": [
            {python!r}, {switch_script!r}, {switch!r}, "--",
            "--timeout=5", "--cull-every=2", "--concurrency=1",
        ],
    }},
]
c.JupyterHub.load_roles = [
    {{"name": "admin", "services": ["cedana-tests"]}},
    {{
        "name": "idle-culler",
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        "services": ["idle-culler"],
    }},
]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds `text` (a kernel id is in every command
    line of its processes: connection file, pid file, image directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def wait_for(what: str, check: Callable[[], Any], timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


class Hub:
    def __init__(self, base: Path, agent_socket: str):
        self.base = base
        self.agent_socket = agent_socket
        self.port, self.hub_port, self.proxy_api_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_token = uuid.uuid4().hex
        self.switch = base / "cull-on"
        self.log = base / "hub.log"
        self._tokens: dict[str, str] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    # -- life -----------------------------------------------------------------------------

    def start(self) -> None:
        config = CONFIG.format(
            base=str(self.base),
            port=self.port,
            hub_port=self.hub_port,
            proxy_api_port=self.proxy_api_port,
            proxy=str(PROXY),
            singleuser=str(NONROOT_BIN / "jupyterhub-singleuser"),
            path=f"{NONROOT_BIN}:/usr/bin:/bin",
            admin_token=self.admin_token,
            python=sys.executable,
            switch_script=str(Path(__file__).parent / "culler_switch.py"),
            switch=str(self.switch),
            agent_socket=self.agent_socket,
        )
        (self.base / "jupyterhub_config.py").write_text(config)
        etc = self.base / "etc"
        etc.mkdir(mode=0o755, exist_ok=True)
        unused = ("jupyterlab", "jupyter_lsp", "notebook_shim", "jupyter_server_terminals")
        (etc / "jupyter_server_config.json").write_text(
            json.dumps({"ServerApp": {"jpserver_extensions": dict.fromkeys(unused, False)}})
        )
        # The Hub's servers inherit its SIGINT; its spawner stops them with one.
        with children_sigint(), open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"],
                cwd=self.base,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for("the Hub to answer", self._up, timeout=WAIT)

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the Hub exited:\n{self.log_tail()}")
        with contextlib.suppress(requests.RequestException):
            return requests.get(f"{self.url}/hub/api/", timeout=5).status_code == 200
        return False

    def stop(self) -> None:
        self.switch.unlink(missing_ok=True)
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # -- Hub API --------------------------------------------------------------------------

    def api(self, method: str, path: str, token: str | None = None, **kw: Any) -> Any:
        r = requests.request(
            method,
            f"{self.url}/hub/api{path}",
            headers={"Authorization": f"token {token or self.admin_token}"},
            timeout=60,
            **kw,
        )
        return r

    def ensure_user(self, name: str) -> None:
        if self.api("GET", f"/users/{name}").status_code == 404:
            assert self.api("POST", f"/users/{name}").status_code == 201

    def token(self, user: str) -> str:
        """The user's own API token (what JupyterLab in their browser holds)."""
        if user not in self._tokens:
            self.ensure_user(user)
            r = self.api("POST", f"/users/{user}/tokens", json={"note": "cedana tests"})
            assert r.status_code == 201, r.text
            self._tokens[user] = r.json()["token"]
        return self._tokens[user]

    def server_model(self, user: str) -> dict[str, Any] | None:
        r = self.api("GET", f"/users/{user}")
        assert r.status_code == 200, r.text
        servers: dict[str, Any] = r.json().get("servers") or {}
        return servers.get("")

    def start_server(self, user: str) -> None:
        """Start the user's server as the user would (their token), wait until ready."""
        self.prepare(user)
        r = self.api("POST", f"/users/{user}/server", token=self.token(user))
        assert r.status_code in (201, 202), r.text
        wait_for(f"{user}'s server", lambda: (self.server_model(user) or {}).get("ready"))

    def stop_server(self, user: str) -> None:
        r = self.api("DELETE", f"/users/{user}/server", token=self.token(user))
        assert r.status_code in (202, 204), r.text
        self.wait_stopped(user)

    def wait_stopped(self, user: str, timeout: float = WAIT) -> None:
        wait_for(f"{user}'s server to stop", lambda: self.server_model(user) is None, timeout)

    def server_pid(self, user: str) -> int:
        model = self.server_model(user)
        assert model is not None
        return int(model["state"]["pid"])

    def prepare(self, user: str) -> None:
        """The user's notebook directory and checkpoint root, theirs alone."""
        pw = pwd.getpwnam(user)
        for d in (self.base / "work" / user, self.base / "ckpt" / user):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chown(d, pw.pw_uid, pw.pw_gid)

    def root(self, user: str) -> Path:
        return self.base / "ckpt" / user

    # -- the checkpoint agent, as the user sees it ----------------------------------------

    def agent(self, user: str, op: str) -> Any:
        """The result of one request of `user` to the agent (as that user: the agent
        answers each uid about its own kernels alone)."""
        argv = [
            str(NONROOT_BIN / "python"),
            "-m",
            "jupyter_cedana.agent.client",
            "--socket",
            self.agent_socket,
            op,
        ]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", user, "--", *argv]
        else:
            assert user == pwd.getpwuid(os.geteuid()).pw_name, user
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/")
        assert done.stdout.strip(), f"no reply from the agent (rc {done.returncode}): {done.stderr}"
        reply = json.loads(done.stdout)
        assert reply.get("ok"), reply
        return reply["result"]

    def at_agent(self, user: str, kernel_id: str) -> dict[str, Any] | None:
        """The agent's `list` entry of the user's kernel, with `image` (its `images`
        entry, or None); None when the agent has neither."""
        kernels = self.agent(user, "list")["kernels"]
        images = self.agent(user, "images")["images"]
        found = next((k for k in kernels if k.get("kernel_id") == kernel_id), None)
        image = next((i for i in images if i.get("kernel_id") == kernel_id), None)
        if found is None and image is None:
            return None
        return {**(found or {}), "image": image}

    # -- the user's server, through the proxy ---------------------------------------------

    def server(self, user: str, method: str, path: str, token: str | None = None, **kw: Any) -> Any:
        return requests.request(
            method,
            f"{self.url}/user/{user}/api{path}",
            headers={"Authorization": f"token {token or self.token(user)}"},
            timeout=120,
            **kw,
        )

    def open_notebook(self, user: str, path: str = "analysis.ipynb") -> dict[str, Any]:
        """POST /api/sessions as JupyterLab does when it opens a notebook."""
        r = self.server(
            user,
            "POST",
            "/sessions",
            json={"path": path, "name": path, "type": "notebook", "kernel": {"name": "python3"}},
        )
        assert r.status_code == 201, r.text
        session: dict[str, Any] = r.json()
        return session

    def execute(self, user: str, kernel_id: str, code: str, token: str | None = None) -> str:
        """Run a cell over a new kernel websocket; return what it printed."""
        return asyncio.run(self._execute(user, kernel_id, code, token or self.token(user)))

    async def _execute(self, user: str, kernel_id: str, code: str, token: str) -> str:
        session = uuid.uuid4().hex
        url = (
            f"ws://127.0.0.1:{self.port}/user/{user}/api/kernels/{kernel_id}/channels"
            f"?session_id={session}"
        )
        ws = await websocket_connect(
            HTTPRequest(url, headers={"Authorization": f"token {token}"}, connect_timeout=60)
        )
        msg_id = uuid.uuid4().hex
        ws.write_message(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "msg_type": "execute_request",
                        "username": user,
                        "session": session,
                        "date": datetime.now(UTC).isoformat(),
                        "version": "5.3",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": True,
                        "user_expressions": {},
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                    "channel": "shell",
                    "buffers": [],
                }
            )
        )
        out: list[str] = []
        reply: dict[str, Any] | None = None
        idle = False
        try:
            while reply is None or not idle:
                raw = await asyncio.wait_for(ws.read_message(), WAIT)
                if raw is None:
                    raise AssertionError(f"kernel websocket closed; printed so far: {out}")
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = msg["header"]["msg_type"]
                if kind == "stream":
                    out.append(msg["content"]["text"])
                elif kind == "error":
                    out.append("\n".join(msg["content"]["traceback"]))
                elif kind == "execute_reply":
                    reply = msg["content"]
                elif kind == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
        finally:
            ws.close()
        assert reply["status"] == "ok", "".join(out)
        return "".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    hub = getattr(item, "funcargs", {}).get("hub")
    if report.when == "call" and report.failed and isinstance(hub, Hub):
        report.sections.append(("JupyterHub log (last lines)", hub.log_tail(150)))


@contextlib.contextmanager
def checkpoint_agent() -> Iterator[str]:
    """The socket of the agent the users' servers use: the run's, or (as root) one of
    this module's, on a private socket and state directory, whose kernels end with it."""
    if AGENT_SOCKET:
        yield AGENT_SOCKET
        return
    if os.geteuid() != 0:
        pytest.skip(
            "an ordinary user's server checkpoints through a checkpoint agent: "
            "set CEDANA_TEST_AGENT_SOCKET (scripts/test.sh starts one as root)"
        )
    from tests.agent.conftest import start_agent, wait_listening

    # Root's own and 0755 up to /, as the agent requires, and the users reach the socket.
    base = Path(tempfile.mkdtemp(prefix="cedana-hub-agent-"))
    base.chmod(0o755)
    proc = start_agent(base, kernels_on_stop="kill")
    try:
        wait_listening(proc)
        # Read as it comes: a full pipe would stall the agent.
        assert proc.stderr is not None
        with open(base / "agent.log", "w") as log:
            pump = subprocess.Popen(["cat"], stdin=proc.stderr, stdout=log)
        try:
            yield str(base / "run" / "agent.sock")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pump.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def hub() -> Iterator[Hub]:
    for user in filter(None, USERS):
        try:
            pwd.getpwnam(user)
        except KeyError:
            pytest.fail(f"user {user} missing: run scripts/setup.sh --test")
    if not PROXY.exists() or not (NONROOT_BIN / "jupyterhub-singleuser").exists():
        pytest.fail("JupyterHub test set-up missing: run scripts/setup.sh --test")
    with checkpoint_agent() as socket_path:
        base = Path(tempfile.mkdtemp(prefix="cedana-hub-"))
        base.chmod(0o755)  # the users enter it for their own 0700 directories
        for d in ("work", "ckpt"):
            (base / d).mkdir(mode=0o755)
        h = Hub(base, socket_path)
        try:
            h.start()
            yield h
        finally:
            h.stop()
            # Whatever the servers left (kernels of a test that failed half-way).
            for pid in processes_mentioning(str(base)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(base, ignore_errors=True)
