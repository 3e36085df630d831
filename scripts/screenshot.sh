#!/usr/bin/env bash
# Regenerates docs/images/sidebar.png, the README's picture of the sidebar with a suspended
# kernel. The browser test that takes it drives a real JupyterLab in Debian's chromium
# (tests/browser/): it runs two cells of a notebook, suspends the kernel from the sidebar
# and saves the page once the sidebar shows the kernel suspended.
# Needs scripts/setup.sh --test, and working checkpoints (as root).
# Usage: scripts/screenshot.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "[screenshot] no .venv here: run scripts/setup.sh --test" >&2; exit 1; }
mkdir -p docs/images
CEDANA_SCREENSHOT_DIR=$PWD/docs/images .venv/bin/python -m pytest -q -p no:cacheprovider \
  "tests/browser/test_lab.py::test_sidebar_screenshot_of_a_suspended_kernel"
ls -l docs/images/sidebar.png
