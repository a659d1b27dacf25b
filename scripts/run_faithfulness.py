"""``python scripts/run_faithfulness.py [options]`` is ``mechgeom run faithfulness [options]``.

What it computes and writes under ``results/faithfulness/<model>/`` is documented in
:mod:`mechgeom.report.runs.faithfulness` (``mechgeom run faithfulness --help``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models come from the installed wheels

from mechgeom.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["run", "faithfulness", *sys.argv[1:]]))
