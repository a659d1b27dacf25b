"""Headline statistics of contribution weights (``docs/definitions.md`` §2.7): how much of each head's weight the sink gets
under attention and under contribution, how often contribution is negative, how often attention and
contribution pick the same top source, and how far apart the two are (total variation).

Every statistic is a mean over texts and queries ``i >= 1`` (query 0 has a single source), positions inside
each text: padding is never a query, a source or the sink, and the sink is each text's first real token. It is kept as a
``(sum, count)`` pair per head so that batches of texts add up exactly (:func:`score_sums`,
:func:`add_sums`, :func:`finish_sums`); :class:`ScoreTotals` keeps those pairs per layer, for the heads and
for the whole layer. The streamed overview over a corpus is
:func:`mechgeom.analyses.contribution.overview.contribution_overview`; the same numbers from a result in memory are
:meth:`mechgeom.analyses.contribution.ContributionResult.summary` (:func:`result_summary`).

This module computes statistics of metric tensors only; it imports no collector, so that
:mod:`mechgeom.analyses.contribution.weights` can use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom.typing import Bool, Float, HeadScores, Int, Tensor

__all__ = [
    "HEAD_STATISTICS",
    "SUMMARY_METRICS",
    "ScoreTotals",
    "add_sums",
    "finish_sums",
    "overview_frames",
    "overview_summary",
    "result_summary",
    "score_sums",
    "special_token_frame",
    "view_layer_of",
]

#: The metrics the statistics read, in the order :func:`score_sums` takes them.
SUMMARY_METRICS = ("attention", "value_weighted_normalized", "contribution")
#: The statistics of :func:`score_sums`, in its order (the columns of the overview tables).
HEAD_STATISTICS = (
    "sink_attention",
    "sink_value_weighted_normalized",
    "sink_contribution",
    "negative_share",
    "top1_agreement",
    "tv_attention_contribution",
)

#: ``{statistic: (sum, count)}``, each ``[head_index]``.
Sums = dict[str, tuple[Tensor, Tensor]]


def score_sums(
    a: HeadScores,
    vn: HeadScores,
    c: HeadScores,
    key_mask: Bool[Tensor, "batch key_pos"] | None = None,
    query_index: Int[Tensor, "batch query_pos"] | None = None,
) -> Sums:
    """Per-head ``(sum, count)`` pairs over texts ``b`` and their queries ``i >= first + 1`` of ``[batch, head,
    q, k]`` attention ``a``, output-normalised value weights ``vn`` and contribution weights ``c``, so that
    batches add up (:func:`add_sums`) and :func:`finish_sums` gives the means.

    Padding is never a query, a source or the sink: ``first`` is each text's first real token (the sink, the
    position 0 of the text run alone), the queries counted are the real ones after it, and the sources of
    query ``i`` are the real keys ``j <= i``. So a text's sums are those of the text run alone, and a batch's
    are the sums of its texts: the mean over every counted query of every text (pooled, as the texts run one
    by one and added with :func:`add_sums`), not a mean of per-text means.

    - ``sink_attention``: ``a[h,i,first]``, the attention on the sink;
    - ``sink_value_weighted_normalized``: ``vn[h,i,first]``, NaN rows left out;
    - ``sink_contribution``: ``c[h,i,first]``, NaN rows (zero output norm) left out;
    - ``negative_share``: the share of sources with ``c[h,i,j] < 0`` among those with a finite ``c``;
    - ``top1_agreement``: how often ``argmax_j a[h,i,j] == argmax_j c[h,i,j]`` over the sources (ties: the
      lower position), over rows with a finite ``c``;
    - ``tv_attention_contribution``: the total-variation distance ``0.5 sum_j |c[h,i,j] - a[h,i,j]|`` over the
      sources, NaN rows left out.

    A whole-layer version takes the inter-head metrics with a head axis of 1 (``inter[k][:, None]``).

    Args:
        a, vn, c: ``[batch, head, q, k]``; row ``r`` is query ``query_index[b, r]`` (default: row ``i`` is
            position ``i``, a square ``q == k``).
        key_mask: ``[batch, k]``, ``True`` at real tokens (``None``: every position is real).
        query_index: ``[batch, q]``, the padded position of each row's query, ``-1`` for an empty row (a
            result computed for some queries only, ``queries=``).

    >>> a = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    >>> c = torch.tensor([[[[1.0, 0.0], [1.5, -0.5]]]])
    >>> {k: float(v[0]) for k, v in finish_sums(score_sums(a, a, c)).items()}  # doctest: +NORMALIZE_WHITESPACE
    {'sink_attention': 0.5, 'sink_value_weighted_normalized': 0.5, 'sink_contribution': 1.5,
     'negative_share': 0.5, 'top1_agreement': 1.0, 'tv_attention_contribution': 1.0}
    """
    B, H, n, k = a.shape
    src, counted, first = _sources(B, n, k, key_mask, query_index, a.device)  # [b n k], [b n], [b]
    src4 = src[:, None]  # [b 1 n k]
    finite = src4 & ~torch.isnan(c)  # [b h n k]: sources with a finite contribution
    row = counted[:, None, :]  # [b 1 n]: the queries counted
    valid = finite & row[..., None]
    a_top = a.masked_fill(~src4, -math.inf).argmax(-1)  # [b h n]
    c_top = c.masked_fill(~finite, -math.inf).argmax(-1)
    row_ok = finite.any(-1) & row  # rows with a finite contribution (not a zero output norm)
    tv = 0.5 * (c - a).abs().masked_fill(~src4, 0.0).sum(-1)  # [b h n]; NaN rows stay NaN
    sink = first[:, None, None, None].expand(B, H, n, 1)
    dims = (0, 2)

    def nan_pair(x: Tensor) -> tuple[Tensor, Tensor]:
        ok = row & ~torch.isnan(x)
        return torch.where(ok, x, 0.0).sum(dims), ok.sum(dims)

    sink_a = a.gather(-1, sink)[..., 0]
    n_rows = row.expand(B, H, n).sum(dims)
    return {
        "sink_attention": (torch.where(row, sink_a, 0.0).sum(dims), n_rows),
        "sink_value_weighted_normalized": nan_pair(vn.gather(-1, sink)[..., 0]),
        "sink_contribution": nan_pair(c.gather(-1, sink)[..., 0]),
        "negative_share": (((c < 0) & valid).sum((0, 2, 3)), valid.sum((0, 2, 3))),
        "top1_agreement": (((a_top == c_top) & row_ok).sum(dims), row_ok.sum(dims)),
        "tv_attention_contribution": nan_pair(tv),
    }


def _sources(
    B: int,
    n: int,
    k: int,
    key_mask: Tensor | None,
    query_index: Tensor | None,
    device: torch.device,
    causal: bool = True,
) -> tuple[Bool[Tensor, "batch query_pos key_pos"], Bool[Tensor, "batch query_pos"], Int[Tensor, " batch"]]:
    """``(sources, counted, first)``: the real keys each row's query sees (``j <= i`` when causal), the rows
    whose query is real and after its text's first real token, and each text's first real position."""
    real = (
        torch.ones(B, k, dtype=torch.bool, device=device) if key_mask is None else key_mask.bool().to(device)
    )
    if query_index is None:
        if n != k:
            raise ValueError(
                f"rows of {n} queries against {k} keys need query_index (the position of each row)"
            )
        qpos = torch.arange(k, device=device).expand(B, k)
    else:
        qpos = query_index.to(device)
    first = real.long().argmax(-1)  # [b]: the sink, position 0 of the text run alone
    has = qpos >= 0
    q_real = has & real.gather(1, qpos.clamp_min(0))  # [b n]
    src = real[:, None, :] & q_real[..., None]
    if causal:
        src = src & (torch.arange(k, device=device) <= qpos[..., None])
    counted = q_real & (qpos > first[:, None])
    return src, counted, first


def finish_sums(sums: Sums) -> dict[str, Float[Tensor, " head_index"]]:
    """``sum / count`` per statistic (in float64, returned as float32), NaN where the count is 0."""
    return {k: (s.double() / n.double()).where(n > 0, torch.nan).float() for k, (s, n) in sums.items()}


def add_sums(acc: Sums | None, new: Sums) -> Sums:
    """``acc + new``, pair by pair, in float64 (``acc=None`` starts a total)."""
    if acc is None:
        return {k: (s.double(), n.double()) for k, (s, n) in new.items()}
    return {k: (acc[k][0] + s.double(), acc[k][1] + n.double()) for k, (s, n) in new.items()}


class ScoreTotals:
    """The ``(sum, count)`` pairs of :func:`score_sums` per layer, for the heads and for the whole layer,
    added up batch by batch; :meth:`heads_frame` and :meth:`layers_frame` give the means."""

    def __init__(self) -> None:
        self.head_sums: dict[int, Sums] = {}
        self.layer_sums: dict[int, Sums] = {}

    def add(
        self,
        layer: int,
        intra: Mapping[str, Tensor],
        inter: Mapping[str, Tensor],
        key_mask: Bool[Tensor, "batch key_pos"] | None = None,
        query_index: Int[Tensor, "batch query_pos"] | None = None,
    ) -> None:
        """Add one batch of one layer: ``intra[k]`` is ``[batch head q k]``, ``inter[k]`` is ``[batch q k]``;
        ``key_mask`` and ``query_index`` as in :func:`score_sums` (padding, a subset of queries)."""
        names = SUMMARY_METRICS
        a, vn, c = (intra[k] for k in names)
        sums = score_sums(a, vn, c, key_mask, query_index)
        self.head_sums[layer] = add_sums(self.head_sums.get(layer), sums)
        a, vn, c = (inter[k][:, None] for k in names)
        sums = score_sums(a, vn, c, key_mask, query_index)
        self.layer_sums[layer] = add_sums(self.layer_sums.get(layer), sums)

    def heads_frame(self) -> pd.DataFrame:
        """One row per ``(layer, head)``: ``layer, head`` and the means of :data:`HEAD_STATISTICS`."""
        frames = []
        for layer in sorted(self.head_sums):
            frame = pd.DataFrame({k: v.cpu().numpy() for k, v in finish_sums(self.head_sums[layer]).items()})
            frame.insert(0, "head", range(len(frame)))
            frame.insert(0, "layer", layer)
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)

    def layers_frame(self) -> pd.DataFrame:
        """One row per layer: ``layer`` and the whole-layer (inter-head) means of :data:`HEAD_STATISTICS`."""
        return pd.DataFrame(
            [
                {"layer": la, **{k: float(v[0]) for k, v in finish_sums(self.layer_sums[la]).items()}}
                for la in sorted(self.layer_sums)
            ]
        )


def view_layer_of(layers: pd.DataFrame) -> int:
    """The layer of largest whole-layer ``tv_attention_contribution`` (the first layer if every one is NaN)."""
    tv = layers["tv_attention_contribution"].to_numpy()
    return int(layers["layer"].to_numpy()[int(np.nanargmax(tv)) if np.isfinite(tv).any() else 0])


def overview_summary(heads: pd.DataFrame, layers: pd.DataFrame, n_texts: int) -> dict[str, Any]:
    """The headline numbers: means over the rows of ``heads`` (``heads[col].mean()``, NaN skipped), the
    view layer (:func:`view_layer_of`) and its whole-layer TV (``np.nanmax`` over layers)."""
    tv = layers["tv_attention_contribution"].to_numpy(dtype=float)
    cols = ("sink_attention", "sink_contribution", "sink_value_weighted_normalized")
    return {
        "n_heads": len(heads),
        "n_texts": int(n_texts),
        **{col: float(heads[col].mean()) for col in cols},
        "negative_share": float(heads["negative_share"].mean()),
        "top1_agreement": float(heads["top1_agreement"].mean()),
        "view_layer": view_layer_of(layers),
        "view_layer_tv": float(np.nanmax(tv)) if (~np.isnan(tv)).any() else math.nan,
    }


def _check_summary_metrics(intra: Mapping[str, Tensor], inter: Mapping[str, Tensor]) -> None:
    for kind, have in (("intra-head", intra), ("inter-head", inter)):
        missing = [m for m in SUMMARY_METRICS if m not in have]
        if missing:
            raise ValueError(
                f"the summary needs the {kind} metric(s) {missing}, which the result does not hold "
                f"(it has {sorted(have)}); compute them with {kind.split('-')[0]}={list(SUMMARY_METRICS)}"
            )


def overview_frames(
    layers: Sequence[int],
    intra: Mapping[str, Float[Tensor, "batch layer head_index query_pos key_pos"]],
    inter: Mapping[str, Float[Tensor, "batch layer query_pos key_pos"]],
    key_mask: Bool[Tensor, "batch key_pos"] | None = None,
    query_index: Int[Tensor, "batch query_pos"] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The per-head and whole-layer tables of a result in memory (every text at once, layer by layer);
    ``key_mask`` and ``query_index`` as in :func:`score_sums`."""
    _check_summary_metrics(intra, inter)
    totals = ScoreTotals()
    for li, layer in enumerate(layers):
        totals.add(
            layer,
            {k: intra[k][:, li] for k in SUMMARY_METRICS},
            {k: inter[k][:, li] for k in SUMMARY_METRICS},
            key_mask,
            query_index,
        )
    return totals.heads_frame(), totals.layers_frame()


