"""`python -m jupyter_cedana.cli`: the same as `jupyter cedana`."""

import sys

from .main import main

sys.exit(main())
