"""Tables written by mechgeom before the sweep log: never resumed silently; adopted only when asked.

The earlier store kept its rows in the table itself, with ``setting_<name>`` columns that did not record the
weights, the dtype, the ``means`` of a mean ablation, or the code and data of extra hooks. Its numbers cannot be
checked against a run, so opening such a table is a ``ValueError`` that names two ways out:

- move the table aside (or choose another path): the sweep is computed afresh;
- ``python -m mechgeom.sweep adopt <table>`` (:func:`request_adoption`), for a table known to come from the
  same model, dtype and hooks: the next run checks the settings the table did record and the rows themselves
  (key cells filled, one value per key, numbers in numeric columns), then writes them into a log under its own
  fingerprint (the header says ``adopted_from``) and resumes from them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from mechgeom.sweep.log import StoreCorrupt, norm_key, same_value, store_paths

__all__ = ["adoption_marker", "open_legacy", "request_adoption"]

_PREFIX = "setting_"


def adoption_marker(table: str | Path) -> Path:
    """The file that asks the next run to adopt ``table``: ``<stem>.adopt`` beside it."""
    p = Path(table)
    return p.with_name(f"{p.stem}.adopt")


def request_adoption(table: str | Path) -> Path:
    """Ask the next run on ``table`` (a store table of an earlier mechgeom, without a log) to adopt its rows.

    Returns:
        The marker file written.

    Raises:
        FileNotFoundError: no such table. ValueError: the table already has a log (nothing to adopt).
    """
    table = Path(table)
    if not table.is_file():
        raise FileNotFoundError(f"no table {table} to adopt")
    if store_paths(table)[0].exists():
        raise ValueError(f"{table} already has its log {store_paths(table)[0]}: there is nothing to adopt")
    marker = adoption_marker(table)
    marker.write_text(json.dumps({"table": table.name}) + "\n")
    return marker


def _refusal(store: Any) -> ValueError:
    log = store.log_path.name
    return ValueError(
        f"{store.what} {store.path} was written by an earlier mechgeom (it has no log {log} beside it), which "
        "did not record the weights, dtype, means or extra hooks its rows were computed with, so they cannot "
        "be checked against this run and are not reused. Either move it aside (e.g. "
        f"`mv {store.path} {store.path}.old`) to compute the sweep afresh, or, if you know it was computed with "
        f"this very model, dtype and hooks, run `python -m mechgeom.sweep adopt {store.path}` and then this "
        "run again: it checks the settings the table recorded and resumes from its rows"
    )


def _kinds(df: pd.DataFrame, raw: pd.DataFrame, table: Path, line: int) -> dict[str, str]:
    """Each column's kind from the table: numeric, boolean, or text; a text column whose cells are mostly
    numbers holds a damaged cell, named by line and column."""
    kinds = {}
    for c in df.columns:
        if pd.api.types.is_bool_dtype(df[c]):
            kinds[c] = "bool"
        elif pd.api.types.is_numeric_dtype(df[c]):
            kinds[c] = "num"
        else:
            numeric = pd.to_numeric(raw[c].where(raw[c] != ""), errors="coerce")
            bad = numeric.isna() & (raw[c] != "")
            if bad.any() and bad.sum() < numeric.notna().sum():
                i = int(bad.to_numpy().nonzero()[0][0])
                raise StoreCorrupt(
                    f"{table}, line {i + line}, column {c!r}: not a number: {raw[c].iloc[i]!r}; mend the cell (or "
                    "remove its line, whose rows are then computed again) before adopting the table"
                )
            kinds[c] = "str"
    return kinds


def open_legacy(store: Any) -> tuple[list[str], list[dict[str, Any]], str | None]:
    """What to do with a store table that has no log: refuse it, or (with an adoption marker) read it.

    Args:
        store: the :class:`~mechgeom.sweep.store.RowStore` being opened (its path, key, settings, fingerprint
            and message texts).

    Returns:
        ``(columns, rows, note)`` for :class:`~mechgeom.sweep.store.RowStore` to append under its own
        fingerprint; no rows for an empty table (nothing to lose: the sweep starts afresh).

    Raises:
        ValueError: a table without the key or setting columns (another program's), the earlier version's
            table without an adoption request, or settings that differ from this run's.
        StoreCorrupt: an empty key cell, a key stored twice with other values, a non-number in a numeric
            column (file, line, column).
    """
    table = store.path
    assert table is not None
    csv = table.suffix == ".csv"
    df = pd.read_csv(table) if csv else pd.read_parquet(table)
    missing = [c for c in [*store.key, *(_PREFIX + k for k in store.settings)] if c not in df.columns]
    if missing:
        raise ValueError(
            f"{store.what} {table} lacks the column(s) {missing}, so it was not written by this sweep "
            f"(or by an older version); {store.fresh} to start a fresh sweep"
        )
    if df.empty:
        return [], [], None
    marker = adoption_marker(table)
    if not marker.exists():
        raise _refusal(store)
    raw = pd.read_csv(table, dtype=str, keep_default_na=False) if csv else df.astype(str)
    line = 2 if csv else 1  # the first data row: line 2 of a CSV file, row 1 of a Parquet table
    diffs = []
    for c in [c for c in df.columns if c.startswith(_PREFIX)]:
        name, stored = c.removeprefix(_PREFIX), sorted(set(raw[c]))
        now = store.fingerprint.get(name, "(not given)")
        if stored != [now]:
            diffs.append(f"{name}: stored {stored[0] if len(stored) == 1 else stored}, now {now}")
    if diffs:
        raise ValueError(
            f"{store.what} {table} was written with other settings ({'; '.join(diffs)}); {store.fresh} to start "
            "a fresh sweep"
        )
    values = df[[c for c in df.columns if not c.startswith(_PREFIX)]]
    kinds = _kinds(values, raw, table, line)
    rows: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}
    records: list[dict[str, Any]] = values.to_dict("records")  # type: ignore[assignment]
    for i, rec in enumerate(records):
        for c in store.key:
            if raw[c].iloc[i] == "" or (isinstance(rec[c], float) and math.isnan(rec[c])):
                raise StoreCorrupt(
                    f"{table}, line {i + line}, column {c!r}: an empty key cell; mend or remove the line"
                )
        rec = {c: (str(v) if kinds[c] == "str" else v) for c, v in rec.items()}
        k = norm_key(rec[c] for c in store.key)
        if k in rows and any(not same_value(rows[k][1][c], rec[c]) for c in rec):
            raise StoreCorrupt(
                f"{table}, line {i + line}: the key {k} of line {rows[k][0]} is stored again with other values; "
                "remove the wrong line (or both: their rows are then computed again) before adopting the table"
            )
        rows.setdefault(k, (i + line, rec))
    note = f"{table.name} (an earlier mechgeom's table, adopted on request; its weights, dtype and hooks unverified)"
    return list(values.columns), [r for _, r in rows.values()], note
