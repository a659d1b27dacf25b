"""The sweep store's cost per row: time per append at 100, 1,000 and 10,000 rows, today's store and (with
``--old``) the store before it, which rewrote the whole table on every ``add``, in one process.

Rows are shaped like a faithfulness record (``metric, mode, rate, unit_hash`` keys, a log-probability and a
count), one row per ``add``, as a sweep stores an item of one row:

- ``today, consecutive``: 10,000 appends in one write session (as :func:`mechgeom.sweep.run_sweep` holds it),
  each timed (wall clock, and CPU time without the waits for the disk); the figure at ``N`` is the median
  (and the mean) of the 50 appends before the ``N``-th row;
- ``today`` and ``before``, ``at N``: a store holding ``N`` rows (written in one ``add``), then 20 appends of
  one row, each timed (today's in a write session); their median. The store before costs O(N) per append
  (so O(N²) over a sweep), so it is measured this way rather than by 10,000 consecutive appends.

Run: ``PYTHONPATH=. python benchmarks/bench_store.py --old /tmp/base/mechgeom/sweep.py`` (the old module file:
a checkout of the commit before the sweep log). Appends go to ``--dir`` (default a temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mechgeom.sweep import RowStore

POINTS = (100, 1_000, 10_000)
KEY = ["metric", "mode", "rate", "unit_hash"]
SETTINGS = {"model": "smollm2-135m", "layers": "all", "scope": "intra", "seed": 0}


def row(i: int) -> dict[str, Any]:
    return {
        "metric": ("attention", "contribution", "random")[i % 3],
        "mode": "comprehensiveness",
        "rate": round(0.1 * (i % 9 + 1), 10),
        "unit_hash": f"u{i:015x}",
        "logprob": -1.2345678 * (i + 1),
        "n_pred": 255,
    }


def consecutive(folder: Path, n: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each of ``n`` appends to today's store, in one write session (the wall time
    includes the fsync of each append, which waits for the disk)."""
    store = RowStore(folder / "consecutive.csv", key=KEY, settings=SETTINGS)
    wall, cpu = [], []
    with store.writing():
        for i in range(n):
            t0, c0 = time.perf_counter(), time.process_time()
            store.add([row(i)])
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return wall, cpu


def at_size(make: Any, folder: Path, n: int, appends: int = 20) -> float:
    """Median seconds of one append to a store (``make(path)``) that holds ``n`` rows, in a write session
    where the store has one (as a sweep appends)."""
    path = folder / f"at{n}.csv"
    make(path).add([row(i) for i in range(n)])
    store = make(path)
    times = []
    with store.writing() if hasattr(store, "writing") else contextlib.nullcontext():
        for i in range(n, n + appends):
            t0 = time.perf_counter()
            store.add([row(i)])
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def old_store_class(module_file: Path) -> Any:
    """``RowStore`` of the sweep module at ``module_file`` (it imports ``mechgeom._io`` and friends, which
    have not changed)."""
    spec = importlib.util.spec_from_file_location("mechgeom_old_sweep", module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.RowStore


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--old", type=Path, default=None, help="the old mechgeom/sweep.py, for the 'before' figures"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the stores go (default: a temporary folder)"
    )
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench_store_"))
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("today", "today_at", "before_at"):
        (folder / sub).mkdir()
    t0 = time.perf_counter()
    times, cpu = consecutive(folder / "today", POINTS[-1])
    total = time.perf_counter() - t0
    rows = {
        "today, consecutive (median)": [statistics.median(times[n - 50 : n]) for n in POINTS],
        "today, consecutive (mean)": [statistics.fmean(times[n - 50 : n]) for n in POINTS],
        "today, consecutive (CPU, median)": [statistics.median(cpu[n - 50 : n]) for n in POINTS],
    }
    rows["today, at N"] = [
        at_size(lambda p: RowStore(p, key=KEY, settings=SETTINGS), folder / "today_at", n) for n in POINTS
    ]
    if args.old is not None:
        old = old_store_class(args.old)
        rows["before, at N"] = [
            at_size(lambda p: old(p, key=KEY, settings=SETTINGS), folder / "before_at", n) for n in POINTS
        ]
    slow = sorted(times)[int(0.99 * len(times))]
    print(
        f"10,000 consecutive appends to today's store: {total:.2f} s in all, 99th percentile {1000 * slow:.2f} ms"
    )
    print("| store | " + " | ".join(f"ms per append at {n:,} rows" for n in POINTS) + " |")
    print("|---|" + "---|" * len(POINTS))
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{1000 * v:.3f}" for v in values) + " |")


if __name__ == "__main__":
    main()
