"""Causal faithfulness of attribution metrics: masking sources on ``hook_pattern`` (``docs/definitions.md`` §3, paper A).

``docs/definitions.md`` §3.1: "removing source ``j`` from query ``i`` = setting ``alpha[h,i,j] = 0`` **without renormalising**
(this deletes ``alpha vt`` from ``o[i]``), as a hook on ``hook_pattern``." The sources of each query are
ranked from a clean pass by a metric of :mod:`mechgeom.analyses.contribution.weights` or at random
(:mod:`mechgeom.analyses.faithfulness.rankings` fixes the ranking conventions: clean ranking and no re-ranking, ties,
NaN, the seeded random control); at removal rate ``r``, ``ceil(r * (i+1))`` sources of query ``i`` are
removed: the top-ranked (**comprehensiveness**: a larger ΔPPL is more faithful) or the bottom-ranked
(**sufficiency**: a smaller ΔPPL is more faithful).

- **Counting.** ``n_i = ceil(r * (i+1))`` with ``r * (i+1)`` rounded to 9 decimals first, so that
  ``0.3 * 10`` counts 3 sources and not 4 (binary floating point would give ``3.0000000000000004``).
  Rate 0 removes nothing (the hook then returns the clean pattern exactly); rate 1 removes every source,
  so ``hook_attn_out`` reads ``b_O``.

Both sweeps (:func:`perplexity_curves`, :func:`task_accuracy_curves`) are specialisations of the masking
harness (:mod:`mechgeom.analyses.faithfulness.harness`): one clean pass per batch of texts (clean loss and
every ranking), then one forward-only masked pass per (metric, mode, rate), on the sweep engine. With
``checkpoint`` they record per-text results after every masked pass and resume from them. ``extra_hooks``
(e.g. :func:`mechgeom.hooks.head_ablation_hooks`) are attached before the masking hooks in every pass,
clean and masked, so the curves are those of the modified model. ``metrics`` may name any registered
ranking method (:func:`mechgeom.analyses.faithfulness.rankings.ranking_methods`).
:func:`~mechgeom.analyses.faithfulness.rankings.faithfulness_summary` ranks the metrics on a ΔPPL table
and judges paper A's claimed order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom._deprecation import keyword_only
from mechgeom._io import write_frame
from mechgeom.analyses.faithfulness.harness import (
    CLEAN,
    UnitBatch,
    Units,
    check_checkpoint,
    masking_sweep,
    record_path,
    unit_values,
)
from mechgeom.analyses.faithfulness.rankings import (
    DEFAULT_RATES,
    FAITHFULNESS_METRICS,
    SweepSettings,
    check_sweep_settings,
    sweep_settings,
    unit_hash,
)
from mechgeom.analyses.scoring import (
    bootstrap_ci,
    encode_choices,
    predicted_correct,
    prediction_targets,
    target_logprob,
)
from mechgeom.hooks import MODES, FwdHook, check_decoder, to_batch
from mechgeom.sweep import Executor
from mechgeom.typing import Tensor

__all__ = [
    "DEFAULT_RATES",
    "TargetLogprob",
    "perplexity_curves",
    "task_accuracy_curves",
]


@dataclass(frozen=True)
class TargetLogprob:
    """The decoders' outcome: each unit's summed log-likelihood of its target tokens
    (:func:`~mechgeom.analyses.scoring.target_logprob`, forward only), recorded with the number of
    predictions ``n_pred``."""

    def measure(self, model: Any, batch: UnitBatch, hooks: Sequence[FwdHook]) -> Tensor:
        assert batch.targets is not None, "decoder units carry their targets"
        return target_logprob(model, batch.tokens, batch.targets, hooks, attention_mask=batch.mask)

    def clean_columns(self, batch: UnitBatch, clean: Tensor) -> dict[str, Any]:
        return self.masked_columns(batch, clean, clean)

    def masked_columns(self, batch: UnitBatch, masked: Tensor, clean: Tensor) -> dict[str, Any]:
        assert batch.targets is not None
        return {"logprob": masked.double().numpy(), "n_pred": batch.targets.sum(-1).long().cpu().numpy()}


def _decoder_record(
    model: Any, units: Units, checked: SweepSettings, **options: Any
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The harness on decoder units with the ``checked`` settings (:func:`check_sweep_settings`) and the
    engine's ``options`` (:func:`~mechgeom.analyses.faithfulness.harness.masking_sweep`): the record and
    its settings fingerprint."""
    settings = sweep_settings(model, checked.layers, checked.scope, options["seed"])
    return masking_sweep(model, units, TargetLogprob(), checked, settings=settings, **options), settings


