"""The JupyterHub examples in docs/jupyterhub.md stay real: every class and option they
configure exists in the installed JupyterHub, KubeSpawner and jupyter-cedana."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from jupyterhub.app import JupyterHub
from jupyterhub.auth import Authenticator
from jupyterhub.scopes import scope_definitions
from jupyterhub.spawner import LocalProcessSpawner, Spawner
from kubespawner import KubeSpawner
from traitlets.config import Configurable
from traitlets.config.loader import PyFileConfigLoader
from traitlets.utils.importstring import import_item

DOCS = Path(__file__).resolve().parent.parent / "docs"
DOC = DOCS / "jupyterhub.md"
HUB_CLASSES: list[type[Configurable]] = [
    JupyterHub,
    Spawner,
    LocalProcessSpawner,
    Authenticator,
    KubeSpawner,
]


def _server_classes() -> dict[str, type[Configurable]]:
    """jupyter-cedana's configurable classes: those docs/config.md documents."""
    spec = importlib.util.spec_from_file_location("gen", DOCS / "generate_config_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {cls.__name__: cls for cls in module.CLASSES}


SERVER_CLASSES = _server_classes()


def example(name: str) -> str:
    text = DOC.read_text()
    m = re.search(rf"<!-- example: {re.escape(name)} -->\s*```\w+\n(.*?)```", text, re.S)
    assert m, f"no example {name} in {DOC}"
    return m.group(1)


def check_options(config: dict[str, Any], classes: dict[str, type[Configurable]]) -> int:
    """Every Class.option in `config` exists; returns how many were checked."""
    checked = 0
    for section, values in config.items():
        assert section in classes, f"unknown class {section}"
        traits = classes[section].class_traits(config=True)
        for key in values:
            assert key in traits, f"{section}.{key} is not an option"
            checked += 1
    return checked


def check_server_args(args: list[str]) -> None:
    """--Class.option=value arguments of the single-user server name real options."""
    for arg in args:
        m = re.fullmatch(r"--(\w+)\.(\w+)=.*", arg)
        if m is None:
            continue
        check_options({m.group(1): {m.group(2): None}}, SERVER_CLASSES)


@pytest.fixture
def hub_config(tmp_path: Path) -> Any:
    (tmp_path / "jupyterhub_config.py").write_text(example("jupyterhub_config.py"))
    return PyFileConfigLoader("jupyterhub_config.py", path=str(tmp_path)).load_config()


def test_jupyterhub_config_example_names_real_options(hub_config: Any) -> None:
    classes = {cls.__name__: cls for cls in HUB_CLASSES}
    assert check_options(hub_config, classes) > 20
    spawner = import_item(hub_config.JupyterHub.spawner_class)
    assert spawner is KubeSpawner
    check_server_args(list(hub_config.KubeSpawner.args))
    assert any(a.startswith("--KernelParking.deadline=") for a in hub_config.KubeSpawner.args)
    # Parking must fit in the pod's grace period.
    deadline = next(
        float(a.split("=", 1)[1]) for a in hub_config.KubeSpawner.args if "deadline" in a
    )
    assert hub_config.KubeSpawner.delete_grace_period >= deadline + 10


def test_jupyterhub_config_example_culler_and_capabilities(hub_config: Any) -> None:
    (culler,) = hub_config.JupyterHub.services
    module = culler["command"][culler["command"].index("-m") + 1]
    importlib.import_module(module)
    (role,) = hub_config.JupyterHub.load_roles
    assert role["services"] == [culler["name"]]
    assert all(scope in scope_definitions for scope in role["scopes"])
    # The server is root in the user's pod (an agent does not serve pods yet), with what
    # root CRIU uses; Kubernetes refuses no_new_privs beside SYS_ADMIN.
    context = hub_config.KubeSpawner.container_security_context
    assert hub_config.KubeSpawner.uid == 0 and context["runAsUser"] == 0
    assert "--allow-root" in hub_config.KubeSpawner.args
    assert context["allowPrivilegeEscalation"] is True
    assert hub_config.KubeSpawner.allow_privilege_escalation is True
    assert set(context["capabilities"]["add"]) == {
        "SYS_ADMIN",
        "SYS_PTRACE",
        "CHECKPOINT_RESTORE",
        "NET_ADMIN",
        "SYS_RESOURCE",
    }


def test_zero_to_jupyterhub_values_example() -> None:
    values = yaml.safe_load(example("config.yaml"))
    # hub.config is passed to the Hub as traitlets configuration.
    assert check_options(values["hub"]["config"], {"KubeSpawner": KubeSpawner}) >= 3
    grace = values["hub"]["config"]["KubeSpawner"]["delete_grace_period"]
    cmd = values["singleuser"]["cmd"]
    check_server_args(cmd if isinstance(cmd, list) else shlex.split(cmd))
    deadline = next(float(a.split("=", 1)[1]) for a in cmd if "KernelParking.deadline" in a)
    assert grace >= deadline + 10
    assert values["singleuser"]["allowPrivilegeEscalation"] is True
    assert values["singleuser"]["uid"] == 0 and "--allow-root" in cmd
    assert values["cull"]["enabled"] is True
