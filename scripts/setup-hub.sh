#!/usr/bin/env bash
# JupyterHub's proxy for the Hub tests (tests/hub/): configurable-http-proxy from npm,
# into .hub-node/ in this checkout (readable by the test users). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=4.6.3
PREFIX=.hub-node
BIN=$PREFIX/node_modules/.bin/configurable-http-proxy
if [ -x "$BIN" ] && [ "$("$BIN" --version 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "[setup-hub] npm missing (apt-get install npm)" >&2; exit 1; }
mkdir -p "$PREFIX"
npm install --silent --no-audit --no-fund --prefix "$PREFIX" "configurable-http-proxy@$VERSION" >&2
"$BIN" --version >/dev/null
