"""Causal faithfulness of attribution metrics: masking sources on ``hook_pattern`` (SPEC.md §A, paper A).

SPEC: "Removing source ``j`` from query ``i`` = setting ``alpha[h,i,j] = 0`` **without renormalising**
(this deletes ``alpha vt`` from ``o[i]``), as a hook on ``hook_pattern``." The sources of each query are
ranked by a metric of :mod:`mechgeom.analyses.contribution` (intra-head metrics rank per head, inter-head metrics
rank once per layer and apply to every head) or at random; at removal rate ``r``, ``ceil(r * (i+1))``
sources of query ``i`` are removed: the top-ranked (**comprehensiveness**: a larger ΔPPL is more
faithful) or the bottom-ranked (**sufficiency**: a smaller ΔPPL is more faithful).

Conventions fixed here (keyword arguments keep the defaults):

- **Clean ranking, no re-ranking.** Rankings are computed once, from a clean forward pass (no hooks of
  ours); the masked pass applies that ranking at every chosen layer and never re-ranks, even though the
  masked pass's own activations at later layers differ from the clean ones.
- **Ranking.** Per query ``i``, only sources ``j <= i`` are ranked (``j > i`` are never counted and
  never removed). Sources are sorted by the **signed** metric value, largest first (rank 0 = top), with
  a stable sort, so ties go to the **lower position first**. A NaN metric value (a zero output norm,
  see :mod:`mechgeom.analyses.contribution`) ranks **below every finite value**; inside a fully NaN row the
  order is by position.
- **Counting.** ``n_i = ceil(r * (i+1))`` with ``r * (i+1)`` rounded to 9 decimals first, so that
  ``0.3 * 10`` counts 3 sources and not 4 (binary floating point would give ``3.0000000000000004``).
  Rate 0 removes nothing (the hook then returns the clean pattern exactly); rate 1 removes every source,
  so ``hook_attn_out`` reads ``b_O``.
- **Per-query normalisation does not change a ranking.** ``value_weighted_normalized`` is
  ``value_weighted`` divided by one positive number per query (``‖o[i,h]‖`` or ``‖o[i]‖``), so both rank
  the sources of a query identically (up to ties made by rounding) and give the same curves; sweeps
  detect identical rankings and run their masked passes once.
- **Random control.** ``metric="random"`` ranks by uniform noise drawn from a generator seeded with
  ``(seed, content hash of the text, layer)``: reproducible for a seed, independent of batching.
- **Storage.** Ranks are stored as the per-query rank of each source in the smallest integer dtype
  (uint8 up to 256 positions); the hook builds the boolean mask on the fly from ``(rank, rate, mode)``.

Sweeps (:func:`perplexity_curves`, :func:`task_accuracy_curves`) run one clean pass per batch of texts
(clean loss and every ranking), then one forward-only masked pass per (metric, mode, rate). With ``out``
they record per-text results after every masked pass and resume from them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom._io import write_frame
from mechgeom.analyses.contribution import (
    INTER_METRICS,
    INTRA_METRICS,
    RANKING_METRICS,
    ContributionCollector,
)
from mechgeom.analyses.evaluation import bootstrap_ci
from mechgeom.hooks import (
    MODES,
    FwdHook,
    check_decoder,
    check_index,
    check_mode,
    check_rate,
    mask_sources_hook,
    masking_hooks,
    n_removed,
    rank_sources,
    ranked_mask_hook,
    removal_interval,
    removal_mask,
    resolve_layers,
    to_tokens,
)
from mechgeom.sweep import Item, LocalExecutor, RowStore, run_sweep
from mechgeom.typing import Bool, Float, Int, SourceRanks, Tensor, Tokens

__all__ = [
    "DEFAULT_RATES",
    "FAITHFULNESS_METRICS",
    "MODES",
    "SCOPES",
    "SourceRanking",
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

#: Intra-head metrics rank per head; inter-head metrics rank once per layer and apply to all heads.
SCOPES = ("intra", "inter")
#: The metrics compared by default: paper A's four, in its claimed order, and the random control.
FAITHFULNESS_METRICS = (*RANKING_METRICS, "random")
#: SPEC's rates ``0, 0.1, ..., 0.9``.
DEFAULT_RATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

_CLEAN = "clean"


# --------------------------------------------------------------------------- validation


def _check_rates(rates: Sequence[float]) -> tuple[float, ...]:
    if isinstance(rates, (int, float)):
        rates = (rates,)
    out = tuple(dict.fromkeys(_rkey(check_rate(r)) for r in rates))
    if not out:
        raise ValueError("rates is empty; give at least one rate in [0, 1]")
    return out


def _check_modes(modes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(modes, str):
        modes = (modes,)
    out = tuple(dict.fromkeys(check_mode(m) for m in modes))
    if not out:
        raise ValueError(f"modes is empty; choose from {list(MODES)}")
    return out


def _check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise ValueError(
            f"unknown scope {scope!r}; choose 'intra' (rank per head) or 'inter' (rank per layer)"
        )
    return scope


def _check_metrics(metrics: Sequence[str], scope: str) -> tuple[str, ...]:
    if isinstance(metrics, str):
        metrics = (metrics,)
    allowed = (*(INTRA_METRICS if scope == "intra" else INTER_METRICS), "random")
    unknown = [m for m in metrics if m not in allowed]
    if unknown:
        raise ValueError(f"unknown {scope}-head ranking metric(s) {unknown}; choose from {list(allowed)}")
    out = tuple(dict.fromkeys(metrics))
    if not out:
        raise ValueError(f"metrics is empty; choose from {list(allowed)}")
    return out


def _rkey(rate: float) -> float:
    """Rates are compared and stored rounded to 10 decimals (so CSV round trips match)."""
    return round(float(rate), 10)


# --------------------------------------------------------------------------- ranking maths


# --------------------------------------------------------------------------- hooks


@dataclass
class SourceRanking:
    """Per-query rankings of the sources at each layer, computed from a clean pass.

    ``ranks[layer]`` is ``[batch, head_index, q, k]`` (``scope="intra"``) or ``[batch, 1, q, k]``
    (``scope="inter"``, one ranking applied to every head): the rank of source ``j`` among the sources
    ``j' <= i`` of query ``i`` (0 = top-ranked). The masked pass uses these clean ranks; it never re-ranks.
    """

    metric: str
    scope: str
    ranks: dict[int, SourceRanks]
    seed: int | None = None
    unit_hashes: list[str] = field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        return list(self.ranks)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.ranks.values())

    def mask(self, layer: int, rate: float, mode: str) -> Bool[Tensor, "batch rank_head query_pos key_pos"]:
        """The boolean removal mask of ``layer`` (True = removed) at ``rate`` and ``mode``."""
        if layer not in self.ranks:
            raise IndexError(f"layer {layer} was not ranked; ranked layers are {self.layers}")
        return removal_mask(self.ranks[layer], rate, mode)

    def same_as(self, other: SourceRanking) -> bool:
        """Whether two rankings would remove exactly the same sources at every rate and mode."""
        return self.ranks.keys() == other.ranks.keys() and all(
            torch.equal(self.ranks[la], other.ranks[la]) for la in self.ranks
        )

    def to_frame(self, *, batch: int = 0, layer: int | None = None) -> pd.DataFrame:
        """Tidy table: ``layer, head, query, key, rank`` for ``key <= query`` (head -1 = whole layer).

        ``batch`` and ``layer`` are checked: out of range raises ``IndexError`` naming the valid range."""
        frames = []
        sel = self.layers if layer is None else [layer]
        for la in sel:
            if la not in self.ranks:
                raise IndexError(f"layer {la} was not ranked; ranked layers are {self.layers}")
        for la in sel:
            r = self.ranks[la][check_index(batch, self.ranks[la].shape[0], "batch")]  # [rank_head, q, k]
            qq, kk = torch.tril_indices(r.shape[-2], r.shape[-1])
            for h in range(r.shape[0]):
                frames.append(
                    pd.DataFrame(
                        {
                            "layer": la,
                            "head": h if self.scope == "intra" else -1,
                            "query": qq.numpy(),
                            "key": kk.numpy(),
                            "rank": r[h, qq, kk].long().cpu().numpy(),
                        }
                    )
                )
        return pd.concat(frames, ignore_index=True)


# --------------------------------------------------------------------------- rankings from a clean pass


def _unit_hash(tokens: Tensor, n_context: int = 0) -> str:
    """Content hash of one sequence (its tokens and where scoring starts)."""
    h = hashlib.sha1(np.asarray(tokens.detach().cpu(), dtype=np.int64).tobytes())
    h.update(str(n_context).encode())
    return "u" + h.hexdigest()[:16]  # the prefix keeps CSV readers from parsing it as a number


def _random_scores(
    n_heads: int, length: int, pad_to: int, *, seed: int, unit_hash: str, layer: int
) -> Float[Tensor, "head query_pos key_pos"]:
    """Uniform noise for the random control, seeded by ``(seed, unit content hash, layer)``."""
    state = np.random.SeedSequence([int(seed), int(unit_hash[1:16], 16), int(layer)]).generate_state(2)
    g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    out = torch.zeros(n_heads, pad_to, pad_to)
    out[:, :length, :length] = torch.rand(n_heads, length, length, generator=g)
    return out


def _clean_pass(
    model: Any,
    tokens: Tokens,
    targets: Bool[Tensor, "batch pos_minus_1"],
    metrics: Sequence[str],
    *,
    scope: str,
    layers: list[int],
    seed: int,
    lengths: list[int],
    store_device: str | torch.device = "cpu",
) -> tuple[dict[str, SourceRanking], Float[Tensor, " batch"], Int[Tensor, " batch"]]:
    """One clean forward: every ranking of ``metrics`` at ``layers`` and the clean target log-likelihood."""
    geo_metrics = [m for m in metrics if m != "random"]
    # the random control is seeded by each text's content (its unpadded tokens), not by its batch slot
    unit_hashes = [_unit_hash(tokens[b, : lengths[b]]) for b in range(tokens.shape[0])]
    ranks: dict[str, dict[int, Tensor]] = {m: {} for m in metrics}

    def on_layer(layer: int, out: dict[str, dict[str, Tensor]]) -> None:
        for m, scores in out[scope].items():
            # intra: [batch, head, q, k]; inter: [batch, q, k] -> one ranking for all heads
            ranks[m][layer] = rank_sources(scores if scope == "intra" else scores[:, None]).to(store_device)

    hooks: list[FwdHook] = []
    if geo_metrics:
        col = ContributionCollector(
            model,
            layers,
            intra=geo_metrics if scope == "intra" else [],
            inter=geo_metrics if scope == "inter" else [],
            on_layer=on_layer,
        )
        hooks = col.fwd_hooks
    logprob = _target_logprob(model, tokens, targets, hooks)
    if "random" in metrics:
        n_heads = int(model.cfg.n_heads) if scope == "intra" else 1
        pos = tokens.shape[1]
        for layer in layers:
            scores = torch.stack(
                [
                    _random_scores(n_heads, lengths[b], pos, seed=seed, unit_hash=unit_hashes[b], layer=layer)
                    for b in range(tokens.shape[0])
                ]
            )
            ranks["random"][layer] = rank_sources(scores).to(store_device)
    rankings = {
        m: SourceRanking(
            metric=m,
            scope=scope,
            ranks={la: ranks[m][la] for la in layers},
            seed=seed if m == "random" else None,
            unit_hashes=list(unit_hashes),
        )
        for m in metrics
    }
    return rankings, logprob, targets.sum(-1)


def source_rankings(
    model: Any,
    tokens_or_text: str | Sequence[str] | Tensor,
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    *,
    scope: str = "intra",
    layers: int | Sequence[int] | None = None,
    seed: int = 0,
) -> dict[str, SourceRanking]:
    """Rankings of every metric at ``layers`` (default: all) from one clean forward pass.

    Intra-head metrics (``scope="intra"``, the default) give one ranking per head; inter-head metrics
    (``scope="inter"``) one per layer, applied to every head. ``"random"`` draws uniform noise seeded by
    ``(seed, text content, layer)``. Ties: lower position first; NaN ranks last (see the module docs).
    """
    scope = _check_scope(scope)
    metrics = _check_metrics(metrics, scope)
    tokens = to_tokens(model, tokens_or_text)
    chosen = resolve_layers(model, layers)
    targets = torch.ones(tokens.shape[0], max(tokens.shape[1] - 1, 0), dtype=torch.bool, device=tokens.device)
    rankings, _, _ = _clean_pass(
        model,
        tokens,
        targets,
        metrics,
        scope=scope,
        layers=chosen,
        seed=seed,
        lengths=[tokens.shape[1]] * tokens.shape[0],
        store_device=tokens.device,
    )
    return rankings


# --------------------------------------------------------------------------- scoring


def _target_logprob(
    model: Any, tokens: Tokens, targets: Bool[Tensor, "batch pos_minus_1"], fwd_hooks: Sequence[FwdHook]
) -> Float[Tensor, " batch"]:
    """``sum`` of ``log p(token[t+1] | tokens[:t+1])`` over the target predictions, hooks attached."""
    with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks), reset_hooks_end=True):
        loss = model(tokens, return_type="loss", loss_per_token=True)  # [batch, pos-1]
    return -(loss.float() * targets.to(loss.device)).sum(-1).cpu()


def _masked_scores(
    model: Any, tokens: Tokens, targets: Bool[Tensor, "batch pos_minus_1"], fwd_hooks: Sequence[FwdHook]
) -> Float[Tensor, " batch"]:
    """One masked forward pass (forward only, no cache)."""
    return _target_logprob(model, tokens, targets, fwd_hooks)


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
                hooks = masking_hooks(
                    model, ranking=b["rankings"][shared[0]], rate=r, mode=mode, layers=self.layers
                )
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
) -> pd.DataFrame:
    """Per-unit target log-likelihoods for the clean pass and every (metric, mode, rate > 0).

    Rate 0 removes nothing, so its rows are the clean pass (the hook is exact at rate 0; see the tests).
    The work runs on :func:`mechgeom.sweep.run_sweep`: one item per batch's clean pass and per (metric,
    mode, rate, batch); with ``store`` the record is rewritten atomically after every item and finished
    (key, unit) pairs are skipped on a rerun.
    """
    rows = RowStore(
        store,
        key=_STORE_KEYS,
        settings=settings,
        what="faithfulness record",
        fresh="delete the file or choose another out=",
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
        _SweepWork(units, layers, scope, seed),
        rows,
        executor=LocalExecutor(model),
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


def _layers_label(model: Any, layers: list[int]) -> str:
    return "all" if layers == list(range(int(model.cfg.n_layers))) else ",".join(map(str, layers))


def _model_label(model: Any) -> str:
    return str(getattr(model.cfg, "model_name", "")) or type(model).__name__


def _side_path(out: Path, what: str) -> Path:
    return out.with_name(f"{out.stem}.{what}{out.suffix}")


def _check_out(out: str | Path | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.suffix not in (".csv", ".parquet"):
        raise ValueError(f"out must end in .csv or .parquet, got {path.name!r}")
    return path


def _check_common(
    model: Any,
    metrics: Sequence[str],
    rates: Sequence[float],
    modes: Sequence[str],
    layers: int | Sequence[int] | None,
    scope: str,
    batch_size: int,
) -> tuple[tuple[str, ...], tuple[float, ...], tuple[str, ...], list[int], str]:
    check_decoder(model)
    scope = _check_scope(scope)
    metrics_t = _check_metrics(metrics, scope)
    rates_t = _check_rates(rates)
    modes_t = _check_modes(modes)
    chosen = resolve_layers(model, layers)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return metrics_t, rates_t, modes_t, chosen, scope


# --------------------------------------------------------------------------- perplexity curves


def perplexity_curves(
    model: Any,
    tokens: Tensor | str | Sequence[str],
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float] = DEFAULT_RATES,
    modes: Sequence[str] = MODES,
    *,
    layers: int | Sequence[int] | None = None,
    scope: str = "intra",
    batch_size: int = 8,
    seed: int = 0,
    n_boot: int = 1000,
    out: str | Path | None = None,
    verbose: bool = True,
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
    masked pass does not re-rank.

    Returns a tidy DataFrame, one row per (metric, mode, rate): ``metric, mode, rate, ppl, delta_ppl,
    delta_nll, ci_low, ci_high, clean_ppl, n_texts, layers, scope, seed``.

    With ``out`` (``.csv`` or ``.parquet``) the table is written there atomically, and per-text results
    go to ``<stem>.per_text<suffix>`` after every masked pass; a rerun with the same settings (model,
    layers, scope, seed) skips every (metric, mode, rate, text) already recorded, so an interrupted sweep
    resumes without duplicate or lost rows (texts are matched by content, so a larger corpus that
    starts with the same windows extends an earlier run). Different settings raise ``ValueError``.
    """
    metrics_t, rates_t, modes_t, chosen, scope = _check_common(
        model, metrics, rates, modes, layers, scope, batch_size
    )
    if isinstance(tokens, Tensor) and (tokens.ndim != 2 or tokens.shape[0] == 0):
        raise ValueError(
            f"empty corpus: need [n_texts >= 1, pos >= 2] tokens, got shape {tuple(tokens.shape)}"
        )
    if not isinstance(tokens, Tensor) and not isinstance(tokens, str) and len(tokens) == 0:
        raise ValueError("empty corpus: give at least one text")
    toks = to_tokens(model, tokens, min_pos=2, what="perplexity (a token to predict)").cpu()
    if toks.shape[1] < 2:
        raise ValueError(f"texts need at least 2 tokens to predict one, got {toks.shape[1]}")
    path = _check_out(out)
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
    )
    frame = _ppl_summary(record, units.hashes, metrics_t, modes_t, rates_t, n_boot=n_boot, seed=seed)
    frame = frame.assign(n_texts=n, layers=settings["layers"], scope=scope, seed=seed)
    if path is not None:
        write_frame(frame, path)
    return frame


