#!/usr/bin/env bash
# Installs the wheel that scripts/build-wheel.sh left in dist/ into a fresh virtualenv and
# checks it from that virtualenv alone, as an administrator's image would use it:
#   - jupyter_cedana imports from the new virtualenv, not from this checkout;
#   - `jupyter server extension list` shows jupyter_cedana enabled, and
#     `jupyter labextension list` shows jupyter-cedana enabled (the wheel's shared data);
#   - the native helpers are inside the installed package, executable, and run here;
#   - the `jupyter-cedana` command runs;
#   - a `jupyter server` started from it (own port, token, root and Jupyter directories)
#     refuses the extension's REST API without the token, answers it with the token, and
#     suspends a kernel started through the REST API; a cell sent over the kernel's
#     websocket then resumes it with its state.
# Dependencies come from the package index, through pip's usual cache. Exits non-zero with a
# message on the first failure; removes the server and every temp file in any case.
# Needs checkpointing to work here (CRIU >= 4.2, as root).
# Usage: scripts/check-wheel.sh [WHEEL]   (default: the manylinux wheel in dist/)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

say() { printf '[check-wheel] %3ss %s\n' "$SECONDS" "$*"; }
fail() { printf '[check-wheel] FAILED: %s\n' "$*" >&2; exit 1; }

