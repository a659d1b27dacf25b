"""The masking harness: one resumable engine under every faithfulness sweep (paper A's masking test).

A faithfulness sweep ranks the sources of every query on a clean pass (:class:`~.rankings.RankingPass`:
any registered ranking method, see :mod:`~.rankings`), removes the top (comprehensiveness) or bottom
(sufficiency) ``ceil(rate * n)`` of them at the chosen layers without renormalising, and measures what
changes. The sweeps differ only in three pieces, which they hand to :func:`masking_sweep`: the
:class:`Units` they score, the :class:`Outcome` a pass measures, and the :data:`Masker` that removes sources.

- ``perplexity_curves``: equal-length windows; the target log-likelihood; removal at ``hook_pattern``;
- ``task_accuracy_curves``: prompt + choice sequences, right-padded; the log-likelihood of the choice
  tokens; removal at ``hook_pattern``;
- ``embedding_curves``: encoder texts with their padding masked; the sentence embedding (``1 − cos``);
  removal at ``hook_pattern``, or at ``hook_z`` where the model discards pattern edits;

so each is a thin specialisation (as TransformerLens' ``patching.py`` specialises one generic patching
function): it builds its units and outcome, calls the engine, and summarises the per-unit record.

**The engine.** :func:`masking_sweep` runs on :func:`mechgeom.sweep.run_sweep`: one
:class:`~mechgeom.sweep.Item` per batch's clean pass and per (metric, mode, rate > 0, batch), each returning
one row per unit of its batch, keyed ``(metric, mode, rate, unit_hash)``, into a
:class:`~mechgeom.sweep.RowStore`. With a checkpoint the store is a file: a rerun skips every finished row
(an interrupted sweep resumes; units are matched by content, so a corpus that starts with the same units
extends an earlier run) and refuses other settings. The items run on any executor
(:class:`~mechgeom.sweep.RayExecutor`: actors that load the model by name); :class:`MaskingWork` is the
picklable work function. Per worker, a batch's clean pass (:func:`clean_pass`: the clean outcome and every
ranking still needed) is kept while the batch's items run; metrics whose rankings coincide on a batch (e.g.
``value_weighted`` and its per-query normalised version) share their masked passes (:func:`masked_pass`).
Rate 0 removes nothing, so its rows are the clean pass's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch

from mechgeom.analyses.faithfulness.rankings import RankingPass, SourceRanking, SweepSettings, rate_key
from mechgeom.hooks import FwdHook, decoder_source_counts, masking_hooks
from mechgeom.sweep import Executor, Item, RowStore, executor_for, run_sweep
from mechgeom.typing import Bool, Int, Tensor, Tokens

__all__ = [
    "CLEAN",
    "CleanBatch",
    "Masker",
    "MaskingWork",
    "Outcome",
    "UnitBatch",
    "Units",
    "check_checkpoint",
    "clean_pass",
    "masked_pass",
    "masking_sweep",
    "pattern_masking",
    "record_path",
    "unit_values",
]

#: The metric, mode and rate of a batch's clean rows in the record.
CLEAN = "clean"
_STORE_KEYS = ["metric", "mode", "rate", "unit_hash"]
_FRESH = "delete the file or choose another checkpoint="


# --------------------------------------------------------------------------- units and batches


@dataclass
class UnitBatch:
    """One batch of units on the model's device, without the columns that are padding in all of them.

    ``n_sources`` is the number of sources of each query, 0 at padding: an encoder's real keys, a padded
    decoder batch's real keys ``j <= i`` (:func:`~mechgeom.hooks.decoder_source_counts`); ``None`` for a
    decoder batch without padding (query ``i`` has the ``i + 1`` sources ``j <= i``)."""

    idx: tuple[int, ...]
    tokens: Tokens
    mask: Bool[Tensor, "batch pos"]
    targets: Bool[Tensor, "batch pos_minus_1"] | None
    n_sources: Int[Tensor, "batch pos"] | None


@dataclass
class Units:
    """The sequences a sweep scores, padded on either side: ``mask[u, t]`` = token ``t`` of unit ``u`` is
    real (each unit's real tokens are contiguous); ``targets[u, t]`` (decoders) = the prediction of token
    ``t + 1`` counts (never at a pad nor of a pad); ``hashes`` name the units in the record (content hashes
    of the real tokens, so the same text has the same name whatever its padding)."""

    tokens: Tokens
    mask: Bool[Tensor, "unit pos"]
    hashes: list[str]
    targets: Bool[Tensor, "unit pos_minus_1"] | None = None

    @classmethod
    def prefixes(
        cls, tokens: Tokens, lengths: Sequence[int], hashes: list[str], targets: Tensor | None = None
    ) -> Units:
        """Units whose first ``lengths[u]`` tokens are real (a decoder's right-padded sequences)."""
        mask = torch.arange(tokens.shape[1])[None, :] < torch.tensor(list(lengths))[:, None]
        return cls(tokens=tokens, mask=mask, hashes=hashes, targets=targets)

    @property
    def lengths(self) -> list[int]:
        """Real tokens per unit."""
        return [int(n) for n in self.mask.sum(-1).tolist()]

    def batches(self, batch_size: int, *, by_length: bool) -> list[list[int]]:
        """Unit indices in batches of ``batch_size``, in order or longest first (``by_length``)."""
        order = list(range(len(self.hashes)))
        if by_length:
            lengths = self.lengths
            order.sort(key=lambda u: -lengths[u])
        return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]

    def batch(self, idx: Sequence[int], device: Any, *, causal: bool) -> UnitBatch:
        """Units ``idx`` on ``device``, without the columns that are padding in every one of them (on the
        right, or on the left of a left-padded corpus)."""
        rows = list(idx)
        mask = self.mask[rows]
        cols = mask.any(0).nonzero().flatten()
        first, last = int(cols.min()), int(cols.max()) + 1
        mask = mask[:, first:last].to(device)
        targets = None if self.targets is None else self.targets[rows, first : last - 1]
        n_sources: Tensor | None
        if not causal:
            n_sources = mask.long().sum(-1, keepdim=True) * mask.long()
        else:
            n_sources = None if bool(mask.all()) else decoder_source_counts(mask)
        return UnitBatch(tuple(rows), self.tokens[rows, first:last].to(device), mask, targets, n_sources)


# --------------------------------------------------------------------------- what a pass measures, how sources go


class Outcome(Protocol):
    """What one pass measures per unit (:meth:`measure`), and the record columns of a clean or masked pass."""

    def measure(self, model: Any, batch: UnitBatch, hooks: Sequence[FwdHook]) -> Tensor:
        """One forward pass of ``batch`` with ``hooks``; a tensor with one row per unit."""
        ...

    def clean_columns(self, batch: UnitBatch, clean: Tensor) -> dict[str, Any]:
        """The record's columns of the clean pass."""
        ...

    def masked_columns(self, batch: UnitBatch, masked: Tensor, clean: Tensor) -> dict[str, Any]:
        """The record's columns of a masked pass, given the clean one."""
        ...


#: ``masker(model, ranking, rate, mode, batch) -> (hooks, check)``: the removal hooks of one masked pass
#: and a check to run after it (or ``None``).
Masker = Callable[
    [Any, SourceRanking, float, str, UnitBatch], tuple[list[FwdHook], Callable[[], None] | None]
]


def pattern_masking(
    model: Any, ranking: SourceRanking, rate: float, mode: str, batch: UnitBatch
) -> tuple[list[FwdHook], None]:
    """Removal at ``hook_pattern`` of every ranked layer (:func:`mechgeom.hooks.masking_hooks`)."""
    return masking_hooks(model, ranking=ranking, rate=rate, mode=mode, n_sources=batch.n_sources), None


# --------------------------------------------------------------------------- the work of one item


@dataclass
class CleanBatch:
    """A batch's clean pass: the clean outcome, the rankings, which metric's passes each metric shares
    (``alias``) and the record columns of the masked passes run so far."""

    batch: UnitBatch
    clean: Tensor
    rankings: dict[str, SourceRanking]
    alias: dict[str, str]
    results: dict[tuple[str, str, float], dict[str, Any]] = field(default_factory=dict)


def clean_pass(model: Any, work: MaskingWork, batch: UnitBatch, needed: Sequence[str]) -> CleanBatch:
    """One clean forward of ``batch`` (``extra_hooks`` first): the clean outcome and every ranking of
    ``needed``; metrics whose rankings coincide on the batch share their masked passes."""
    ranked = RankingPass(
        model,
        batch.tokens,
        needed,
        layers=work.layers,
        scope=work.scope,
        seed=work.seed,
        key_mask=batch.mask,
        causal=work.causal,
        extra_hooks=work.extra_hooks,
        store_device=batch.tokens.device,
    )
    clean = work.outcome.measure(model, batch, [*work.extra_hooks, *ranked.hooks])
    rankings = ranked.rankings()
    alias: dict[str, str] = {}
    for m in needed:
        alias[m] = next((a for a in alias.values() if rankings[a].same_as(rankings[m])), m)
    return CleanBatch(batch, clean, rankings, alias)


def masked_pass(
    model: Any, work: MaskingWork, batch: UnitBatch, ranking: SourceRanking, rate: float, mode: str
) -> Tensor:
    """One masked forward of ``batch``: ``extra_hooks``, then the removal of ``ranking`` at ``rate``."""
    hooks, check = work.masker(model, ranking, rate, mode, batch)
    out = work.outcome.measure(model, batch, [*work.extra_hooks, *hooks])
    if check is not None:
        check()
    return out


@dataclass
class MaskingWork:
    """The work of one sweep item (picklable): a batch's clean rows or one (metric, mode, rate) pass.

    Items name their batch by its unit indices and carry the metrics its clean pass must rank; the
    batch's :class:`CleanBatch` is kept per worker, one batch at a time.
    """

    units: Units
    outcome: Outcome
    layers: list[int]
    scope: str
    seed: int
    extra_hooks: tuple[FwdHook, ...] = ()
    causal: bool = True
    masker: Masker = pattern_masking
    _cache: dict[Any, CleanBatch] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def _clean(self, model: Any, idx: tuple[int, ...], needed: tuple[str, ...]) -> CleanBatch:
        if (idx, needed) not in self._cache:
            self._cache.clear()  # one batch at a time: its rankings live on the model's device
            batch = self.units.batch(idx, model.cfg.device, causal=self.causal)
            self._cache[(idx, needed)] = clean_pass(model, self, batch, needed)
        return self._cache[(idx, needed)]

    def __call__(self, model: Any, item: Item) -> pd.DataFrame:
        idx, (m, mode, r) = item.batch, item.key[:3]
        b = self._clean(model, idx, item.data)
        if m == CLEAN:
            columns = self.outcome.clean_columns(b.batch, b.clean)
        else:
            shared = (b.alias[m], mode, r)
            if shared not in b.results:
                masked = masked_pass(model, self, b.batch, b.rankings[shared[0]], r, mode)
                b.results[shared] = self.outcome.masked_columns(b.batch, masked, b.clean)
            columns = b.results[shared]
        hashes = [self.units.hashes[u] for u in idx]
        return pd.DataFrame({"metric": m, "mode": mode, "rate": r, "unit_hash": hashes, **columns})


# --------------------------------------------------------------------------- the engine


def check_checkpoint(checkpoint: str | Path | None) -> Path | None:
    """``checkpoint`` as a path (``.csv`` or ``.parquet``, else ``ValueError``), or None."""
    if checkpoint is None:
        return None
    path = Path(checkpoint)
    if path.suffix not in (".csv", ".parquet"):
        raise ValueError(f"checkpoint must end in .csv or .parquet, got {path.name!r}")
    return path


def record_path(checkpoint: Path, what: str) -> Path:
    """The per-unit record beside a checkpoint table: ``<stem>.<what><suffix>``."""
    return checkpoint.with_name(f"{checkpoint.stem}.{what}{checkpoint.suffix}")


def _items(
    units: Units, keys: list[tuple[str, str, float]], store: RowStore, batch_size: int, by_length: bool
) -> list[Item]:
    """One clean item per batch, then one per (metric, mode, rate > 0); each batch's items carry the
    metrics its clean pass must rank (those of its unfinished masked items)."""
    items = []
    for b, idx in enumerate(units.batches(batch_size, by_length=by_length)):
        hashes = [units.hashes[u] for u in idx]
        planned = [(key, tuple((*key, h) for h in hashes)) for key in [(CLEAN, CLEAN, 0.0), *keys]]
        pending = [key for key, rows in planned[1:] if not store.finished(Item(key=(*key, b), rows=rows))]
        needed = tuple(dict.fromkeys(key[0] for key in pending))  # the clean pass ranks only what is left
        items += [Item(key=(*key, b), rows=rows, batch=tuple(idx), data=needed) for key, rows in planned]
    return items


def masking_sweep(
    model: Any,
    units: Units,
    outcome: Outcome,
    checked: SweepSettings,
    *,
    seed: int,
    batch_size: int,
    settings: dict[str, Any],
    record: Path | None = None,
    extra_hooks: Sequence[FwdHook] = (),
    executor: Executor | None = None,
    causal: bool = True,
    masker: Masker = pattern_masking,
    by_length: bool = False,
    what: str = "faithfulness record",
    desc: str = "faithfulness: masked passes",
    verbose: bool = False,
) -> pd.DataFrame:
    """The per-unit record of the clean pass and every (metric, mode, rate > 0) of a masking sweep.

    Args:
        model: the model (the driver's; an executor's workers load their own by name).
        units: what to score; outcome: what a pass measures (see the module docstring).
        checked: the metrics, rates, modes, layers and scope
            (:func:`~mechgeom.analyses.faithfulness.rankings.check_sweep_settings`).
        seed: the random control's seed.
        batch_size: units per batch (one clean pass each).
        settings: the record's fingerprint (:func:`~mechgeom.analyses.faithfulness.rankings.sweep_settings`).
        record: the record's file (``.csv``/``.parquet``), rewritten after every item and resumed from;
            None keeps it in memory.
        extra_hooks: interventions attached first in every pass, clean and masked.
        executor: where the items run (default: this process, on ``model``).
        causal: False for an encoder (every real key is a source); masker: how sources are removed.
        by_length: batch the longest units together (right-padded units of different lengths).
        what, desc, verbose: the record's name in messages, the progress bar's label, whether to show it.

    Returns:
        The record without its setting columns: ``metric, mode, rate, unit_hash`` and the outcome's
        columns, one row per unit for the clean pass (metric and mode ``"clean"``, rate 0) and per
        (metric, mode, rate > 0).
    """
    store = RowStore(
        record,
        key=_STORE_KEYS,
        settings=settings,
        model=model,
        extra_hooks=extra_hooks,
        what=what,
        fresh=_FRESH,
    )
    keys = [(m, mode, r) for m in checked.metrics for mode in checked.modes for r in checked.rates if r > 0]
    work = MaskingWork(
        units, outcome, checked.layers, checked.scope, seed, tuple(extra_hooks), causal, masker
    )
    run_sweep(
        _items(units, keys, store, batch_size, by_length),
        work,
        store,
        executor=executor_for(model, executor),
        desc=desc,
        verbose=verbose,
    )
    rows = store.rows()
    rows["rate"] = rows["rate"].astype(float).map(rate_key)
    rows["unit_hash"] = rows["unit_hash"].astype(str)
    return rows


def unit_values(
    record: pd.DataFrame, key: tuple[str, str, float], hashes: list[str], column: str
) -> np.ndarray:
    """``column`` of the record's rows of ``key = (metric, mode, rate)``, one value per unit of ``hashes``."""
    sub = record[(record["metric"] == key[0]) & (record["mode"] == key[1]) & (record["rate"] == key[2])]
    by_hash = dict(zip(sub["unit_hash"], sub[column], strict=True))
    return np.array([by_hash[h] for h in hashes], dtype=np.float64)
