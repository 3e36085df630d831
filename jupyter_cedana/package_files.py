"""Files the package ships beside its modules: the native helpers built into `bin/`
(native/, by the build hook), the empty CRIU plugin directory, the event schemas.
Named here once, so that a module's place in the package does not decide them."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
BIN_DIR = PACKAGE_DIR / "bin"
# Holds no .so: a CRIU given it as its plugin directory loads nothing.
NO_PLUGINS_DIR = PACKAGE_DIR / "criu_plugins"
EVENTS_DIR = PACKAGE_DIR / "events"
