"""``python -m mechgeom.sweep {repair,adopt,show}``: the ways out that the sweep store's errors name.

- ``repair LOG``: move the damaged lines of a store's log to ``LOG.rejected`` (their rows are computed again on
  the next run) and keep every other line (:func:`mechgeom.sweep.repair_log`).
- ``adopt TABLE``: let the next run take the rows of a table written by an earlier mechgeom (which recorded no
  weights, dtype or hooks) as its own, after checking the settings it did record
  (:func:`mechgeom.sweep.request_adoption`).
- ``show TABLE``: the store's fingerprint and row count, read without locking.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (2 for a refused input, with the reason on stderr)."""
    from mechgeom.sweep.legacy import request_adoption
    from mechgeom.sweep.log import parse_log, repair_log, store_paths

    parser = argparse.ArgumentParser(prog="python -m mechgeom.sweep", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("repair", help="move a log's damaged lines aside").add_argument("path", type=Path)
    sub.add_parser("adopt", help="adopt an earlier version's table").add_argument("path", type=Path)
    sub.add_parser("show", help="a store's fingerprint and row count").add_argument("path", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "repair":
            log = args.path if args.path.name.endswith(".log.jsonl") else store_paths(args.path)[0]
            kept, moved = repair_log(log)
            out = f"{log}: kept {kept} line(s), moved {moved} to {log}.rejected"
        elif args.cmd == "adopt":
            marker = request_adoption(args.path)
            out = f"{args.path}: the next run with matching settings adopts its rows ({marker} asks it to)"
        else:
            log = store_paths(args.path)[0]
            parsed = parse_log(log, log.read_bytes())
            out = json.dumps({"log": str(log), "rows": len(parsed.rows), **(parsed.header or {})}, indent=2)
    except (ValueError, OSError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
