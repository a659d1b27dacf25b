"""The sweep engine: work items, executors, and :func:`run_sweep`, which stores each item's rows as it finishes.

A sweep is a list of :class:`Item` s. Each item has a ``key`` (its identity), the store keys of the rows it will
return (``rows``; the item is finished when all of them are stored), the text ``batch`` it reads and optional
picklable ``data``. The work function ``fn(model, item)`` returns the item's rows (a DataFrame or a list of
dicts); it may depend only on the model, the item and constants it holds itself (the corpus, the settings), so
an executor may run it anywhere. Caches of a worker (e.g. a batch's clean pass) are allowed as an
optimisation, keyed by what they depend on. Only the driver writes the store (:mod:`mechgeom.sweep.store`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pandas as pd

from mechgeom._progress import progress
from mechgeom.sweep.fingerprint import model_label
from mechgeom.sweep.log import norm_key
from mechgeom.sweep.store import RowStore

__all__ = ["Executor", "Item", "LocalExecutor", "ModelRef", "WorkFn", "as_frame", "executor_for", "run_sweep"]


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


def as_frame(rows: pd.DataFrame | Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The rows of a work function as a DataFrame."""
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
            yield item, as_frame(fn(self.model, item))


@dataclass(frozen=True)
class ModelRef:
    """A model named so that any worker can load it: ``load()`` calls
    ``mechgeom.models.load_model(name, backend=, device=, dtype=)``, or, with ``factory="module:function"``,
    ``function(**dict(kwargs))`` (e.g. a seeded random model for tests). Picklable and small: workers get
    this, never the model's weights.

    >>> ModelRef("smollm2-135m").name, ModelRef("tiny", factory="pkg.mod:make", kwargs=(("seed", 0),)).factory
    ('smollm2-135m', 'pkg.mod:make')
    """

    name: str = "smollm2-135m"
    backend: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    factory: str | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()

    def load(self) -> Any:
        """Load (or build) the model in this process."""
        if self.factory is not None:
            module, _, attr = self.factory.partition(":")
            if not module or not attr:
                raise ValueError(f"factory must be 'module:function', got {self.factory!r}")
            return getattr(importlib.import_module(module), attr)(**dict(self.kwargs))
        import torch

        from mechgeom.models import load_model

        return load_model(
            self.name,
            backend=self.backend,  # type: ignore[arg-type]
            device=self.device,
            dtype=getattr(torch, self.dtype),
        )


def executor_for(model: Any, executor: Executor | None) -> Executor:
    """``executor``, or a :class:`LocalExecutor` on ``model`` when it is None. An executor that loads its
    own model (one with an ``expect_label``, e.g. :class:`~mechgeom.sweep.RayExecutor`) is told the driver
    model's :func:`~mechgeom.sweep.fingerprint.model_label`, and its workers refuse to run on a model of
    another name (the results would not match the store's fingerprint)."""
    if executor is None:
        return LocalExecutor(model)
    if hasattr(executor, "expect_label"):
        executor.expect_label = model_label(model)
    return executor


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
    """Run every unfinished item and store its rows as soon as it finishes.

    The whole run is one write session of ``store`` (:meth:`~mechgeom.sweep.store.RowStore.writing`): its
    lock is held throughout, so a second writer stops before doing any work, and the table is written once at
    the end (also after an error or Ctrl-C); each item's rows are appended to the log as it finishes.

    Args:
        items: the work items; their keys must be unique. Finished items (every declared row stored) are
            skipped.
        fn: the work function, ``fn(model, item) -> rows``.
        store: where the rows go.
        executor: runs the items (default :class:`LocalExecutor` with no model). An executor with an
            ``expect_weights`` attribute (a remote one, which loads its own model) is given the store's weights
            digest, and its workers refuse to run on other weights.
        desc, verbose: the progress bar (counts finished items; off when ``verbose`` is False).
        on_item: ``on_item(item, rows)`` runs after each item is stored.

    Returns:
        ``store``.

    Raises:
        ValueError: two items share a key, or an item returned fewer rows than it declared (it would never
            count as finished).
        StoreLocked: another process writes the store.
    """
    items = list(items)
    seen: set[tuple[Hashable, ...]] = set()
    for item in items:
        k = norm_key(item.key)
        if k in seen:
            raise ValueError(f"two work items share the key {item.key!r}; item keys must be unique")
        seen.add(k)
    with store.writing():
        todo = [item for item in items if not store.finished(item)]
        runner = executor if executor is not None else LocalExecutor()
        if todo and hasattr(runner, "expect_weights"):
            runner.expect_weights = store.weights()
        results = runner.run(fn, todo)
        try:
            for item, rows in progress(results, desc=desc, enabled=verbose, total=len(todo)):
                if item.rows:
                    got = set(store.keys_of(rows)) if set(store.key) <= set(rows.columns) else set()
                    lost = [k for k in item.rows if norm_key(k) not in got]
                    if lost:
                        raise ValueError(
                            f"work item {item.key!r} returned no rows for {len(lost)} key(s) {lost[:3]}"
                        )
                store.add(rows)
                if on_item is not None:
                    on_item(item, rows)
        finally:  # an error or Ctrl-C here ends the executor's work now (its workers), not at garbage collection
            close = getattr(results, "close", None)
            if close is not None:
                close()
    return store
