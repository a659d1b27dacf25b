"""``python scripts/run_sinks.py [options]`` is ``mechgeom run sinks [options]``.

What it computes and writes under ``results/sinks/<model>/`` is documented in
:mod:`mechgeom.report.runs.sinks` (``mechgeom run sinks --help``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models come from the installed wheels

from mechgeom.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["run", "sinks", *sys.argv[1:]]))
