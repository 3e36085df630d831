"""Hatch build hook: compile native/ into jupyter_cedana/bin/ for wheels and editable installs."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class NativeBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name not in ("wheel", "editable"):
            return
        root = Path(self.root)
        if shutil.which("make") is None or shutil.which("cc") is None:
            raise RuntimeError("building jupyter-cedana needs make and a C compiler (cc)")
        dest = root / "jupyter_cedana" / "bin"
        subprocess.run(
            ["make", "-C", str(root / "native"), "install", f"DESTDIR={dest}"], check=True
        )
        build_data["pure_python"] = False
        # Executables, no extension module: any CPython 3 on this platform can use them
        # (e.g. the GPU check's bundle, built here for another Python version).
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform}"
