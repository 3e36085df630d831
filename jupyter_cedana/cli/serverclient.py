"""Finding a running Jupyter server (its `jpserver-*.json` runtime files, or `--url` and
`--token`) and calling its /api/cedana REST API with the standard library's HTTP client;
errors become one message and an exit status of `jupyter cedana` (main.py)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_SERVER = 3
EXIT_NOT_FOUND = 4
EXIT_CONFLICT = 5
EXIT_UNAVAILABLE = 6
EXIT_AUTH = 7

_STATUS_EXIT = {
    400: EXIT_USAGE,
    401: EXIT_AUTH,
    403: EXIT_AUTH,
    404: EXIT_NOT_FOUND,
    409: EXIT_CONFLICT,
    503: EXIT_UNAVAILABLE,
    507: EXIT_UNAVAILABLE,
}


class CliError(Exception):
    """An error reported to the user as one message and an exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR, code: str = "error"):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.code = code


class ApiError(CliError):
    """The server answered with an error ({code, message})."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message, _STATUS_EXIT.get(status, EXIT_ERROR), code)
        self.status = status


# -- finding the server -------------------------------------------------------------------


@dataclass
class Server:
    url: str
    token: str = ""
    pid: int | None = None
    root_dir: str | None = None

    @property
    def label(self) -> str:
        return f"{self.url} (pid {self.pid})" if self.pid else self.url


def running_servers(runtime_dir: str | None = None) -> list[Server]:
    """Running Jupyter servers, as `jupyter server list` sees them (oldest first)."""
    from jupyter_server.serverapp import list_running_servers

    servers = []
    for info in list_running_servers(runtime_dir):
        url = str(info.get("url") or "")
        if info.get("sock") and not url.startswith(("http://", "https://")):
            # Reachable only through a Unix socket, which urllib cannot speak.
            url = ""
        servers.append(
            Server(
                url=url,
                token=str(info.get("token") or ""),
                pid=info.get("pid"),
                root_dir=info.get("root_dir"),
            )
        )
    servers.sort(key=lambda s: s.pid or 0)
    return servers


def same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def find_server(url: str | None, token: str | None) -> Server:
    """The server to talk to: --url (with --token, or the token of the running server at
    that URL, or $JUPYTER_TOKEN), else the first running server."""
    if url:
        if not url.startswith(("http://", "https://")):
            raise CliError(f"--url must be an http:// or https:// URL, not {url!r}", EXIT_USAGE)
        if token is None:
            for s in running_servers():
                if s.url and same_url(s.url, url):
                    return Server(url=url, token=s.token, pid=s.pid, root_dir=s.root_dir)
            token = os.environ.get("JUPYTER_TOKEN", "")
        return Server(url=url, token=token)
    servers = running_servers()
    usable = [s for s in servers if s.url]
    if not usable:
        from jupyter_core.paths import jupyter_runtime_dir

        if servers:
            raise CliError(
                "The running Jupyter server listens only on a Unix socket, which this "
                "command cannot use; pass --url and --token of an HTTP server.",
                EXIT_NO_SERVER,
                "no_server",
            )
        raise CliError(
            f"No running Jupyter server found (looked in {jupyter_runtime_dir()}). "
            "Start one, or pass --url and --token.",
            EXIT_NO_SERVER,
            "no_server",
        )
    server = usable[0]
    if token is not None:
        server.token = token
    if len(usable) > 1:
        print(
            f"note: {len(usable)} Jupyter servers are running; using {server.label} "
            "(choose another with --url)",
            file=sys.stderr,
        )
    return server


# -- HTTP ---------------------------------------------------------------------------------


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Client:
    """The /api/cedana REST API of one server."""

    def __init__(self, server: Server, timeout: float = 30.0):
        self.server = server
        self.timeout = timeout
        base = server.url if server.url.endswith("/") else server.url + "/"
        self.base = urllib.parse.urljoin(base, "api/cedana/")
        host = urllib.parse.urlsplit(self.base).hostname
        # A proxy from the environment must not see requests to a local server (or its token).
        handlers = [urllib.request.ProxyHandler({})] if _is_loopback(host) else []
        self._opener = urllib.request.build_opener(*handlers)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        params = {**(query or {}), "no_track_activity": "1"}
        url = urllib.parse.urljoin(self.base, path) + "?" + urllib.parse.urlencode(params)
        headers = {"Accept": "application/json"}
        if self.server.token:
            headers["Authorization"] = f"token {self.server.token}"
        data = None
        if method != "GET":
            data = json.dumps(body if body is not None else {}).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            raise self._api_error(e) from None
        except urllib.error.URLError as e:
            raise CliError(
                f"Cannot reach the Jupyter server at {self.server.url}: {e.reason}",
                EXIT_NO_SERVER,
                "no_server",
            ) from None
        except (TimeoutError, OSError) as e:
            raise CliError(
                f"No answer from the Jupyter server at {self.server.url}: {e}",
                EXIT_NO_SERVER,
                "no_server",
            ) from None
        except ValueError as e:
            raise CliError(f"The server sent a response that is not JSON: {e}") from None

    def _api_error(self, e: urllib.error.HTTPError) -> CliError:
        try:
            raw = e.read()
        except OSError:
            raw = b""
        payload: Any = None
        with contextlib.suppress(ValueError):
            payload = json.loads(raw)
        if isinstance(payload, dict) and "code" in payload and "message" in payload:
            return ApiError(e.code, str(payload["code"]), str(payload["message"]))
        if e.code == 404:
            return CliError(
                f"The Jupyter server at {self.server.url} does not serve /api/cedana "
                "(is the jupyter_cedana server extension enabled?)",
                EXIT_NO_SERVER,
                "no_extension",
            )
        message = payload.get("message") if isinstance(payload, dict) else None
        if e.code in (401, 403):
            message = message or e.reason
            return ApiError(e.code, "forbidden", f"Not authorized by {self.server.url}: {message}")
        return ApiError(e.code, "http_error", f"HTTP {e.code}: {message or e.reason}")

    def get(self, path: str) -> Any:
        return self.request("GET", path)[1]

    def post(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        return self.request("POST", path, **kwargs)


# -- formatting ---------------------------------------------------------------------------
