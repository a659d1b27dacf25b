"""Markdown tables of a ``mechgeom sweep tasks`` result, for ``results/tasks/README.md``.

    python scripts/task_tables.py results/tasks/smollm2-135m/tasks.csv [--mode comprehensiveness]

Prints two tables. The first gives each task's clean accuracy with its 95% bootstrap interval, beside chance
and the majority-class rate. The second gives the accuracy under masking per metric, task and rate. There,
``*`` marks a change whose 95% bootstrap interval excludes 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

METRIC_NAMES = {
    "attention": "raw attention",
    "value_weighted": "value-weighted",
    "value_weighted_normalized": "value-weighted, output-normalised",
    "contribution": "contribution",
    "random": "random",
}


def _fmt(x: float) -> str:
    return f"{100 * x:.1f}"


def clean_table(frame: pd.DataFrame) -> list[str]:
    """One row per task: n, clean accuracy [95% CI], chance, majority (all in %)."""
    rows = frame[frame["rate"] == 0].drop_duplicates("task")
    out = ["| task | items | clean accuracy % [95% CI] | chance % | majority % |", "|---|---|---|---|---|"]
    for r in rows.itertuples():
        chance = "" if pd.isna(r.chance) else _fmt(r.chance)
        majority = "" if pd.isna(r.majority) else _fmt(r.majority)
        out.append(
            f"| {r.task} | {r.n_items} | {_fmt(r.accuracy)} [{_fmt(r.accuracy_ci_low)}, "
            f"{_fmt(r.accuracy_ci_high)}] | {chance} | {majority} |"
        )
    return out


def masked_table(frame: pd.DataFrame, mode: str) -> list[str]:
    """Rows: metric; columns: (task, rate > 0) accuracy in %, ``*`` where the Δ interval excludes 0."""
    sub = frame[(frame["mode"] == mode) & (frame["rate"] > 0)]
    cols = [(t, r) for t in dict.fromkeys(sub["task"]) for r in sorted(set(sub["rate"]))]
    head = "| accuracy % | " + " | ".join(f"{t} {r:g}" for t, r in cols) + " |"
    out = [head, "|---|" + "---|" * len(cols)]
    for m in dict.fromkeys(sub["metric"]):
        cells = []
        for t, r in cols:
            row = sub[(sub["metric"] == m) & (sub["task"] == t) & (sub["rate"] == r)].iloc[0]
            star = "*" if row.ci_high < 0 or row.ci_low > 0 else ""
            cells.append(_fmt(row.accuracy) + star)
        out.append(f"| {METRIC_NAMES.get(m, m)} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tasks_csv", type=Path)
    ap.add_argument("--mode", default="comprehensiveness")
    args = ap.parse_args(argv)
    frame = pd.read_csv(args.tasks_csv)
    sys.stdout.write("\n".join([*clean_table(frame), "", *masked_table(frame, args.mode)]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
