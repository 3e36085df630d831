"""New ports for a parked kernel whose ports were taken while no server held them.

A suspended kernel's ports are held by its provisioner while a server runs; between the
exit of the server that parked it and the start of the one that adopts it, nobody holds
them, and any program may bind one. CRIU then cannot restore the kernel's listening
socket (EADDRINUSE) and the resume fails. Before adopting, every listening TCP socket of
the image whose port is taken gets a free port: the port is rewritten in the image's
socket entries (files.img: the listening socket, and both ends of any connection the
kernel has to itself on it) and in the connection info its clients get. A kernel binds
its sockets once, at start, so nothing else in its memory needs the old number.

The rewrite is crash-safe: the new files.img is written beside the old one, then the
manifest (its checksums, and the map of ports, original to current) replaces the old
manifest atomically, then the new file replaces the old. `finish` completes or undoes an
interrupted rewrite before the image is checked, so an image is never left with a
checksum that does not match.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt
from .crimg import ImageError, decode, fields_in_order, varint_bytes
from .durable import fsync_path
from .integrity import file_crc32
from .store import CheckpointStore

FILES = "files.img"
PENDING = FILES + ".remap"
_INETSK = 4  # fd_types.INETSK
_FILE_TYPE, _FILE_ISK = 1, 4  # file_entry: type, isk
# inet_sk_entry (CRIU images/sk-inet.proto)
_FAMILY, _STATE, _SRC_PORT, _DST_PORT, _SRC_ADDR, _DST_ADDR = 3, 6, 7, 8, 11, 12
_TCP_LISTEN = 10


def _records(data: bytes) -> tuple[bytes, list[bytes]]:
    """The magic header of a CRIU image file, and its length-prefixed records."""
    if len(data) < 8:
        raise ImageError(f"{FILES} is too short")
    pos, out = 8, []
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError(f"{FILES}: truncated record header")
        (size,) = struct.unpack_from("<I", data, pos)
        if pos + 4 + size > len(data):
            raise ImageError(f"{FILES}: truncated record")
        out.append(data[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return data[:8], out


def _address(family: int, words: list[int | bytes]) -> str:
    packed = b"".join(struct.pack("<I", int(w)) for w in words)
    if family == socket.AF_INET6:
        return str(ipaddress.IPv6Address(packed.ljust(16, b"\0")))
    return str(ipaddress.IPv4Address(packed.ljust(4, b"\0")[:4]))


def listeners(images: Path) -> list[tuple[int, str, int]]:
    """(family, address, port) of every listening TCP socket in a CRIU image."""
    out = []
    for record in _records((images / FILES).read_bytes())[1]:
        entry = decode(record)
        if entry.get(_FILE_TYPE, [None])[-1] != _INETSK or _FILE_ISK not in entry:
            continue
        isk = decode(bytes(entry[_FILE_ISK][-1]))  # type: ignore[arg-type]
        if isk.get(_STATE, [0])[-1] != _TCP_LISTEN:
            continue
        family = int(isk.get(_FAMILY, [socket.AF_INET])[-1])
        port = int(isk.get(_SRC_PORT, [0])[-1])
        out.append((family, _address(family, isk.get(_SRC_ADDR, [])), port))
    return out


def port_free(family: int, address: str, port: int) -> bool:
    """Whether CRIU can bind the kernel's listening socket there again (it binds with
    SO_REUSEADDR, so a connection of the old kernel in TIME_WAIT does not count)."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _free_port(family: int, address: str, avoid: set[int]) -> int:
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port


def _rewrite_isk(isk: bytes, ports: dict[int, int]) -> bytes:
    fields = fields_in_order(isk)
    values = {n: v for n, _, _, v in fields}
    local = [v for n, _, _, v in fields if n == _SRC_ADDR]
    remote = [v for n, _, _, v in fields if n == _DST_ADDR]
    # A connection's far end is the kernel's own port only when it goes to the kernel's
    # own address (a connection of the kernel to itself).
    to_itself = values.get(_STATE) != _TCP_LISTEN and remote == local
    out = bytearray()
    for number, wire, raw, value in fields:
        moved = number == _SRC_PORT or (number == _DST_PORT and to_itself)
        if moved and wire == 0 and isinstance(value, int) and value in ports:
            out += varint_bytes(number << 3) + varint_bytes(ports[value])
        else:
            out += raw
    return bytes(out)


