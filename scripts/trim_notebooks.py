"""Keep executed tutorials small and readable on GitHub: run by scripts/run_tutorials.sh after nbconvert.

For each notebook given:

- a live circuitsvis view (an HTML output that inlines circuitsvis' 1.3 MB JavaScript bundle) is replaced by a
  one-line note; the static PNG that ``mechgeom.viz.show`` puts under it stays. GitHub runs no JavaScript
  and Jupyter does not run the scripts of an untrusted stored output, so the stored bundle showed nothing;
  running the cell brings the live view back.
- stderr streams (progress bars, warnings from dependencies) are dropped, and the per-cell execution
  timestamps nbclient records are removed, so a rerun changes only what the code computed;
- the notebook is written back through a temporary file and a rename, and must stay under ``--max-bytes``
  (default 1 MB): a larger one fails the script.

Usage: ``python scripts/trim_notebooks.py tutorials/*.ipynb``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechgeom._io import atomic_write

BUNDLE_MARK = "var CircuitsVis="
LIVE_NOTE = (
    "<p><i>Live circuitsvis view (interactive): run this cell in Jupyter to see it. "
    "The picture below is a static PNG of the same view.</i></p>"
)


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def trim(nb: dict[str, Any]) -> dict[str, int]:
    """Trim ``nb`` in place; return how many live views, stderr streams and timings were removed."""
    counts = {"live_views": 0, "stderr": 0, "timings": 0}
    for cell in nb["cells"]:
        if cell.get("metadata", {}).pop("execution", None) is not None:
            counts["timings"] += 1
        if cell["cell_type"] != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                counts["stderr"] += 1
                continue
            data = out.get("data", {})
            if BUNDLE_MARK in _text(data.get("text/html", "")):
                out["data"] = {"text/html": LIVE_NOTE, "text/plain": "<live circuitsvis view>"}
                counts["live_views"] += 1
            kept.append(out)
        cell["outputs"] = kept
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--max-bytes", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    too_big = []
    for path in args.notebooks:
        nb = json.loads(path.read_text(encoding="utf-8"))
        counts = trim(nb)
        text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
        with atomic_write(path) as f:
            f.write(text)
        size = len(text.encode())
        print(f"{path}: {size / 1024:.0f} KiB; removed {counts}")
        if size > args.max_bytes:
            too_big.append(f"{path} ({size} bytes)")
    if too_big:
        print(f"over {args.max_bytes} bytes: {', '.join(too_big)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
