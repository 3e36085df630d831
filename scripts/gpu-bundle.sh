#!/usr/bin/env bash
# Builds what the GPU check needs on a machine with an NVIDIA GPU but no network and
# nothing installable (there: Python 3.12 with PyTorch and nvidia-ml-py): one folder,
# at most 64 MiB, holding
#   run.sh            the one prepared script to run there (results go to $OUT)
#   payload.tar.gz    site/   jupyter-cedana and every dependency, for CPython 3.12
#                             (installed here with pip --target; the native helpers
#                             are in site/jupyter_cedana/bin)
#                     criu/   CRIU with every shared library it needs, glibc and its
#                             loader included, run through a wrapper (criu/criu)
#                     bench/  gpu_check.py and gpu_workloads.py
#   MANIFEST          versions, sizes and checksums
# Usage: scripts/gpu-bundle.sh [OUT_DIR]   (default build/gpu-bundle); needs setup.sh run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-build/gpu-bundle}
PY=${PYTHON:-$ROOT/.venv/bin/python}
CRIU_BIN=${CRIU_BIN:-$(command -v criu || echo /usr/local/sbin/criu)}
LIMIT=$((64 * 1024 * 1024))

say() { printf '[gpu-bundle] %s\n' "$*"; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/payload/bench" "$work/payload/criu/lib" "$work/wheels"

say "building the jupyter-cedana wheel (native helpers included)"
scripts/without-dev-install-json.sh \
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" . >/dev/null
wheel=$(ls "$work"/wheels/jupyter_cedana-*.whl)
"$PY" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for need in ("jupyter_cedana/bin/cedana-cuda", "jupyter_cedana/bin/cedana-init",
             "jupyter_cedana/criu_plugins/README.md"):
    if need not in names:
        raise SystemExit(f"the wheel lacks {need}")
PY

say "installing it with its dependencies for CPython 3.12 (x86_64, binary wheels only)"
"$PY" -m pip install -q --target "$work/payload/site" --no-compile \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 \
  --only-binary=:all: "$wheel" 2>&1 | grep -v "^WARNING: Location" || true
[ -d "$work/payload/site/jupyter_cedana" ] || { say "pip install --target failed" >&2; exit 1; }
# what the GPU machine has already, or what the check never uses
rm -rf "$work"/payload/site/{share,etc} "$work"/payload/site/jupyter_cedana/labextension
find "$work/payload/site" -name __pycache__ -prune -exec rm -rf {} +

say "bundling CRIU ($CRIU_BIN) with its shared libraries and loader"
"$CRIU_BIN" --version | grep -q "Version: 4\.[2-9]" || { say "$CRIU_BIN is not CRIU 4.2+" >&2; exit 1; }
install -m 0755 "$CRIU_BIN" "$work/payload/criu/lib/criu.bin"
loader=""
while read -r lib; do
  [ -n "$lib" ] || continue
  cp -L "$lib" "$work/payload/criu/lib/"
  case $(basename "$lib") in ld-linux*) loader=$(basename "$lib") ;; esac
done < <(ldd "$CRIU_BIN" | awk '/=>/ {print $3} $1 ~ /ld-linux/ {print $1}')
[ -n "$loader" ] || { say "no dynamic loader found for $CRIU_BIN" >&2; exit 1; }
cat >"$work/payload/criu/criu" <<EOF
#!/bin/sh
# CRIU through the loader and libraries it was built with (the host's glibc may differ).
d=\$(dirname "\$(readlink -f "\$0")")
exec "\$d/lib/$loader" --library-path "\$d/lib" "\$d/lib/criu.bin" "\$@"
EOF
chmod 0755 "$work/payload/criu/criu"
# the native helpers, the same way, for a host whose glibc is older than this one's
for h in cedana-cuda cedana-init; do
  cat >"$work/payload/criu/$h" <<EOF
#!/bin/sh
d=\$(dirname "\$(readlink -f "\$0")")
exec "\$d/lib/$loader" --library-path "\$d/lib" "\$d/../site/jupyter_cedana/bin/$h" "\$@"
EOF
  chmod 0755 "$work/payload/criu/$h"
done

cp bench/gpu_check.py bench/gpu_workloads.py "$work/payload/bench/"

rm -rf "$OUT"
mkdir -p "$OUT"
tar -C "$work/payload" -czf "$OUT/payload.tar.gz" site criu bench
cp scripts/gpu-bundle-run.sh "$OUT/run.sh"
chmod 0755 "$OUT/run.sh"
{
  echo "built: $(date -u +%FT%TZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "criu: $("$CRIU_BIN" --version | head -n1)"
  echo "glibc: $(ldd --version | head -n1)"
  echo "wheels for cp312:"
  ls "$work/payload/site" | grep -E '\.dist-info$' | sed 's/\.dist-info$//; s/^/  /'
  echo "sha256:"
  (cd "$OUT" && sha256sum payload.tar.gz run.sh | sed 's/^/  /')
} >"$OUT/MANIFEST"
size=$(du -cb "$OUT"/* | tail -n1 | cut -f1)
say "bundle $OUT: $((size / 1024 / 1024)) MiB ($size bytes)"
[ "$size" -le "$LIMIT" ] || { say "over the 64 MiB a run may carry" >&2; exit 1; }