# --------------------------------------------------------------------------- perplexity curves


@keyword_only("metrics", "rates", "modes")
def perplexity_curves(
    model: Any,
    tokens_or_text: Tensor | str | Sequence[str],
    *,
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float] = DEFAULT_RATES,
    modes: Sequence[str] = MODES,
    layers: int | Sequence[int] | None = None,
    scope: str = "intra",
    attention_mask: Tensor | None = None,
    batch_size: int = 8,
    seed: int = 0,
    n_boot: int = 1000,
    checkpoint: str | Path | None = None,
    extra_hooks: Sequence[FwdHook] = (),
    executor: Executor | None = None,
    per_text: bool = False,
    verbose: bool = False,
) -> pd.DataFrame:
    """ΔPPL of next-token prediction when each metric's top (comprehensiveness) or bottom (sufficiency)
    ``ceil(rate * (i+1))`` sources per query are removed at ``layers`` (default: all at once).

    ``docs/definitions.md`` §3.4: "ΔPPL = PPL(masked) − PPL(clean) of next-token prediction on the text; also report ΔNLL."
    PPL is ``exp`` of the mean over texts of each text's mean next-token NLL (equal-length windows, as
    :func:`mechgeom.analyses.scoring.perplexity`); ``ci_low``/``ci_high`` are a 95% percentile bootstrap over
    texts of ΔPPL (:func:`mechgeom.analyses.scoring.bootstrap_ci`, ``n_boot`` resamples, ``seed``).

    **Padding.** Texts of different lengths are padded (``attention_mask``; for a list of texts the default
    is derived by :func:`~mechgeom.hooks.to_batch`, on the tokenizer's ``padding_side``, left or right).
    Every pass runs with the mask; a pad is never a target nor predicted (each text's mean NLL is over its
    own real predictions), never ranked among a query's sources, never removed, and a padded query
    removes nothing: a query ``i`` of a text has its ``i + 1`` real sources, ``i`` counted inside the text.
    Each text's numbers are those it has run alone (to float rounding), and PPL pools them as above.

    One clean pass per batch of ``batch_size`` texts gives the clean loss and every ranking; each
    (metric, mode, rate > 0) then costs one masked forward; rate 0 is the clean pass. Metrics whose
    rankings coincide on a batch share their masked passes. Rankings come from the clean pass; the
    masked pass does not re-rank. ``extra_hooks`` are attached before ours in every pass (clean and
    masked): "clean" then means the model with those hooks. ``verbose`` shows a progress bar.

    Returns a tidy DataFrame, one row per (metric, mode, rate): ``metric, mode, rate, ppl, delta_ppl,
    delta_nll, ci_low, ci_high, clean_ppl, n_texts, layers, scope, seed``. With ``per_text=True``, one row
    per (metric, mode, rate, text) instead: ``metric, mode, rate, text, unit_hash, n_pred, nll, ppl,
    clean_nll, clean_ppl, delta_nll, delta_ppl`` (the text's own numbers; ``text`` its index in the input).

    With ``checkpoint`` (``.csv`` or ``.parquet``) the table is written there atomically, and per-text
    results go to ``<stem>.per_text<suffix>`` after every masked pass; a rerun with the same settings
    (model, layers, scope, seed, ``extra_hooks`` by a stable repr) skips every (metric, mode, rate, text)
    already recorded, so an interrupted sweep resumes without duplicate or lost rows (texts are matched by
    the content of their real tokens, so a larger corpus that starts with the same windows extends an
    earlier run, and a text's rows serve it whatever its padding). Different settings raise ``ValueError``.

    ``executor`` runs the sweep's items elsewhere, e.g. :class:`mechgeom.sweep.RayExecutor` on actors that
    each load the same model by name (default: in this process, on ``model``); the table is the same.
    """
    check_decoder(model)
    checked = check_sweep_settings(model, metrics, rates, modes, layers, scope, batch_size)
    tokens = tokens_or_text
    if isinstance(tokens, Tensor) and (tokens.ndim != 2 or tokens.shape[0] == 0):
        raise ValueError(
            f"empty corpus: need [n_texts >= 1, pos >= 2] tokens, got shape {tuple(tokens.shape)}"
        )
    if not isinstance(tokens, Tensor) and not isinstance(tokens, str) and len(tokens) == 0:
        raise ValueError("empty corpus: give at least one text")
    units = _text_units(model, tokens, attention_mask)
    path = check_checkpoint(checkpoint)
    record, settings = _decoder_record(
        model, units, checked, batch_size=int(batch_size), seed=seed,
        record=None if path is None else record_path(path, "per_text"),
        extra_hooks=extra_hooks, executor=executor, verbose=verbose, by_length=False,
    )  # fmt: skip
    frame = _ppl_summary(record, units.hashes, checked, n_boot=n_boot, seed=seed)
    n = len(units.hashes)
    frame = frame.assign(n_texts=n, layers=settings["layers"], scope=settings["scope"], seed=seed)
    if path is not None:
        write_frame(frame, path)
    return _ppl_per_text(record, units.hashes, checked) if per_text else frame


