#!/usr/bin/env bash
# TEST-ONLY: builds CRIU's CUDA plugin (cuda_plugin.so, what distribution CRIU packages
# ship) from the CRIU source that install-criu.sh uses, into OUT_DIR (default
# tests/fakes/build/criu-plugins). The tests load it to show that jupyter-cedana's CRIU
# runs never let it act. Idempotent: an existing build of the same source is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-tests/fakes/build/criu-plugins}
# shellcheck source=scripts/criu-source.sh
. scripts/criu-source.sh
tarball=$(criu_tarball)
stamp="$OUT/.source-$(basename "$tarball")"
if [ -f "$OUT/cuda_plugin.so" ] && [ -f "$stamp" ]; then
  exit 0
fi
criu_build_deps
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
tar -xf "$tarball" -C "$build"
# the plugin is built against CRIU's tree (compel, generated headers): build that first
make -C "$build"/criu-* -j"$(nproc)" cuda_plugin >"$build/make.log" 2>&1 \
  || { tail -n 30 "$build/make.log" >&2; echo "building cuda_plugin.so failed" >&2; exit 1; }
mkdir -p "$OUT"
install -m 0755 "$build"/criu-*/plugins/cuda/cuda_plugin.so "$OUT/cuda_plugin.so"
rm -f "$OUT"/.source-*
touch "$stamp"
echo "built $OUT/cuda_plugin.so from $(basename "$tarball")"
