#!/usr/bin/env bash
# The GPU check, on the GPU machine: the one prepared script of the bundle that
# scripts/gpu-bundle.sh builds (it is copied there as run.sh). Unpacks the payload,
# runs `criu check` first, then bench/gpu_check.py, and leaves everything in $OUT:
# run.log, criu-check.txt, driver-info.json, gpu_check.json, logs/.
# Environment: OUT (default ./results), PYTHON (a Python 3.12 with torch and pynvml;
# default python3), BOX (time box of the check, s; default 420).
# Arguments are passed on to gpu_check.py (e.g. --fake --fakes DIR for a dry run).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$HERE/results}
mkdir -p "$OUT/logs"
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PYTHON:-python3}
BOX=${BOX:-420}
base=${TMPDIR:-/tmp}
WORK=$(mktemp -d "$base/cedana-gpu.XXXXXX")
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT

echo "== $(date -u +%FT%TZ) on $(uname -srm), $(nproc) CPUs, euid $(id -u)"
echo "== disk for images under $base: $(df -h "$base" | tail -n1)"
tar -xzf "$HERE/payload.tar.gz" -C "$WORK" || { echo "cannot unpack the payload"; exit 2; }
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$WORK/site/bin:$PATH"
"$PY" - <<'PY' || { echo "== $PY is not a Python 3.12 with pynvml and jupyter-cedana"; exit 2; }
import sys
import jupyter_cedana, pynvml
print("== python", sys.version.split()[0], "jupyter-cedana", jupyter_cedana.__version__)
assert sys.version_info[:2] == (3, 12), sys.version
PY

CRIU="$WORK/criu/criu"
echo "== criu check (first: can CRIU work on this machine at all?)"
{ "$CRIU" --version; "$CRIU" check; echo "rc=$?"; "$CRIU" check --feature uffd-noncoop; } \
  >"$OUT/criu-check.txt" 2>&1
cat "$OUT/criu-check.txt"

HELPER="$WORK/site/jupyter_cedana/bin/cedana-cuda"
INIT="$WORK/site/jupyter_cedana/bin/cedana-init"
if { "$HELPER" --help; "$INIT" --help; } 2>&1 | grep -qE "GLIBC_|error while loading"; then
  echo "== the native helpers do not run on this glibc: through the bundled loader"
  HELPER="$WORK/criu/cedana-cuda"
  INIT="$WORK/criu/cedana-init"
fi
"$HELPER" --driver-info >"$OUT/driver-info.json" 2>&1
echo "== driver: $(cat "$OUT/driver-info.json")"

echo "== gpu_check (time box ${BOX} s)"
timeout --kill-after=20 $((BOX + 60)) "$PY" "$WORK/bench/gpu_check.py" \
  --criu "$CRIU" --helper "$HELPER" --init "$INIT" --checkpoint-root "$WORK/ckpt" \
  --out "$OUT" --timeout "$BOX" "$@"
rc=$?
echo "== gpu_check exit $rc"
# kernel output and every CRIU log left behind (images themselves are too big to keep)
find "$WORK/ckpt" -name '*.log' -size -4M -exec cp --parents {} "$OUT/logs/" \; 2>/dev/null
exit $rc
