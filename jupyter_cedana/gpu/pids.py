"""Which kernel an NVML process entry belongs to. NVML names processes by PIDs that may
be of another PID namespace (a server or kernel in a container), so matching them to
the kernels' process trees takes several steps: the PID itself, `NSpid`, PIDs learned
earlier, and last the `/dev/nvidiaN` files the trees hold open, by elimination (see
docs/gpu.md for what each match can know). Kept apart from the monitor (monitor.py), which
owns the learned PIDs and the NVML calls; this is the reasoning over what they return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint.proctree import gpu_minor, nspids, open_device_files, stat_fields

Matches = dict[str, list[tuple["NvmlProcess", int | None, str]]]


@dataclass
class NvmlDevice:
    index: int
    uuid: str
    name: str
    minor: int | None
    handle: Any
    mig: bool = False


@dataclass
class NvmlProcess:
    """One NVML process entry on one device."""

    dev: NvmlDevice
    pid: int  # as NVML reports it
    memory: int
    mps: bool = False


def match_processes(
    trees: dict[str, set[int]],
    procs: list[NvmlProcess],
    aliases: dict[int, tuple[int, str]],
    device_path_prefix: str,
) -> Matches:
    """kernel id -> [(NVML entry, host pid or None, how matched)]. `aliases` (NVML pid of
    another namespace -> (host pid, its start time)) is read and updated: the caller
    keeps what was learned by elimination for the next call."""
    owner: dict[int, str] = {}
    for kid, pids in trees.items():
        for p in pids:
            owner[p] = kid
    out: Matches = {k: [] for k in trees}
    unmatched: list[NvmlProcess] = []
    for pu in procs:
        owner_kid = owner.get(pu.pid)
        if owner_kid is not None:
            out[owner_kid].append((pu, pu.pid, "pid"))
        else:
            unmatched.append(pu)
    if not unmatched:
        return out
    # NVML may report PIDs as seen from another namespace: NSpid lists each
    # process's PID in every namespace it is in. Only unique values match.
    ns_owner: dict[int, tuple[str, int] | None] = {}
    for kid, pids in trees.items():
        for p in pids:
            for alias in nspids(p)[1:]:
                ns_owner[alias] = None if alias in ns_owner else (kid, p)
    rest: list[NvmlProcess] = []
    for pu in unmatched:
        hit = ns_owner.get(pu.pid)
        if hit is not None:
            out[hit[0]].append((pu, hit[1], "nspid"))
        else:
            rest.append(pu)
    if not rest:
        return out
    rest = _match_learned(rest, owner, out, aliases)
    if not rest:
        return out
    # Last resort: which kernels hold /dev/nvidiaN open, and by elimination which
    # process an unexplained NVML entry is.
    holders: dict[int, dict[str, set[int]]] = {}
    for kid, pids in trees.items():
        for p in pids:
            for path in open_device_files(p, device_path_prefix):
                minor = gpu_minor(path, device_path_prefix)
                if minor is not None:
                    holders.setdefault(minor, {}).setdefault(kid, set()).add(p)
    by_minor: dict[int | None, list[NvmlProcess]] = {}
    for pu in rest:
        by_minor.setdefault(pu.dev.minor, []).append(pu)
    for minor, entries in by_minor.items():
        kids = holders.get(minor, {}) if minor is not None else {}
        # holders not yet explained by an NVML entry of this GPU
        open_kids = {
            k: hp for k, hp in kids.items() if not any(m[0].dev.minor == minor for m in out[k])
        }
        if len(entries) == 1 and len(open_kids) == 1:
            kid, hps = next(iter(open_kids.items()))
            if len(hps) == 1:
                (hp,) = hps
                _learn(aliases, entries[0].pid, hp)
                out[kid].append((entries[0], hp, "learned"))
                continue
        for pu in entries:
            if len(open_kids) == 1:
                kid, hps = next(iter(open_kids.items()))
                out[kid].append((pu, min(hps), "devfile"))
            else:
                for kid, hps in open_kids.items():
                    # known: this kernel uses the GPU; unknown: how much of it
                    out[kid].append((NvmlProcess(pu.dev, pu.pid, 0, pu.mps), min(hps), "devfile"))
    return out


def _learn(aliases: dict[int, tuple[int, str]], nvml_pid: int, host_pid: int) -> None:
    started = _start_time(host_pid)
    if started is not None:
        aliases[nvml_pid] = (host_pid, started)


def _match_learned(
    rest: list[NvmlProcess],
    owner: dict[int, str],
    out: Matches,
    aliases: dict[int, tuple[int, str]],
) -> list[NvmlProcess]:
    """Match NVML entries through PIDs learned earlier; entries learned to be another
    process (not in these trees) are dropped. Returns the entries still unexplained."""
    seen = {pu.pid for pu in rest}
    for nvml_pid in [n for n in aliases if n not in seen]:
        del aliases[nvml_pid]  # that NVML process is gone
    left = []
    for pu in rest:
        alias = aliases.get(pu.pid)
        if alias is not None and _start_time(alias[0]) != alias[1]:
            del aliases[pu.pid]  # the host process is gone (its pid may be reused)
            alias = None
        if alias is None:
            left.append(pu)
        elif alias[0] in owner:
            out[owner[alias[0]]].append((pu, alias[0], "learned"))
    return left


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a process from a later one with the same pid."""
    fields = stat_fields(pid)
    return fields[19] if len(fields) > 19 else None
