"""The agent's CRIU: the one way the checkpoint agent runs CRIU, as root, for callers who
are not.

CRIU treats its command line, its environment, its configuration files, its plugin
directory and its images as trusted input: `--libdir` and `CRIU_LIBS_DIR` make it
`dlopen` every `*.so` there, `CRIU_CONFIG_FILE` is read even with `--no-default-config`,
`~/.criu/default.conf` and `/etc/criu/default.conf` add options, and `LD_PRELOAD` /
`LD_LIBRARY_PATH` load code into it before `main`. Run as root, any of them is root for
whoever controls it. So the agent's CRIU gets:

- an argument list built here and in the engine from typed values only (a pid the agent
  found in its own records, directories of its own store), never a string from a request;
  `CheckpointEngine.extra_dump_args` / `extra_restore_args` must stay empty;
- `--no-default-config`, and `--libdir` naming the agent's own plugin directory;
- an environment of exactly `FIXED_ENV` (no CRIU_*, no LD_*, HOME the agent's state);
- binaries, plugin directory and state directory that no user but root can change: each
  of them and every directory above them is owned by root and not writable by group or
  others (a root-owned sticky directory such as /tmp is allowed above them: nobody else
  can rename or remove what root owns in it). Anything else makes the agent refuse to run
  CRIU at all.

CRIU running as root keeps its kernel-feature cache in /run/criu.kdat, a path compiled
into it (`--unprivileged` would move it to `$XDG_RUNTIME_DIR`, which the agent never
uses); the agent refuses a cache file there that root does not own.

A dump of a non-root caller's kernel runs CRIU with that caller's real uid and gid and
root's effective ids (all capabilities kept), through setpriv: the kernel lets a process
read the resource limits (prlimit) of a task whose ids all equal its real ids without
CAP_SYS_RESOURCE, which root lacks in some containers, and every task of the dumped tree
is the caller's (cedana-init --user). Such a CRIU needs its kernel-feature cache (its
nftables probe fails under that real uid), which CRIU saves only on a tmpfs: the agent
writes a fresh one at every start (install_kdat_cache).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traitlets import TraitError, validate
from traitlets.config import Config

from ..checkpoint.engine import MIN_CRIU, CheckpointEngine, EngineInfo
from ..errors import EngineUnavailable
from ..package_files import BIN_DIR, NO_PLUGINS_DIR

FIXED_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KDAT = "/run/criu.kdat"
PACKAGE_PLUGIN_DIR = NO_PLUGINS_DIR


# Run by the agent's own interpreter (-I -S: no user site, no PYTHON* variables) in a
# child: argv criu_path, plugin_dir, the descriptor to write the cache to.
_KDAT_SCRIPT = """
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
def ok(rc, what):
    if rc != 0:
        sys.exit(what + ": " + os.strerror(ctypes.get_errno()))
ok(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
ok(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None), "make mounts private")
ok(libc.mount(b"none", b"/run", b"tmpfs", 2 | 4 | 8, b"mode=0700"), "tmpfs on /run")
r = subprocess.run([sys.argv[1], "--no-default-config", "--libdir", sys.argv[2], "check"],
                   cwd="/", stdin=subprocess.DEVNULL, capture_output=True)
try:
    data = open("/run/criu.kdat", "rb").read()
except OSError as e:
    sys.exit("criu check left no cache (%s): %s" % (e, (r.stdout + r.stderr)[-300:]))
out = int(sys.argv[3])
while data:
    data = data[os.write(out, data):]
"""


class UnsafeSetup(EngineUnavailable):
    """A file the agent's CRIU depends on could be changed by someone other than root."""

    code = "unsafe_setup"


def fixed_env(state_dir: str) -> dict[str, str]:
    """The whole environment of every CRIU the agent runs."""
    return {"PATH": FIXED_PATH, "HOME": state_dir, "LANG": "C", "LC_ALL": "C"}


