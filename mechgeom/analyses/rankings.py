"""Rankings for paper A's faithfulness test (SPEC.md §A): of the sources of each query, from a clean pass,
and of the metrics, from the curves of :mod:`mechgeom.analyses.faithfulness`.

**Source rankings.** The sources of each query are ranked by a metric of
:mod:`mechgeom.analyses.contribution` (intra-head metrics rank per head, inter-head metrics rank once per
layer and apply to every head) or at random; the masking hooks (:func:`mechgeom.hooks.masking_hooks`)
then remove the top- or bottom-ranked sources. Conventions fixed here (keyword arguments keep the defaults):

- **Clean ranking, no re-ranking.** Rankings are computed once, from a clean forward pass (no hooks of
  ours; a sweep's ``extra_hooks`` are attached); the masked pass applies that ranking at every chosen
  layer and never re-ranks, even though the masked pass's own activations at later layers differ from
  the clean ones.
- **Ranking.** Per query ``i``, only sources ``j <= i`` are ranked (``j > i`` are never counted and
  never removed). Sources are sorted by the **signed** metric value, largest first (rank 0 = top), with
  a stable sort, so ties go to the **lower position first**. A NaN metric value (a zero output norm,
  see :mod:`mechgeom.analyses.contribution`) ranks **below every finite value**; inside a fully NaN row the
  order is by position.
- **Per-query normalisation does not change a ranking.** ``value_weighted_normalized`` is
  ``value_weighted`` divided by one positive number per query (``‖o[i,h]‖`` or ``‖o[i]‖``), so both rank
  the sources of a query identically (up to ties made by rounding) and give the same curves; sweeps
  detect identical rankings and run their masked passes once.
- **Random control.** ``metric="random"`` ranks by uniform noise drawn from a generator seeded with
  ``(seed, content hash of the text, layer)``: reproducible for a seed, independent of batching.
- **Storage.** Ranks are stored as the per-query rank of each source in the smallest integer dtype
  (uint8 up to 256 positions); the hook builds the boolean mask on the fly from ``(rank, rate, mode)``.

A sweep's rankings depend on the model (with its ``extra_hooks``), the layers, the scope and the seed:
:func:`_settings` gives the settings, and the sweep store adds the model's weights, dtype and hooks
(:mod:`mechgeom.sweep.fingerprint`).

**Metric rankings.** :func:`faithfulness_summary` ranks the metrics by mean ΔPPL and judges paper A's
claimed order; :func:`area_ordering` orders them by the area under a curve.

>>> _rkey(0.1 + 0.2), _unit_hash(torch.tensor([1, 2, 3]))[:1]
(0.3, 'u')
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom.analyses.contribution import (
    INTER_METRICS,
    INTRA_METRICS,
    RANKING_METRICS,
    ContributionCollector,
)
from mechgeom.analyses.evaluation import target_logprob
from mechgeom.hooks import (
    MODES,
    FwdHook,
    check_decoder,
    check_index,
    check_mode,
    check_rate,
    rank_sources,
    removal_mask,
    resolve_layers,
    to_tokens,
)
from mechgeom.sweep import model_label
from mechgeom.typing import Bool, Float, Int, SourceRanks, Tensor, Tokens

__all__ = [
    "FAITHFULNESS_METRICS",
    "SCOPES",
    "SourceRanking",
    "area_ordering",
    "faithfulness_summary",
    "source_rankings",
]

#: Intra-head metrics rank per head; inter-head metrics rank once per layer and apply to all heads.
SCOPES = ("intra", "inter")
#: The metrics compared by default: paper A's four, in its claimed order, and the random control.
FAITHFULNESS_METRICS = (*RANKING_METRICS, "random")


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


def _check_common(
    model: Any,
    metrics: Sequence[str],
    rates: Sequence[float],
    modes: Sequence[str],
    layers: int | Sequence[int] | None,
    scope: str,
    batch_size: int,
) -> tuple[tuple[str, ...], tuple[float, ...], tuple[str, ...], list[int], str]:
    """The settings of a sweep on a decoder, checked (:func:`_check_settings`)."""
    check_decoder(model)
    return _check_settings(model, metrics, rates, modes, layers, scope, batch_size)


def _check_settings(
    model: Any,
    metrics: Sequence[str],
    rates: Sequence[float],
    modes: Sequence[str],
    layers: int | Sequence[int] | None,
    scope: str,
    batch_size: int,
) -> tuple[tuple[str, ...], tuple[float, ...], tuple[str, ...], list[int], str]:
    """The settings of a sweep, checked: metrics, rates and modes deduplicated in order, the layers."""
    scope = _check_scope(scope)
    metrics_t = _check_metrics(metrics, scope)
    rates_t = _check_rates(rates)
    modes_t = _check_modes(modes)
    chosen = resolve_layers(model, layers)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return metrics_t, rates_t, modes_t, chosen, scope


# --------------------------------------------------------------------------- the ranking


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


def ranking_readers(
    model: Any,
    layers: list[int],
    metrics: Sequence[str],
    scope: str,
    rank: Callable[[Tensor], Tensor],
) -> tuple[dict[str, dict[int, Tensor]], list[FwdHook]]:
    """The readers of a clean pass that rank every query's sources by each geometric metric of ``metrics``
    (``"random"`` is left to the caller): ``({metric: {layer: ranks}}, hooks)``, filled as the pass runs.

    ``rank`` turns ``[batch, head or 1, q, k]`` scores into ranks (``scope="intra"``: one ranking per head;
    ``"inter"``: the layer's, shared by all heads)."""
    ranks: dict[str, dict[int, Tensor]] = {m: {} for m in metrics}
    geo = [m for m in metrics if m != "random"]
    if not geo:
        return ranks, []

    def on_layer(layer: int, out: dict[str, dict[str, Tensor]]) -> None:
        for m, scores in out[scope].items():  # intra: [batch, head, q, k]; inter: [batch, q, k]
            ranks[m][layer] = rank(scores if scope == "intra" else scores[:, None])

    intra, inter = (geo, []) if scope == "intra" else ([], geo)
    col = ContributionCollector(model, layers, intra=intra, inter=inter, on_layer=on_layer)
    return ranks, col.fwd_hooks


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
    extra_hooks: Sequence[FwdHook] = (),
) -> tuple[dict[str, SourceRanking], Float[Tensor, " batch"], Int[Tensor, " batch"]]:
    """One clean forward: every ranking of ``metrics`` at ``layers`` and the clean target log-likelihood.

    ``extra_hooks`` are attached first (before the metric readers on the same hook point)."""
    # the random control is seeded by each text's content (its unpadded tokens), not by its batch slot
    unit_hashes = [_unit_hash(tokens[b, : lengths[b]]) for b in range(tokens.shape[0])]
    ranks, readers = ranking_readers(
        model, layers, metrics, scope, lambda scores: rank_sources(scores).to(store_device)
    )
    hooks: list[FwdHook] = [*extra_hooks, *readers]
    logprob = target_logprob(model, tokens, targets, hooks)
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
    extra_hooks: Sequence[FwdHook] = (),
) -> dict[str, SourceRanking]:
    """Rankings of every metric at ``layers`` (default: all) from one clean forward pass.

    Intra-head metrics (``scope="intra"``, the default) give one ranking per head; inter-head metrics
    (``scope="inter"``) one per layer, applied to every head. ``"random"`` draws uniform noise seeded by
    ``(seed, text content, layer)``. Ties: lower position first; NaN ranks last (see the module docs).
    ``extra_hooks`` run in the same pass, before the metric readers (the ranking of a modified model).
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
        extra_hooks=extra_hooks,
    )
    return rankings


# --------------------------------------------------------------------------- what a ranking depends on


def _layers_label(model: Any, layers: list[int]) -> str:
    return "all" if layers == list(range(int(model.cfg.n_layers))) else ",".join(map(str, layers))


def _settings(model: Any, layers: list[int], scope: str, seed: int) -> dict[str, Any]:
    """What a resumed sweep must match besides the model and its ``extra_hooks`` (which the sweep store
    fingerprints itself: weights, dtype, hook code and data): the model's name, layers, ranking scope, seed."""
    return {"model": model_label(model), "layers": _layers_label(model, layers), "scope": scope, "seed": seed}