if [ $# -ge 1 ]; then
  wheel=$(realpath "$1")
else
  wheels=("$ROOT"/dist/jupyter_cedana-*-manylinux_*.whl)
  [ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] \
    || fail "expected one manylinux wheel in dist/ (run scripts/build-wheel.sh), got: ${wheels[*]}"
  wheel=${wheels[0]}
fi
[ -f "$wheel" ] || fail "no wheel at $wheel"

work=$(mktemp -d -t cedana-check-wheel.XXXXXX)
# The virtualenv (about 200 MB in 15,000 files) on a tmpfs when there is a usable one:
# removing it from a disk can take longer than the whole check.
vbase=$work
if [ -d /dev/shm ] && [ -w /dev/shm ] && ! findmnt -no OPTIONS /dev/shm | grep -qw noexec \
  && [ "$(df -Pk /dev/shm | awk 'NR == 2 { print $4 }')" -gt $((1024 * 1024)) ]; then
  vbase=$(mktemp -d -p /dev/shm cedana-check-wheel.XXXXXX)
fi
trap 'rm -rf "$work" "$vbase"' EXIT
V=$vbase/venv
mkdir -p "$work/home" "$work/root" "$work/config" "$work/data" "$work/runtime"

# Everything below runs in the temp directory (an import from the current directory would
# find this checkout's package) with an environment that names only the new virtualenv:
# no VIRTUAL_ENV, PYTHONPATH or JUPYTER_* from the caller, own Jupyter config/data/runtime
# directories, and a PATH without this checkout's .venv.
in_venv() {
  (cd "$work" && env -i \
    HOME="$work/home" LANG=C.UTF-8 \
    PATH="$V/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    JUPYTER_CONFIG_DIR="$work/config" JUPYTER_DATA_DIR="$work/data" \
    JUPYTER_RUNTIME_DIR="$work/runtime" IPYTHONDIR="$work/ipython" \
    "$@")
}
# What `jupyter ... list` prints, without its colours.
plain() { in_venv "$@" 2>&1 | sed 's/\x1b\[[0-9;]*m//g'; }

PY=${PYTHON:-python3}
say "installing $(basename "$wheel") into a fresh virtualenv ($($PY --version))"
"$PY" -m venv "$V" || fail "$PY -m venv"
# [lab]: `jupyter labextension list` is JupyterLab's. --no-compile: the check needs no .pyc.
(cd "$work" && env -u VIRTUAL_ENV -u PYTHONPATH -u PIP_USER "$V/bin/python" -m pip install \
  --no-compile "$wheel[lab]" >"$work/pip.log" 2>&1) \
  || { cat "$work/pip.log" >&2; fail "pip install of the wheel"; }

say "the package imports from the new virtualenv"
where=$(in_venv python -c 'import jupyter_cedana; print(jupyter_cedana.__file__)') \
  || fail "import jupyter_cedana"
case $where in
  "$V"/*) say "  $where" ;;
  *) fail "jupyter_cedana imports from $where, not from $V" ;;
esac

say "the server extension is enabled"
out=$(plain jupyter server extension list) || fail "jupyter server extension list: $out"
grep -E "jupyter_cedana +enabled" <<<"$out" >/dev/null \
  || fail "jupyter_cedana is not enabled in \`jupyter server extension list\`:"$'\n'"$out"
grep -E "jupyter_cedana .*OK" <<<"$out" >/dev/null \
  || fail "jupyter_cedana does not load in \`jupyter server extension list\`:"$'\n'"$out"
# Enabled by the wheel's own file, not by some system-wide configuration.
[ -f "$V/etc/jupyter/jupyter_server_config.d/jupyter_cedana.json" ] \
  || fail "no $V/etc/jupyter/jupyter_server_config.d/jupyter_cedana.json from the wheel"

say "the JupyterLab extension is enabled"
out=$(plain jupyter labextension list) || fail "jupyter labextension list: $out"
grep -E "jupyter-cedana .*enabled.*OK" <<<"$out" >/dev/null \
  || fail "jupyter-cedana is not enabled in \`jupyter labextension list\`:"$'\n'"$out"
[ -f "$V/share/jupyter/labextensions/jupyter-cedana/static/style.js" ] \
  || fail "no $V/share/jupyter/labextensions/jupyter-cedana/static/style.js from the wheel"

say "the native helpers are in the package and run"
pkg=$(dirname "$where")
for helper in cedana-init cedana-pages cedana-cuda; do
  exe=$pkg/bin/$helper
  [ -f "$exe" ] && [ -x "$exe" ] || fail "$exe is missing or not executable"
  # Without arguments each one prints its usage and exits 2: it loaded and ran.
  rc=0
  usage=$(in_venv "$exe" </dev/null 2>&1) || rc=$?
  [ "$rc" = 2 ] && grep -q "^usage: $helper" <<<"$usage" \
    || fail "$exe did not run (exit $rc): $usage"
done
digests=$(in_venv python -c \
  'from jupyter_cedana.checkpoint import digests; print(digests.native_digests() is not None)') \
  || fail "the page digests do not import"
[ "$digests" = True ] || fail "the wheel's libcedana-digest.so does not load"
engine_init=$(in_venv python -c \
  'from jupyter_cedana.checkpoint.engine import CheckpointEngine; print(CheckpointEngine.instance().init_binary())') \
  || fail "the checkpoint engine finds no cedana-init"
[ "$engine_init" = "$pkg/bin/cedana-init" ] || fail "the engine uses $engine_init, not $pkg/bin/cedana-init"

say "nothing the wheel installed is setuid, setgid or carries file capabilities"
special=$(find "$V" -type f -perm /6000 2>/dev/null)
[ -z "$special" ] || fail "setuid/setgid files from the wheel: $special"
if command -v getcap >/dev/null; then
  caps=$(getcap -r "$V" 2>/dev/null)
  [ -z "$caps" ] || fail "files with capabilities from the wheel: $caps"
fi

say "the jupyter-cedana command runs"
version=$(in_venv jupyter-cedana --version 2>&1) || fail "jupyter-cedana --version: $version"
expected=$(basename "$wheel" | cut -d- -f2)
[ "$version" = "$expected" ] || fail "jupyter-cedana --version says $version, the wheel is $expected"

say "a jupyter server from the wheel: REST API, suspend, transparent resume"
in_venv python - "$work" <<'PY' || fail "the server check (above)"
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import NoReturn

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

work = Path(sys.argv[1])
token = uuid.uuid4().hex
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
base = f"http://127.0.0.1:{port}/"
log_path = work / "server.log"
cmd = [
    "jupyter",
    "server",
    "--no-browser",
    f"--port={port}",
    "--ip=127.0.0.1",
    "--ServerApp.port_retries=0",
    f"--IdentityProvider.token={token}",
    f"--ServerApp.root_dir={work / 'root'}",
    f"--CedanaApp.checkpoint_root={work / 'checkpoints'}",
    f"--CheckpointEngine.checkpoint_root={work / 'checkpoints'}",
]
if os.geteuid() == 0:
    cmd.append("--allow-root")


def fail(msg: str) -> NoReturn:
    tail = log_path.read_text(errors="replace").splitlines()[-40:] if log_path.exists() else []
    print(f"[check-wheel] FAILED: {msg}", file=sys.stderr)
    if tail:
        print("[check-wheel] the server's log ends:\n" + "\n".join(tail), file=sys.stderr)
    raise SystemExit(1)


def call(method: str, path: str, body=None, auth: bool = True):
    req = urllib.request.Request(
        base + path, method=method, data=None if body is None else json.dumps(body).encode()
    )
    if auth:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = resp.read().decode()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


async def execute(ws, code: str, timeout: float = 120) -> str:
    """Run code in the kernel over its websocket; returns its stdout."""
    msg_id = uuid.uuid4().hex
    await ws.write_message(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "msg_type": "execute_request",
                    "username": "check",
                    "session": "check-wheel",
                    "version": "5.3",
                },
                "parent_header": {},
                "metadata": {},
                "channel": "shell",
                "buffers": [],
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
            }
        )
    )
    out, replied, idle = [], None, False
    deadline = time.monotonic() + timeout
    while replied is None or not idle:
        left = deadline - time.monotonic()
        if left <= 0:
            fail(f"no answer to {code!r} within {timeout} s")
        raw = await asyncio.wait_for(ws.read_message(), left)
        if raw is None:
            fail(f"the kernel's websocket closed while running {code!r}")
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["header"]["msg_type"]
        if kind == "stream":
            out.append(msg["content"]["text"])
        elif kind == "execute_reply":
            replied = msg["content"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    if replied.get("status") != "ok":
        fail(f"{code!r} failed: {replied}")
    return "".join(out)


async def main() -> None:
    status, body = call("GET", "api/cedana/status", auth=False)
    if status not in (401, 403):
        fail(f"GET /api/cedana/status without the token answered {status}, not 401/403")
    status, body = call("GET", "api/cedana/status")
    if status != 200:
        fail(f"GET /api/cedana/status: {status} {body} (is the server extension loaded?)")
    if not body.get("available"):
        fail(f"checkpointing is unavailable here: {body.get('reason')}")
    status, kernel = call("POST", "api/kernels", {"name": "python3"})
    if status != 201:
        fail(f"POST /api/kernels: {status} {kernel}")
    kid = kernel["id"]
    ws = await websocket_connect(
        HTTPRequest(
            f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels?session_id=check-wheel",
            headers={"Authorization": f"token {token}"},
            connect_timeout=30,
        )
    )
    if (await execute(ws, "x = 41; print('set')")).strip() != "set":
        fail("the first cell printed nothing")
    status, kernel = call("POST", f"api/cedana/kernels/{kid}/suspend")
    if status != 200 or kernel.get("state") != "suspended":
        fail(f"POST /api/cedana/kernels/{kid}/suspend: {status} {kernel}")
    if not kernel.get("checkpoint_bytes"):
        fail(f"a suspended kernel without a checkpoint: {kernel}")
    listed = subprocess.run(
        ["jupyter-cedana", "list", "--url", base, "--token", token],
        capture_output=True,
        text=True,
        timeout=60,
    )
    row = [line for line in listed.stdout.splitlines() if kid in line]
    if listed.returncode != 0 or not row or "suspended" not in row[0]:
        fail(f"jupyter-cedana list (exit {listed.returncode}):\n{listed.stdout}{listed.stderr}")
    print(f"[check-wheel]   suspended: {row[0]}")
    # The next cell resumes the kernel, with the state it had.
    if (await execute(ws, "print(x + 1)")).strip() != "42":
        fail("the cell after the suspend did not print 42")
    status, kernel = call("GET", f"api/cedana/kernels/{kid}")
    if status != 200 or kernel.get("state") != "running":
        fail(f"after the cell, the kernel is not running: {status} {kernel}")
    print(f"[check-wheel]   resumed by a cell in {kernel.get('last_resume_seconds')} s")
    ws.close()
    status, body = call("DELETE", f"api/kernels/{kid}")
    if status != 204:
        fail(f"DELETE /api/kernels/{kid}: {status} {body}")


with log_path.open("wb") as log:
    server = subprocess.Popen(cmd, cwd=work / "root", stdout=log, stderr=subprocess.STDOUT)
try:
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None:
            fail(f"jupyter server exited with {server.returncode}")
        try:
            if call("GET", "api/status")[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            fail("jupyter server did not answer within 60 s")
        time.sleep(0.2)
    asyncio.run(main())
finally:
    # Through the API first, so the server shuts its kernels down.
    try:
        call("POST", "api/shutdown")
        server.wait(timeout=30)
    except Exception:
        server.kill()
        server.wait()
PY
say "ok"