def _text_units(model: Any, tokens_or_text: Any, attention_mask: Tensor | None) -> Units:
    """Texts as decoder units (:func:`~mechgeom.hooks.to_batch`): ids and real-token mask on the CPU, the
    targets every prediction between two real tokens, named by the content hash of the real tokens (an
    unpadded text keeps the name it always had)."""
    toks, mask = to_batch(
        model,
        tokens_or_text,
        attention_mask=attention_mask,
        min_pos=2,
        what="perplexity (a token to predict)",
    )
    toks = toks.cpu()
    if toks.shape[1] < 2:
        raise ValueError(f"texts need at least 2 tokens to predict one, got {toks.shape[1]}")
    real = torch.ones(toks.shape, dtype=torch.bool) if mask is None else mask.cpu()
    pos = torch.arange(toks.shape[1])
    span = torch.where(real, pos, -1).amax(-1) - torch.where(real, pos, toks.shape[1]).amin(-1) + 1
    gaps = (span != real.sum(-1)).nonzero().flatten().tolist()
    if gaps:
        raise ValueError(
            f"attention_mask marks padding inside text(s) {gaps}: a text's real tokens must be contiguous "
            "(padding on the left or on the right only)"
        )
    hashes = [unit_hash(toks[t][real[t]]) for t in range(toks.shape[0])]
    return Units(toks, real, hashes, prediction_targets(real, *toks.shape))


def _delta_ppl(x: np.ndarray) -> float:
    """ΔPPL of resampled rows ``[masked NLL, clean NLL]``: ``exp(mean masked) − exp(mean clean)``."""
    return float(np.exp(x[:, 0].mean()) - np.exp(x[:, 1].mean()))


