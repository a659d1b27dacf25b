"""``python scripts/run_selection.py [options]`` is ``mechgeom run selection [options]``.

What it computes and writes under ``results/selection/<model>/`` is documented in
:mod:`mechgeom.report.runs.selection` (``mechgeom run selection --help``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models come from the installed wheels

from mechgeom.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["run", "selection", *sys.argv[1:]]))
