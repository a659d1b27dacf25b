"""The sweep engine: independent work items over text batches, their rows kept in one resumable, locked store.

A sweep is a list of :class:`Item` s run by :func:`run_sweep` on an :class:`Executor`
(:class:`LocalExecutor` in this process, :class:`RayExecutor` on Ray actors that each load the model once from
a :class:`ModelRef`). Each item's rows go to a :class:`RowStore` as it finishes; only the driver writes it.

- :mod:`~mechgeom.sweep.engine`: items, executors, :func:`run_sweep`;
- :mod:`~mechgeom.sweep.store`: the store (an append-only log with a checksum per line, a lock held for the
  sweep's lifetime, the table written atomically at the end of every run);
- :mod:`~mechgeom.sweep.log`: the log's line format and its strict reader;
- :mod:`~mechgeom.sweep.fingerprint`: what a record is tied to (weights, dtype, settings, the code and data of
  extra hooks) and :func:`labelled_hook` for a hook whose state has no stable content;
- :mod:`~mechgeom.sweep.legacy`: tables of the earlier store, never resumed silently;
- :mod:`~mechgeom.sweep.ray`: the Ray executor.

``python -m mechgeom.sweep repair <log>`` and ``python -m mechgeom.sweep adopt <table>`` are the ways out that
the store's errors name. ``docs/sweeps.md`` describes the files and what the fingerprint covers.

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
>>> sorted(p.name for p in path.parent.iterdir())
['squares.csv', 'squares.lock', 'squares.log.jsonl']
>>> RowStore(path, key=["x"], settings={"power": 3})
Traceback (most recent call last):
...
ValueError: sweep store ... was written with other settings (power: stored 2, now 3); delete it or choose another path to start a fresh sweep
"""

from __future__ import annotations

from mechgeom.sweep.engine import (
    Executor,
    Item,
    LocalExecutor,
    ModelRef,
    WorkFn,
    as_frame,
    executor_for,
    run_sweep,
)
from mechgeom.sweep.fingerprint import (
    LabelledHook,
    Unfingerprintable,
    describe,
    hook_fingerprint,
    hooks_fingerprint,
    labelled_hook,
    model_dtype,
    model_label,
    tokens_hash,
    weights_digest,
)
from mechgeom.sweep.legacy import request_adoption
from mechgeom.sweep.log import StoreCorrupt, StoreWarning, repair_log, store_paths
from mechgeom.sweep.ray import RayExecutor
from mechgeom.sweep.store import RowStore, StoreLocked, read_store, remove_store

__all__ = [
    "Executor",
    "Item",
    "LabelledHook",
    "LocalExecutor",
    "ModelRef",
    "RayExecutor",
    "RowStore",
    "StoreCorrupt",
    "StoreLocked",
    "StoreWarning",
    "Unfingerprintable",
    "WorkFn",
    "as_frame",
    "describe",
    "executor_for",
    "hook_fingerprint",
    "hooks_fingerprint",
    "labelled_hook",
    "model_dtype",
    "model_label",
    "read_store",
    "remove_store",
    "repair_log",
    "request_adoption",
    "run_sweep",
    "store_paths",
    "tokens_hash",
    "weights_digest",
]
