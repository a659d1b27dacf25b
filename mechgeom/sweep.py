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
driver writes the store. :class:`LocalExecutor` runs items in order in this process;
:class:`RayExecutor` (``pip install mechgeom[ray]``) runs them on Ray actors, one per model replica, each
loading the model once from a :class:`ModelRef` (the model is named, never pickled), streaming rows back to
the driver and retrying a lost actor's items on a new one. Both implement :class:`Executor`.

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
import importlib
import math
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from mechgeom._batch_queue import BatchQueue
from mechgeom._io import read_frame, write_frame
from mechgeom._progress import progress

__all__ = [
    "Executor",
    "Item",
    "LocalExecutor",
    "ModelRef",
    "RayExecutor",
    "RowStore",
    "WorkFn",
    "executor_for",
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
    own model (:class:`RayExecutor`) is told the driver model's :func:`model_label`, and its workers refuse
    to run on a model of another name (the results would not match the store's fingerprint)."""
    if executor is None:
        return LocalExecutor(model)
    if isinstance(executor, RayExecutor):
        executor.expect_label = model_label(model)
    return executor


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
    results = runner.run(fn, todo)
    try:
        for item, rows in progress(results, desc=desc, enabled=verbose, total=len(todo)):
            if item.rows:
                got = set(store._keys(rows)) if set(store.key) <= set(rows.columns) else set()
                lost = [k for k in item.rows if _norm_key(k) not in got]
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


# --------------------------------------------------------------------------- Ray


def _import_ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise ImportError(
            "the Ray executor needs Ray: pip install 'mechgeom[ray]' (or pip install 'ray>=2.40')"
        ) from None


class _SweepActor:
    """One model replica: loads the model once, then runs the items of each sweep it is given."""

    def __init__(self, ref: ModelRef, threads: int | None, expect_label: str | None) -> None:
        import os

        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        self.pid = os.getpid()
        self.model = ref.load()
        label = model_label(self.model)
        if expect_label is not None and label != expect_label:
            raise ValueError(f"the worker loaded {label!r} but the sweep's model is {expect_label!r}")
        self.fn: WorkFn | None = None

    def process_id(self) -> int:
        return self.pid

    def set_work(self, fn: WorkFn) -> None:
        self.fn = fn  # one copy per sweep, so its per-worker caches live across the sweep's items

    def run(self, item: Item) -> tuple[Item, pd.DataFrame]:
        assert self.fn is not None, "set_work comes first"
        return item, _as_frame(self.fn(self.model, item))


class RayExecutor:
    """Runs work items on Ray actors, one per model replica; rows stream back to the driver (which alone
    writes the store, in :func:`run_sweep`).

    - ``model``: a :class:`ModelRef` or an offline model name; each actor loads it once.
    - ``workers`` actors, each with ``num_cpus`` / ``num_gpus`` Ray resources and ``threads`` torch threads
      (default ``max(1, int(num_cpus))``); ``in_flight`` items queued per actor (2 overlaps transfer and work).
    - ``address``: ``None`` uses the running Ray session if there is one, else starts a local cluster;
      ``"auto"`` or ``"ray://host:port"`` connects to an existing cluster. ``init_kwargs`` go to
      ``ray.init`` (e.g. ``runtime_env``). Workers that cannot start (an error loading the model, or no
      free resources within ``start_timeout`` seconds) are a ``RuntimeError`` that says why.
    - Items of one ``batch`` go to the same actor while it has any (a batch's clean pass is cached per
      worker); an idle actor takes a fresh batch, else a share of the largest one left.
    - **Fault tolerance.** When an actor dies (``ray.kill``, SIGKILL, a lost node), its unfinished items go
      back to the queue and a new actor replaces it; an item whose actors died more than ``max_retries``
      times is a ``RuntimeError``. An exception raised by the work function itself is re-raised on the
      driver (it would recur). Each item is yielded once.
    - **Lifetime.** Used as a context manager (``with RayExecutor(...) as ex:``) the actors and a cluster
      started here serve every sweep in the block (the model loads once) and end with it; otherwise they
      end with each :meth:`run`. On an error or Ctrl-C they end at once.

    ``actors`` lists the live actor handles, ``pids`` their process ids (tests kill them); ``restarts``
    counts the actors replaced.
    """

    def __init__(
        self,
        model: ModelRef | str,
        *,
        workers: int = 1,
        num_cpus: float = 1,
        num_gpus: float = 0,
        threads: int | None = None,
        address: str | None = None,
        in_flight: int = 2,
        max_retries: int = 3,
        start_timeout: float = 900.0,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if workers < 1 or in_flight < 1 or max_retries < 0:
            raise ValueError(
                f"need workers >= 1, in_flight >= 1 and max_retries >= 0, got {workers}, {in_flight}, {max_retries}"
            )
        self.model = model if isinstance(model, ModelRef) else ModelRef(model)
        self.workers, self.num_cpus, self.num_gpus = int(workers), num_cpus, num_gpus
        self.threads = threads if threads is not None else max(1, int(num_cpus))
        self.address, self.in_flight, self.max_retries = address, int(in_flight), int(max_retries)
        self.init_kwargs = dict(init_kwargs or {})
        self.start_timeout = float(start_timeout)
        self.expect_label: str | None = None
        self.actors: list[Any] = []
        self.restarts = 0
        self._pid_refs: list[Any] = []
        self._started_cluster = False
        self._held = False
        self._ray: Any = None

    @property
    def pids(self) -> list[int]:
        """The actors' process ids (waits until they are up)."""
        return list(self._ray.get(self._pid_refs)) if self._pid_refs else []

    def __enter__(self) -> RayExecutor:
        self._held = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._held = False
        self.close()

    def close(self, wait: float = 30.0) -> None:
        """Kill the actors and wait (up to ``wait`` seconds in all) until each is dead, so that their
        resources are free on return; then shut down a cluster this executor started. ``ray.kill`` only
        asks for the kill: a call sent just after it may still be served, so each actor is called until
        Ray answers that it died."""
        ray = self._ray
        for actor in self.actors:
            ray.kill(actor)
        deadline = time.monotonic() + wait
        for actor in self.actors:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    ray.get(actor.process_id.remote(), timeout=left)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    break
                time.sleep(0.02)
        self.actors, self._pid_refs = [], []
        if self._started_cluster:
            ray.shutdown()
            self._started_cluster = False

    def start(self) -> RayExecutor:
        """Connect to (or start) the cluster and start every actor now, waiting until each has loaded the
        model (otherwise the first :meth:`run` does); returns self. For a held executor (``with``)."""
        self._start(self.workers)
        return self

    def _start(self, n: int) -> None:
        """Connect or start a cluster, then start the missing actors and wait until they load the model
        (a worker that cannot load it fails here, with its own error)."""
        ray = self._ray = _import_ray()
        if not ray.is_initialized():
            if self.address is None:
                need = max(self.workers * self.num_cpus, 1)
                kwargs = {"num_cpus": math.ceil(need), "include_dashboard": False, "log_to_driver": False}
                ray.init(**{**kwargs, **self.init_kwargs})
            else:
                ray.init(address=self.address, **{"log_to_driver": False, **self.init_kwargs})
            self._started_cluster = True
        while len(self.actors) < n:
            self.actors.append(self._new_actor())
            self._pid_refs.append(self.actors[-1].process_id.remote())
        try:
            ray.get(self._pid_refs, timeout=self.start_timeout)
        except ray.exceptions.RayActorError as exc:
            self.close()
            raise RuntimeError(f"a Ray worker could not start: {exc}") from None
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources()
            self.close()
            raise RuntimeError(
                f"{n} Ray worker(s) of num_cpus={self.num_cpus}, num_gpus={self.num_gpus} did not start within "
                f"{self.start_timeout} s (free in the cluster now: {free}); ask for fewer or smaller workers"
            ) from None

    def _new_actor(self) -> Any:
        cls = self._ray.remote(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0)(_SweepActor)
        return cls.remote(self.model, self.threads, self.expect_label)

    def run(self, fn: WorkFn, items: Sequence[Item]) -> Iterator[tuple[Item, pd.DataFrame]]:
        if not items:
            return
        self._start(min(self.workers, len(items)) if not self._held else self.workers)
        ray = self._ray
        fn_ref = ray.put(fn)
        queue = BatchQueue(items)
        running: dict[Any, tuple[int, int]] = {}  # object ref -> (actor slot, item index)
        load = [0] * len(self.actors)
        tries: dict[int, int] = {}
        for actor in self.actors:
            actor.set_work.remote(fn_ref)  # actor calls run in order: this precedes the items

        def fill() -> None:
            for slot, actor in enumerate(self.actors):
                while load[slot] < self.in_flight:
                    nxt = queue.take(slot)
                    if nxt is None:
                        break
                    i, item = nxt
                    running[actor.run.remote(item)] = (slot, i)
                    load[slot] += 1

        ok = False
        try:
            fill()
            while running:
                ready, _ = ray.wait(list(running), num_returns=1)
                slot, i = running.pop(ready[0])
                load[slot] -= 1
                try:
                    item, rows = ray.get(ready[0])
                except ray.exceptions.RayActorError as exc:
                    self._replace(slot, i, exc, running, queue, tries)
                    load[slot] = 0
                    self.actors[slot].set_work.remote(fn_ref)
                except ray.exceptions.RayTaskError as exc:
                    raise exc.as_instanceof_cause() from None
                else:
                    yield item, rows
                fill()
            ok = True
        finally:
            if not (ok and self._held):
                self.close()

    def _replace(
        self,
        slot: int,
        lost: int,
        exc: BaseException,
        running: dict[Any, tuple[int, int]],
        queue: BatchQueue,
        tries: dict[int, int],
    ) -> None:
        """The actor of ``slot`` died: requeue its items (the failed one and those still queued on it) and
        put a new actor in its slot (not waited for: its first item waits for it)."""
        mine = [r for r, (s, _) in running.items() if s == slot]
        orphans = [lost, *(running.pop(r)[1] for r in mine)]
        for i in orphans:
            tries[i] = tries.get(i, 0) + 1
            if tries[i] > self.max_retries:
                raise RuntimeError(
                    f"work item {queue.items[i].key!r} lost its actor {tries[i]} times (max_retries="
                    f"{self.max_retries}); the last error: {exc}"
                )
        queue.give_back(slot, orphans)
        self._ray.kill(self.actors[slot])
        self.actors[slot] = self._new_actor()
        self._pid_refs[slot] = self.actors[slot].process_id.remote()
        self.restarts += 1