def _settings(model: Any, layers: list[int], scope: str, seed: int) -> dict[str, Any]:
    """What a resumed sweep must match: model, layers, ranking scope and seed."""
    return {
        "model": _model_label(model),
        "layers": _layers_label(model, layers),
        "scope": scope,
        "seed": seed,
    }


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


def _encode(model: Any, text: str, *, prepend_bos: bool) -> list[int]:
    """Token ids of ``text`` with the model's tokenizer (one place, so tests can swap it)."""
    return [int(t) for t in model.to_tokens(text, prepend_bos=prepend_bos, truncate=False)[0].tolist()]


def _task_units(model: Any, items: Sequence[Any], max_len: int) -> tuple[_Units, list[tuple[int, int]]]:
    """One unit per (item, choice): ``prompt`` tokens (model's BOS default) then ``choice`` tokens.

    The prompt and the choice are tokenised separately; a sequence longer than ``max_len`` loses tokens
    from the left of the prompt. Targets are the predictions of the choice tokens.
    """
    seqs: list[list[int]] = []
    n_ctx: list[int] = []
    owner: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        if not item.choices or not 0 <= int(item.answer) < len(item.choices):
            raise ValueError(f"item {i} has answer {item.answer} but {len(item.choices)} choices")
        prompt = _encode(
            model, item.prompt, prepend_bos=bool(getattr(model.cfg, "default_prepend_bos", False))
        )
        for c, choice in enumerate(item.choices):
            cont = _encode(model, choice, prepend_bos=False)
            if not cont:
                raise ValueError(f"item {i} choice {c} ({choice!r}) has no tokens")
            if len(cont) >= max_len:
                raise ValueError(
                    f"item {i} choice {c} is {len(cont)} tokens, not shorter than max_len={max_len}"
                )
            ctx = prompt[-(max_len - len(cont)) :] if len(prompt) + len(cont) > max_len else prompt
            if not ctx:
                raise ValueError(f"item {i} has an empty prompt; the first choice token needs a context")
            seqs.append(ctx + cont)
            n_ctx.append(len(ctx))
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
    out: str | Path | None = None,
    verbose: bool = True,
) -> pd.DataFrame:
    """Accuracy on multiple-choice items (:func:`mechgeom.data.load_task`) under the same masking.

    SPEC: "accuracy change on multiple-choice / yes-no items (BoolQ, Winogrande, MMLU), each choice scored
    by its log-likelihood under the same masking." Each choice's score is the summed log-likelihood of its
    tokens given the prompt (prompt and choice tokenised separately, the model's BOS default), with the
    masking hooks at every position; the ranking comes from the clean pass of that prompt+choice sequence.
    The prediction is the highest-scoring choice (ties: the first); ``accuracy`` is the share of items
    predicted right, ``delta_accuracy`` its change from the clean pass, ``ci_low``/``ci_high`` a 95%
    bootstrap over items of Δaccuracy.

    Sequences are right-padded in batches of similar length (padding never reaches a scored position);
    ``max_len`` (default ``n_ctx``) trims long prompts from the left. Rows: one per (task, metric, mode,
    rate), plus ``task="all"`` when the items mix tasks: ``task, metric, mode, rate, accuracy,
    delta_accuracy, ci_low, ci_high, clean_accuracy, n_items, layers, scope, seed``. ``out`` and resume
    work as in :func:`perplexity_curves` (per-choice record ``<stem>.per_choice<suffix>``).
    """
    metrics_t, rates_t, modes_t, chosen, scope = _check_common(
        model, metrics, rates, modes, layers, scope, batch_size
    )
    items = list(items)
    if not items:
        raise ValueError("no items: give at least one task item (see mechgeom.data.load_task)")
    path = _check_out(out)
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
    )
    frame = _accuracy_summary(
        record, units.hashes, owner, items, metrics_t, modes_t, rates_t, n_boot=n_boot, seed=seed
    )
    frame = frame.assign(layers=settings["layers"], scope=scope, seed=seed)
    if path is not None:
        write_frame(frame, path)
    return frame


def _correct(scores: np.ndarray, owner: list[tuple[int, int]], items: Sequence[Any]) -> np.ndarray:
    """1.0 where the highest-scoring choice (first on ties) is the answer, per item."""
    per_item: list[list[float]] = [[-math.inf] * len(it.choices) for it in items]
    for u, (i, c) in enumerate(owner):
        per_item[i][c] = float(scores[u])
    return np.array(
        [float(int(np.argmax(s)) == int(it.answer)) for s, it in zip(per_item, items, strict=True)]
    )


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
                    rows.append(
                        {
                            "task": g,
                            "metric": m,
                            "mode": mode,
                            "rate": r,
                            "accuracy": float(masked[sel].mean()),
                            "delta_accuracy": float(diff.mean()),
                            "ci_low": lo,
                            "ci_high": hi,
                            "clean_accuracy": float(clean[sel].mean()),
                            "n_items": int(sel.sum()),
                        }
                    )
    return pd.DataFrame(rows)
