"""Authorization of the REST API, and the extension refusing to fight over the websocket
connection class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.auth.authorizer import Authorizer
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from tornado.httpclient import HTTPClientError

pytestmark = pytest.mark.criu


class ReadOnlyKernels(Authorizer):
    """A user who may look at kernels but not change them."""

    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        return not (resource == "kernels" and action == "write")


class OtherConnection(ZMQChannelsWebsocketConnection):
    """Stands for another extension's websocket connection class."""


@pytest.fixture
def jp_server_config(checkpoint_root: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    config: dict[str, Any] = {
        "ServerApp": {"jpserver_extensions": {"jupyter_cedana": True}},
        "CedanaApp": {"checkpoint_root": str(checkpoint_root)},
    }
    marker = request.node.get_closest_marker("server")
    if marker:
        for key, value in marker.kwargs.items():
            config["ServerApp"][key] = value
    return config


@pytest.mark.server(authorizer_class=ReadOnlyKernels)
async def test_write_needs_kernels_write_permission(jp_fetch, jp_serverapp) -> None:
    kid = await jp_serverapp.kernel_manager.start_kernel(kernel_name="python3")
    r = await jp_fetch("api", "cedana", "kernels", kid)
    assert json.loads(r.body)["state"] == "running"
    for action in ("suspend", "resume", "keep-awake"):
        with pytest.raises(HTTPClientError) as info:
            await jp_fetch("api", "cedana", "kernels", kid, action, method="POST", body="{}")
        assert info.value.code == 403
    assert jp_serverapp.kernel_manager.get_kernel(kid).provisioner.state.value == "running"


@pytest.mark.server(
    kernel_websocket_connection_class=OtherConnection, reraise_server_extension_failures=True
)
def test_another_websocket_connection_class_is_refused_loudly(jp_configurable_serverapp) -> None:
    with pytest.raises(RuntimeError, match="kernel_websocket_connection_class"):
        jp_configurable_serverapp()
