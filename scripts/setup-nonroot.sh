#!/usr/bin/env bash
# Test set-up for non-root servers (called by scripts/setup.sh --test), idempotently:
#   - users cedana-test and cedana-test2 (the second user of the isolation tests), with
#     no privilege of any kind: their servers checkpoint through the checkpoint agent;
#   - a virtualenv those users can read, .venv-nonroot, from the system's python3 (the
#     root virtualenv's interpreter may live under /root, which they cannot enter), with
#     the package installed editable from this checkout.
# Prints the virtualenv's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { printf '[setup-nonroot] %s\n' "$*" >&2; }
fail() { printf '[setup-nonroot] FAILED: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (useradd)"
TEST_USERS=(cedana-test cedana-test2)
for u in "${TEST_USERS[@]}"; do
  id "$u" >/dev/null 2>&1 || { say "creating user $u"; useradd --create-home --shell /bin/bash "$u"; }
done
# Earlier versions of this set-up installed a copy of criu carrying file capabilities
# for group `cedana`, which handed root to its members' notebooks: remove it, and the
# test users' membership.
if [ -e /usr/local/lib/cedana/criu ] || [ -e /usr/local/lib/cedana/cedana-pidbase ]; then
  say "removing the capability-carrying copies in /usr/local/lib/cedana"
  rm -f /usr/local/lib/cedana/criu /usr/local/lib/cedana/cedana-pidbase
  rmdir /usr/local/lib/cedana 2>/dev/null || true
fi
for u in "${TEST_USERS[@]}"; do
  if id -nG "$u" | tr ' ' '\n' | grep -qx cedana; then
    say "removing $u from group cedana"
    gpasswd -d "$u" cedana >/dev/null
  fi
done

# The test users must read this checkout (tests and the editable package live here).
# A checkout under a private directory (e.g. /root) gets a traverse-only ACL entry for
# each test user on each directory above it that they cannot enter: no listing, no
# reading of anything there that is not world-readable anyway.
for u in "${TEST_USERS[@]}"; do
  runuser -u "$u" -- test -r "$ROOT/pyproject.toml" && continue
  command -v setfacl >/dev/null || fail "$ROOT is not readable by $u and setfacl is missing (apt-get install acl)"
  d=$ROOT
  while [ "$d" != / ]; do
    if ! runuser -u "$u" -- test -x "$d"; then
      say "granting $u traverse (x) on $d"
      setfacl -m "u:$u:x" "$d"
    fi
    d=$(dirname "$d")
  done
  runuser -u "$u" -- test -r "$ROOT/pyproject.toml" \
    || fail "user $u cannot read $ROOT (is the checkout world-readable?)"
done

SYSPY=${NONROOT_PYTHON:-/usr/bin/python3}
[ -x "$SYSPY" ] || fail "no $SYSPY (apt-get install python3 python3-venv)"
VENV=$ROOT/.venv-nonroot
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($SYSPY --version)"
  "$SYSPY" -m venv "$VENV" || fail "python3 -m venv (apt-get install python3-venv)"
fi
stamp=$VENV/.cedana-deps-$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -e "$stamp" ]; then
  say "installing jupyter-cedana[test] into $VENV"
  "$VENV/bin/python" -m pip install -q -U pip >&2 || fail "pip upgrade"
  "$VENV/bin/python" -m pip install -q "jupyterlab>=4,<5" "hatchling>=1.21" "hatch-jupyter-builder>=0.5" editables >&2 \
    || fail "pip install of the build tools"
  # (The editable build runs jlpm, which comes with jupyterlab.)
  PATH=$VENV/bin:$PATH scripts/without-dev-install-json.sh \
    "$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test]" >&2 \
    || fail "pip install -e .[test]"
  touch "$stamp"
fi
chmod -R a+rX "$VENV"
runuser -u cedana-test -- "$VENV/bin/python" -c "import jupyter_cedana, jupyterhub" \
  || fail "cedana-test cannot import jupyter_cedana from $VENV"
echo "$VENV"
