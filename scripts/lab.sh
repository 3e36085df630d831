#!/usr/bin/env bash
# Sets up (idempotently) and starts JupyterLab with jupyter-cedana on its default policy.
# Extra arguments go to `jupyter lab`, e.g. scripts/lab.sh --port 9999
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=(--ServerApp.ip=127.0.0.1)
[ "$(id -u)" = 0 ] && args+=(--allow-root)
exec .venv/bin/jupyter lab "${args[@]}" "$@"