# --------------------------------------------------------------------------- ranking the metrics


def faithfulness_summary(frame: pd.DataFrame, claimed: Sequence[str] = RANKING_METRICS) -> dict[str, Any]:
    """Paper A's claimed order judged on a ΔPPL table of :func:`perplexity_curves`.

    Per mode, each metric's mean ΔPPL over the rates > 0 ranks the metrics, most faithful first
    (comprehensiveness: higher is more faithful; sufficiency: lower). The claimed order
    ``claimed[0] < claimed[1] < ...`` (least to most faithful) **holds** when every adjacent pair of
    ``claimed`` is strictly in that order, **holds up to ties** when some pairs have equal means (identical
    rankings, e.g. intra-head value-weighted and output-normalised) and none is reversed, and else **does
    not hold** (a claimed metric missing from the table has a NaN mean, so the order does not hold).
    ``ties`` lists the adjacent claimed pairs with equal means. Modes absent from the table are left out.

    >>> rows = [{"mode": mo, "metric": m, "rate": r, "delta_ppl": v * r}
    ...         for mo, vals in (("comprehensiveness", (1, 2, 2, 4)), ("sufficiency", (4, 3, 2, 1)))
    ...         for m, v in zip(RANKING_METRICS, vals) for r in (0.0, 0.5, 1.0)]
    >>> out = faithfulness_summary(pd.DataFrame(rows))
    >>> out["modes"]["comprehensiveness"]["verdict"], out["modes"]["comprehensiveness"]["ties"]
    ('holds up to ties', [['value_weighted', 'value_weighted_normalized']])
    >>> out["modes"]["sufficiency"]["verdict"], out["modes"]["sufficiency"]["ranking"][0]
    ('holds', ['contribution', 0.75])
    """
    claimed = list(claimed)
    area = frame[frame["rate"] > 0].groupby(["mode", "metric"])["delta_ppl"].mean()
    modes: dict[str, Any] = {}
    for mode, higher in (("comprehensiveness", True), ("sufficiency", False)):
        if mode not in area.index.get_level_values(0):
            continue
        by_metric = area[mode]
        ranked = by_metric.sort_values(ascending=not higher)
        verdict, ties = claimed_order_verdict(
            claimed, [float(by_metric.get(m, np.nan)) for m in claimed], higher
        )
        modes[mode] = {
            "higher_is_more_faithful": higher,
            "ranking": [[str(m), float(v)] for m, v in ranked.items()],
            "verdict": verdict,
            "ties": ties,
        }
    clean = float(frame["clean_ppl"].iloc[0]) if "clean_ppl" in frame.columns and len(frame) else None
    rates = [float(r) for r in sorted(frame["rate"].unique())]
    return {"claimed": claimed, "clean_ppl": clean, "rates": rates, "modes": modes}