def result_summary(
    layers: Sequence[int],
    intra: Mapping[str, Float[Tensor, "batch layer head_index query_pos key_pos"]],
    inter: Mapping[str, Float[Tensor, "batch layer query_pos key_pos"]],
    key_mask: Bool[Tensor, "batch key_pos"] | None = None,
    query_index: Int[Tensor, "batch query_pos"] | None = None,
) -> dict[str, Any]:
    """:func:`overview_summary` of a result in memory; needs intra and inter ``attention``,
    ``value_weighted_normalized`` and ``contribution`` (``ValueError`` naming the missing ones). The texts are
    pooled (see :func:`score_sums`): padding excluded, the statistics of a padded batch are those of its texts
    run one by one and added up."""
    heads, layer_frame = overview_frames(layers, intra, inter, key_mask, query_index)
    n_texts = int(next(iter(intra.values())).shape[0])
    return overview_summary(heads, layer_frame, n_texts)


def special_token_frame(
    layers: Sequence[int],
    intra: Mapping[str, Float[Tensor, "batch layer head_index query_pos key_pos"]],
    key_mask: Tensor | None = None,
    query_index: Tensor | None = None,
) -> pd.DataFrame:
    """An encoder's special tokens under each metric: one row per ``(layer, head, token)`` with ``token``
    ``"[CLS]"`` (each text's first real position) or ``"[SEP]"`` (its last real position), and for each of
    :data:`SUMMARY_METRICS` the mean over texts and real queries ``i`` of ``metric[h,i,s]`` (NaN rows
    skipped), then ``negative_share``: the share of real ``(i, j)`` pairs with ``c[h,i,j] < 0`` among finite
    ones. ``key_mask [batch, pos]`` marks real tokens (``None``: all real); ``query_index [batch, q]`` is the
    position of each row's query (``-1``: an empty row; ``None``: row ``i`` is position ``i``).

    >>> a = torch.full((1, 1, 1, 3, 3), 1 / 3)
    >>> f = special_token_frame([0], {"attention": a, "value_weighted_normalized": a, "contribution": a})
    >>> f[["token", "attention"]].round(3).values.tolist()
    [['[CLS]', 0.333], ['[SEP]', 0.333]]
    """
    missing = [m for m in SUMMARY_METRICS if m not in intra]
    if missing:
        raise ValueError(f"the special-token table needs the intra-head metric(s) {missing}")
    B, _, H, Q, K = intra["attention"].shape
    src, _, first = _sources(
        B,
        Q,
        K,
        key_mask,
        None if query_index is None else query_index.cpu(),
        torch.device("cpu"),
        causal=False,
    )
    q_real = src.any(-1)  # [b q]: rows whose query is real
    real = torch.ones(B, K, dtype=torch.bool) if key_mask is None else key_mask.bool().cpu()
    last = K - 1 - real.flip(-1).long().argmax(-1)  # [b]: each text's [SEP]
    rows = []
    for li, layer in enumerate(layers):
        cols: dict[str, Tensor] = {}
        for m in SUMMARY_METRICS:
            t = intra[m][:, li].cpu()  # [b h q k]
            at_cls = t.gather(-1, first[:, None, None, None].expand(B, H, Q, 1))[..., 0]  # [b h q]
            at_sep = t.gather(-1, last[:, None, None, None].expand(B, H, Q, 1))[..., 0]
            for name, x in (("[CLS]", at_cls), ("[SEP]", at_sep)):
                keep = q_real[:, None, :].expand_as(x) & ~torch.isnan(x)
                cols[f"{name}|{m}"] = torch.where(keep, x, 0).sum((0, 2)) / keep.sum((0, 2)).clamp_min(1)
        c = intra["contribution"][:, li].cpu()
        pair = src[:, None] & ~torch.isnan(c)  # [b h q k]
        neg = ((c < 0) & pair).sum((0, 2, 3)) / pair.sum((0, 2, 3)).clamp_min(1)
        for h in range(H):
            for name in ("[CLS]", "[SEP]"):
                row: dict[str, Any] = {"layer": int(layer), "head": h, "token": name}
                row.update({m: float(cols[f"{name}|{m}"][h]) for m in SUMMARY_METRICS})
                row["negative_share"] = float(neg[h])
                rows.append(row)
    return pd.DataFrame(rows)
