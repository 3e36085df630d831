"""The host memory room the GPU offload checks (jupyter_cedana.gpu.hostmem), from /proc and
cgroup files laid out as the kernel shows them, and from this machine's own."""

from __future__ import annotations

import os
from pathlib import Path

from jupyter_cedana.gpu.hostmem import host_room, mem_available

GiB = 1 << 30


def proc_tree(tmp: Path, pid: int, cgroup: str, mountinfo: str, avail_kb: int) -> Path:
    proc = tmp / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / str(pid) / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {avail_kb} kB\n")
    return proc


def limit(d: Path, name_max: str, name_cur: str, mx: str, cur: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name_max).write_text(mx + "\n")
    (d / name_cur).write_text(f"{cur}\n")


def test_cgroup_v2_tightest_ancestor_wins(tmp_path: Path) -> None:
    v2 = tmp_path / "unified"
    mountinfo = f"30 1 0:26 / {v2} rw,nosuid - cgroup2 cgroup2 rw\n"
    proc = proc_tree(tmp_path, 42, "0::/user.slice/jupyter/kernel\n", mountinfo, 64 << 20)
    limit(v2 / "user.slice", "memory.max", "memory.current", str(20 * GiB), 15 * GiB)
    limit(v2 / "user.slice/jupyter", "memory.max", "memory.current", "max", 14 * GiB)
    limit(v2 / "user.slice/jupyter/kernel", "memory.max", "memory.current", str(30 * GiB), 4 * GiB)
    room = host_room(42, proc=proc)
    assert room is not None and room.bytes == 5 * GiB
    assert room.source.startswith("cgroup /user.slice (memory.max 20.00 GiB, 15.00 GiB in use")


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    v1 = tmp_path / "memory"
    mountinfo = (
        f"30 1 0:26 / {tmp_path / 'cpu'} rw - cgroup cgroup rw,cpu\n"
        f"31 1 0:27 / {v1} rw - cgroup cgroup rw,memory\n"
    )
    cgroup = "5:cpu:/a\n4:memory:/docker/abc\n0::/\n"
    proc = proc_tree(tmp_path, 7, cgroup, mountinfo, 64 << 20)
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    limit(v1, *names, str(9223372036854771712), 10 * GiB)  # v1's "no limit"
    limit(v1 / "docker/abc", *names, str(8 * GiB), 5 * GiB)
    room = host_room(7, proc=proc)
    assert room is not None and room.bytes == 3 * GiB and "cgroup /docker/abc" in room.source


def test_machine_memory_when_no_cgroup_limits(tmp_path: Path) -> None:
    proc = proc_tree(tmp_path, 9, "0::/\n", "", 2 << 20)
    room = host_room(9, proc=proc)
    assert room is not None and room.bytes == 2 * GiB
    assert room.source == "MemAvailable of the machine"
    assert host_room(9, proc=tmp_path / "nothing") is None


def test_this_machine(tmp_path: Path) -> None:
    """This machine's cgroups (read live) against a snapshot of its /proc/meminfo."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(Path("/proc/meminfo").read_text())
    room = host_room(os.getpid(), meminfo=meminfo)
    avail = mem_available(meminfo)
    assert room is not None and avail is not None and 0 < room.bytes <= avail
    assert room.source == "MemAvailable of the machine" or room.source.startswith("cgroup /")
