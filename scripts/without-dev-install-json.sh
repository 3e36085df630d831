#!/usr/bin/env bash
# Runs a command (a wheel or editable build of this package) with the install.json that
# `jupyter labextension develop` (scripts/setup.sh) leaves in jupyter_cedana/labextension/
# set aside: pyproject.toml's shared-data adds its own install.json, and hatchling
# refuses a second file at the same path. Put back afterwards, whatever the command did.
# Usage: scripts/without-dev-install-json.sh COMMAND [ARG...]   (run in the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
stray=jupyter_cedana/labextension/install.json
moved=
if [ -e "$stray" ]; then
  mv "$stray" "$stray.aside" && moved=1
fi
rc=0
"$@" || rc=$?
if [ -n "$moved" ]; then
  mv "$stray.aside" "$stray"
fi
exit "$rc"
