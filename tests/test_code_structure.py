"""The package's structure, checked from its source: which part may import which, no
import cycles (type-only imports included), and no module reaching into another's
private names. Every module must be placed in a layer, so a new one is placed on
purpose. docs/architecture.md describes the layers."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jupyter_cedana"

# Each layer is a set of folders of the package (and the few modules every layer
# shares), so that the package's listing is its architecture:
# - core: the checkpoint core (CRIU, the image store and its formats) and the GPU (NVML,
#   the CUDA driver's checkpoint). Used by the server and by the checkpoint agent; it
#   knows neither;
# - server: the Jupyter server extension, its kernels' provisioner among it;
# - cli: `jupyter cedana`, which talks to servers over REST and reads stores;
# - agent: the checkpoint agent, the one privileged part.
LAYERS = {
    "core": {"_version", "errors", "timestamps", "package_files", "checkpoint", "gpu"},
    "server": {"server"},
    "cli": {"cli"},
    "agent": {"agent"},
}
# What a server may use of the agent: the client and its wire format, nothing that
# runs with the agent's privilege.
AGENT_CLIENT = {"agent.client", "agent.protocol"}

ALLOWED = {
    "core": {"core"},
    "agent": {"core", "agent", "agent-client"},
    "server": {"core", "server", "agent-client"},
    "cli": {"core", "cli"},
    "agent-client": {"agent-client"},
    "root": {"server", "core"},
}

# Private names of other projects that are used on purpose, each with its reason.
FOREIGN_PRIVATE = {
    # jupyter_server keeps each kernel's websocket count only here (its culler reads it).
    ("kernel_facts", "_kernel_connections"),
    # jupyter_client's future of a kernel's start: the one sign that a start is underway.
    ("kernel_facts", "_ready"),
    # The stop path of ServerApp, wrapped so that kernels are parked before it goes on.
    ("parking", "_bind_http_server"),
    ("parking", "_signal_stop"),
    # jupyter_server's registry of open kernel websockets: the gate delivers held
    # messages to each connection of a kernel, which jupyter_server lists nowhere else.
    ("gate", "_open_sockets"),
    # The launch kwargs LocalProvisioner passes to Popen, cleaned as it cleans them: the
    # kernel is started through cedana-init with the same arguments a stock launch gets.
    ("provisioner", "_scrub_kwargs"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> str | None:
    if name == "":
        return "root"
    if name in AGENT_CLIENT:
        return "agent-client"
    top = name.split(".")[0]
    for layer_name, folders in LAYERS.items():
        if top in folders:
            return layer_name
    return None


def imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """Every module of the package that `name` imports, anywhere in it: at the top, in a
    function, or for type checking only."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "":
        package = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                base_name = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and node.module.startswith("jupyter_cedana"):
                base_name = node.module.removeprefix("jupyter_cedana").lstrip(".")
            else:
                continue
            for alias in node.names:
                full = f"{base_name}.{alias.name}" if base_name else alias.name
                yield (full if full in known else base_name), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jupyter_cedana."):
                    yield alias.name.removeprefix("jupyter_cedana."), node.lineno


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {
        name: {t for t, _ in imports(name, path, known) if t in known and t != name}
        for name, path in mods.items()
    }


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def layer_violations(g: dict[str, set[str]]) -> list[str]:
    out = []
    for name, targets in sorted(g.items()):
        mine = layer(name)
        for t in sorted(targets):
            theirs = layer(t)
            if mine is None or theirs is None or theirs not in ALLOWED[mine]:
                out.append(f"{name or 'jupyter_cedana'} ({mine}) imports {t} ({theirs})")
    return out


def private_reaches(name: str, path: Path, own: set[str]) -> Iterator[str]:
    """`x._name` on anything but self/cls, and `from .m import _name`, where `_name` is
    one of the package's own private names (or a foreign one not listed as allowed)."""
    short = name.rsplit(".", 1)[-1]
    tree = ast.parse(path.read_text())
    classes_here = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", *classes_here):
                continue
            if isinstance(node.value, ast.Call) and ast.unparse(node.value) == "super()":
                continue
            if attr in own or (short, attr) not in FOREIGN_PRIVATE:
                yield f"{name}:{node.lineno}: {ast.unparse(node)}"
        elif isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("jupyter_cedana")
        ):
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and alias.name != "_version":
                    yield f"{name}:{node.lineno}: imports {alias.name}"


def own_private_names() -> set[str]:
    names = set()
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                candidate = node.name
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                candidate = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                candidate = node.id
            else:
                continue
            if candidate.startswith("_") and not candidate.startswith("__"):
                names.add(candidate)
    return names


def test_every_module_is_in_a_layer() -> None:
    unplaced = [m for m in modules() if layer(m) is None]
    assert not unplaced, f"place these modules in a layer of {__name__}: {unplaced}"


def test_layers_import_only_what_they_may() -> None:
    assert layer_violations(graph()) == []


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_no_module_reaches_into_another_modules_private_names() -> None:
    own = own_private_names()
    found = [r for name, path in modules().items() for r in private_reaches(name, path, own)]
    assert found == []


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        ("import asyncio\nasyncio._get_running_loop()\n", "asyncio._get_running_loop"),
        ("class A:\n    def f(self, b):\n        return b._state\n", "b._state"),
        ("from .checkpoint import _helper\n", "imports _helper"),
    ],
)
def test_the_private_check_catches_a_reach(tmp_path: Path, source: str, expect: str) -> None:
    path = tmp_path / "mod.py"
    path.write_text(source)
    found = list(private_reaches("mod", path, {"_state", "_helper"}))
    assert len(found) == 1 and found[0].endswith(expect), found
    path.write_text("class A:\n    def f(self):\n        return self._state\n")
    assert list(private_reaches("mod", path, {"_state"})) == []


def test_the_cycle_and_layer_checks_catch_a_breach() -> None:
    g = {
        "checkpoint.engine": {"checkpoint.dumping"},
        "checkpoint.dumping": {"checkpoint.engine"},
        "server.manager": set(),
        "cli.main": {"server.manager"},
    }
    assert cycles(g) == [["checkpoint.dumping", "checkpoint.engine"]]
    assert layer_violations(g) == ["cli.main (cli) imports server.manager (server)"]
    assert layer_violations({"agent.criu": {"server.gate"}}) == [
        "agent.criu (agent) imports server.gate (server)"
    ]
    assert layer_violations({"agent.client": {"checkpoint.engine"}}) == [
        "agent.client (agent-client) imports checkpoint.engine (core)"
    ]
    assert layer_violations({"checkpoint.engine": {"server.kernel.provisioner"}}) == [
        "checkpoint.engine (core) imports server.kernel.provisioner (server)"
    ]
    assert layer("flat_module") is None


def test_the_import_reader_sees_type_only_and_function_imports(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .engine import CheckpointEngine\n"
        "def f():\n    from . import gate\n"
        "import jupyter_cedana.agent.client\n"
    )
    found = {t for t, _ in imports("mod", path, {"engine", "gate", "agent.client"})}
    assert found == {"engine", "gate", "agent.client"}
    # From inside a subpackage, `..` climbs out of it.
    deep = tmp_path / "deep.py"
    deep.write_text("from ..checkpoint.store import CheckpointStore\nfrom . import gate\n")
    known = {"checkpoint.store", "server.gate"}
    assert {t for t, _ in imports("server.deep", deep, known)} == known