def rewrite_files_img(data: bytes, ports: dict[int, int]) -> bytes:
    """files.img with the TCP sockets' ports mapped by `ports` (old -> new)."""
    magic, records = _records(data)
    out = bytearray(magic)
    for record in records:
        fields = fields_in_order(record)
        if not any(n == _FILE_TYPE and v == _INETSK for n, _, _, v in fields):
            out += struct.pack("<I", len(record)) + record
            continue
        entry = bytearray()
        for number, _wire, raw, value in fields:
            if number == _FILE_ISK and isinstance(value, bytes):
                isk = _rewrite_isk(value, ports)
                entry += varint_bytes((number << 3) | 2) + varint_bytes(len(isk)) + isk
            else:
                entry += raw
        out += struct.pack("<I", len(entry)) + entry
    return bytes(out)


def finish(store: CheckpointStore, kernel_id: str) -> None:
    """Complete a rewrite interrupted by a crash (its manifest already names the new
    file) or undo it (the manifest still names the old one)."""
    images = store.path(kernel_id)
    pending = images / PENDING
    if not pending.exists():
        return
    meta = store.read_manifest(kernel_id)["files"].get(FILES) or {}
    if pending.stat().st_size == meta.get("size") and file_crc32(pending) == meta.get("crc32"):
        os.rename(pending, images / FILES)
    else:
        pending.unlink()
    fsync_path(images, directory=True)


def remap_taken(store: CheckpointStore, kernel_id: str) -> dict[int, int]:
    """Give every listening socket of the kernel's image whose port is taken a free port;
    returns {old: new} for the ports changed now (empty when all were free)."""
    images = store.path(kernel_id)
    found = listeners(images)
    manifest = store.read_manifest(kernel_id)
    avoid = {port for _, _, port in found} | {int(k) for k in manifest.get("port_map") or {}}
    ports: dict[int, int] = {}
    for family, address, port in found:
        if port not in ports and not port_free(family, address, port):
            ports[port] = _free_port(family, address, avoid | set(ports.values()))
    if not ports:
        return {}
    if file_crc32(images / FILES) != manifest["files"][FILES].get("crc32"):
        # Rewritten, a damaged file would get a checksum that hides the damage.
        raise CheckpointCorrupt(
            f"Checkpoint of {kernel_id} is corrupted: checksum mismatch in {FILES}"
        )
    data = rewrite_files_img((images / FILES).read_bytes(), ports)
    pending = images / PENDING
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    manifest["files"][FILES] = {**manifest["files"][FILES], "size": len(data)}
    manifest["files"][FILES]["crc32"] = file_crc32(pending)
    if isinstance(manifest.get("ports"), list):
        manifest["ports"] = [ports.get(int(p), int(p)) for p in manifest["ports"]]
    # Every number a socket of this kernel had, to the one it has now: a record written
    # at any point of the kernel's life finds its ports.
    history = {int(k): int(v) for k, v in (manifest.get("port_map") or {}).items()}
    history = {k: ports.get(v, v) for k, v in history.items()} | ports
    manifest["port_map"] = {str(k): v for k, v in history.items()}
    store.write_manifest(kernel_id, manifest)
    os.rename(pending, images / FILES)
    fsync_path(images, directory=True)
    return ports


def with_port_map(info: dict[str, Any], port_map: dict[str, int]) -> dict[str, Any]:
    """Connection info whose ports are moved as an image's map says (original, or any
    number a socket had since, to the current one)."""
    return {k: port_map.get(str(v), v) if k.endswith("_port") else v for k, v in info.items()}
