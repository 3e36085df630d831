#!/usr/bin/env bash
# Peer conformance: the kernel test suites of nbclient and jupyter_client (from their
# sdists, at the versions installed in .venv) run with cedana-provisioner as the default
# provisioner, and once with the stock one, so both results stand side by side in the log.
# Fails when a suite fails under cedana-provisioner or passes fewer tests than stock.
#
# Usage: scripts/conformance.sh [--through-agent] [--no-stock] [pytest args...]
# Cache (sdists, a venv with their test dependencies layered over .venv): .conformance/
#
# --through-agent (as root; opt-in, not part of scripts/test.sh: about 10 minutes more):
# both runs as the ordinary user cedana-test (.venv-nonroot, scripts/setup-nonroot.sh),
# every cedana-provisioner of the suites launching, suspending and resuming its kernels
# through a checkpoint agent started here as root on a private socket, as scripts/test.sh
# does for its non-root pass. By hand instead: set CEDANA_TEST_AGENT_SOCKET to an agent's
# socket, CONFORMANCE_PYTHON to a virtualenv's python that the user can run and
# CONFORMANCE_CACHE to a directory of theirs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ "${1:-}" = "--through-agent" ]; then
  shift
  [ "$(id -u)" = 0 ] || { echo "--through-agent: run as root (the agent runs as root)" >&2; exit 1; }
  NR=$ROOT/.venv-nonroot/bin
  [ -x "$NR/python" ] || { echo "no $NR/python: run scripts/setup-nonroot.sh" >&2; exit 1; }
  # shellcheck source=scripts/test-agent.sh
  . scripts/test-agent.sh
  start_test_agent conformance
  install -d -m 0755 "$ROOT/.conformance"
  install -d -o cedana-test -g cedana-test "$ROOT/.conformance/agent"
  rc=0
  runuser -u cedana-test -- env -i HOME=/home/cedana-test LANG=C.UTF-8 \
    PATH="$NR:/usr/bin:/bin" CEDANA_TEST_AGENT_SOCKET="$AGENT_SOCKET" \
    CONFORMANCE_PYTHON="$NR/python" CONFORMANCE_CACHE="$ROOT/.conformance/agent" \
    bash "$ROOT/scripts/conformance.sh" "$@" || rc=$?
  if [ "$rc" != 0 ]; then
    echo "the checkpoint agent's log (last lines):" >&2
    tail -n 40 "$AGENT_DIR/agent.log" >&2
  fi
  exit "$rc"
fi
STOCK=1
if [ "${1:-}" = "--no-stock" ]; then STOCK=0; shift; fi
CACHE=${CONFORMANCE_CACHE:-$ROOT/.conformance}
BASE=${CONFORMANCE_PYTHON:-$ROOT/.venv/bin/python}
say() { printf '\n[conformance] %s\n' "$*"; }
[ -x "$BASE" ] || { say "no $BASE: run scripts/setup.sh --test first"; exit 1; }
AGENT_PLUGIN=()
if [ -n "${CEDANA_TEST_AGENT_SOCKET:-}" ]; then
  # The suites make their kernel managers without our configuration: a plugin gives
  # cedana-provisioner the agent (tests/conformance/cedana_agent_plugin.py).
  export PYTHONPATH=$ROOT/tests/conformance${PYTHONPATH:+:$PYTHONPATH}
  AGENT_PLUGIN=(-p cedana_agent_plugin)
fi

version() { "$BASE" -c "import importlib.metadata as m; print(m.version('$1'))"; }
NBCLIENT=$(version nbclient)
JCLIENT=$(version jupyter_client)

# A venv whose site-packages puts .venv's after its own: the suites' test-only plugins
# (pytest-asyncio for nbclient) stay out of the project's own test runs.
VENV=$CACHE/venv
VPY=$VENV/bin/python
if [ ! -x "$VPY" ]; then
  say "creating $VENV over .venv"
  mkdir -p "$CACHE"
  python_exe=$("$BASE" -c 'import sys; print(sys._base_executable)')
  "$python_exe" -m venv "$VENV"
