#!/usr/bin/env bash
# Sets up everything jupyter-cedana needs on a fresh Debian machine, idempotently:
#   system packages, CRIU >= 4.2, a virtualenv at .venv with the package (its native
#   helpers and the JupyterLab extension are built by the Python build).
# Usage: scripts/setup.sh [--test]   (--test adds what the test suite needs: chromium,
#                                    linters, jest dependencies; as root also the non-root
#                                    test users and criu with file capabilities; the
#                                    JupyterHub proxy)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TEST=0
[ "${1:-}" = "--test" ] && TEST=1

say() { printf '\n[setup] %s\n' "$*"; }
fail() { printf '\n[setup] FAILED: %s\n' "$*" >&2; exit 1; }

need_pkgs=()
want() { dpkg -s "$1" >/dev/null 2>&1 || need_pkgs+=("$1"); }
for p in build-essential make pkg-config libcap2-bin; do want "$p"; done
command -v node >/dev/null 2>&1 || want nodejs
command -v python3 >/dev/null 2>&1 || { want python3; want python3-venv; }
[ "$TEST" = 1 ] && want chromium
# Non-root tests: a virtualenv from the system's python3 (readable by the test users),
# ACLs when the checkout sits under a private directory.
[ "$TEST" = 1 ] && [ "$(id -u)" = 0 ] && { want python3-venv; want acl; }
if [ ${#need_pkgs[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || fail "missing system packages (${need_pkgs[*]}); run as root or install them"
  say "installing system packages: ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || fail "apt-get update"
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null \
    || fail "apt-get install ${need_pkgs[*]}"
fi

say "checking CRIU (>= 4.2)"
bash scripts/install-criu.sh || fail "CRIU could not be installed (see above)"

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating the virtualenv .venv with $($PY --version)"
  "$PY" -m venv .venv || fail "python3 -m venv (install python3-venv)"
fi
VPY=$ROOT/.venv/bin/python
export PATH=$ROOT/.venv/bin:$PATH

extras="lab"
[ "$TEST" = 1 ] && extras="lab,test,dev"
stamp=.venv/.cedana-deps-$(cat pyproject.toml package.json yarn.lock 2>/dev/null | sha256sum | cut -c1-16)-$extras
if [ ! -e "$stamp" ]; then
  say "installing Python dependencies ([$extras])"
  "$VPY" -m pip install -q -U pip || fail "pip upgrade"
  "$VPY" -m pip install -q "jupyterlab>=4,<5" "hatchling>=1.21" "hatch-jupyter-builder>=0.5" editables \
    || fail "pip install of the build tools"
fi

# Builds native/ (C, -Werror) and the labextension (jlpm install + build) and installs
# the package editable with its dependencies.
say "building and installing jupyter-cedana (native helpers, JupyterLab extension)"
scripts/without-dev-install-json.sh "$VPY" -m pip install -q --no-build-isolation -e ".[$extras]" \
  || fail "pip install -e ."
# The editable install copies the built extension; link it instead so rebuilds show up.
"$ROOT/.venv/bin/jupyter" labextension develop --overwrite . >/dev/null 2>&1 \
  || fail "jupyter labextension develop"
touch "$stamp"

# (grep reads all of the output: with -q, pipefail would see jupyter die of SIGPIPE)
server_exts=$("$ROOT/.venv/bin/jupyter" server extension list 2>&1)
grep "jupyter_cedana.*enabled" <<<"$server_exts" >/dev/null || fail "the server extension is not enabled"
lab_exts=$("$ROOT/.venv/bin/jupyter" labextension list 2>&1)
grep "jupyter-cedana.*enabled" <<<"$lab_exts" >/dev/null || fail "the JupyterLab extension is not enabled"
"$VPY" - <<'PY' || fail "the checkpoint engine is unavailable"
import os
from jupyter_cedana.checkpoint.engine import CheckpointEngine
info = CheckpointEngine.instance().probe()
if os.geteuid() != 0:
    # Such a user's server runs no CRIU; it checkpoints through the checkpoint agent.
    print(f"[setup] checkpoint engine: none in this user's servers: {info.reason}")
    raise SystemExit(0)
print(f"[setup] checkpoint engine: CRIU {info.criu_version} at {info.criu_path}, "
      f"PID namespaces {'on' if info.pidns else 'off'}")
raise SystemExit(0 if info.available else f"unavailable: {info.reason}")
PY
if [ "$TEST" = 1 ]; then
  if [ "$(id -u)" = 0 ]; then
    # Test users (no privilege: their servers checkpoint through the checkpoint agent)
    # and a venv they can read.
    say "non-root test set-up (users cedana-test, cedana-test2, .venv-nonroot)"
    bash scripts/setup-nonroot.sh >/dev/null || fail "non-root test set-up"
  fi
  say "configurable-http-proxy for the JupyterHub tests (tests/hub/)"
  bash scripts/setup-hub.sh || fail "JupyterHub test set-up"
fi
say "done"
