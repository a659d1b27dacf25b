"""``python scripts/run_encoder.py [options]`` is ``mechgeom run encoder [options]``.

What it computes and writes under ``results/encoder/<model>/`` is documented in
:mod:`mechgeom.report.runs.encoder` (``mechgeom run encoder --help``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models come from the installed wheels

from mechgeom.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["run", "encoder", *sys.argv[1:]]))
