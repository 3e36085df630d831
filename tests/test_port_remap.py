"""A parked kernel's ports taken between the exit of its server and the start of the next
one (nobody holds them then): the adopting server moves each taken port to a free one, in
the image and in the connection info its clients get, and the kernel comes back with its
state. Real `jupyter server` processes, real kernels, real CRIU; the port is taken by the
test itself, at the named point (after the park, before the adoption).
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest

from jupyter_cedana.checkpoint.integrity import file_crc32
from jupyter_cedana.checkpoint.portremap import FILES, PENDING, listeners, rewrite_files_img
from jupyter_cedana.checkpoint.store import CheckpointStore
from tests.test_cli import Server
from tests.test_parking import (
    execute,
    kernel_processes,
    listed,
    records,
    server_with_kernel,
    servers,
    start_server,
    stop_with,
)

__all__ = ["servers"]  # a fixture, used by name

pytestmark = pytest.mark.criu

PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def listening_ports(server: Server, kid: str) -> set[int]:
    """TCP ports the processes of a kernel listen on (from /proc, by socket inode)."""
    inodes = set()
    for p, row in kernel_processes(server, [kid]).items():
        if kid not in row[3]:  # the kernel's own command line names its connection file
            continue
        fds = Path(f"/proc/{p}/fd")
        for fd in fds.iterdir():
            try:
                target = fd.readlink()
            except OSError:
                continue
            if str(target).startswith("socket:["):
                inodes.add(str(target)[8:-1])
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
            ports.add(int(cols[1].split(":")[1], 16))
    return ports


def test_a_port_taken_while_the_kernel_was_parked_is_moved(
    tmp_path: Path, servers: list[Server]
) -> None:
    a, root, kid = server_with_kernel(
        tmp_path, servers, "import numpy as np; arr = np.arange(1000); x = 41"
    )
    assert "parked 1 of 1 kernel(s)" in stop_with(a, signal.SIGTERM)
    before = records(root)[kid]["connection_info"]

    # Between the two servers another program takes the kernel's shell port.
    taken = int(before["shell_port"])
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As servers do: the old kernel's connections may still be in TIME_WAIT on the port.
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    try:
        b = start_server(tmp_path / "b", checkpoint_root=root)
        servers.append(b)
        assert listed(b) == {kid}
        assert b.kernel(kid)["state"] == "suspended"
        log = b.log.read_text()
        assert f"parked kernel {kid}: port(s) {taken} taken since its server stopped" in log

        # The record and the connection file (what clients read) name the new port...
        after = records(root)[kid]["connection_info"]
        moved = int(after["shell_port"])
        assert moved != taken
        assert {n: after[n] for n in PORTS if n != "shell_port"} == {
            n: before[n] for n in PORTS if n != "shell_port"
        }
        (conn,) = [json.loads(p.read_text()) for p in b.runtime_dir.glob(f"kernel-{kid}.json")]
        assert conn["shell_port"] == moved and conn["key"] == before["key"]
        # ...and so does the image, with its checksums and map of ports.
        store = CheckpointStore(root)
        manifest = store.read_manifest(kid)
        assert manifest["files"][FILES]["crc32"] == file_crc32(root / kid / FILES)
        assert manifest["port_map"] == {str(taken): moved}
        assert ("127.0.0.1", moved) in {(a, p) for _, a, p in listeners(root / kid)}
        assert taken not in {p for _, _, p in listeners(root / kid)}
        store.verify(kid)

        # A cell through the server resumes the kernel with its state, on the new port.
        out = execute(b, kid, "print(x + 1, int(arr.sum()))")
        assert out["reply"]["status"] == "ok" and out["stdout"].strip() == "42 499500", out
        assert moved in listening_ports(b, kid) and taken not in listening_ports(b, kid)
    finally:
        squatter.close()


def test_a_remap_cut_short_by_a_crash_is_completed_or_undone(
    tmp_path: Path, servers: list[Server]
) -> None:
    """What a server killed in the middle of a remap leaves (the new files.img beside the
    old one; the manifest naming the old or the new): the next adoption completes the
    remap when the manifest names the new file, and drops the new file if not."""
    root = tmp_path / "checkpoints"
    a = start_server(tmp_path / "a", checkpoint_root=root)
    servers.append(a)
    undone, completed = a.start_kernel(), a.start_kernel()
    for kid, value in ((undone, 1), (completed, 2)):
        assert execute(a, kid, f"x = {value}")["reply"]["status"] == "ok"
    assert "parked 2 of 2 kernel(s)" in stop_with(a, signal.SIGTERM)
    store = CheckpointStore(root)
    ports = {kid: records(root)[kid]["connection_info"] for kid in (undone, completed)}

    # Killed before the manifest: the new file is written, nothing else.
    old_port = int(ports[undone]["shell_port"])
    data = (root / undone / FILES).read_bytes()
    (root / undone / PENDING).write_bytes(rewrite_files_img(data, {old_port: free_port()}))

    # Killed after the manifest, before the rename: the manifest names the new file
    # and maps the port; the record still names the old one.
    old_port = int(ports[completed]["shell_port"])
    new_port = free_port()
    data = (root / completed / FILES).read_bytes()
    (root / completed / PENDING).write_bytes(rewrite_files_img(data, {old_port: new_port}))
    manifest = store.read_manifest(completed)
    manifest["files"][FILES] = {
        "size": (root / completed / PENDING).stat().st_size,
        "crc32": file_crc32(root / completed / PENDING),
    }
    manifest["port_map"] = {str(old_port): new_port}
    store.write_manifest(completed, manifest)

    b = start_server(tmp_path / "b", checkpoint_root=root)
    servers.append(b)
    assert listed(b) == {undone, completed}
    for kid in (undone, completed):
        assert not (root / kid / PENDING).exists()
        store.verify(kid)
    assert records(root)[undone]["connection_info"] == ports[undone]
    conn = json.loads((b.runtime_dir / f"kernel-{completed}.json").read_text())
    assert conn["shell_port"] == new_port
    for kid, value in ((undone, 1), (completed, 2)):
        out = execute(b, kid, "print(x)")
        assert out["reply"]["status"] == "ok" and out["stdout"].strip() == str(value), out
    assert new_port in listening_ports(b, completed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