def check_root_only(path: str | os.PathLike[str], what: str, *, is_dir: bool | None = None) -> str:
    """Raise UnsafeSetup unless `path` (symbolic links resolved) and every directory above
    it are owned by root and not writable by group or others; returns the resolved path.
    A root-owned sticky directory above it is allowed (its other entries are not ours)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        raise UnsafeSetup(f"The agent's {what} {path} is not usable: {e.strerror}") from e
    if is_dir is not None and stat.S_ISDIR(st.st_mode) != is_dir:
        kind = "a directory" if is_dir else "a regular file"
        raise UnsafeSetup(f"The agent's {what} {real} is not {kind}")
    _refuse_unless_root_only(real, st, what, ancestor=False)
    parent = os.path.dirname(real)
    while True:
        _refuse_unless_root_only(parent, os.stat(parent), what, ancestor=True)
        if parent == "/":
            return real
        parent = os.path.dirname(parent)


def _refuse_unless_root_only(path: str, st: os.stat_result, what: str, ancestor: bool) -> None:
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if ancestor and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        writable = 0
    if st.st_uid != 0 or writable:
        where = f"{path}, a directory above it," if ancestor else path
        raise UnsafeSetup(
            f"The agent refuses to run CRIU: its {what} is at {where} which is "
            f"{'owned by uid ' + str(st.st_uid) if st.st_uid else 'writable by group or others'}"
            f" (mode {stat.S_IMODE(st.st_mode):o}); anyone who can change it can run code "
            "as root"
        )


@dataclass(frozen=True)
class CriuSettings:
    """What the agent's administrator chooses (root's configuration, never a request)."""

    state_dir: str  # the agent's own directory: image store, CRIU's HOME
    criu_path: str = "/usr/local/sbin/criu"
    plugin_dir: str = str(PACKAGE_PLUGIN_DIR)
    init_path: str = str(BIN_DIR / "cedana-init")
    pages_path: str = str(BIN_DIR / "cedana-pages")
    setpriv_path: str = "/usr/bin/setpriv"
    dump_timeout: float = 600.0
    restore_timeout: float = 600.0
    lazy_restore: bool = True
    # The GPU (gpu_ops.py): the driver libraries' directory (None: the system's), the
    # helper the agent runs as root, and CudaCheckpointer's limits.
    cuda_library: str | None = None
    cuda_helper: str = str(BIN_DIR / "cedana-cuda")
    cuda_lock_timeout_ms: int = 10_000
    cuda_host_headroom_bytes: int = 1 << 30
    # Chains folded in the background past these (compaction_ops.py; 0 and 0: never).
    compact_chain_ratio: float = 1.1
    compact_chain_deltas: int = 8


CONFIG_NAME = "checkpoint.json"


def load_settings(state_dir: Path, default_quota: int) -> tuple[CriuSettings, int]:
    """The administrator's settings: `<state>/checkpoint.json` (root's, like the state
    directory), keys criu_path, plugin_dir, quota_bytes, dump_timeout, cuda_library,
    cuda_lock_timeout_ms, cuda_host_headroom_bytes, compact_chain_ratio,
    compact_chain_deltas; defaults otherwise."""
    path = state_dir / CONFIG_NAME
    data: dict[str, Any] = {}
    if path.exists():
        st = os.lstat(path)
        if st.st_uid != 0 or st.st_mode & 0o022 or not path.is_file():
            raise UnsafeSetup(f"{path} must be a regular file root alone can write")
        data = json.loads(path.read_text())
    d = CriuSettings(state_dir=str(state_dir))
    library = data.get("cuda_library")
    settings = CriuSettings(
        state_dir=str(state_dir),
        criu_path=str(data.get("criu_path", d.criu_path)),
        plugin_dir=str(data.get("plugin_dir", d.plugin_dir)),
        dump_timeout=float(data.get("dump_timeout", d.dump_timeout)),
        cuda_library=str(library) if library else None,
        cuda_lock_timeout_ms=int(data.get("cuda_lock_timeout_ms", d.cuda_lock_timeout_ms)),
        cuda_host_headroom_bytes=int(
            data.get("cuda_host_headroom_bytes", d.cuda_host_headroom_bytes)
        ),
        compact_chain_ratio=float(data.get("compact_chain_ratio", d.compact_chain_ratio)),
        compact_chain_deltas=int(data.get("compact_chain_deltas", d.compact_chain_deltas)),
    )
    return settings, int(data.get("quota_bytes", default_quota))


class AgentEngine(CheckpointEngine):
    """The checkpoint engine as the agent runs it: the same dump and restore code as a
    root server's, with the fixed CRIU invocation of this module. Built from
    CriuSettings only: no Jupyter configuration file is read."""

    @validate("extra_dump_args", "extra_restore_args")
    def _no_extra_args(self, proposal: Any) -> list[str]:
        if proposal["value"]:
            raise TraitError("the agent's CRIU takes no extra arguments")
        return []

    def __init__(self, settings: CriuSettings) -> None:
        super().__init__(
            config=Config(),
            checkpoint_root=os.path.join(settings.state_dir, "images"),
            criu_path=settings.criu_path,
            criu_plugin_dir=settings.plugin_dir,
            init_path=settings.init_path,
            pages_path=settings.pages_path,
            use_pid_namespace=True,
            # The kernel is the agent's child and must outlive its server; the agent
            # decides when it ends.
            kernels_die_with_server=False,
            # The agent's own GPU steps (gpu_ops.py) wrap the dump and the restore.
            gpu=False,
            dump_timeout=settings.dump_timeout,
            restore_timeout=settings.restore_timeout,
            lazy_restore=settings.lazy_restore,
        )
        self.settings = settings
        self._env = fixed_env(settings.state_dir)

    def check_setup(self) -> None:
        """Refuse (UnsafeSetup) unless everything the agent's CRIU runs or reads is root's."""
        s = self.settings
        check_root_only(s.state_dir, "state directory", is_dir=True)
        if stat.S_IMODE(os.stat(s.state_dir).st_mode) & 0o077:
            raise UnsafeSetup(f"The agent's state directory {s.state_dir} must be mode 0700")
        self._check_criu()

    def _check_criu(self) -> None:
        s = self.settings
        check_root_only(s.criu_path, "criu binary", is_dir=False)
        check_root_only(s.init_path, "cedana-init binary", is_dir=False)
        check_root_only(s.pages_path, "cedana-pages binary", is_dir=False)
        check_root_only(s.setpriv_path, "setpriv binary", is_dir=False)
        plugins = check_root_only(s.plugin_dir, "CRIU plugin directory", is_dir=True)
        for entry in sorted(os.listdir(plugins)):
            if entry.endswith(".so"):
                check_root_only(os.path.join(plugins, entry), "CRIU plugin", is_dir=False)
        conflict = self._plugin_conflict()
        if conflict is not None:
            raise UnsafeSetup(conflict)
        if os.path.lexists(KDAT):
            check_root_only(KDAT, "CRIU kernel-feature cache", is_dir=False)

    # The engine's hooks, fixed.

    def criu_env(self) -> dict[str, str]:
        return dict(self._env)

    def criu_cache_problem(self) -> str | None:
        return None

    def base_args(self, info: EngineInfo) -> list[str]:
        return [info.criu_path or self.settings.criu_path, "--no-default-config"]

    def dump_command_prefix(self, owner: tuple[int, int] | None) -> list[str]:
        """A user's tree is dumped by a CRIU whose real uid and gid are the user's
        (effective ids root's, capabilities kept); see the module's docstring. The user
        may signal that CRIU (kill(2) compares real uids), which can only fail their own
        dump: the dump's timeout ends a stopped one, and its tree is continued."""
        if owner is None or owner[0] == 0:
            return []
        uid, gid = owner
        return [
            self.settings.setpriv_path,
            f"--ruid={uid}",
            f"--rgid={gid}",
            "--clear-groups",
            "--",
        ]

    def ensure_kdat_cache(self) -> None:
        """Write the cache if it is missing (removed since the agent started)."""
        if not os.path.lexists(KDAT):
            self.install_kdat_cache()

    def install_kdat_cache(self) -> None:
        """Write a fresh kernel-feature cache to /run/criu.kdat (root's, 0600), made by
        `criu check` in a private mount namespace with a tmpfs on /run (CRIU saves its
        cache on a tmpfs only), then renamed into place. CRIU loads any cache it finds
        without checking that it is still this kernel's; written at every start of the
        agent, it is. Made before the state directory exists: it needs only CRIU."""
        self._check_criu()
        run = check_root_only(os.path.dirname(KDAT), "cache directory", is_dir=True)
        fd, tmp = tempfile.mkstemp(dir=run, prefix=".criu.kdat.agent.")
        try:
            out = subprocess.run(
                [
                    sys.executable,
                    *("-I", "-S", "-c", _KDAT_SCRIPT),
                    *(self.settings.criu_path, self.settings.plugin_dir, str(fd)),
                ],
                pass_fds=(fd,),
                capture_output=True,
                text=True,
                timeout=120,
                env=self.criu_env(),
                cwd="/",
            )
            if out.returncode != 0:
                raise EngineUnavailable(
                    f"cannot make CRIU's kernel-feature cache: {(out.stderr or out.stdout)[-300:]}"
                )
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, KDAT)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            os.unlink(tmp)
            raise

    def probe(self, refresh: bool = False) -> EngineInfo:
        if self._info is not None and not refresh:
            return self._info
        info = EngineInfo(False, None, None, None, True)
        try:
            self.check_setup()
            out = subprocess.run(
                [self.settings.criu_path, "--no-default-config", "--version"],
                capture_output=True,
                text=True,
                timeout=30,
                env=self.criu_env(),
                cwd="/",
            ).stdout
        except (OSError, subprocess.SubprocessError, EngineUnavailable) as e:
            info.reason = str(e)
            self._info = info
            return info
        m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
        if not m:
            info.reason = f"cannot read the version of {self.settings.criu_path}"
        elif (int(m.group(1)), int(m.group(2))) < MIN_CRIU:
            info.reason = f"{self.settings.criu_path} is older than CRIU 4.2"
        else:
            version = ".".join(g for g in m.groups() if g is not None)
            info = EngineInfo(True, None, self.settings.criu_path, version, True)
        self._info = info
        return info

    def require(self) -> EngineInfo:
        # Checked on every run, not once: a binary or directory may be changed later.
        self.check_setup()
        return super().require()

    def lazy_unsupported(self) -> str | None:
        if not self.lazy_restore:
            return "lazy restore is off"
        with self._lazy_lock:
            if not self._lazy_probed:
                info = self.require()
                if not os.access(self.pages_binary(), os.X_OK):
                    return f"{self.pages_binary()} is missing"
                try:
                    out = subprocess.run(
                        [*self.base_args(info), "check", "--feature", "uffd-noncoop"],
                        capture_output=True,
                        text=True,
                        timeout=30,
                        env=self.criu_env(),
                        cwd="/",
                    )
                except (OSError, subprocess.SubprocessError) as e:
                    return f"criu check failed: {e}"
                text = (out.stdout + out.stderr).strip()
                if out.returncode != 0 or "is supported" not in text:
                    self._lazy_reason = f"CRIU says userfaultfd is not usable: {text[-200:]}"
                self._lazy_probed = True
        return self._lazy_reason