fi
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$BASE" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$base_site')" >"$site/_cedana_base.pth"
stamp=$VENV/.deps-$NBCLIENT-$JCLIENT
if [ ! -e "$stamp" ]; then
  say "installing the suites' test dependencies"
  "$VPY" -m pip install -q flaky ipywidgets "pytest-asyncio>=1.3.0" testpath xmltodict \
    msgpack anyio pytest-cov
  touch "$stamp"
fi

fetch() { # name version -> unpacked source dir
  local dir=$CACHE/src/$1-$2
  if [ ! -d "$dir/tests" ]; then
    mkdir -p "$CACHE/src"
    # --no-binary for this package only: pip builds the sdist's metadata, and its build
    # dependencies (hatchling...) then come as wheels, not all built from source too.
    "$VPY" -m pip download -q --no-deps --no-binary "$1" -d "$CACHE/sdist" "$1==$2" >&2
    tar -xzf "$CACHE/sdist/$1-$2.tar.gz" -C "$CACHE/src"
  fi
  echo "$dir"
}
NB_DIR=$(fetch nbclient "$NBCLIENT")
JC_DIR=$(fetch jupyter_client "$JCLIENT")

# Kernels: the stock python3 kernelspec, run by the venv's python (which sees .venv);
# .venv/bin for the console scripts (jupyter-execute).
export PATH=$VENV/bin:$ROOT/.venv/bin:$PATH
results=$CACHE/results
rm -rf "$results"
mkdir -p "$results"
status=0

suite() { # provisioner name dir pytest-args...
  local prov=$1 name=$2 dir=$3 plugin=()
  shift 3
  [ "$prov" = cedana-provisioner ] && plugin=("${AGENT_PLUGIN[@]}")
  say "$name with $prov${plugin[*]:+ through the checkpoint agent at $CEDANA_TEST_AGENT_SOCKET}"
  (cd "$dir" && JUPYTER_DEFAULT_PROVISIONER_NAME=$prov "$VPY" -m pytest -p no:cacheprovider \
    "${plugin[@]}" --color=no -q -o log_cli=false --junitxml="$results/$name-$prov.xml" \
    "$@") || return 1
}
run_suites() { # provisioner
  local prov=$1 rc=0
  # (pytest-asyncio warns, and their config turns warnings into errors, without a scope)
  suite "$prov" nbclient "$NB_DIR" -o asyncio_default_fixture_loop_scope=function tests \
    "${EXTRA[@]}" || rc=1
  suite "$prov" jupyter_client "$JC_DIR" -p no:asyncio tests/test_kernelmanager.py \
    tests/test_restarter.py tests/test_multikernelmanager.py tests/test_client.py \
    tests/test_provisioning.py "${EXTRA[@]}" || rc=1
  return $rc
}
EXTRA=("$@")
run_suites cedana-provisioner || status=1
if [ "$STOCK" = 1 ]; then
  run_suites local-provisioner || say "(the stock provisioner failed too: see above)"
fi

"$VPY" - "$results" "$STOCK" <<'PY' || status=1
import sys, xml.etree.ElementTree as ET
from pathlib import Path

results, stock = Path(sys.argv[1]), sys.argv[2] == "1"

def counts(path):
    if not path.exists():
        return None
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return n

ok = True
print("\n[conformance] suite           provisioner          passed failed errors skipped")
for name in ("nbclient", "jupyter_client"):
    ours = counts(results / f"{name}-cedana-provisioner.xml")
    theirs = counts(results / f"{name}-local-provisioner.xml") if stock else None
    for prov, n in (("cedana-provisioner", ours), ("local-provisioner", theirs)):
        if n is not None:
            print(f"[conformance] {name:15} {prov:20} {n['passed']:6} {n['failures']:6} "
                  f"{n['errors']:6} {n['skipped']:7}")
    if ours is None or ours["failures"] or ours["errors"]:
        ok = False
    elif theirs is not None and ours["passed"] < theirs["passed"]:
        print(f"[conformance] {name}: fewer tests pass with cedana-provisioner than stock")
        ok = False
sys.exit(0 if ok else 1)
PY
exit $status
