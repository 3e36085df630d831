"""Adopt on start: kernels suspended to disk by an earlier server, whether it parked them
on a clean stop (parking.py) or was killed with them suspended, become this server's
suspended kernels, under their old ids, with their sessions, before it serves requests.

Only the records of the same uid, JupyterHub user and server name, and server identity
(KernelParking.server_identity: by default the server's root_dir) are adopted; the others
are left in place, each with the reason in the log.

Adoption goes through jupyter_server's public path, `start_kernel(kernel_id=<old id>)`;
cedana-provisioner's launch_kernel calls `claim_adoption`, which hands it the saved
connection info instead of launching a process. The next message to the kernel resumes it
from its image like any suspended kernel.

Nobody holds a parked kernel's ports between the two servers: a port taken meanwhile is
moved to a free one in the image and in the connection info (parked_ports.py) before the
kernel is adopted.

The record stays while the kernel is suspended, locked by the adopting server (the
provisioner holds the lock): another live server skips it as busy, and if this server is
killed the lock goes with it and the next server adopts the kernel again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.kernelspec import NoSuchKernel
from jupyter_client.provisioning import KernelProvisionerFactory
from jupyter_core.utils import ensure_async
from tornado import web

from ..checkpoint import portremap
from ..checkpoint.parkrecords import (
    HeldRecord,
    RecordBusy,
    RecordInvalid,
    list_records,
    parse_record,
    remove_record,
)
from ..checkpoint.store import CheckpointStore
from ..errors import CedanaError, CheckpointCorrupt, EngineUnavailable, NotFound
from ..timestamps import Stamp, iso
from .kernel.checkpoint_agent import CheckpointAgent, agent_for
from .kernel.transitions import KernelState
from .parked_ports import follow_port_map, free_taken_ports
from .policy import retention_ended

PROVISIONER = "cedana-provisioner"


@dataclass
class _Plan:
    record: dict[str, Any]
    manifest: dict[str, Any]
    held: HeldRecord
    claimed: bool = False


# Kernel id -> the adoption the next launch of that id must perform instead of launching.
_PLANS: dict[str, _Plan] = {}


async def claim_adoption(prov: Any) -> KernelConnectionInfo | None:
    """For the provisioner's launch_kernel: the connection info of a parked kernel being
    adopted under this id (the provisioner then holds it suspended), or None (launch)."""
    plan = _PLANS.get(str(prov.kernel_id))
    if plan is None or plan.claimed:
        return None
    plan.claimed = True
    record, manifest = plan.record, plan.manifest
    info: dict[str, Any] = dict(record["connection_info"])
    # jupyter_client compares the key as bytes with the one it holds.
    info["key"] = str(info.get("key", "")).encode()
    saved = record.get("provisioner") or {}
    # A kernel at the checkpoint agent may still run there (its server was killed).
    running_pid = manifest.get("agent_pid")
    # What the parking server's get_provisioner_info saved, as a suspended kernel on disk
    # without a process: the provisioner's own inverse restores it (and holds its ports).
    await prov.load_provisioner_info(
        {
            **saved,
            "kernel_id": prov.kernel_id,
            "connection_info": info,
            "pid": None,
            "pgid": None,
            "ip": info.get("ip") or saved.get("ip"),
            "cedana_state": (KernelState.running if running_pid else KernelState.suspended).value,
            "cedana_tier": None if running_pid else "disk",
            "cedana_reason": _rolled_back(record, manifest),
            "cedana_suspended_at": None if running_pid else suspended_since(record),
            "cedana_checkpoint_bytes": int(manifest.get("total_bytes") or 0),
        }
    )
    prov.process = None
    prov.cwd = record.get("cwd") or os.getcwd()
    if record.get("agent"):
        agent = agent_for(prov.parent)
        if agent is None:  # the adopter checked; the configuration cannot change meanwhile
            raise RuntimeError("a kernel at the checkpoint agent, and no agent configured")
        prov.attach_at_agent(agent.kernel(str(prov.kernel_id)), running_pid)
    else:
        prov.adopt_gpu_state(manifest.get("gpu"))
    prov.records.take(plan.held)  # locked for as long as this server owns the kernel
    return cast(KernelConnectionInfo, info)


def _rolled_back(record: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    """What a kernel whose server died while its memory was coming back lost, if so."""
    resumed = record.get("resumed_at")
    if resumed is None:
        return None
    return (
        f"Its server stopped while the kernel was being resumed (at {iso(float(resumed))}): "
        f"it is back as it was at its checkpoint taken at {iso(manifest.get('created'))}, "
        "and what it did after that resume is lost."
    )


def suspended_since(record: dict[str, Any]) -> float | None:
    """When a parked kernel was suspended (its image made), for idle time and retention."""
    saved = record.get("provisioner") or {}
    since = saved.get("cedana_suspended_at") or record.get("parked_at")
    return float(since) if since is not None else None


@dataclass
class AdoptionReport:
    adopted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # kernel id -> why


class Adopter:
    """Validates the park records of a checkpoint root and adopts the valid ones."""

    def __init__(
        self,
        *,
        kernel_manager: Any,
        session_manager: Any,
        store: CheckpointStore,
        retention: float,
        verify_bytes: int,
        log: Any,
        replies: Any = None,
        identity: str | None = None,
        agent: CheckpointAgent | None = None,
    ):
        self.mkm = kernel_manager
        self.sessions = session_manager
        self.store = store
        self.retention = retention
        self.verify_bytes = verify_bytes
        self._verify: set[str] = set()
        self.replies = replies  # the gate's ReplyCache, seeded from each record
        self.identity = identity  # KernelParking.server_identity, resolved
        self.agent = agent  # where this server's kernels run, if at a checkpoint agent
        self.log = log

    async def adopt_all(self) -> AdoptionReport:
        # Verifying images is most of the work: a few at a time, as the CPUs allow.
        slots = asyncio.Semaphore(max(1, min(4, os.cpu_count() or 1)))

        async def adopt(path: Path) -> str | None:
            async with slots:
                return await self._adopt_path(path)

        paths = list_records(self.store)
        self._plan_verification([p.name[: -len(".json")] for p in paths if self._candidate(p)])
        report = AdoptionReport()
        for path, why in zip(paths, await asyncio.gather(*map(adopt, paths)), strict=True):
            kid = path.name[: -len(".json")]
            if why is None:
                report.adopted.append(kid)
            else:
                report.skipped[kid] = why
        return report

    def _candidate(self, path: Path) -> bool:
        """Whether a record looks adoptable, read without its lock, so that the checksum
        budget goes to images this server may adopt (each is checked again, locked)."""
        try:
            record = parse_record(path, path.read_text())
        except (OSError, RecordInvalid):
            return False
        return self._foreign(record) is None and not retention_ended(
            self.retention, self._retention_since(record)
        )

    def _plan_verification(self, kids: list[str]) -> None:
        """Which images get their checksums verified before adoption: the smallest, up to
        verify_bytes in all (this is read before the server answers HTTP); the others
        are size-checked now and verified by their resume, as every resume does."""
        sizes = sorted((self.store.size_of(k), k) for k in kids)
        budget = self.verify_bytes if self.verify_bytes >= 0 else sum(n for n, _ in sizes)
        for size, kid in sizes:
            if size > budget:
                break
            budget -= size
            self._verify.add(kid)
        later = [(n, k) for n, k in sizes if k not in self._verify and n]
        if later:
            self.log.info(
                "jupyter-cedana: %d parked image(s) of %.2f GB over adopt_verify_bytes: "
                "sizes checked now, checksums at their resume",
                len(later),
                sum(n for n, _ in later) / 1e9,
            )

    async def _adopt_path(self, path: Path) -> str | None:
        """Adopt the kernel of one record; None when adopted, else why not (logged)."""
        kid = path.name[: -len(".json")]
        try:
            held, text = HeldRecord.acquire(path)
        except RecordBusy as e:
            return self._skip(kid, f"{e} (a live server owns this kernel)", level="info")
        except FileNotFoundError:
            gone = "its record went away (its kernel was resumed or shut down)"
            return self._skip(kid, gone, "info")
        why: str | None
        try:
            why = await self._adopt_locked(path, kid, text, held)
        except Exception as e:
            why = f"adoption failed: {e}"
            self.log.exception("jupyter-cedana: adopting parked kernel %s failed", kid)
        if why is not None and not (kid in self.mkm and self._owns(kid, held)):
            held.release()
        return why

    def _owns(self, kid: str, held: HeldRecord) -> bool:
        prov = getattr(self.mkm.get_kernel(kid), "provisioner", None)
        return getattr(getattr(prov, "records", None), "held", None) is held

    def _skip(self, kid: str, why: str, level: str = "warning") -> str:
        getattr(self.log, level)("jupyter-cedana: parked kernel %s not adopted: %s", kid, why)
        return why

    async def _adopt_locked(self, path: Path, kid: str, text: str, held: HeldRecord) -> str | None:
        try:
            record = parse_record(path, text)
        except RecordInvalid as e:
            return self._skip(kid, f"{e}; left for 'jupyter cedana gc'")
        why = self._foreign(record)
        if why:
            return self._skip(kid, f"{why}; left in place", level="info")
        if kid in self.mkm:
            return self._skip(kid, "a kernel with this id is already running here")
        if record.get("agent"):
            return await self._adopt_at_agent(path, kid, record, held)
        if retention_ended(self.retention, self._retention_since(record)):
            self.store.remove(kid)
            remove_record(path)
            return self._skip(
                kid,
                f"suspended for longer than SuspendPolicy.retention ({self.retention:.0f} s); "
                "its image and record were removed",
            )
        why = await self._spec_problem(str(record["kernel_name"]))
        if why:
            return self._skip(kid, f"{why}; left for 'jupyter cedana gc'")
        try:
            if self.store.exists(kid):
                portremap.finish(self.store, kid)  # a remap cut short by a crash
            manifest = await self._check_image(kid)
            manifest = free_taken_ports(self.store, kid, record, manifest, held, self.log)
        except NotFound:
            remove_record(path)
            return self._skip(
                kid, "its checkpoint image is missing; the record and its sessions were removed"
            )
        except CheckpointCorrupt as e:
            return self._skip(kid, f"{e.message}; left for 'jupyter cedana gc'")
        await self._start(kid, record, manifest, held)
        return None

    async def _adopt_at_agent(
        self, path: Path, kid: str, record: dict[str, Any], held: HeldRecord
    ) -> str | None:
        """A kernel its server launched at the checkpoint agent: the agent still runs
        it (its server was killed), or holds its image (suspended, or parked)."""
        if self.agent is None:
            return self._skip(
                kid,
                "its kernel is at a checkpoint agent, and this server uses none "
                "(CheckpointAgent.socket); left in place",
            )
        try:
            found = await self.agent.find(kid)
        except EngineUnavailable as e:
            return self._skip(kid, f"{e.message}; left in place for the next start")
        state = (found or {}).get("state")
        if found is None or state == "exited":
            if found is not None:
                await self.agent.kernel(kid).release(timeout=0)
            remove_record(path)
            ended = (
                "the checkpoint agent no longer has its kernel"
                if found is None
                else f"its kernel exited (status {found.get('returncode')}) with no server"
            )
            return self._skip(kid, f"{ended}; the record and its sessions were removed")
        if state == "dumped" and retention_ended(self.retention, suspended_since(record)):
            await self.agent.kernel(kid).discard()
            remove_record(path)
            return self._skip(
                kid,
                f"suspended for longer than SuspendPolicy.retention ({self.retention:.0f} s); "
                "its image at the checkpoint agent and its record were removed",
            )
        if state not in ("running", "dumped"):
            return self._skip(kid, f"the checkpoint agent says it is {state}; left in place")
        why = await self._spec_problem(str(record["kernel_name"]))
        if why:
            return self._skip(kid, f"{why}; left in place")
        if state == "dumped":
            try:
                freed = await self.agent.kernel(kid).free_ports()
            except CedanaError as e:
                return self._skip(kid, f"{e.message}; left in place for the next start")
            follow_port_map(kid, record, held, freed["moved"], freed["port_map"], self.log)
        manifest = {
            "total_bytes": int(found.get("bytes") or 0),
            "created": found.get("created"),
            "agent_pid": found.get("pid") if state == "running" else None,
        }
        await self._start(kid, record, manifest, held)
        return None

    def _retention_since(self, record: dict[str, Any]) -> Stamp | float | None:
        """When the kernel's retention began: its image's making, on the boot clock
        where its manifest says (a wall clock set forward ends nothing), else the
        record's wall-clock time."""
        with contextlib.suppress(CedanaError, OSError, ValueError):
            made = self.store.read_manifest(str(record["kernel_id"])).get("created_clock")
            found = Stamp.from_json(made)
            if found is not None:
                return found
        return suspended_since(record)

    def _foreign(self, record: dict[str, Any]) -> str | None:
        """Why a record belongs to someone else (another uid, Hub user or named server,
        or another server identity: e.g. a server of the same user in another directory)."""
        if record.get("uid") != os.geteuid():
            return f"it was parked by uid {record.get('uid')}, this server runs as {os.geteuid()}"
        user = os.environ.get("JUPYTERHUB_USER") or None
        if (record.get("hub_user") or None) != user:
            return f"it was parked by Hub user {record.get('hub_user')!r}, not {user!r}"
        name = os.environ.get("JUPYTERHUB_SERVER_NAME") or ""
        if (record.get("hub_server_name") or "") != name:
            return f"it belongs to named server {record.get('hub_server_name')!r}, not {name!r}"
        # Records written before identities were recorded have none: any server adopts them.
        theirs = record.get("identity")
        if "identity" in record and theirs != self.identity:
            return (
                f"it belongs to the server with identity {theirs!r}, not this one "
                f"({self.identity!r}; KernelParking.server_identity, by default the root_dir)"
            )
        return None

    async def _spec_problem(self, name: str) -> str | None:
        try:
            spec = await ensure_async(self.mkm.kernel_spec_manager.get_kernel_spec(name))
        except NoSuchKernel:
            return f"its kernelspec {name!r} is gone"
        configured = (spec.metadata or {}).get("kernel_provisioner", {}).get("provisioner_name")
        provisioner = configured or KernelProvisionerFactory.instance().default_provisioner_name
        if provisioner != PROVISIONER:
            return f"kernelspec {name!r} now uses provisioner {provisioner!r}, not {PROVISIONER}"
        return None

    async def _check_image(self, kid: str) -> dict[str, Any]:
        if not self.store.exists(kid):
            raise NotFound(f"No checkpoint for kernel {kid}")
        if kid in self._verify:
            return await asyncio.to_thread(self.store.verify, kid)
        return self.store.check_sizes(kid)

    async def _start(
        self, kid: str, record: dict[str, Any], manifest: dict[str, Any], held: HeldRecord
    ) -> None:
        kwargs: dict[str, Any] = {}
        cwd = record.get("cwd")
        if cwd and os.path.isdir(cwd):
            kwargs["cwd"] = cwd  # kept for a later restart of the kernel
        sessions = [s for s in record.get("sessions") or [] if s.get("id") and s.get("path")]
        if sessions and hasattr(self.sessions, "get_kernel_env"):
            kwargs["env"] = self.sessions.get_kernel_env(sessions[0]["path"])
        plan = _PLANS[kid] = _Plan(record, manifest, held)
        try:
            await self.mkm.start_kernel(
                kernel_id=kid, kernel_name=str(record["kernel_name"]), **kwargs
            )
        finally:
            _PLANS.pop(kid, None)
        if not plan.claimed:
            # Never a fresh kernel under a parked kernel's id: the user would take it for theirs.
            await self.mkm.shutdown_kernel(kid, now=True)
            raise RuntimeError("its kernel was launched, not adopted, by the provisioner")
        kernel = self.mkm.get_kernel(kid)
        # Adoption is not activity: idle time and culling go on from the parked values.
        last = _parse_time(record.get("last_activity"))
        if last is not None:
            kernel.last_activity = last
        state = record.get("execution_state")
        kernel.execution_state = state if state in ("idle", "busy") else "idle"
        # Clients reconnecting to it are answered from what it said before its server stopped.
        saved = record.get("replies")
        if self.replies is not None and saved is not None and not self.replies.seed(kid, saved):
            self.log.warning(
                "jupyter-cedana: parked kernel %s: its saved replies are unusable", kid
            )
        restored = await self._restore_sessions(kid, sessions)
        held_as = (
            "running at the checkpoint agent"
            if manifest.get("agent_pid")
            else f"suspended, {int(manifest.get('total_bytes') or 0) / 1e6:.1f} MB image"
        )
        self.log.info(  # bench/chaos.py watches for "adopted parked kernel"
            "jupyter-cedana: adopted parked kernel %s (%s, left by server pid %s): %s; "
            "sessions: %s",
            kid,
            record["kernel_name"],
            record.get("server_pid"),
            held_as,
            ", ".join(restored) or "none",
        )

    async def _restore_sessions(self, kid: str, sessions: list[dict[str, Any]]) -> list[str]:
        """Put the kernel's sessions back under their old ids, so that JupyterLab finds each
        notebook's kernel by path."""
        if self.sessions is None:
            return []
        restored = []
        for s in sessions:
            try:
                await self.sessions.get_session(session_id=s["id"])
                continue  # a persistent session database kept it
            except web.HTTPError:
                pass
            await self.sessions.save_session(
                s["id"], path=s["path"], name=s.get("name"), type=s.get("type"), kernel_id=kid
            )
            restored.append(str(s["path"]))
        return restored


def _parse_time(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)
