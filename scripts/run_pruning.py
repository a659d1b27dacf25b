"""``python scripts/run_pruning.py [options]`` is ``mechgeom run pruning [options]``.

What it computes and writes under ``results/pruning/<model>/`` is documented in
:mod:`mechgeom.report.runs.pruning` (``mechgeom run pruning --help``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models come from the installed wheels

from mechgeom.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["run", "pruning", *sys.argv[1:]]))
