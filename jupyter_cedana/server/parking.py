"""Park on stop, adopt on start: kernels outlive their server.

Every kernel suspended to disk has a record (parkrecords.py: what adoption needs) from
before its image is committed until it is resumed or shut down, so suspended kernels
survive any end of their server, SIGKILL and reboots included. When the server stops
politely (SIGTERM, SIGINT with or without a terminal, /api/shutdown, a JupyterHub stop or
cull), every other kernel under cedana-provisioner is checkpointed to disk too, instead
of killed (kernel_parker.py, a few kernels at a time): running kernels are dumped (their
disk reserved in the checkpoint budget as the policy's suspends do), GPU-offloaded ones
go to disk, suspended ones keep their image and get their record brought up to date
(sessions, replies). Then the kernel is detached from the server, so the normal kernel
shutdown neither kills anything nor deletes its image. A kernel that cannot be parked
within the deadline is shut down as before, with the reason in the log; a committed image
is never deleted because its record could not be written.

The next server on the same checkpoint root, with the same identity (by default the same
root_dir), adopts every valid record before it serves requests (adoption.py): the kernel
is listed under its old id, suspended, with its sessions, and the next message resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from typing import Any

from traitlets import Any as AnyTrait
from traitlets import Bool, Float, Integer, Unicode
from traitlets.config import LoggingConfigurable

from ..checkpoint.parkrecords import ParkingLock, set_server_facts, wait_for_parkers
from ..errors import CedanaError
from .adoption import PROVISIONER, Adopter
from .kernel.checkpoint_agent import agent_for
from .kernel.provisioner import CedanaProvisioner, KernelState
from .kernel_parker import GIVEN_BACK, IMAGE_KEPT, KernelParker

__all__ = ["KernelParking"]


class KernelParking(LoggingConfigurable):
    """Checkpoint every kernel when the server stops; adopt them when it starts again."""

    park_on_stop = Bool(
        True,
        help="When the server stops, checkpoint its kernels to disk (running ones are "
        "dumped, GPU-offloaded ones go to disk, suspended ones keep their image) instead "
        "of killing them; the next server on the same checkpoint root adopts them.",
    ).tag(config=True)

    deadline = Float(
        20.0,
        help="Seconds parking may take when the server stops; a kernel not parked by then "
        "is shut down as without parking (the log says which and why). The whole stop "
        "must end before the spawner kills the server: JupyterHub's LocalProcessSpawner "
        "sends SIGTERM 30 s after SIGINT (interrupt_timeout; jupyter-cedana ignores that "
        "second signal while it stops) and SIGKILL 30 s later (term_timeout); systemd "
        "waits TimeoutStopSec (90 s) and needs KillMode=mixed, as the default "
        "control-group kills the kernels at once; Docker kills 10 s after SIGTERM and "
        "KubeSpawner after delete_grace_period (1 s): raise those to at least this "
        "deadline plus 10 s.",
    ).tag(config=True)

    concurrency = Integer(
        2,
        help="Kernels parked at the same time (their dumps run together), smallest first, "
        "so that as many as possible make the deadline. The dumps share the disk, which "
        "limits what more at once gains; 2 also overlaps one kernel's dump with the image "
        "fsync and record of another.",
    ).tag(config=True)

    adopt_on_start = Bool(
        True,
        help="On start, before serving requests, adopt the kernels that an earlier server "
        "of the same uid, JupyterHub user and server name, and server_identity left "
        "suspended in the checkpoint root (parked when it stopped, or suspended when it "
        "was killed): they are listed under their old ids, suspended, with their sessions.",
    ).tag(config=True)

    adopt_verify_bytes = Integer(
        2 << 30,
        help="Bytes of parked images whose checksums are verified before adoption, the "
        "smallest images first. Everything verified here is read before the server "
        "answers HTTP, which counts against JupyterHub's Spawner.http_timeout (30 s); a "
        "loaded disk read 10 GB in 30-57 s in the benchmark. Larger images get their "
        "sizes checked and their checksums verified by their resume, as every resume "
        "does (a damaged one then fails it: state failed, image kept). -1: no limit.",
    ).tag(config=True)

    server_identity = Unicode(
        "",
        help="What a kernel's record says of the server that suspended or parked it; a "
        "starting server adopts only the kernels recorded with its own identity (and its "
        "uid, JupyterHub user and server name), and logs why it leaves the others. Empty: "
        "the server's root_dir, so that a server of the same user started in another "
        "directory, sharing the default checkpoint root, does not take this one's kernels. "
        "Set the same value on servers that should adopt each other's kernels from "
        "different directories.",
    ).tag(config=True)

    wait_for_parking = Float(
        30.0,
        help="Seconds a starting server waits for another server that is still parking "
        "kernels into the same checkpoint root; after that it adopts what is parked so "
        "far, and the rest at its next start.",
    ).tag(config=True)

    manager = AnyTrait(help="The SuspendManager of the server.")
    replies = AnyTrait(
        None,
        allow_none=True,
        help="The message gate's ReplyCache (None without transparent resume): what it "
        "knows of a kernel is parked with it, so that an adopted kernel answers its "
        "clients' reconnects without being resumed.",
    )

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._adoption: asyncio.Task[None] | None = None
        self.identity: str | None = self.server_identity or None
        set_server_facts(self._server_facts)

    @property
    def _mkm(self) -> Any:
        return self.manager.kernel_manager

    @property
    def _store(self) -> Any:
        return self.manager.engine.store

    # -- server hooks ---------------------------------------------------------------------

    def install(self, serverapp: Any) -> None:
        """Take over the stop signals and hold the HTTP server back until adoption is done."""
        self._serverapp = serverapp
        if not self.server_identity:
            root = getattr(serverapp, "root_dir", None)
            self.identity = os.path.realpath(os.path.expanduser(root)) if root else None
        self._install_stop_signals(serverapp)
        self._watch_sessions(getattr(serverapp, "session_manager", None))
        bind = getattr(serverapp, "_bind_http_server", None)
        if bind is not None and self.adopt_on_start:

            async def bind_after_adoption() -> None:
                await self.adopt()
                bind()

            # ServerApp.init_httpserver (after the extensions load) schedules the bind.
            serverapp._bind_http_server = bind_after_adoption

    def _install_stop_signals(self, serverapp: Any) -> None:
        """SIGTERM and SIGINT stop the server once, through the normal stop (extensions
        first, then kernels); a repeated signal does not interrupt parking. Without a
        terminal jupyter_server leaves SIGINT to Python, which ends the loop with no
        cleanup at all: JupyterHub's LocalProcessSpawner stops servers with it."""
        # Only where jupyter_server installed its own handlers (test harnesses do not).
        if signal.getsignal(signal.SIGTERM) != serverapp._signal_stop:
            return
        normal_stop = serverapp._signal_stop
        log = self.log

        def stop_once(sig: int, frame: Any) -> None:
            if getattr(serverapp, "_stopping", False):
                log.warning(
                    "jupyter-cedana: received signal %s while the server is stopping "
                    "(parking its kernels): ignored",
                    sig,
                )
                return
            normal_stop(sig, frame)

        # jupyter_server's interactive ^C handler re-installs self._signal_stop.
        serverapp._signal_stop = stop_once
        signal.signal(signal.SIGTERM, stop_once)
        sigint = signal.getsignal(signal.SIGINT)
        if sigint is signal.default_int_handler:
            signal.signal(signal.SIGINT, stop_once)
        elif sigint == signal.SIG_IGN:
            # Inherited (e.g. a non-interactive shell's `cmd &`): the parent asked for
            # SIGINT to be ignored, so it is, and only SIGTERM stops the server.
            log.info(
                "jupyter-cedana: SIGINT is ignored by this server (inherited from its "
                "parent); SIGTERM stops it and parks its kernels"
            )

    def _watch_sessions(self, sm: Any) -> None:
        """A suspended kernel's record follows its sessions (a notebook renamed or opened
        on it while it is suspended), so that a server started after a crash puts each
        notebook back on its kernel."""
        if sm is None:
            return
        save, update, delete = sm.save_session, sm.update_session, sm.delete_session

        async def kernel_of(session_id: Any) -> str | None:
            try:
                model = await sm.get_session(session_id=session_id)
            except Exception:
                return None
            return (model.get("kernel") or {}).get("id")

        async def save_session(session_id: Any, *args: Any, **kwargs: Any) -> Any:
            model = await save(session_id, *args, **kwargs)
            await self._sessions_changed((model.get("kernel") or {}).get("id"))
            return model

        async def update_session(session_id: Any, **kwargs: Any) -> Any:
            before = await kernel_of(session_id)
            result = await update(session_id, **kwargs)
            for kid in {before, await kernel_of(session_id)}:
                await self._sessions_changed(kid)
            return result

        async def delete_session(session_id: Any) -> Any:
            before = await kernel_of(session_id)
            result = await delete(session_id)
            await self._sessions_changed(before)
            return result

        sm.save_session = save_session
        sm.update_session = update_session
        sm.delete_session = delete_session

    async def _sessions_changed(self, kid: str | None) -> None:
        adopting = self._adoption is None or not self._adoption.done()
        if kid is None or (self.adopt_on_start and adopting) or kid not in self._mkm:
            return  # adoption puts back the sessions its records hold; a kernel shut down
        # jupyter_server's get_kernel raises 404, not KeyError, for a kernel gone.
        prov = getattr(self._mkm.get_kernel(kid), "provisioner", None)
        if isinstance(prov, CedanaProvisioner):
            # Before the session's change is answered: the record says what the client
            # was told.
            await self._refresh_record(kid, prov)

    async def _refresh_record(self, kid: str, prov: CedanaProvisioner) -> None:
        if prov.remote is not None:
            # A kernel at the agent has its record running too (sessions included).
            await prov.write_agent_record()
            return
        if prov.records.held is None or prov.state not in (
            KernelState.suspended,
            KernelState.failed,
        ):
            return  # e.g. running while a lazy restore's pages come in
        try:
            record = await prov.record()
            # On the event loop, not in a thread: no resume (which drops the record) or
            # suspend (which writes it) can run in between; the file is small.
            at_rest = prov.state in (KernelState.suspended, KernelState.failed)
            if prov.records.held is not None and at_rest and prov.transition_in_flight is None:
                prov.records.hold(record)
        except Exception as e:
            self.log.warning(
                "jupyter-cedana: kernel %s: its record could not be updated with its sessions: %s",
                kid,
                e,
            )

    # -- adopt on start -------------------------------------------------------------------

    async def adopt(self) -> None:
        """Adopt the parked kernels (once; later calls wait for the first)."""
        if not self.adopt_on_start:
            return
        if self._adoption is None:
            self._adoption = asyncio.ensure_future(self._adopt())
        await asyncio.shield(self._adoption)

    async def _adopt(self) -> None:
        store = self._store
        try:
            busy = await wait_for_parkers(store, self.wait_for_parking, self.log)
            if busy:
                self.log.warning(
                    "jupyter-cedana: server(s) %s still parking kernels after %.0f s; "
                    "adopting the kernels parked so far, the rest at the next start",
                    ", ".join(map(str, busy)),
                    self.wait_for_parking,
                )
            adopter = Adopter(
                kernel_manager=self._mkm,
                session_manager=getattr(self._serverapp_or_none(), "session_manager", None),
                store=store,
                retention=self.manager.policy.retention,
                verify_bytes=self.adopt_verify_bytes,
                replies=self.replies,
                identity=self.identity,
                log=self.log,
                agent=agent_for(self.parent),
            )
            report = await adopter.adopt_all()
        except Exception:
            self.log.exception("jupyter-cedana: adopting parked kernels failed")
            return
        if report.adopted or report.skipped:
            self.log.info(
                "jupyter-cedana: adopted %d kernel(s), %d not adopted%s",
                len(report.adopted),
                len(report.skipped),
                "".join(f"\n  {kid}: {why}" for kid, why in sorted(report.skipped.items())),
            )

    def _serverapp_or_none(self) -> Any:
        return getattr(self, "_serverapp", None)

    # -- park on stop ---------------------------------------------------------------------

    async def park_all(self) -> dict[str, str]:
        """Park every kernel of this server within the deadline; returns, per kernel,
        "parked" or why not. Kernels not parked stay for the normal shutdown."""
        if not self.park_on_stop:
            return {}
        if self._adoption is not None and not self._adoption.done():
            self._adoption.cancel()
            with contextlib.suppress(BaseException):
                await self._adoption
        candidates = []
        outcome: dict[str, str] = {}
        for kid in list(self._mkm.list_kernel_ids()):
            with contextlib.suppress(KeyError):
                km = self._mkm.get_kernel(kid)
                prov = getattr(km, "provisioner", None)
                if isinstance(prov, CedanaProvisioner):
                    candidates.append((kid, km, prov))
                else:
                    outcome[kid] = f"not started by {PROVISIONER}"
        if not candidates:
            return outcome
        t0 = time.monotonic()
        self.log.info(
            "jupyter-cedana: parking %d kernel(s) (deadline %.0f s)", len(candidates), self.deadline
        )
        lock = ParkingLock(self._store)
        parker = KernelParker(self.manager, self.log)
        try:
            candidates.sort(key=lambda c: parker.dump_cost(c[0], c[2]))
            slots = asyncio.Semaphore(max(1, self.concurrency))
            recording: set[str] = set()
            tasks = {
                kid: asyncio.ensure_future(parker.park(kid, km, prov, slots, recording))
                for kid, km, prov in candidates
            }
            await asyncio.wait(tasks.values(), timeout=self.deadline)
            for kid, task in tasks.items():
                # A kernel whose image is on disk (its process is gone) finishes; the
                # others stop where they are: a cancelled dump leaves the kernel running.
                if not task.done() and kid not in recording:
                    task.cancel()
            late = f"not parked within the deadline of {self.deadline:.0f} s"
            for kid, task in tasks.items():
                try:
                    outcome[kid] = await task
                except asyncio.CancelledError:
                    km, prov = next((k, p) for i, k, p in candidates if i == kid)
                    outcome[kid] = await parker.give_back(kid, km, prov, late) or late
                except CedanaError as e:
                    outcome[kid] = e.message
                except Exception as e:
                    outcome[kid] = f"{type(e).__name__}: {e}"
        finally:
            lock.release()
        for kid, what in outcome.items():
            if what not in ("parked", IMAGE_KEPT) and not what.startswith(GIVEN_BACK):
                # A suspend's refusal says the kernel keeps running: at stop it does not.
                what = _RUNS_ON.sub("", what).rstrip(" .;,")
                self.log.warning(
                    "jupyter-cedana: kernel %s not parked (%s): it is shut down with the "
                    "server, and what it held in memory is lost",
                    kid,
                    what,
                )
                outcome[kid] = what
        self.log.info(
            "jupyter-cedana: parked %d of %d kernel(s) in %.2f s",
            sum(1 for w in outcome.values() if w == "parked" or w.startswith(GIVEN_BACK)),
            len(outcome),
            time.monotonic() - t0,
        )
        return outcome

    async def _server_facts(self, kid: str) -> dict[str, Any]:
        """This server's part of a kernel's record (parkrecords.server_facts)."""
        return {
            "identity": self.identity,
            "sessions": await self._sessions_of(kid),
            # What the kernel answered (kernel_info, comms): not secret, kept for its clients.
            "replies": self.replies.saved(kid) if self.replies is not None else None,
        }

    async def _sessions_of(self, kid: str) -> list[dict[str, Any]]:
        sm = getattr(self._serverapp_or_none(), "session_manager", None)
        if sm is None:
            return []
        try:
            models = await sm.list_sessions()
        except Exception:
            self.log.exception("jupyter-cedana: could not list sessions to record with kernels")
            return []
        return [
            {k: m.get(k) for k in ("id", "path", "name", "type")}
            for m in models
            if (m.get("kernel") or {}).get("id") == kid
        ]


_RUNS_ON = re.compile(r"[;,]? (and )?the kernel keeps running|\(the kernel keeps running\)")
