#!/usr/bin/env bash
# Sourced by the scripts that build CRIU from source (install-criu.sh, gpu-bundle.sh,
# build-criu-cuda-plugin.sh): CRIU's build dependencies and Debian unstable's CRIU 4.2
# source tarball, cached in $CEDANA_CACHE.
CACHE=${CEDANA_CACHE:-/var/cache/jupyter-cedana}
CRIU_DEPS="build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev
libnftables-dev uuid-dev xz-utils libcap2-bin iproute2"

# Installs CRIU's build dependencies that are missing (needs root when any is).
criu_build_deps() {
  local missing=() p
  for p in $CRIU_DEPS; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "CRIU build dependencies missing (${missing[*]}); installing them needs root" >&2
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Prints the path of the cached CRIU source tarball, fetching it first if needed
# (a deb-src-only apt source for sid: installed packages are never upgraded from it).
criu_tarball() {
  local tarball uri srcdir
  mkdir -p "$CACHE"
  tarball=$(ls "$CACHE"/criu_4.*.orig.tar.* 2>/dev/null | sort -V | tail -n1 || true)
  if [ -z "$tarball" ]; then
    [ "$(id -u)" = 0 ] || { echo "fetching the CRIU source needs root (apt-get source)" >&2; return 1; }
    uri=$(grep -rhoE '^(URIs:|deb) +[^ ]*http[^ ]+debian/?' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
          | head -n1 | awk '{print $NF}' || true)
    uri=${uri:-http://deb.debian.org/debian}
    srcdir=$(mktemp -d)
    printf 'Types: deb-src\nURIs: %s\nSuites: sid\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$uri" >/etc/apt/sources.list.d/cedana-criu-src.sources
    apt-get update -qq >&2
    (cd "$srcdir" && apt-get source --download-only --tar-only criu/sid >/dev/null)
    tarball=$(ls "$srcdir"/criu_*.orig.tar.* | head -n1)
    cp "$tarball" "$CACHE/"
    tarball="$CACHE/$(basename "$tarball")"
    rm -rf "$srcdir"
  fi
  printf '%s\n' "$tarball"
}
