"""``python -m mechgeom <verb>``: the same command line as the ``mechgeom`` script (see :mod:`mechgeom.cli`)."""

from __future__ import annotations

import sys

from mechgeom.cli import main

if __name__ == "__main__":
    sys.exit(main())
