"""Causal faithfulness of attribution metrics: masking sources on ``hook_pattern`` (SPEC.md §A, paper A).

SPEC: "Removing source ``j`` from query ``i`` = setting ``alpha[h,i,j] = 0`` **without renormalising**
(this deletes ``alpha vt`` from ``o[i]``), as a hook on ``hook_pattern``." The sources of each query are
ranked from a clean pass by a metric of :mod:`mechgeom.analyses.contribution` or at random
(:mod:`mechgeom.analyses.rankings` fixes the ranking conventions: clean ranking and no re-ranking, ties,
NaN, the seeded random control); at removal rate ``r``, ``ceil(r * (i+1))`` sources of query ``i`` are
removed: the top-ranked (**comprehensiveness**: a larger ΔPPL is more faithful) or the bottom-ranked
(**sufficiency**: a smaller ΔPPL is more faithful).

- **Counting.** ``n_i = ceil(r * (i+1))`` with ``r * (i+1)`` rounded to 9 decimals first, so that
  ``0.3 * 10`` counts 3 sources and not 4 (binary floating point would give ``3.0000000000000004``).
  Rate 0 removes nothing (the hook then returns the clean pattern exactly); rate 1 removes every source,
  so ``hook_attn_out`` reads ``b_O``.

Sweeps (:func:`perplexity_curves`, :func:`task_accuracy_curves`) run one clean pass per batch of texts
(clean loss and every ranking), then one forward-only masked pass per (metric, mode, rate). With
``checkpoint`` they record per-text results after every masked pass and resume from them. ``extra_hooks``
(e.g. :func:`mechgeom.hooks.head_ablation_hooks`) are attached before the masking hooks in every pass,
clean and masked, so the curves are those of the modified model. :func:`faithfulness_summary` (ranks the
metrics on a ΔPPL table and judges paper A's claimed order) and :func:`area_ordering` live in
:mod:`mechgeom.analyses.rankings` and are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom._io import write_frame
from mechgeom.analyses.evaluation import bootstrap_ci, encode_choices, predicted_correct, target_logprob
from mechgeom.analyses.rankings import (
    FAITHFULNESS_METRICS,
    SCOPES,
    SourceRanking,
    _check_common,
    _clean_pass,
    _rkey,
    _settings,
    _unit_hash,
    area_ordering,
    faithfulness_summary,
    source_rankings,
)
from mechgeom.hooks import (
    MODES,
    FwdHook,
    mask_sources_hook,
    masking_hooks,
    n_removed,
    rank_sources,
    ranked_mask_hook,
    removal_interval,
    removal_mask,
    to_tokens,
)
from mechgeom.sweep import Executor, Item, RowStore, executor_for, run_sweep
from mechgeom.typing import Bool, Float, Tensor, Tokens

__all__ = [
    "DEFAULT_RATES",
    "FAITHFULNESS_METRICS",
    "MODES",
    "SCOPES",
    "SourceRanking",
    "area_ordering",
    "faithfulness_summary",
    "mask_sources_hook",
    "masking_hooks",
    "n_removed",
    "perplexity_curves",
    "rank_sources",
    "ranked_mask_hook",
    "removal_interval",
    "removal_mask",
    "source_rankings",
    "task_accuracy_curves",
]

#: SPEC's rates ``0, 0.1, ..., 0.9``.
DEFAULT_RATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

_CLEAN = "clean"
_FRESH = "delete the file or choose another checkpoint="


# --------------------------------------------------------------------------- scoring


def _masked_scores(
    model: Any, tokens: Tokens, targets: Bool[Tensor, "batch pos_minus_1"], fwd_hooks: Sequence[FwdHook]
) -> Float[Tensor, " batch"]:
    """One masked forward pass (forward only, no cache)."""
    return target_logprob(model, tokens, targets, fwd_hooks)


# --------------------------------------------------------------------------- the resumable sweep


@dataclass
class _Units:
    """Right-padded sequences to score; ``targets[u, t]`` = whether the prediction of token ``t+1`` counts."""

    tokens: Tokens
    lengths: list[int]
    targets: Bool[Tensor, "unit pos_minus_1"]
    hashes: list[str]

    def batches(self, batch_size: int, *, by_length: bool) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        if by_length:
            order.sort(key=lambda u: -self.lengths[u])
        return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


_STORE_KEYS = ["metric", "mode", "rate", "unit_hash"]


@dataclass
class _SweepWork:
    """The work of one sweep item (picklable): the clean rows of a batch or one (metric, mode, rate) pass.

    Items name their batch by its unit indices; the batch's clean pass (rankings, clean log-likelihoods,
    metric aliases) and its masked results are cached per worker, one batch at a time.
    """

    units: _Units
    layers: list[int]
    scope: str
    seed: int
    extra_hooks: tuple[FwdHook, ...] = ()
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def _batch(self, model: Any, idx: tuple[int, ...], needed: tuple[str, ...]) -> dict[str, Any]:
        if (idx, needed) not in self._cache:
            self._cache.clear()  # one batch at a time: its rankings live on the model's device
            pos = max(self.units.lengths[u] for u in idx)
            tokens = self.units.tokens[list(idx), :pos].to(model.cfg.device)
            targets = self.units.targets[list(idx), : pos - 1]
            rankings, clean_lp, n_pred = _clean_pass(
                model,
                tokens,
                targets,
                needed,
                scope=self.scope,
                layers=self.layers,
                seed=self.seed,
                lengths=[self.units.lengths[u] for u in idx],
                store_device=model.cfg.device,
                extra_hooks=self.extra_hooks,
            )
            # metrics whose rankings coincide on this batch (e.g. value_weighted and its per-query
            # normalised version, which differ only by a positive factor per query) share their passes
            alias: dict[str, str] = {}
            for m in needed:
                alias[m] = next((a for a in alias.values() if rankings[a].same_as(rankings[m])), m)
            self._cache[(idx, needed)] = {
                "tokens": tokens,
                "targets": targets,
                "rankings": rankings,
                "clean": clean_lp,
                "n_pred": n_pred,
                "alias": alias,
                "results": {},
            }
        return self._cache[(idx, needed)]  # type: ignore[no-any-return]

    def __call__(self, model: Any, item: Item) -> pd.DataFrame:
        idx, (m, mode, r) = item.batch, item.key[:3]
        b = self._batch(model, idx, item.data)
        if m == _CLEAN:
            logprob = b["clean"]
        else:
            shared = (b["alias"][m], mode, r)
            if shared not in b["results"]:
                hooks = [
                    *self.extra_hooks,
                    *masking_hooks(
                        model, ranking=b["rankings"][shared[0]], rate=r, mode=mode, layers=self.layers
                    ),
                ]
                b["results"][shared] = _masked_scores(model, b["tokens"], b["targets"], hooks)
            logprob = b["results"][shared]
        return pd.DataFrame(
            {
                "metric": m,
                "mode": mode,
                "rate": r,
                "unit_hash": [self.units.hashes[u] for u in idx],
                "logprob": logprob.double().numpy(),
                "n_pred": b["n_pred"].long().cpu().numpy(),
            }
        )


def _sweep(
    model: Any,
    units: _Units,
    *,
    metrics: tuple[str, ...],
    modes: tuple[str, ...],
    rates: tuple[float, ...],
    layers: list[int],
    scope: str,
    batch_size: int,
    seed: int,
    store: Path | None,
    settings: dict[str, Any],
    verbose: bool,
    by_length: bool,
    extra_hooks: tuple[FwdHook, ...] = (),
    executor: Executor | None = None,
) -> pd.DataFrame:
    """Per-unit target log-likelihoods for the clean pass and every (metric, mode, rate > 0).

    Rate 0 removes nothing, so its rows are the clean pass (the hook is exact at rate 0; see the tests).
    The work runs on :func:`mechgeom.sweep.run_sweep`: one item per batch's clean pass and per (metric,
    mode, rate, batch); with ``store`` each item's rows are appended to the record as it finishes and
    finished (key, unit) pairs are skipped on a rerun.
    """
    rows = RowStore(
        store,
        key=_STORE_KEYS,
        settings=settings,
        model=model,
        extra_hooks=extra_hooks,
        what="faithfulness record",
        fresh=_FRESH,
    )
    keys = [(m, mode, r) for m in metrics for mode in modes for r in rates if r > 0]
    items = []
    for b, idx in enumerate(units.batches(batch_size, by_length=by_length)):
        hashes = [units.hashes[u] for u in idx]
        pending = [k for k in keys if any((*k, h) not in rows for h in hashes)]
        needed = tuple(dict.fromkeys(k[0] for k in pending))  # the clean pass ranks only what is left
        for key in [(_CLEAN, _CLEAN, 0.0), *keys]:
            row_keys = tuple((*key, h) for h in hashes)
            items.append(Item(key=(*key, b), rows=row_keys, batch=tuple(idx), data=needed))
    run_sweep(
        items,
        _SweepWork(units, layers, scope, seed, tuple(extra_hooks)),
        rows,
        executor=executor_for(model, executor),
        desc="faithfulness: masked passes",
        verbose=verbose,
    )
    record = rows.frame.copy()
    record["rate"] = record["rate"].astype(float).map(_rkey)
    record["unit_hash"] = record["unit_hash"].astype(str)
    return record


def _unit_matrix(
    record: pd.DataFrame, key: tuple[str, str, float], hashes: list[str], column: str = "logprob"
) -> np.ndarray:
    sub = record[(record["metric"] == key[0]) & (record["mode"] == key[1]) & (record["rate"] == key[2])]
    by_hash = dict(zip(sub["unit_hash"], sub[column], strict=True))
    return np.array([by_hash[h] for h in hashes], dtype=np.float64)


def _side_path(checkpoint: Path, what: str) -> Path:
    return checkpoint.with_name(f"{checkpoint.stem}.{what}{checkpoint.suffix}")


def _check_checkpoint(checkpoint: str | Path | None) -> Path | None:
    if checkpoint is None:
        return None
    path = Path(checkpoint)
    if path.suffix not in (".csv", ".parquet"):
        raise ValueError(f"checkpoint must end in .csv or .parquet, got {path.name!r}")
    return path


# --------------------------------------------------------------------------- perplexity curves


def perplexity_curves(
    model: Any,
    tokens_or_text: Tensor | str | Sequence[str],
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float] = DEFAULT_RATES,
    modes: Sequence[str] = MODES,
    *,
    layers: int | Sequence[int] | None = None,
    scope: str = "intra",
    batch_size: int = 8,
    seed: int = 0,
    n_boot: int = 1000,
    checkpoint: str | Path | None = None,
    extra_hooks: Sequence[FwdHook] = (),
    executor: Executor | None = None,
    verbose: bool = False,
) -> pd.DataFrame:
    """ΔPPL of next-token prediction when each metric's top (comprehensiveness) or bottom (sufficiency)
    ``ceil(rate * (i+1))`` sources per query are removed at ``layers`` (default: all at once).

    SPEC: "ΔPPL = PPL(masked) − PPL(clean) of next-token prediction on the text; also report ΔNLL."
    PPL is ``exp`` of the mean over texts of each text's mean next-token NLL (equal-length windows, as
    :func:`mechgeom.analyses.evaluation.perplexity`); ``ci_low``/``ci_high`` are a 95% percentile bootstrap over
    texts of ΔPPL (:func:`mechgeom.analyses.evaluation.bootstrap_ci`, ``n_boot`` resamples, ``seed``).

    One clean pass per batch of ``batch_size`` texts gives the clean loss and every ranking; each
    (metric, mode, rate > 0) then costs one masked forward; rate 0 is the clean pass. Metrics whose
    rankings coincide on a batch share their masked passes. Rankings come from the clean pass; the
    masked pass does not re-rank. ``extra_hooks`` are attached before ours in every pass (clean and
    masked): "clean" then means the model with those hooks. ``verbose`` shows a progress bar.

    Returns a tidy DataFrame, one row per (metric, mode, rate): ``metric, mode, rate, ppl, delta_ppl,
    delta_nll, ci_low, ci_high, clean_ppl, n_texts, layers, scope, seed``.

    With ``checkpoint`` (``.csv`` or ``.parquet``) the table is written there atomically, and per-text
    results go to the store ``<stem>.per_text<suffix>`` after every masked pass (:mod:`mechgeom.sweep`); a
    rerun of the same experiment (the model's weights and dtype, layers, scope, seed, and the code and data of
    ``extra_hooks``: ``docs/sweeps.md``) skips every (metric, mode, rate, text) already recorded, so an
    interrupted sweep resumes without duplicate or lost rows (texts are matched by content, so a larger
    corpus that starts with the same windows extends an earlier run). Another experiment raises
    ``ValueError`` naming each difference.

    ``executor`` runs the sweep's items elsewhere, e.g. :class:`mechgeom.sweep.RayExecutor` on actors that
    each load the same model by name (default: in this process, on ``model``); the table is the same.
    """
    metrics_t, rates_t, modes_t, chosen, scope = _check_common(
        model, metrics, rates, modes, layers, scope, batch_size
    )
    tokens = tokens_or_text
    if isinstance(tokens, Tensor) and (tokens.ndim != 2 or tokens.shape[0] == 0):
        raise ValueError(
            f"empty corpus: need [n_texts >= 1, pos >= 2] tokens, got shape {tuple(tokens.shape)}"
        )
    if not isinstance(tokens, Tensor) and not isinstance(tokens, str) and len(tokens) == 0:
        raise ValueError("empty corpus: give at least one text")
    toks = to_tokens(model, tokens, min_pos=2, what="perplexity (a token to predict)").cpu()
    if toks.shape[1] < 2:
        raise ValueError(f"texts need at least 2 tokens to predict one, got {toks.shape[1]}")
    path = _check_checkpoint(checkpoint)
    n, pos = toks.shape
    units = _Units(
        tokens=toks,
        lengths=[pos] * n,
        targets=torch.ones(n, pos - 1, dtype=torch.bool),
        hashes=[_unit_hash(t) for t in toks],
    )
    settings = _settings(model, chosen, scope, seed)
    record = _sweep(
        model,
        units,
        metrics=metrics_t,
        modes=modes_t,
        rates=rates_t,
        layers=chosen,
        scope=scope,
        batch_size=int(batch_size),
        seed=seed,
        store=None if path is None else _side_path(path, "per_text"),
        settings=settings,
        verbose=verbose,
        by_length=False,
        extra_hooks=tuple(extra_hooks),
        executor=executor,
    )
    frame = _ppl_summary(record, units.hashes, metrics_t, modes_t, rates_t, n_boot=n_boot, seed=seed)
    frame = frame.assign(n_texts=n, layers=settings["layers"], scope=scope, seed=seed)
    if path is not None:
        write_frame(frame, path)
    return frame


def _delta_ppl(x: np.ndarray) -> float:
    """ΔPPL of resampled rows ``[masked NLL, clean NLL]``: ``exp(mean masked) − exp(mean clean)``."""
    return float(np.exp(x[:, 0].mean()) - np.exp(x[:, 1].mean()))


def _ppl_summary(
    record: pd.DataFrame,
    hashes: list[str],
    metrics: tuple[str, ...],
    modes: tuple[str, ...],
    rates: tuple[float, ...],
    *,
    n_boot: int,
    seed: int,
) -> pd.DataFrame:
    clean_key = (_CLEAN, _CLEAN, 0.0)
    n_pred = _unit_matrix(record, clean_key, hashes, "n_pred")
    clean = -_unit_matrix(record, clean_key, hashes) / n_pred
    clean_ppl = float(np.exp(clean.mean()))
    rows = []
    for m in metrics:
        for mode in modes:
            for r in rates:
                nll = clean if r == 0 else -_unit_matrix(record, (m, mode, r), hashes) / n_pred
                lo, hi = bootstrap_ci(np.stack([nll, clean], axis=1), _delta_ppl, n_boot=n_boot, seed=seed)
                ppl = float(np.exp(nll.mean()))
                rows.append(
                    {
                        "metric": m,
                        "mode": mode,
                        "rate": r,
                        "ppl": ppl,
                        "delta_ppl": ppl - clean_ppl,
                        "delta_nll": float((nll - clean).mean()),
                        "ci_low": lo,
                        "ci_high": hi,
                        "clean_ppl": clean_ppl,
                    }
                )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- downstream accuracy


def _task_units(model: Any, items: Sequence[Any], max_len: int) -> tuple[_Units, list[tuple[int, int]]]:
    """One unit per (item, choice): the prompt then the choice, as :func:`~mechgeom.analyses.evaluation.encode_choices`
    tokenises them (the prompt with the model's BOS default, each choice without; a long prompt loses tokens
    from the left so that every ``prompt + choice`` fits in ``max_len``). Targets are the predictions of the
    choice tokens.
    """
    seqs: list[list[int]] = []
    n_ctx: list[int] = []
    owner: list[tuple[int, int]] = []
    for i, enc in enumerate(encode_choices(model, items, max_len)):
        for c, cont in enumerate(enc.choices):
            seqs.append(enc.prompt + cont)
            n_ctx.append(len(enc.prompt))
            owner.append((i, c))
    pos = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), pos, dtype=torch.long)
    targets = torch.zeros(len(seqs), pos - 1, dtype=torch.bool)
    for u, s in enumerate(seqs):
        tokens[u, : len(s)] = torch.tensor(s)
        targets[u, n_ctx[u] - 1 : len(s) - 1] = True
    hashes = [_unit_hash(tokens[u, : len(s)], n_ctx[u]) for u, s in enumerate(seqs)]
    return _Units(tokens=tokens, lengths=[len(s) for s in seqs], targets=targets, hashes=hashes), owner


def task_accuracy_curves(
    model: Any,
    items: Sequence[Any],
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float] = DEFAULT_RATES,
    modes: Sequence[str] = MODES,
    *,
    layers: int | Sequence[int] | None = None,
    scope: str = "intra",
    batch_size: int = 4,
    seed: int = 0,
    max_len: int | None = None,
    n_boot: int = 1000,
    checkpoint: str | Path | None = None,
    extra_hooks: Sequence[FwdHook] = (),
    executor: Executor | None = None,
    verbose: bool = False,
) -> pd.DataFrame:
    """Accuracy on multiple-choice items (:func:`mechgeom.data.load_task`) under the same masking.

    SPEC: "accuracy change on multiple-choice / yes-no items (BoolQ, Winogrande, MMLU), each choice scored
    by its log-likelihood under the same masking." Each choice's score is the summed log-likelihood of its
    tokens given the prompt (prompt and choice tokenised separately, the model's BOS default), with the
    masking hooks at every position; the ranking comes from the clean pass of that prompt+choice sequence.
    The prediction is the highest-scoring choice (ties: the first); ``accuracy`` is the share of items
    predicted right (``accuracy_ci_low``/``accuracy_ci_high``: its 95% bootstrap over items, to set beside
    the task's chance rate), ``delta_accuracy`` its change from the clean pass, ``ci_low``/``ci_high`` a 95%
    bootstrap over items of Δaccuracy.

    Sequences are right-padded in batches of similar length (padding never reaches a scored position);
    ``max_len`` (default ``n_ctx``) trims long prompts from the left. Rows: one per (task, metric, mode,
    rate), plus ``task="all"`` when the items mix tasks: ``task, metric, mode, rate, accuracy,
    accuracy_ci_low, accuracy_ci_high, delta_accuracy, ci_low, ci_high, clean_accuracy, n_items, layers, scope, seed``. ``checkpoint``, resume
    ``extra_hooks`` and ``executor`` work as in :func:`perplexity_curves` (per-choice record
    ``<stem>.per_choice<suffix>``).
    """
    metrics_t, rates_t, modes_t, chosen, scope = _check_common(
        model, metrics, rates, modes, layers, scope, batch_size
    )
    items = list(items)
    if not items:
        raise ValueError("no items: give at least one task item (see mechgeom.data.load_task)")
    path = _check_checkpoint(checkpoint)
    limit = int(model.cfg.n_ctx) if max_len is None else int(max_len)
    if not 2 <= limit <= int(model.cfg.n_ctx):
        raise ValueError(f"max_len must be in [2, n_ctx={model.cfg.n_ctx}], got {max_len}")
    units, owner = _task_units(model, items, limit)
    settings = _settings(model, chosen, scope, seed)
    record = _sweep(
        model,
        units,
        metrics=metrics_t,
        modes=modes_t,
        rates=rates_t,
        layers=chosen,
        scope=scope,
        batch_size=int(batch_size),
        seed=seed,
        store=None if path is None else _side_path(path, "per_choice"),
        settings=settings,
        verbose=verbose,
        by_length=True,
        extra_hooks=tuple(extra_hooks),
        executor=executor,
    )
    frame = _accuracy_summary(
        record, units.hashes, owner, items, metrics_t, modes_t, rates_t, n_boot=n_boot, seed=seed
    )
    frame = frame.assign(layers=settings["layers"], scope=scope, seed=seed)
    if path is not None:
        write_frame(frame, path)
    return frame


def _correct(scores: np.ndarray, owner: list[tuple[int, int]], items: Sequence[Any]) -> np.ndarray:
    """1.0 where the highest-scoring choice (first on ties) is the answer, per item
    (:func:`~mechgeom.analyses.evaluation.predicted_correct`)."""
    per_item: list[list[float]] = [[-math.inf] * len(it.choices) for it in items]
    for u, (i, c) in enumerate(owner):
        per_item[i][c] = float(scores[u])
    return predicted_correct(per_item, [int(it.answer) for it in items])


def _accuracy_summary(
    record: pd.DataFrame,
    hashes: list[str],
    owner: list[tuple[int, int]],
    items: Sequence[Any],
    metrics: tuple[str, ...],
    modes: tuple[str, ...],
    rates: tuple[float, ...],
    *,
    n_boot: int,
    seed: int,
) -> pd.DataFrame:
    clean = _correct(_unit_matrix(record, (_CLEAN, _CLEAN, 0.0), hashes), owner, items)
    tasks = np.array([str(getattr(it, "task", "items")) for it in items])
    groups = list(dict.fromkeys(tasks.tolist()))
    if len(groups) > 1:
        groups.append("all")
    rows = []
    for m in metrics:
        for mode in modes:
            for r in rates:
                masked = (
                    clean if r == 0 else _correct(_unit_matrix(record, (m, mode, r), hashes), owner, items)
                )
                for g in groups:
                    sel = np.ones(len(items), dtype=bool) if g == "all" else tasks == g
                    diff = masked[sel] - clean[sel]
                    lo, hi = bootstrap_ci(diff, n_boot=n_boot, seed=seed)
                    acc_lo, acc_hi = bootstrap_ci(masked[sel], n_boot=n_boot, seed=seed)
                    rows.append(
                        {
                            "task": g,
                            "metric": m,
                            "mode": mode,
                            "rate": r,
                            "accuracy": float(masked[sel].mean()),
                            "accuracy_ci_low": acc_lo,
                            "accuracy_ci_high": acc_hi,
                            "delta_accuracy": float(diff.mean()),
                            "ci_low": lo,
                            "ci_high": hi,
                            "clean_accuracy": float(clean[sel].mean()),
                            "n_items": int(sel.sum()),
                        }
                    )
    return pd.DataFrame(rows)
