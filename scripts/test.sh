#!/usr/bin/env bash
# Sets up everything (idempotently) and runs every check: Python lint and types, C with
# -Werror (in the build), TypeScript lint, jest, and pytest (real kernels, real CRIU, a
# real JupyterLab in Debian's chromium), then builds the wheel and checks it in a fresh
# virtualenv. Needs root: CRIU dumps processes, and some fault tests mount a tiny tmpfs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/setup.sh --test
export PATH=$ROOT/.venv/bin:$PATH

step() { printf '\n[test] %s\n' "$*"; }
step "ruff (lint + format)"
ruff check jupyter_cedana tests bench docs native/hatch_build.py
ruff format --check jupyter_cedana tests bench docs native/hatch_build.py
step "mypy"
mypy
step "C helpers with -Wall -Wextra -Werror, checked against CUDA's cuda.h when present"
make -s -C native all
if [ -f /usr/local/cuda/include/cuda.h ]; then make -s -C native check-decls; fi
step "TypeScript: eslint + prettier, jest"
jlpm install >/dev/null
jlpm lint:check
jlpm test
# The peer suites run in their own virtualenv, side by side with pytest, to keep the whole
# run short; their output is shown when they end.
step "peer conformance (in the background): nbclient and jupyter_client kernel suites, cedana-provisioner vs stock"
CONF_LOG=$(mktemp)
bash scripts/conformance.sh >"$CONF_LOG" 2>&1 &
conf_pid=$!
step "pytest"
pytest_rc=0
python -m pytest "$@" || pytest_rc=$?
step "peer conformance: results"
conf_rc=0
wait "$conf_pid" || conf_rc=$?
cat "$CONF_LOG"
rm -f "$CONF_LOG"
[ "$pytest_rc" = 0 ] || { echo "pytest failed (exit $pytest_rc)" >&2; exit "$pytest_rc"; }
[ "$conf_rc" = 0 ] || { echo "peer conformance failed (exit $conf_rc)" >&2; exit "$conf_rc"; }
step "the wheel: manylinux wheel and sdist, installed into a fresh virtualenv, a server from it"
bash scripts/build-wheel.sh
bash scripts/check-wheel.sh
if [ $# -eq 0 ] && [ "$(id -u)" = 0 ]; then
  # The server, provisioner and Hub tests again as an ordinary user, whose servers
  # launch, suspend and resume every kernel through a checkpoint agent (docs/agent.md)
  # that runs as root: the user holds no capability and runs no CRIU (the Hub then runs
  # as that user too, and spawns only that user's server).
  step "pytest as the ordinary user cedana-test, through a checkpoint agent"
  NR=$ROOT/.venv-nonroot/bin
  # shellcheck source=scripts/test-agent.sh
  . scripts/test-agent.sh
  start_test_agent test
  nonroot_rc=0
  runuser -u cedana-test -- env -i HOME=/home/cedana-test LANG=C.UTF-8 PATH="$NR:/usr/bin:/bin" \
    CEDANA_TEST_AGENT_SOCKET="$AGENT_SOCKET" \
    "$NR/python" -m pytest -p no:cacheprovider \
    tests/test_provisioner.py tests/test_server.py tests/hub || nonroot_rc=$?
  if [ "$nonroot_rc" != 0 ]; then
    echo "the checkpoint agent's log (last lines):" >&2
    tail -n 60 "$AGENT_DIR/agent.log" >&2
  fi
  stop_test_agent
  trap - EXIT
  [ "$nonroot_rc" = 0 ] || exit "$nonroot_rc"
fi
