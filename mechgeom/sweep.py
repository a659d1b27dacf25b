"""The sweep engine: independent work items over text batches, their rows kept in one resumable store.

A sweep is a list of :class:`Item` s. Each item has a ``key`` (its identity), the store keys of the rows
it will return (``rows``; the item is finished when all of them are stored), the text ``batch`` it reads
and optional picklable ``data``. The work function ``fn(model, item)`` returns the item's rows (a
DataFrame or a list of dicts); it may depend only on the model, the item and constants it holds itself
(the corpus, the settings), so an executor may run it anywhere. Caches of a worker (e.g. a batch's clean
pass) are allowed as an optimisation, keyed by what they depend on.

A :class:`RowStore` holds the rows under their key columns with the run's settings fingerprint in
``setting_*`` columns. Opening an existing file checks the fingerprint (a changed setting is a
``ValueError`` naming it, stored vs now); :meth:`RowStore.add` drops rows whose key is already stored and
rewrites the file atomically (:func:`mechgeom._io.write_frame`). :func:`run_sweep` skips finished items,
hands the rest to an :class:`Executor` and stores every item's rows as soon as they come back; only the
driver writes the store. :class:`LocalExecutor` runs items in order in this process; an executor on
remote workers (which each load the model once, stream rows back and retry a lost worker's items)
implements the same ``run`` method.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "squares.csv"
>>> def square(model, item):
...     return [{"x": x, "y": x * x} for x in item.data]
>>> items = [Item(key=(b,), rows=tuple((x,) for x in xs), data=xs) for b, xs in enumerate([(1, 2), (3,)])]
>>> store = run_sweep(items, square, RowStore(path, key=["x"], settings={"power": 2}), verbose=False)
>>> store.rows()["y"].tolist()
[1, 4, 9]
>>> sorted(RowStore(path, key=["x"], settings={"power": 2}).done)
[(1,), (2,), (3,)]
>>> RowStore(path, key=["x"], settings={"power": 3})
Traceback (most recent call last):
...
ValueError: sweep store ... was written with other settings (power: stored 2, now 3); delete it or choose another path to start a fresh sweep
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from mechgeom._io import read_frame, write_frame
from mechgeom._progress import progress

__all__ = [
    "Executor",
    "Item",
    "LocalExecutor",
    "RowStore",
    "WorkFn",
    "model_label",
    "run_sweep",
    "tokens_hash",
]

SETTING_PREFIX = "setting_"


def _norm(value: Any) -> Hashable:
    """A key value as plain Python: numpy scalars unwrapped, floats rounded to 10 decimals (CSV round trips)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return round(value, 10)
    return value  # type: ignore[no-any-return]


def _norm_key(key: Iterable[Any]) -> tuple[Hashable, ...]:
    return tuple(_norm(v) for v in key)


def model_label(model: Any) -> str:
    """The model's name for a fingerprint: ``cfg.model_name``, else the class name."""
    return str(getattr(model.cfg, "model_name", "")) or type(model).__name__


def tokens_hash(tokens: Any) -> str:
    """Content hash of a token tensor or array (its shape and int64 values), 16 hex digits.

    >>> tokens_hash(np.array([[1, 2, 3]])) == tokens_hash([[1, 2, 3]])
    True
    """
    arr = np.asarray(tokens.detach().cpu() if hasattr(tokens, "detach") else tokens, dtype=np.int64)
    h = hashlib.sha256(str(arr.shape).encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Item:
    """One unit of work: ``key`` identifies it; ``rows`` are the store keys of the rows it returns (it is
    finished when all are stored; empty = always run); ``batch`` names the text batch it reads (worker
    caches key on it); ``data`` is any picklable input the work function needs."""

    key: tuple[Any, ...]
    rows: tuple[tuple[Any, ...], ...] = ()
    batch: Any = field(default=None, compare=False)
    data: Any = field(default=None, compare=False)


#: ``fn(model, item) -> rows``: the work of one item; must be picklable and read no driver state.
WorkFn = Callable[[Any, Item], "pd.DataFrame | Sequence[Mapping[str, Any]]"]


def _as_frame(rows: pd.DataFrame | Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    return rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))


class Executor(Protocol):
    """Runs work items and yields ``(item, rows)`` as each finishes, in any order; it never writes the store.

    An executor on workers gives each worker its model once (e.g. loaded by name), ships ``fn`` and the
    items to them (both picklable; ``fn`` arrives without its caches), streams the rows back and runs the
    items of a lost worker again (``fn`` is pure, so a retried item returns the same rows).
    """

    def run(self, fn: WorkFn, items: Sequence[Item]) -> Iterator[tuple[Item, pd.DataFrame]]: ...


class LocalExecutor:
    """Runs the items in order in this process, on ``model`` (passed to ``fn`` as is)."""

    def __init__(self, model: Any = None) -> None:
        self.model = model

    def run(self, fn: WorkFn, items: Sequence[Item]) -> Iterator[tuple[Item, pd.DataFrame]]:
        for item in items:
            yield item, _as_frame(fn(self.model, item))