def claimed_order_verdict(
    claimed: Sequence[str], values: Sequence[float], higher: bool
) -> tuple[str, list[list[str]]]:
    """Whether ``values`` (one per metric of ``claimed``, least to most faithful) come in the claimed order:
    ``"holds"`` (each step more faithful: larger if ``higher``, else smaller), ``"holds up to ties"`` (some
    steps equal, e.g. identical rankings) or ``"does not hold"`` (a NaN never holds); and the tied pairs.

    >>> claimed_order_verdict(["a", "b", "c"], [1.0, 2.0, 2.0], higher=True)
    ('holds up to ties', [['b', 'c']])
    """
    better = [(b - a) if higher else (a - b) for a, b in itertools.pairwise(values)]  # > 0: claimed order
    ties = [[x, y] for (x, y), d in zip(itertools.pairwise(claimed), better, strict=True) if d == 0]
    if all(d > 0 for d in better):
        return "holds", ties
    if all(d >= 0 for d in better):
        return "holds up to ties", ties
    return "does not hold", ties


def area_ordering(
    frame: pd.DataFrame, y: str = "delta_ppl", claimed: Sequence[str] = RANKING_METRICS
) -> dict[str, Any]:
    """Per mode: each metric's area under ``y`` vs rate (trapezoid) and the metrics from least to most
    faithful (comprehensiveness: a larger area is more faithful; sufficiency: a smaller one), whether the
    ``claimed`` metrics present come in that order, and the random control's place (``None`` if absent).

    >>> rows = [{"mode": mo, "metric": m, "rate": r, "delta_ppl": v * r} for mo in MODES
    ...         for m, v in (("attention", 1.0), ("contribution", 3.0)) for r in (0.0, 1.0)]
    >>> out = area_ordering(pd.DataFrame(rows))
    >>> out["comprehensiveness"]["area"], out["sufficiency"]["least_to_most_faithful"]
    ({'attention': 0.5, 'contribution': 1.5}, ['contribution', 'attention'])
    """
    out: dict[str, Any] = {}
    for mode in MODES:
        sub = frame[frame["mode"] == mode]
        area = {}
        for metric, d in sub.groupby("metric", sort=False):
            d = d.sort_values("rate")
            x, v = d["rate"].to_numpy(float), d[y].to_numpy(float)
            area[str(metric)] = float(np.sum((x[1:] - x[:-1]) * (v[1:] + v[:-1]) / 2))
        sign = 1 if mode == "comprehensiveness" else -1
        least_to_most = sorted(area, key=lambda m: sign * area[m])
        ranks = [least_to_most.index(m) for m in claimed if m in area]
        out[mode] = {
            "area": area,
            "least_to_most_faithful": least_to_most,
            "agrees_with_paper_order": ranks == sorted(ranks),
            "random_rank": least_to_most.index("random") if "random" in area else None,
        }
    return out