def _ppl_per_text(record: pd.DataFrame, hashes: list[str], checked: SweepSettings) -> pd.DataFrame:
    """One row per (metric, mode, rate, text): the text's own NLL and PPL, masked and clean."""
    clean_key = (CLEAN, CLEAN, 0.0)
    n_pred = unit_values(record, clean_key, hashes, "n_pred")
    clean = -unit_values(record, clean_key, hashes, "logprob") / n_pred
    frames = []
    for m, mode, r in itertools.product(checked.metrics, checked.modes, checked.rates):
        nll = clean if r == 0 else -unit_values(record, (m, mode, r), hashes, "logprob") / n_pred
        frames.append(
            pd.DataFrame(
                {
                    "metric": m,
                    "mode": mode,
                    "rate": r,
                    "text": np.arange(len(hashes)),
                    "unit_hash": hashes,
                    "n_pred": n_pred.astype(np.int64),
                    "nll": nll,
                    "ppl": np.exp(nll),
                    "clean_nll": clean,
                    "clean_ppl": np.exp(clean),
                    "delta_nll": nll - clean,
                    "delta_ppl": np.exp(nll) - np.exp(clean),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def _ppl_summary(
    record: pd.DataFrame,
    hashes: list[str],
    checked: SweepSettings,
    *,
    n_boot: int,
    seed: int,
) -> pd.DataFrame:
    clean_key = (CLEAN, CLEAN, 0.0)
    n_pred = unit_values(record, clean_key, hashes, "n_pred")
    clean = -unit_values(record, clean_key, hashes, "logprob") / n_pred
    clean_ppl = float(np.exp(clean.mean()))
    rows = []
    for m, mode, r in itertools.product(checked.metrics, checked.modes, checked.rates):
        nll = clean if r == 0 else -unit_values(record, (m, mode, r), hashes, "logprob") / n_pred
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


def _task_units(model: Any, items: Sequence[Any], max_len: int) -> tuple[Units, list[tuple[int, int]]]:
    """One unit per (item, choice): the prompt then the choice, as :func:`~mechgeom.analyses.scoring.encode_choices`
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
    hashes = [unit_hash(tokens[u, : len(s)], n_ctx[u]) for u, s in enumerate(seqs)]
    return Units.prefixes(tokens, [len(s) for s in seqs], hashes, targets), owner


@keyword_only("metrics", "rates", "modes")
def task_accuracy_curves(
    model: Any,
    items: Sequence[Any],
    *,
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float] = DEFAULT_RATES,
    modes: Sequence[str] = MODES,
    layers: int | Sequence[int] | None = None,
    scope: str = "intra",
    batch_size: int = 8,
    seed: int = 0,
    max_len: int | None = None,
    n_boot: int = 1000,
    checkpoint: str | Path | None = None,
    extra_hooks: Sequence[FwdHook] = (),
    executor: Executor | None = None,
    verbose: bool = False,
) -> pd.DataFrame:
    """Accuracy on multiple-choice items (:func:`mechgeom.data.load_task`) under the same masking.

    ``docs/definitions.md`` §3.5: "accuracy change on multiple-choice / yes-no items (BoolQ, Winogrande, MMLU), each choice scored
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
    check_decoder(model)
    checked = check_sweep_settings(model, metrics, rates, modes, layers, scope, batch_size)
    items = list(items)
    if not items:
        raise ValueError("no items: give at least one task item (see mechgeom.data.load_task)")
    path = check_checkpoint(checkpoint)
    limit = int(model.cfg.n_ctx) if max_len is None else int(max_len)
    if not 2 <= limit <= int(model.cfg.n_ctx):
        raise ValueError(f"max_len must be in [2, n_ctx={model.cfg.n_ctx}], got {max_len}")
    units, owner = _task_units(model, items, limit)
    record, settings = _decoder_record(
        model, units, checked, batch_size=int(batch_size), seed=seed,
        record=None if path is None else record_path(path, "per_choice"),
        extra_hooks=extra_hooks, executor=executor, verbose=verbose, by_length=True,
    )  # fmt: skip
    frame = _accuracy_summary(record, units.hashes, owner, items, checked, n_boot=n_boot, seed=seed)
    frame = frame.assign(layers=settings["layers"], scope=settings["scope"], seed=seed)
    if path is not None:
        write_frame(frame, path)
    return frame


def _correct(scores: np.ndarray, owner: list[tuple[int, int]], items: Sequence[Any]) -> np.ndarray:
    """1.0 where the highest-scoring choice (first on ties) is the answer, per item
    (:func:`~mechgeom.analyses.scoring.predicted_correct`)."""
    per_item: list[list[float]] = [[-math.inf] * len(it.choices) for it in items]
    for u, (i, c) in enumerate(owner):
        per_item[i][c] = float(scores[u])
    return predicted_correct(per_item, [int(it.answer) for it in items])


def _accuracy_summary(
    record: pd.DataFrame,
    hashes: list[str],
    owner: list[tuple[int, int]],
    items: Sequence[Any],
    checked: SweepSettings,
    *,
    n_boot: int,
    seed: int,
) -> pd.DataFrame:
    clean = _correct(unit_values(record, (CLEAN, CLEAN, 0.0), hashes, "logprob"), owner, items)
    tasks = np.array([str(getattr(it, "task", "items")) for it in items])
    groups = list(dict.fromkeys(tasks.tolist()))
    if len(groups) > 1:
        groups.append("all")
    rows = []
    for m, mode, r in itertools.product(checked.metrics, checked.modes, checked.rates):
        masked = (
            clean if r == 0 else _correct(unit_values(record, (m, mode, r), hashes, "logprob"), owner, items)
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