class RowStore:
    """Rows under the ``key`` columns, with the settings fingerprint in ``setting_<name>`` columns.

    ``path`` (``.csv``/``.parquet``, or None for an in-memory store) is read when it exists: it must have
    the key and setting columns, and every stored setting must equal this run's (compared as text), else
    ``ValueError`` names each difference (stored vs now) and says how to start fresh (``fresh``). ``what``
    names the file in messages. Duplicate keys on file keep their first row.
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        key: Sequence[str],
        settings: Mapping[str, Any],
        what: str = "sweep store",
        fresh: str = "delete it or choose another path",
    ) -> None:
        if not key:
            raise ValueError("a row store needs at least one key column")
        self.path = None if path is None else Path(path)
        if self.path is not None and self.path.suffix not in (".csv", ".parquet"):
            raise ValueError(f"{what} must end in .csv or .parquet, got {self.path.name!r}")
        self.key = list(key)
        self.settings = dict(settings)
        self.what, self.fresh = what, fresh
        self._setting_cols = {SETTING_PREFIX + k: v for k, v in self.settings.items()}
        self.frame = pd.DataFrame(columns=[*self.key, *self._setting_cols])
        if self.path is not None and self.path.exists():
            self.frame = self._load(self.path)
        self.done: set[tuple[Hashable, ...]] = set(self._keys(self.frame))

    def _keys(self, frame: pd.DataFrame) -> list[tuple[Hashable, ...]]:
        return [_norm_key(k) for k in zip(*(frame[c] for c in self.key), strict=True)]

    def _load(self, path: Path) -> pd.DataFrame:
        df = read_frame(path)
        missing = [c for c in [*self.key, *self._setting_cols] if c not in df.columns]
        if missing:
            raise ValueError(
                f"{self.what} {path} lacks the column(s) {missing}, so it was not written by this sweep "
                f"(or by an older version); {self.fresh} to start a fresh sweep"
            )
        diffs = []
        for col, now in self._setting_cols.items():
            stored = sorted({str(v) for v in df[col]})
            if stored and stored != [str(now)]:
                shown = stored[0] if len(stored) == 1 else stored
                diffs.append(f"{col.removeprefix(SETTING_PREFIX)}: stored {shown}, now {now}")
        if diffs:
            raise ValueError(
                f"{self.what} {path} was written with other settings ({'; '.join(diffs)}); "
                f"{self.fresh} to start a fresh sweep"
            )
        keys = pd.Series(self._keys(df), dtype=object)
        return df[~keys.duplicated().to_numpy()].reset_index(drop=True)

    def __contains__(self, key: object) -> bool:
        """Whether a row with this key (a tuple of key-column values) is stored."""
        return isinstance(key, tuple) and _norm_key(key) in self.done

    def finished(self, item: Item) -> bool:
        """Whether every row the item declares is stored (an item that declares none never is)."""
        return bool(item.rows) and all(_norm_key(k) in self.done for k in item.rows)

    def add(self, rows: pd.DataFrame | Sequence[Mapping[str, Any]]) -> int:
        """Store the rows whose key is new (also new within ``rows``), add the setting columns, rewrite the
        file atomically; returns how many rows were added."""
        new = _as_frame(rows)
        missing = [c for c in self.key if c not in new.columns]
        if missing:
            raise ValueError(f"rows lack the key column(s) {missing} of {self.what}")
        keys = self._keys(new)
        keep, seen = [], set()
        for k in keys:
            keep.append(k not in self.done and k not in seen)
            seen.add(k)
        new = new[keep].assign(**self._setting_cols)
        if new.empty:
            return 0
        self.frame = pd.concat([self.frame, new], ignore_index=True) if len(self.frame) else new
        self.frame = self.frame.reset_index(drop=True)
        self.done.update(k for k, kept in zip(keys, keep, strict=True) if kept)
        if self.path is not None:
            write_frame(self.frame, self.path)
        return len(new)

    def discard(self, keys: Iterable[Iterable[Any]]) -> int:
        """Drop the rows with these keys (tuples of key-column values) and rewrite the file atomically;
        returns how many rows went. For a store whose entries are replaced (the report's stages)."""
        gone = {_norm_key(k) for k in keys} & self.done
        if not gone:
            return 0
        drop = pd.Series([k in gone for k in self._keys(self.frame)], dtype=bool).to_numpy()
        n = int(drop.sum())
        self.frame = self.frame[~drop].reset_index(drop=True)
        self.done -= gone
        if self.path is not None:
            write_frame(self.frame, self.path)
        return n

    def rows(self) -> pd.DataFrame:
        """The stored rows without the setting columns."""
        return self.frame.drop(columns=list(self._setting_cols)).reset_index(drop=True)


def run_sweep(
    items: Iterable[Item],
    fn: WorkFn,
    store: RowStore,
    *,
    executor: Executor | None = None,
    desc: str = "sweep",
    verbose: bool = True,
    on_item: Callable[[Item, pd.DataFrame], None] | None = None,
) -> RowStore:
    """Run every unfinished item with ``executor`` (default :class:`LocalExecutor` with no model) and
    store its rows as soon as it finishes; ``on_item(item, rows)`` runs after each. Progress counts
    finished items (``desc``; off when ``verbose`` is False). An item that returns fewer rows than it
    declared is a ``ValueError`` (it would never count as finished). Returns ``store``."""
    items = list(items)
    seen: set[tuple[Hashable, ...]] = set()
    for item in items:
        k = _norm_key(item.key)
        if k in seen:
            raise ValueError(f"two work items share the key {item.key!r}; item keys must be unique")
        seen.add(k)
    todo = [item for item in items if not store.finished(item)]
    runner = executor if executor is not None else LocalExecutor()
    for item, rows in progress(runner.run(fn, todo), desc=desc, enabled=verbose, total=len(todo)):
        if item.rows:
            got = set(store._keys(rows)) if set(store.key) <= set(rows.columns) else set()
            lost = [k for k in item.rows if _norm_key(k) not in got]
            if lost:
                raise ValueError(f"work item {item.key!r} returned no rows for {len(lost)} key(s) {lost[:3]}")
        store.add(rows)
        if on_item is not None:
            on_item(item, rows)
    return store
