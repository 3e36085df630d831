"""REST API: a thin layer over SuspendManager (spec: docs/rest-api.yaml)."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from http.client import responses
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from ..checkpoint.store import validate_kernel_id
from ..errors import BadRequest, CedanaError
from .manager import SuspendManager

_ID = r"(?P<kernel_id>[^/]+)"


class CedanaHandler(APIHandler):
    # Same permission as jupyter_server's kernel API: whoever may use kernels may
    # suspend them.
    auth_resource = "kernels"
    # Watching, suspending and resuming kernels is not user activity: a JupyterHub must
    # be able to cull a server whose kernels are all suspended.
    _track_activity = False

    @property
    def manager(self) -> SuspendManager:
        return self.settings["cedana_manager"]

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Every error is JSON {code, message}."""
        self.set_header("Content-Type", "application/json")
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, CedanaError):
            body = exc.to_json()
        elif isinstance(exc, web.HTTPError):
            name = exc.reason or responses.get(status_code, "error")
            body = {
                "code": name.lower().replace(" ", "_"),
                "message": exc.log_message or responses.get(status_code, "Error"),
            }
        else:
            body = {"code": "internal_error", "message": str(exc) if exc else "Internal error"}
        self.finish(json.dumps(body))

    async def respond(self, work: Awaitable[Any], status: int = 200) -> None:
        try:
            result = await work
        except CedanaError as e:
            self.set_status(e.status)
            self.finish(json.dumps(e.to_json()))
            return
        self.set_status(status)
        self.finish(json.dumps(result))

    def fail(self, e: CedanaError) -> None:
        self.set_status(e.status)
        self.finish(json.dumps(e.to_json()))


async def _value(v: Any) -> Any:
    return v


class KernelsHandler(CedanaHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        await self.respond(_value(self.manager.list_kernels()))


class KernelHandler(CedanaHandler):
    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        try:
            self.finish(json.dumps(self.manager.view(validate_kernel_id(kernel_id))))
        except CedanaError as e:
            self.fail(e)


class TransitionHandler(CedanaHandler):
    """POST suspend / resume: 200 with the settled kernel, or 202 while it runs on."""

    action = ""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        wait = self.get_query_argument("wait", "1") != "0"
        try:
            validate_kernel_id(kernel_id)
            if self.action == "suspend":
                tier = self.get_query_argument("tier", "disk")
                if tier not in ("disk", "offload"):
                    raise BadRequest(f"Unknown tier {tier!r}: use disk or offload")
                view, done = await self.manager.suspend(kernel_id, tier=tier, wait=wait)
            else:
                view, done = await self.manager.resume(kernel_id, wait=wait)
        except CedanaError as e:
            self.fail(e)
            return
        self.set_status(200 if done else 202)
        self.finish(json.dumps(view))


class SuspendHandler(TransitionHandler):
    action = "suspend"


class ResumeHandler(TransitionHandler):
    action = "resume"


class KeepAwakeHandler(CedanaHandler):
    _track_activity = True  # a person asked to keep working with this kernel

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        try:
            validate_kernel_id(kernel_id)
            try:
                body = json.loads(self.request.body or b"{}")
                seconds = float(body["seconds"])
            except (ValueError, KeyError, TypeError):
                raise BadRequest('Body must be JSON {"seconds": N}') from None
            self.finish(json.dumps(self.manager.keep_awake(kernel_id, seconds)))
        except CedanaError as e:
            self.fail(e)


class StatusHandler(CedanaHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.finish(json.dumps(self.manager.status()))


def handlers(base_url: str) -> list[tuple[str, type[CedanaHandler]]]:
    api = url_path_join(base_url, "api", "cedana")
    return [
        (url_path_join(api, "kernels"), KernelsHandler),
        (url_path_join(api, "kernels", _ID), KernelHandler),
        (url_path_join(api, "kernels", _ID, "suspend"), SuspendHandler),
        (url_path_join(api, "kernels", _ID, "resume"), ResumeHandler),
        (url_path_join(api, "kernels", _ID, "keep-awake"), KeepAwakeHandler),
        (url_path_join(api, "status"), StatusHandler),
    ]
