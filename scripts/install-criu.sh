#!/usr/bin/env bash
# Installs CRIU >= 4.2 into /usr/local when the machine lacks it. Debian 12's criu 3.17
# and Debian 13's 4.1.1 do not work on kernels >= 6.16 (see docs/design.md), so we build
# Debian unstable's 4.2.x source. Idempotent: a working criu >= 4.2 is left alone.
set -euo pipefail
MIN_MAJOR=4 MIN_MINOR=2
PREFIX=${CRIU_PREFIX:-/usr/local}

say() { printf '[install-criu] %s\n' "$*"; }

criu_ok() {
  local bin=$1 v
  [ -x "$bin" ] || return 1
  v=$("$bin" --version 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$v" ] || return 1
  local major=${v%%.*} rest=${v#*.}
  local minor=${rest%%.*}
  [ "$major" -gt "$MIN_MAJOR" ] || { [ "$major" -eq "$MIN_MAJOR" ] && [ "$minor" -ge "$MIN_MINOR" ]; }
}

for cand in "$PREFIX/sbin/criu" "$(command -v criu 2>/dev/null || true)"; do
  if [ -n "$cand" ] && criu_ok "$cand"; then
    say "criu $("$cand" --version | awk '/^Version:/ {print $2}') already at $cand"
    exit 0
  fi
done

if [ "$(id -u)" != 0 ]; then
  say "criu >= $MIN_MAJOR.$MIN_MINOR is missing and installing it needs root (apt-get, make install)" >&2
  exit 1
fi

# shellcheck source=scripts/criu-source.sh
. "$(dirname "$0")/criu-source.sh"
say "installing build dependencies"
criu_build_deps
say "fetching criu source (cached in $CACHE)"
tarball=$(criu_tarball)

say "building $(basename "$tarball")"
build=$(mktemp -d)
tar -xf "$tarball" -C "$build"
cd "$build"/criu-*
make -j"$(nproc)" criu >"$CACHE/criu-build.log" 2>&1 || { tail -n 30 "$CACHE/criu-build.log" >&2; say "build failed (log: $CACHE/criu-build.log)" >&2; exit 1; }
install -D -m 0755 criu/criu "$PREFIX/sbin/criu"
cd / && rm -rf "$build"
say "installed $("$PREFIX/sbin/criu" --version | awk '/^Version:/ {print $2}') at $PREFIX/sbin/criu"
"$PREFIX/sbin/criu" check || say "warning: 'criu check' reported problems" >&2
