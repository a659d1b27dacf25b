"""The Ray executor: work items on Ray actors, one per model replica, rows streamed back to the driver.

``pip install mechgeom[ray]``. Each actor loads the model once from a :class:`~mechgeom.sweep.ModelRef` (the
model is named, never pickled); only the driver writes the store (:func:`~mechgeom.sweep.run_sweep`).
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pandas as pd

from mechgeom._batch_queue import BatchQueue
from mechgeom.sweep.engine import Item, ModelRef, WorkFn, as_frame
from mechgeom.sweep.fingerprint import model_label, weights_digest

__all__ = ["RayExecutor"]


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
        self.weights: str | None = None
        self.refused: str | None = None

    def process_id(self) -> int:
        return self.pid

    def set_work(self, fn: WorkFn, expect_weights: str | None = None) -> None:
        """The sweep's work (one copy per sweep, so its per-worker caches live across the sweep's items), and
        the driver's weights digest: a worker whose weights differ refuses every item of the sweep."""
        self.fn, self.refused = fn, None
        if expect_weights is not None:
            if self.weights is None:
                self.weights = weights_digest(self.model)
            if self.weights != expect_weights:
                self.refused = (
                    f"the worker's weights ({self.weights}) are not the driver's ({expect_weights}): the "
                    "driver's model was changed after loading, or loads otherwise; a worker loads the model by "
                    "name, so run this sweep on the driver's model (no executor)"
                )

    def run(self, item: Item) -> tuple[Item, pd.DataFrame]:
        assert self.fn is not None, "set_work comes first"
        if self.refused is not None:
            raise ValueError(self.refused)
        return item, as_frame(self.fn(self.model, item))


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
        self.expect_weights: str | None = None
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
            actor.set_work.remote(
                fn_ref, self.expect_weights
            )  # actor calls run in order: this precedes the items

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
                    self.actors[slot].set_work.remote(fn_ref, self.expect_weights)
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
