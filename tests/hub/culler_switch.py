"""Runs jupyterhub-idle-culler (as the Hub service it is) only while a switch file exists.

    python culler_switch.py SWITCH_FILE -- CULLER ARGS...

The culler's timeouts are seconds long: left running, it would cull a server while the
test is still setting up its state on a slow machine, or again right after the test has
started it anew. The test switches it on when the server is meant to go idle, and off
once it was culled: the culling itself is the real culler's, through the Hub's API.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main() -> None:
    switch, rest = sys.argv[1], sys.argv[2:]
    args = rest[1:] if rest[:1] == ["--"] else rest
    culler: subprocess.Popen[bytes] | None = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            on = os.path.exists(switch)
            if on and culler is None:
                culler = subprocess.Popen([sys.executable, "-m", "jupyterhub_idle_culler", *args])
            elif not on and culler is not None:
                culler.terminate()
                culler.wait()
                culler = None
            time.sleep(0.2)
    finally:
        if culler is not None:
            culler.terminate()
            culler.wait()


if __name__ == "__main__":
    main()
