"""Contribution weights and their baselines (``docs/definitions.md`` §2, paper A).

For one layer (batch ``b``, head ``h``, query ``i``, source ``j <= i``), with ``alpha = hook_pattern``,
``v = hook_v`` (GQA-expanded), ``z = hook_z`` and ``W_O`` from the model:

- projected value ``vt[j,h] = v[j,h] @ W_O[h]``; head output ``o[i,h] = z[i,h] @ W_O[h]``;
  layer output ``o[i] = sum_h o[i,h]``, **without** ``b_O``.

The metrics are computed layer by layer, in blocks of queries, by
:class:`~mechgeom.analyses.contribution.geometry.LayerGeometry` (one ``q x k`` product in ``d_head`` per
head and metric; entries above the diagonal, ``key > query``, are exactly 0, factors included).
Headline statistics (sink shares, negative share, top-1 agreement, TV) are
:mod:`mechgeom.analyses.contribution.stats`: :meth:`ContributionResult.summary` for a result in memory,
:func:`~mechgeom.analyses.contribution.overview.contribution_overview` streamed over a corpus.

**Zero output norm.** Where ``‖o[i,h]‖ = 0`` (or ``‖o[i]‖ = 0`` for inter-head metrics and head shares)
the normalised metrics of that row are NaN at every source ``j <= i``: never a crash, never a silent 0.
Where a projected value is zero its cosine factor is 0 (then ``alpha * ratio * cos = c = 0`` still holds).

**Basis.** Geometry is measured on the model as loaded (see :mod:`mechgeom.models`); ``b_O`` is
excluded from ``o``, so ``sum_j c[h,i,j] = 1`` and ``sum_j c[i,j] = 1`` exactly.

**After an intervention** (``docs/definitions.md`` §2.6). The metrics describe the output the model actually produced,
``o[i,h] = z[i,h] @ W_O[h]`` with ``z`` as it reached ``W_O``. Where an earlier hook changed ``hook_z``
(head removal, mean ablation, patching from another run), ``z[i,h]`` is no longer ``sum_j alpha v_j``; the
reader marks that head and query as *modified* (:func:`mechgeom.hooks.modified_mask`). Then:

- the head's output still counts in ``o[i]``, as one part with no per-source terms, whose share
  ``<o[i], o[i,h]> / ‖o[i]‖²`` is ``modified_share`` (0 for a zeroed head);
- its per-source metrics are NaN (raw attention excepted: it is what the model computed), and its
  per-source head shares ``c[h→i,j]`` are exactly 0;
- inter-head metrics sum ``alpha vt`` over the unmodified heads only, projected on the full ``o[i]``, so
  ``sum_j c[i,j] + sum_h modified_share[h,i] = 1`` and
  ``sum_(h,j) c[h→i,j] + sum_h modified_share[h,i] = 1`` hold exactly. Pattern or value interventions
  (before the readers) need none of this: ``z`` follows from what the readers saw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import einops
import pandas as pd
import torch

from mechgeom._deprecation import warn_deprecated
from mechgeom._progress import progress
from mechgeom.analyses.base import (
    Collector,
    PassOptions,
    Result,
    entry_point,
    nothing_collected,
    run_collector,
)
from mechgeom.analyses.budget import contribution_budget
from mechgeom.analyses.contribution.geometry import INTER_METRICS, INTRA_METRICS, LayerGeometry, compute_dtype
from mechgeom.analyses.contribution.rows import query_index, row_metrics, top_row_metrics
from mechgeom.analyses.contribution.stats import SUMMARY_METRICS, result_summary, special_token_frame
from mechgeom.hooks import (
    LayerActivations,
    Queries,
    TokensOrText,
    check_indices,
    check_text_position,
    head_outputs,
    hook_name,
    modified_pairs,
    run_hooks,
    select_queries,
    text_positions,
    to_batch,
    token_strings,
)
from mechgeom.models.adapter import adapter
from mechgeom.typing import Bool, Float, Int, Tensor, Tokens

__all__ = [
    "MAX_FRAME_ROWS",
    "RANKING_METRICS",
    "ContributionCollector",
    "ContributionResult",
    "contribution_weights",
    "contribution_weights_from_cache",
    "reconstruct_attn_out",
]

#: The default row budget of :meth:`ContributionResult.to_frame` (a table of 4 M rows and ~20 columns is about
#: 1 GB in pandas); above it the table refuses and says how to make it smaller.
MAX_FRAME_ROWS = 4_000_000

#: The four metrics compared by paper A, in its claimed order of faithfulness.
RANKING_METRICS = ("attention", "value_weighted", "value_weighted_normalized", "contribution")


def _check_metrics(metrics: Sequence[str] | None, allowed: Sequence[str], kind: str) -> tuple[str, ...]:
    if metrics is None:
        return tuple(allowed)
    if isinstance(metrics, str):
        metrics = (metrics,)
    unknown = [m for m in metrics if m not in allowed]
    if unknown:
        raise ValueError(f"unknown {kind} metric(s) {unknown}; choose from {list(allowed)}")
    return tuple(dict.fromkeys(metrics))


@dataclass
class ContributionResult(Result):
    """Contribution weights and baselines for a batch of texts.

    ``intra[name]`` is ``[batch, layer, head_index, query_pos, key_pos]``; ``inter[name]`` is
    ``[batch, layer, query_pos, key_pos]``; ``layers[k]`` is the model layer at index ``k`` of the
    layer axis. Entries above the diagonal (``key > query``, not sources) are 0 in every metric, factors
    included; a row whose output norm is 0 is NaN at its sources ``key <= query`` (see the module docstring).
    For an encoder (``causal=False``) every key is a source.

    **Padding.** ``key_mask [batch, pos]`` marks each text's real tokens (decoders and encoders, left or right
    padding; ``None``: no padding). Padding is 0 as query and as key in every metric, and the table, the
    summary and :meth:`special_token_frame` leave it out: the sink is each text's first real token, the
    ``query``/``key`` columns of :meth:`to_frame` are positions inside each text, and every per-text number
    equals that of the text run alone. A text's padded index of text position ``p`` is ``p`` plus its number
    of left pads (``key_mask[b].long().argmax()``).

    **Some queries only** (``queries=``). Then the query axis holds the kept queries only, ``n`` rows per
    text (the most any text keeps): ``intra[name]`` is ``[batch, layer, head_index, n, key_pos]``, and
    ``query_index[b, r]`` is the padded position of row ``r``'s query (``-1`` for an empty row of a text that
    keeps fewer, which holds 0). Without ``queries=``, ``query_index`` is ``None`` and row ``i`` is position
    ``i``. The kept rows equal the same rows of the full computation.

    **The largest sources only** (``top_k=``). Then the last axis holds, per row, head and metric, the ``k``
    sources of largest ``|value|`` (in that order; a NaN, the metric of a row with no output, first):
    ``intra[name]`` is ``[batch, layer, head_index, query_pos, k]`` and ``intra_keys[name]`` the padded key
    position of each value (``-1`` with value 0 where the row has fewer sources); the same for ``inter`` with
    ``inter_keys``. The query axis is as with ``queries=`` (every real query without it). Every kept value
    equals the full computation's at that key. :meth:`summary` and :meth:`special_token_frame` need every
    source and refuse such a result; :meth:`to_frame` lists the kept sources; :meth:`key_row` scatters them.

    ``modified[b, l, h, i]`` marks the heads whose ``z`` an earlier hook changed, and ``modified_share`` is
    their part ``<o[i], o[i,h]> / ‖o[i]‖²`` of the layer output (0 elsewhere); see "After an intervention"
    in the module docstring. ``tokens`` is ``None`` when the result was built from a cache without them.
    """

    layers: list[int]
    tokens: Tokens | None
    intra: dict[str, Float[Tensor, "batch layer head_index query_pos key_pos"]]
    inter: dict[str, Float[Tensor, "batch layer query_pos key_pos"]]
    str_tokens: list[list[str]] | None = None
    basis: str = "as loaded, b_O excluded"
    model_name: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    modified: Bool[Tensor, "batch layer head_index query_pos"] | None = None
    modified_share: Float[Tensor, "batch layer head_index query_pos"] | None = None
    #: ``False`` for an encoder: every key is a source of every query (no zero upper triangle).
    causal: bool = True
    #: The real (non-padding) tokens ``[batch, pos]`` of every text (``None``: no padding); every metric is 0
    #: at a padded query or key.
    key_mask: Bool[Tensor, "batch pos"] | None = None
    #: ``[batch, n]``: the padded position of each row of the query axis (``-1``: an empty row); ``None``: the
    #: query axis is every position (row ``i`` is position ``i``). Set by ``queries=`` and by ``top_k=``.
    query_index: Int[Tensor, "batch query_pos"] | None = None
    #: The sources kept per row, head and metric (``top_k=``); ``None``: every key (the last axis is ``key_pos``).
    top_k: int | None = None
    #: With ``top_k``: the padded key position of each kept value, ``[batch, layer, head_index, query_pos, k]``
    #: per intra-head metric (``-1``: none, the row has fewer sources; its value is 0).
    intra_keys: dict[str, Int[Tensor, "batch layer head_index query_pos k"]] | None = None
    #: With ``top_k``: the same for the inter-head metrics, ``[batch, layer, query_pos, k]``.
    inter_keys: dict[str, Int[Tensor, "batch layer query_pos k"]] | None = None
    #: With ``top_k``: the padded length of the texts (the last axis of the metrics is then the kept sources).
    n_positions: int | None = None

    @property
    def modified_heads(self) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs whose ``z`` was changed by an earlier hook at some query of some text."""
        return modified_pairs(self.modified, self.layers)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(batch, n_heads, pos)`` of the analysed texts (``pos``: the key axis, the padded length)."""
        t = next(iter(self.intra.values())) if self.intra else None
        if t is None:
            t4 = next(iter(self.inter.values()))
            return int(t4.shape[0]), 0, int(self.n_positions or t4.shape[-1])
        return int(t.shape[0]), int(t.shape[2]), int(self.n_positions or t.shape[-1])

    def rows(self) -> Int[Tensor, "batch query_pos"]:
        """The padded position of each row of the query axis, ``[batch, rows]`` (``-1``: an empty row)."""
        n_batch, _, pos = self.shape
        if self.query_index is not None:
            return self.query_index.cpu()
        return torch.arange(pos).expand(n_batch, pos)

    def real(self) -> Bool[Tensor, "batch pos"]:
        """The real tokens, ``[batch, pos]`` on the CPU (all ``True`` without padding)."""
        n_batch, _, pos = self.shape
        return (
            torch.ones(n_batch, pos, dtype=torch.bool)
            if self.key_mask is None
            else self.key_mask.bool().cpu()
        )

    def _every_source(self, what: str) -> None:
        if self.top_k is not None:
            raise ValueError(
                f"{what} needs every source of each query, but this result keeps the top_k={self.top_k} largest "
                "only: compute without top_k= (queries=[-1] keeps it small), or use contribution_overview, which "
                "streams the summary statistics over every source"
            )

    def key_row(
        self, metric: str, batch: int, layer: int, row: int, *, head: int | None = None
    ) -> Float[Tensor, " key_pos"]:
        """One row of a metric against every key, ``[pos]`` (padded positions): the intra-head ``metric`` of
        ``head``, or the inter-head one when ``head`` is ``None``. For a ``top_k`` result the kept sources are
        scattered at their keys and every other key is 0 (not computed, not necessarily 0).

        Args:
            metric: a metric of the result (``KeyError`` names those it has).
            batch: the text; layer: a model layer that was analysed; row: a row of the query axis
                (:meth:`rows` gives its padded position); head: a head, or ``None`` for the whole layer.
        """
        table, keys = (self.inter, self.inter_keys) if head is None else (self.intra, self.intra_keys)
        if metric not in table:
            kind = "inter" if head is None else "intra"
            raise KeyError(f"{kind}-head metric {metric!r} is not in the result; it has {sorted(table)}")
        li = self.layer_index(layer)
        pick = (batch, li, row) if head is None else (batch, li, head, row)
        values = table[metric][pick]
        if keys is None:
            return values
        where = keys[metric][pick]
        out = values.new_zeros(self.shape[2])
        kept = where >= 0
        return out.index_put_((where[kept],), values[kept])

    def layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise IndexError(f"layer {layer} was not analysed; analysed layers are {self.layers}") from None

    def summary(self, *, batch: int | Sequence[int] | None = None) -> dict[str, Any]:
        """The headline numbers of :func:`contribution_overview`, from this result in memory.

        ``{"n_heads", "n_texts", "sink_attention", "sink_contribution", "sink_value_weighted_normalized",
        "negative_share", "top1_agreement", "view_layer", "view_layer_tv"}``: means over heads of the
        per-head statistics of :func:`~mechgeom.analyses.contribution.stats.score_sums`, and the layer of
        largest whole-layer TV between attention and contribution with that TV. Needs the intra- and
        inter-head metrics ``attention``, ``value_weighted_normalized`` and ``contribution`` (a ``ValueError``
        names any that is missing). For an encoder, ``[CLS]`` and ``[SEP]`` take the sink's place:
        ``{"n_heads", "n_texts", "cls_<metric>", "sep_<metric>", "negative_share"}``, means over the rows of
        :meth:`special_token_frame`.

        **Texts and padding.** Padding is never a query, a source or the sink; the sink is each text's first
        real token and the queries counted are the real ones after it (``i >= 1`` inside the text). Several
        texts are pooled: each per-head statistic is the mean over every counted query of every text (what
        the texts run one by one give when their ``(sum, count)`` pairs are added), then the mean over heads.
        ``batch`` keeps some texts (an int or a sequence; ``IndexError`` names the range): ``summary(batch=b)``
        is the summary of text ``b`` run alone. With ``queries=``, the counted queries are the kept ones.
        """
        self._every_source("summary()")
        n_batch = self.shape[0]
        sel = check_indices(batch, n_batch, "batch")
        keep = None if batch is None else torch.tensor(sel, dtype=torch.long)

        def pick(t: Tensor | None) -> Tensor | None:
            return t if t is None or keep is None else t[keep.to(t.device)]

        intra = {k: pick(v) for k, v in self.intra.items()}
        inter = {k: pick(v) for k, v in self.inter.items()}
        key_mask, query_index = pick(self.key_mask), pick(self.query_index)
        if not self.causal:  # an encoder: [CLS] and [SEP] take the sink's place
            frame = special_token_frame(self.layers, intra, key_mask, query_index)  # type: ignore[arg-type]
            means = frame.groupby("token")[list(SUMMARY_METRICS)].mean()
            out: dict[str, Any] = {"n_heads": int(frame[["layer", "head"]].drop_duplicates().shape[0])}
            out["n_texts"] = len(sel)
            for token, key in (("[CLS]", "cls"), ("[SEP]", "sep")):
                out.update({f"{key}_{m}": float(means[m][token]) for m in SUMMARY_METRICS})
            out["negative_share"] = float(frame.drop_duplicates(["layer", "head"])["negative_share"].mean())
            return out
        return result_summary(self.layers, intra, inter, key_mask, query_index)  # type: ignore[arg-type]

    def special_token_frame(self) -> pd.DataFrame:
        """An encoder's ``[CLS]`` and ``[SEP]`` under attention, output-normalised value weight and contribution,
        per (layer, head): :func:`~mechgeom.analyses.contribution.stats.special_token_frame`."""
        self._every_source("special_token_frame()")
        return special_token_frame(self.layers, self.intra, self.key_mask, self.query_index)

    def to_frame(
        self,
        *,
        batch: int | Sequence[int] | None = None,
        layers: int | Sequence[int] | None = None,
        heads: int | Sequence[int] | None = None,
        query: int | Sequence[int] | None = None,
        max_rows: int | None = MAX_FRAME_ROWS,
    ) -> pd.DataFrame:
        """A tidy table: one row per (batch, layer, head, query, key) with ``key`` a source of ``query``
        (``key <= query`` on a decoder, every key on an encoder), real tokens only.

        Columns: ``batch, layer, head, query, key``, then ``query_token, key_token`` when the result has
        tokens (a result built from a cache without tokens has none), every intra-head metric and
        factor kept (``factor_attention`` is ``attention``), ``modified`` and ``modified_share`` of the
        head at that query, then the inter-head metrics of the same ``(layer, query, key)`` prefixed
        ``layer_``. ``query`` and ``key`` are **positions inside the text** (the numbers the text run alone
        has); padding has no row (see "Padding" in the class docstring for the padded index). With
        ``queries=``, only the kept queries have rows.

        **A top_k result** has a long table instead, one row per kept source of each (text, layer, head,
        query, metric): ``batch, layer, head, query, [query_token], metric, rank, key, [key_token], value``,
        ``rank`` 0 the largest ``|value|``. Inter-head metrics are named ``layer_<metric>`` with ``head`` NA
        (``head`` is a nullable integer column); they are left out when ``heads`` is given.

        Args:
            batch, layers, heads: filters, each checked (an index out of range raises ``IndexError`` naming the
                valid range; a layer that was not analysed names the analysed ones). ``None``: all.
            query: positions inside each text (an int or a sequence); negative ones count from each text's
                end, so ``-1`` is each text's last real token. ``IndexError`` names a text's valid range.
            max_rows: the most rows the table may have (``None``: no limit). The count is computed first, and
                a larger table raises ``ValueError`` with the count and the ways to make it smaller, before
                anything is built.
        """
        # Why this function is long: the filters, the row budget and one pass over texts, layers and heads
        # share the per-text index arithmetic (real tokens, kept rows, text positions) computed once per text.
        n_batch, n_heads, pos = self.shape
        b_sel = check_indices(batch, n_batch, "batch")
        if layers is None:
            l_sel = list(self.layers)
        else:
            l_sel = [layers] if isinstance(layers, int) else list(layers)
            for layer in l_sel:
                self.layer_index(layer)
        h_sel = check_indices(heads, n_heads, "head")
        real_all, rows = self.real(), self.rows()
        if self.top_k is not None:
            kept = {b: self._row_filter(b, query, real_all[b], rows[b]) for b in b_sel}
            return self._top_frame(kept, l_sel, h_sel if heads is not None else None, max_rows)
        pairs = {b: self._pairs(b, query, real_all[b], rows[b]) for b in b_sel}
        n_rows = sum(len(r) for r, _ in pairs.values()) * len(l_sel) * len(h_sel)
        if max_rows is not None and n_rows > max_rows:
            raise ValueError(
                f"to_frame would build {n_rows:,} rows ({len(b_sel)} text(s) x {len(l_sel)} layer(s) x "
                f"{len(h_sel)} head(s) x their (query, key) pairs), above max_rows={max_rows:,}: filter with "
                "batch=, layers=, heads= or query= (e.g. query=-1, each text's last token), compute fewer "
                "queries with contribution_weights(..., queries=[-1]), or pass a larger max_rows= (None: no limit)"
            )
        str_tokens = self.str_tokens if self.tokens is not None else None
        positions = text_positions(self.key_mask, n_batch, pos)  # [b pos]: index inside each text
        frames = []
        for b in b_sel:
            rr, kk = pairs[b]  # row of the query axis, padded key position
            qq = rows[b][rr]  # padded query position
            q_text, k_text = positions[b][qq].numpy(), positions[b][kk].numpy()
            for layer in l_sel:
                li = self.layer_index(layer)
                inter_cols = {f"layer_{k}": v[b, li, rr, kk].cpu().numpy() for k, v in self.inter.items()}
                for h in h_sel:
                    cols: dict[str, Any] = {
                        "batch": b,
                        "layer": layer,
                        "head": h,
                        "query": q_text,
                        "key": k_text,
                    }
                    if str_tokens is not None:
                        st = str_tokens[b]
                        cols["query_token"] = [st[i] for i in qq.tolist()]
                        cols["key_token"] = [st[j] for j in kk.tolist()]
                    for k, v in self.intra.items():
                        cols[k] = v[b, li, h, rr, kk].cpu().numpy()
                    if "attention" in self.intra:
                        cols["factor_attention"] = cols["attention"]
                    if self.modified is not None and self.modified_share is not None:
                        cols["modified"] = self.modified[b, li, h, rr].cpu().numpy()
                        cols["modified_share"] = self.modified_share[b, li, h, rr].cpu().numpy()
                    cols.update(inter_cols)
                    frames.append(pd.DataFrame(cols))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def _row_filter(
        self, b: int, query: int | Sequence[int] | None, real: Tensor, qpos: Tensor
    ) -> Bool[Tensor, " query_pos"]:
        """The rows of text ``b``'s query axis in its table: real queries kept by ``query`` (positions inside
        the text, negative from its end). ``real`` is the text's real tokens, ``qpos`` the padded position of
        each row (``-1``: an empty row)."""
        n_real = int(real.sum())
        ok = (qpos >= 0) & real[qpos.clamp_min(0)]
        if query is not None:
            items = [query] if isinstance(query, int) or not isinstance(query, Sequence) else list(query)
            wanted = set()
            for q in items:
                wanted.add(check_text_position(q, n_real, b))
            inside = text_positions(real[None], 1, real.shape[0])[0]  # index inside the text
            ok &= torch.isin(inside[qpos.clamp_min(0)], torch.tensor(sorted(wanted), dtype=torch.long))
        return ok

    def _pairs(
        self, b: int, query: int | Sequence[int] | None, real: Tensor, qpos: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(row, key)`` of text ``b``'s table: the row of the query axis and the padded key position of each
        source (``key <= query`` on a decoder, every real key on an encoder) of the rows :meth:`_row_filter`
        keeps, in row-major order."""
        ok = self._row_filter(b, query, real, qpos)
        src = real[None, :] & ok[:, None]  # [rows k]
        if self.causal:
            src &= torch.arange(real.shape[0]) <= qpos[:, None]
        rr, kk = src.nonzero(as_tuple=True)
        return rr, kk

    def _top_frame(
        self,
        kept: dict[int, Tensor],
        l_sel: list[int],
        h_sel: list[int] | None,
        max_rows: int | None,
    ) -> pd.DataFrame:
        """The long table of a ``top_k`` result (see :meth:`to_frame`): ``kept[b]`` the rows of text ``b``,
        ``h_sel`` the heads (``None``: every head, and the inter-head metrics)."""
        assert self.intra_keys is not None and self.inter_keys is not None
        n_batch, n_heads, pos = self.shape
        li = torch.tensor([self.layer_index(layer) for layer in l_sel], dtype=torch.long)
        hi = torch.arange(n_heads) if h_sel is None else torch.tensor(h_sel, dtype=torch.long)
        rows, positions = self.rows(), text_positions(self.key_mask, n_batch, pos)
        parts: list[tuple[int, str, Tensor, Tensor, Tensor | None]] = []  # b, metric, values, keys, heads
        for b, ok in kept.items():
            for m, t in self.intra.items():  # [l h n k] -> the selected layers and heads
                vals, keys = (
                    x[b][li.to(x.device)][:, hi.to(x.device)].cpu() for x in (t, self.intra_keys[m])
                )
                parts.append((b, m, vals, keys.masked_fill(~ok[None, None, :, None], -1), hi))
            if h_sel is None:
                for m, t in self.inter.items():  # [l n k]
                    vals, keys = (x[b][li.to(x.device)].cpu() for x in (t, self.inter_keys[m]))
                    parts.append((b, f"layer_{m}", vals, keys.masked_fill(~ok[None, :, None], -1), None))
        n_rows = sum(int((keys >= 0).sum()) for _, _, _, keys, _ in parts)
        if max_rows is not None and n_rows > max_rows:
            raise ValueError(
                f"to_frame would build {n_rows:,} rows (the kept sources of {len(kept)} text(s) x {len(l_sel)} "
                f"layer(s)), above max_rows={max_rows:,}: filter with batch=, layers=, heads= or query=, or pass "
                "a larger max_rows= (None: no limit)"
            )
        str_tokens = self.str_tokens if self.tokens is not None else None
        frames = []
        for b, metric, vals, keys, heads in parts:
            idx = (keys >= 0).nonzero(as_tuple=True)  # (l, [h,] row, rank), row-major
            l_at, r_at, rank = idx[0], idx[-2], idx[-1]
            qq, kk = rows[b][r_at], keys[idx]
            cols: dict[str, Any] = {
                "batch": b,
                "layer": torch.tensor(l_sel, dtype=torch.long)[l_at].numpy(),
                "head": pd.array(heads[idx[1]].numpy() if heads is not None else [pd.NA] * len(kk), "Int64"),
                "query": positions[b][qq].numpy(),
            }
            if str_tokens is not None:
                cols["query_token"] = [str_tokens[b][i] for i in qq.tolist()]
            cols.update({"metric": metric, "rank": rank.numpy(), "key": positions[b][kk].numpy()})
            if str_tokens is not None:
                cols["key_token"] = [str_tokens[b][j] for j in kk.tolist()]
            cols["value"] = vals[idx].numpy()
            frames.append(pd.DataFrame(cols))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


class ContributionCollector(Collector):
    """A hook collector that computes the metric family layer by layer during a forward pass.

    Use ``collector.fwd_hooks`` with ``model.run_with_hooks``, ``model.hooks(...)`` or next to
    ``run_with_cache``; after the pass, :meth:`result` returns a :class:`ContributionResult`. With
    ``on_layer`` given, each layer's metrics go to that callback instead and nothing is stored
    (``{"intra": {...}, "inter": {...}, "modified", "modified_share", "key_mask", "query_index"}`` per layer:
    the pass' real tokens, ``None`` without padding, and the kept rows, ``None`` without ``queries``), so
    memory stays at one layer's worth. Without ``on_layer``, the metrics are written straight into the
    ``[batch, layer, ...]`` tensors of the result (no second copy); several passes (the batches of
    :func:`~mechgeom.analyses.base.collect`) are kept one after the other, with their padding. :meth:`result`
    takes the analysed tokens (optional) and derives their strings from the model's tokenizer.

    ``queries`` (as :func:`~mechgeom.hooks.select_queries` takes it: positions inside each text, ``-1`` its
    last real token; a slice; a boolean mask) computes the kept queries' rows only, ``O(k)`` per kept query
    (:mod:`mechgeom.analyses.contribution.rows`); the result's query axis then holds those rows
    (``ContributionResult.query_index``). ``top_k`` keeps, per row, head and metric, the ``top_k`` sources of
    largest ``|value|`` as values and key positions (every real query's row without ``queries``), computed a
    block of rows at a time, so memory is ``O(top_k)`` per row (:func:`~mechgeom.analyses.contribution.rows.
    top_row_metrics`); see "The largest sources only" in :class:`ContributionResult`. With ``on_layer`` the
    payload then has ``intra_keys`` and ``inter_keys`` as well.

    **Recycled buffers (the on_layer contract).** After ``on_layer`` returns, each metric tensor it was
    given is written again for the next layer *unless the callback kept a reference to it or to any view
    of it* (checked on the tensor's storage), so a callback that reduces or writes out its layer costs no
    fresh memory per layer, and one that keeps tensors (or views) gets fresh ones next time. A clone is
    always safe to keep. ``reuse_buffers=True`` (deprecated: the storage check recycles the same buffers)
    recycles unconditionally, so the callback must copy what it keeps.

    **Devices.** Every metric is computed on the model's device. ``store_device`` says where they are handed
    over: by default (``None``) a streaming collector's ``on_layer`` payload stays on the model's device (a GPU
    run streams without a copy to the host per layer; the callback moves what it keeps), and a stored result
    is built on the CPU, one copy per layer into the result's tensors.

    **Precision.** The metrics are computed in float32 for a bfloat16 or float16 model (see "Half precision" in
    :mod:`~mechgeom.analyses.contribution.geometry`) and returned in that dtype, or in ``out_dtype`` when given.

    >>> import torch
    >>> from transformer_lens.config import TransformerBridgeConfig
    >>> from transformer_lens.model_bridge import TransformerBridge
    >>> cfg = TransformerBridgeConfig(n_layers=1, d_model=8, n_ctx=8, d_head=4, n_heads=2,
    ...                               attn_only=True, d_vocab=10, seed=0)
    >>> model = TransformerBridge.boot_native(cfg)  # works on TransformerLens 3.x and 4.x
    >>> col = ContributionCollector(model, intra=["contribution"], inter=["contribution"])
    >>> _ = model.run_with_hooks(torch.tensor([[1, 2, 3]]), fwd_hooks=col.fwd_hooks)
    >>> res = col.result(torch.tensor([[1, 2, 3]]))
    >>> res.intra["contribution"].sum(-1).allclose(torch.ones(1, 1, 2, 3))
    True
    """

    supports_encoders = True  # every key of every query, padding excluded (see ContributionResult)

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        intra: Sequence[str] | None = None,
        inter: Sequence[str] | None = None,
        on_layer: Callable[[int, dict[str, Any]], None] | None = None,
        store_device: str | torch.device | None = None,
        reuse_buffers: bool = False,
        queries: Queries = None,
        out_dtype: torch.dtype | None = None,
        top_k: int | None = None,
    ) -> None:
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(
                f"top_k must be a positive int (the sources kept per query and head), got {top_k!r}"
            )
        if reuse_buffers and on_layer is None:
            raise ValueError(
                "reuse_buffers=True needs an on_layer callback (the buffers are overwritten per layer)"
            )
        if reuse_buffers:
            warn_deprecated(
                "ContributionCollector(reuse_buffers=True)",
                "ContributionCollector(on_layer=...) alone: buffers the callback does not keep are recycled",
            )
        super().__init__(model, layers)
        self.intra_metrics = _check_metrics(intra, INTRA_METRICS, "intra-head")
        self.inter_metrics = _check_metrics(inter, INTER_METRICS, "inter-head")
        if not self.intra_metrics and not self.inter_metrics:
            raise ValueError(
                "intra=[] and inter=[] leave nothing to compute: name at least one metric, e.g. "
                f"intra=['contribution'] (intra-head: {list(INTRA_METRICS)}; inter-head: {list(INTER_METRICS)}), "
                "or leave both out for every metric"
            )
        self.user_on_layer = on_layer
        #: Where the metrics are handed over; ``None``: the model's device of each layer (streaming only).
        self.store_device: torch.device | None = (
            torch.device(store_device)
            if store_device is not None
            else (None if on_layer is not None else torch.device("cpu"))
        )
        #: The dtype of the metrics returned; ``None``: the dtype they are computed in (float32 for a bfloat16 or
        #: float16 model, else the model's own; see "Half precision" in the geometry module).
        self.out_dtype = out_dtype
        self.reuse_buffers = reuse_buffers
        self._intra: dict[int, dict[str, Tensor]] = {}
        self._inter: dict[int, dict[str, Tensor]] = {}
        self._modified: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> (modified [b h q], share [b h q])
        self._buffers: tuple[dict[str, Tensor], dict[str, Tensor]] = ({}, {})  # recycled (on_layer)
        self._versions: dict[tuple[int, str], int] = {}  # buffer -> its _version when last written
        self._store: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        self._after_layer: Callable[[int], Any] | None = None  # progress of contribution_weights
        self._key_mask: Tensor | None = None  # the real tokens of the current pass (LayerActivations)
        self.queries = queries
        #: The sources kept per row, head and metric (``None``: every key).
        self.top_k = top_k
        self._keys: dict[
            int, tuple[dict[str, Tensor], dict[str, Tensor]]
        ] = {}  # layer -> top_k key positions
        self._query_index: Tensor | None = None  # [b n]: the kept queries of the current pass (queries=)
        self._batch = 0  # texts in the current pass
        self._n_pos = 0  # its padded length
        self._texts_done = 0  # texts of the passes before it (to cut a [texts, pos] queries mask)
        self._passes: list[_Pass] = []  # the finished passes (batches of collect())
        self._workspace: dict[str, Tensor] = {}  # LayerGeometry's temporaries, kept between layers

    def _out_tensors(self, acts: LayerActivations) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Where this layer's metrics are written: reused buffers, a slice of the result, or fresh memory."""
        B, H, Q, _ = acts.pattern.shape
        intra_metrics = [m for m in self.intra_metrics if m != "attention"]
        dtype = self._dtype(acts)
        if self.user_on_layer is not None:
            bufs = self._buffers
            p = acts.pattern
            for kind, names, shape in ((0, intra_metrics, (B, H, Q, Q)), (1, self.inter_metrics, (B, Q, Q))):
                for m in names:
                    t = bufs[kind].get(m)
                    if t is None or t.shape != shape or t.dtype != dtype or t.device != p.device:
                        bufs[kind][m] = p.new_empty(shape, dtype=dtype)
                        self._versions.pop((kind, m), None)
            return bufs
        if acts.pattern.device != self._dev(acts):
            return {}, {}
        L = len(self.layers)
        store = self._store
        if store is None:  # first layer of a (new) pass: fresh result tensors
            dev = self._dev(acts)
            store = (
                {m: torch.empty((B, L, H, Q, Q), dtype=dtype, device=dev) for m in self.intra_metrics},
                {m: torch.empty((B, L, Q, Q), dtype=dtype, device=dev) for m in self.inter_metrics},
            )
            self._store = store
            self._intra, self._inter = {}, {}
        li = self.layers.index(acts.layer)
        return ({m: t[:, li] for m, t in store[0].items()}, {m: t[:, li] for m, t in store[1].items()})

    def _dev(self, acts: LayerActivations) -> torch.device:
        """Where this layer's metrics are handed over: ``store_device``, else the layer's own device."""
        return self.store_device or acts.pattern.device

    def _dtype(self, acts: LayerActivations) -> torch.dtype:
        """The dtype of this layer's metrics: ``out_dtype``, else the dtype they are computed in."""
        return self.out_dtype or compute_dtype(acts.pattern.dtype)

    def _zeroed(self, out_intra: dict[str, Tensor], out_inter: dict[str, Tensor]) -> bool:
        """Whether every recycled buffer is exactly as this collector last wrote it (0 above the blocks)."""
        if self.user_on_layer is None or not self._versions:
            return False
        for kind, bufs in enumerate((out_intra, out_inter)):
            for m, t in bufs.items():
                if self._versions.get((kind, m)) != t._version:
                    return False
        return True

    def _written(self) -> None:
        """Note each buffer's version once this collector has written it (before the callback sees it)."""
        for kind, bufs in enumerate(self._buffers):
            for m, t in bufs.items():
                self._versions[(kind, m)] = t._version

    def _recycle(self) -> None:
        """Keep for the next layer the buffers nobody else holds (see "Recycled buffers"); drop the rest."""
        for kind, bufs in enumerate(self._buffers):
            for m in list(bufs):
                if not (self.reuse_buffers or _sole_owner(bufs[m])):
                    del bufs[m]  # the callback kept it (or a view): never write into it again
                    self._versions.pop((kind, m), None)

    def on_layer(self, acts: LayerActivations) -> None:
        if self.user_on_layer is None and acts.layer in self._intra:
            self._finish_pass()  # a layer seen again: a new pass (a batch of collect()) begins
        B, _, Q, _ = acts.pattern.shape
        self._key_mask = None if acts.key_mask is None else acts.key_mask.to(self._dev(acts))
        self._batch, self._n_pos = B, int(acts.pattern.shape[-1])
        keys: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        if self.queries is not None or self.top_k is not None:
            if self._query_index is None or acts.layer == min(self.layers):  # once per pass (on the host)
                self._query_index = query_index(self._pass_queries(B), acts.key_mask, B, Q)
            intra, inter, modified, share, keys = self._rows(acts, self._query_index)
        else:
            intra, inter, modified, share = self._full_layer(acts)
        if keys is not None:
            self._keys[acts.layer] = keys
        if self.user_on_layer is not None:
            payload = {"intra": intra, "inter": inter, "modified": modified, "modified_share": share}
            payload["key_mask"] = self._key_mask
            payload["query_index"] = self._query_index
            if keys is not None:
                payload["intra_keys"], payload["inter_keys"] = keys
            del intra, inter
            self._written()
            try:
                self.user_on_layer(acts.layer, payload)
            finally:
                del payload
                self._recycle()
            self._texts_done += B if acts.layer == max(self.layers) else 0
        else:
            self._intra[acts.layer] = intra
            self._inter[acts.layer] = inter
            self._modified[acts.layer] = (modified, share)
        if self._after_layer is not None:
            self._after_layer(acts.layer)

    def _rows(
        self, acts: LayerActivations, index: Tensor
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor, Tensor, Any]:
        """The kept rows ``index`` of the layer (``queries=``), or their ``top_k`` largest sources:
        ``(intra, inter, modified, modified_share, keys)`` on the store device, ``keys`` the ``(intra, inter)``
        key positions of a ``top_k`` collector (else ``None``)."""
        dtype, dev = self._dtype(acts), self._dev(acts)
        keys = None
        if self.top_k is None:
            intra, inter, modified, share = row_metrics(acts, index, self.intra_metrics, self.inter_metrics)
        else:
            top = top_row_metrics(acts, index, self.intra_metrics, self.inter_metrics, self.top_k)
            intra = {m: v for m, (v, _) in top[0].items()}
            inter = {m: v for m, (v, _) in top[1].items()}
            keys = (
                {m: k.to(dev) for m, (_, k) in top[0].items()},
                {m: k.to(dev) for m, (_, k) in top[1].items()},
            )
            modified, share = top[2], top[3]
        intra = {m: t.to(dev, dtype) for m, t in intra.items()}
        inter = {m: t.to(dev, dtype) for m, t in inter.items()}
        return intra, inter, modified.to(dev), share.to(dev, dtype), keys

    def _pass_queries(self, batch: int) -> Queries:
        """``queries`` for this pass: a ``[texts, pos]`` mask given for every text of a ``collect()`` run is
        cut to the rows of the batch being run."""
        q = self.queries
        if isinstance(q, Tensor) and q.ndim == 2 and q.shape[0] != batch:
            t0 = self._texts_done
            if t0 + batch <= q.shape[0]:
                return q[t0 : t0 + batch]
        return q

    def _full_layer(
        self, acts: LayerActivations
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor, Tensor]:
        """Every query of the layer (the blocked sweep of :class:`LayerGeometry`), written where
        :meth:`_out_tensors` says: ``(intra, inter, modified, modified_share)`` on the store device."""
        geo = LayerGeometry.from_activations(acts, workspace=self._workspace)
        out_intra, out_inter = self._out_tensors(acts)
        with torch.no_grad():
            intra, inter = geo.compute(
                self.intra_metrics,
                self.inter_metrics,
                out_intra=out_intra,
                out_inter=out_inter,
                zeroed=self._zeroed(out_intra, out_inter),
            )
            dtype, dev = self._dtype(acts), self._dev(acts)
            intra = {m: t.to(dev, dtype) for m, t in intra.items()}
            inter = {m: t.to(dev, dtype) for m, t in inter.items()}
            if geo.modified is None:
                modified = torch.zeros(acts.pattern.shape[:3], dtype=torch.bool, device=dev)
                share = torch.zeros(acts.pattern.shape[:3], dtype=dtype, device=dev)
            else:
                modified = geo.modified.to(dev)
                share = geo.modified_share.to(dev, dtype)
        return intra, inter, modified, share

    def _finish_pass(self) -> None:
        """Keep the metrics of the pass just run (every layer of it) and start afresh for the next one."""
        missing = [layer for layer in self.layers if layer not in self._intra]
        if missing:
            raise nothing_collected(missing)
        if self._store is not None and all(
            self._intra[la][m].data_ptr() == self._store[0][m][:, li].data_ptr()
            for li, la in enumerate(self.layers)
            for m in self.intra_metrics
        ):
            intra, inter = self._store  # written in place, layer by layer
        else:
            intra = {
                m: torch.stack([self._intra[la][m] for la in self.layers], dim=1) for m in self.intra_metrics
            }
            inter = {
                m: torch.stack([self._inter[la][m] for la in self.layers], dim=1) for m in self.inter_metrics
            }
        modified = torch.stack([self._modified[la][0] for la in self.layers], dim=1)
        share = torch.stack([self._modified[la][1] for la in self.layers], dim=1)
        keys = None
        if self.top_k is not None:

            def stacked(kind: int, names: Sequence[str]) -> dict[str, Tensor]:
                return {m: torch.stack([self._keys[la][kind][m] for la in self.layers], dim=1) for m in names}

            keys = (stacked(0, self.intra_metrics), stacked(1, self.inter_metrics))
        self._passes.append(
            _Pass(
                intra,
                inter,
                modified,
                share,
                self._key_mask,
                self._query_index,
                self._batch,
                self._n_pos,
                keys,
            )
        )
        self._texts_done += self._batch
        self._intra, self._inter, self._modified, self._keys = {}, {}, {}, {}
        self._store, self._key_mask, self._query_index = None, None, None

    def build(self, tokens: Tokens | None) -> ContributionResult:
        """The metrics of every pass so far (the batches of :func:`~mechgeom.analyses.base.collect`, in order)
        as one :class:`ContributionResult`; ``tokens`` (optional) are the analysed ids, whose strings come from
        the model's tokenizer (none without a tokenizer). The real tokens of every pass are kept
        (``key_mask``), so padding stays out of the table and the summary."""
        if self.user_on_layer is not None:
            raise RuntimeError(
                "this collector streams each layer's metrics to its on_layer callback and keeps none: "
                "collect them there, or make the collector without on_layer to get a result"
            )
        if self._intra:
            self._finish_pass()
        if not self._passes:
            raise nothing_collected(self.layers)
        if len(self._passes) > 1:
            self._passes = [_Pass.concat(self._passes)]  # once: later builds reuse it
        p = self._passes[0]
        return ContributionResult(
            layers=list(self.layers),
            tokens=tokens,
            intra=p.intra,
            inter=p.inter,
            str_tokens=token_strings(self.model, tokens),
            model_name=self.model_name,
            modified=p.modified,
            modified_share=p.share,
            causal=self.causal,
            key_mask=p.key_mask,
            query_index=p.query_index,
            top_k=self.top_k,
            intra_keys=None if p.keys is None else p.keys[0],
            inter_keys=None if p.keys is None else p.keys[1],
            n_positions=None if p.keys is None else p.n_positions,
        )


@dataclass
class _Pass:
    """The metrics of one forward pass (one batch), ``[batch, layer, ...]``, with its padding and kept rows."""

    intra: dict[str, Tensor]
    inter: dict[str, Tensor]
    modified: Tensor
    share: Tensor
    key_mask: Tensor | None
    query_index: Tensor | None
    batch: int
    #: The padded length of the pass' texts (the key axis).
    n_positions: int
    #: ``(intra, inter)`` key positions of a ``top_k`` collector's values; ``None``: every key.
    keys: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None

    @staticmethod
    def concat(passes: Sequence[_Pass]) -> _Pass:
        """The passes one after the other on the batch axis; a pass with fewer kept query rows gets empty ones
        (``query_index = -1``, metrics 0). Passes of different lengths are refused (``ValueError``)."""
        lengths = {int(p.modified.shape[-1]) if p.query_index is None else -1 for p in passes}
        n_pos = {p.n_positions for p in passes}
        if len(n_pos) > 1:
            raise ValueError(
                f"the passes this collector saw have {sorted(n_pos)} positions: one result needs texts of one "
                "padded length; pad them together (collect(model, texts, ...) does) or use one collector per length"
            )
        (k,) = n_pos
        n = max(int(p.modified.shape[-1]) for p in passes)
        rows = None
        if any(p.query_index is not None for p in passes) or lengths != {k}:
            rows = torch.cat(
                [
                    torch.nn.functional.pad(
                        p.query_index if p.query_index is not None else torch.arange(k).expand(p.batch, k),
                        (0, n - int(p.modified.shape[-1])),
                        value=-1,
                    )
                    for p in passes
                ]
            )

        def cat(ts: list[Tensor], axis: int, value: int = 0) -> Tensor:  # pad the query axis (``axis``) to n
            padded = []
            for t in ts:
                extra = n - int(t.shape[axis])
                widths = [0, 0] * (-axis - 1) + [0, extra]
                padded.append(torch.nn.functional.pad(t, widths, value=value) if extra else t)
            return torch.cat(padded)

        def mask(p: _Pass) -> Tensor:
            return torch.ones(p.batch, k, dtype=torch.bool) if p.key_mask is None else p.key_mask.cpu().bool()

        masks = [mask(p) for p in passes]
        key_mask = None if all(bool(m.all()) for m in masks) else torch.cat(masks)
        keys = None
        every = [p.keys for p in passes if p.keys is not None]  # a top_k collector's passes all have keys
        if every:

            def cat_keys(kind: int) -> dict[str, Tensor]:  # empty rows have no key (-1)
                return {m: cat([k[kind][m] for k in every], -2, -1) for m in every[0][kind]}

            keys = (cat_keys(0), cat_keys(1))
        return _Pass(
            intra={m: cat([p.intra[m] for p in passes], -2) for m in passes[0].intra},
            inter={m: cat([p.inter[m] for p in passes], -2) for m in passes[0].inter},
            modified=cat([p.modified for p in passes], -1),
            share=cat([p.share for p in passes], -1),
            key_mask=None if key_mask is None else key_mask.to(passes[0].modified.device),
            query_index=rows,
            batch=sum(p.batch for p in passes),
            n_positions=k,
            keys=keys,
        )


def _sole_owner(t: Tensor) -> bool:
    """Whether ``t`` is the only tensor that holds its storage (no other reference, no view of it).

    Counts the holders of the storage itself, so a view the caller kept is seen as well as the tensor.
    Where this PyTorch does not expose the count, ``False`` (never recycle a tensor that may be held).
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = t.untyped_storage()
    return int(use_count(storage._cdata)) <= 2  # this tensor, and the ``storage`` object just made


@entry_point
def contribution_weights(
    model: Any,
    tokens_or_text: TokensOrText | None,
    *,
    layers: int | Sequence[int] | None = None,
    intra: Sequence[str] | None = None,
    inter: Sequence[str] | None = None,
    queries: Queries = None,
    out_dtype: torch.dtype | None = None,
    memory_budget: float | None = None,
    top_k: int | None = None,
    **run: Unpack[PassOptions],
) -> ContributionResult:
    """Contribution weights and baselines of every head of ``layers`` in one forward pass.

    Args:
        model: a decoder or an encoder (on an encoder every key is a source of every query).
        tokens_or_text: text, texts or token ids; with ``cache``, the cached texts (optional: without them
            the result has no token strings and its table no token columns).
        layers: an int or a sequence of ints; ``None`` is every layer.
        verbose: a progress bar over the layers as they are computed (all texts run in one pass).
        intra, inter: the metrics kept (default: all of :data:`INTRA_METRICS` and :data:`INTER_METRICS`); each
            costs ``batch * layers * heads * q * k`` floats.
        attention_mask: ``[batch, pos]``, 1 at real tokens. The default is the padding of a list of texts
            (left or right, the model's padding side) and an encoder's ``[PAD]`` ids
            (:func:`~mechgeom.hooks.to_batch`); padding is then neither a source nor a query (every metric
            is 0 in its rows and columns, and the table and summary leave it out).
        queries: the queries to compute, ``None`` for all: an int or ints (positions inside each text,
            negative from its end: ``[-1]`` is each text's last real token, the prediction position, wherever
            the padding is), a ``slice`` of those positions, or a boolean ``[pos]`` / ``[batch, pos]`` mask
            over the padded batch (:func:`~mechgeom.hooks.select_queries`). Only the kept rows are computed,
            ``O(k)`` per kept query in time and memory (``batch * layers * heads * n_kept * k`` floats per
            metric); the result's query axis holds them and ``query_index`` says where each stands.
        out_dtype: the dtype of the metrics returned. ``None``: the dtype they are computed in, float32 for a
            bfloat16 or float16 model (its activations are read as they are and every metric is accumulated in
            float32, see :mod:`~mechgeom.analyses.contribution.geometry`), else the model's own. E.g.
            ``torch.bfloat16`` halves the memory of the result, at 8 significant bits.
        memory_budget: bytes the outputs may take (``math.inf``: no check); ``None``: the default of
            :mod:`mechgeom.analyses.budget` (50 % of the free memory where the result is kept). They are
            estimated before the pass (``batch * layers * heads * q * k`` per intra-head metric, plus the
            inter-head ones).
        top_k: keep, per query row, head and metric, the ``top_k`` sources of largest ``|value|`` as values
            and key positions (``result.intra_keys``, ``result.inter_keys``), for long contexts: the metrics
            are computed a block of rows at a time and reduced, so the result holds ``top_k`` values per row
            instead of ``k`` (``None``: every key). Combines with ``queries=``.

    Returns:
        A :class:`ContributionResult`.

    Raises:
        MemoryBudgetError: The estimate is above the budget (nothing was run); the message gives it and the
            ways out: ``queries=``, fewer metrics or layers, a streaming ``on_layer`` collector.
        IndexError: a query position outside some text (naming its valid range).
        ValueError, TypeError: as :func:`~mechgeom.hooks.select_queries` for a bad ``queries``.
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 24 lines.
    col = ContributionCollector(
        model, layers, intra=intra, inter=inter, queries=queries, out_dtype=out_dtype, top_k=top_k
    )
    cache, attention_mask = run["cache"], run["attention_mask"]
    if cache is not None:
        shape = _cache_shape(cache, col.layers[0])
        kept = None if shape is None else _kept_rows(queries, attention_mask, shape)
        contribution_budget(col, shape, cache=cache, memory_budget=memory_budget, queries=kept)
        return run_collector(model, tokens_or_text, col, **run)  # type: ignore[no-any-return]
    if tokens_or_text is None:
        raise ValueError("give text or token ids to analyse, or cache= with the activations of a pass")
    tokens, mask = to_batch(model, tokens_or_text, attention_mask=attention_mask, encoders=True)
    kept = _kept_rows(queries, mask, tokens.shape)
    contribution_budget(col, tokens.shape, memory_budget=memory_budget, queries=kept)
    bar = _layer_bar(col.layers, run["verbose"])
    col._after_layer = lambda _layer: next(bar, None)
    hooks = [*run["extra_hooks"], *col.fwd_hooks]
    try:
        run_hooks(model, tokens, hooks, stop_at_layer=max(col.layers) + 1, attention_mask=mask)
    finally:
        close = getattr(bar, "close", None)
        if close is not None:
            close()
    return col.result(tokens)  # type: ignore[return-value]


def _cache_shape(cache: Any, layer: int) -> tuple[int, int] | None:
    """``(batch, pos)`` of a cache's pattern of ``layer``; ``None`` where it has none (reading it fails later
    with its own message)."""
    try:
        pattern = cache[hook_name(layer, "pattern")]  # [batch head q k]
    except (KeyError, TypeError):
        return None
    return int(pattern.shape[0]), int(pattern.shape[-1])


def _kept_rows(queries: Queries, mask: Tensor | None, shape: tuple[int, ...] | torch.Size) -> int | None:
    """The query rows a text keeps under ``queries`` (the most of any text): what the budget counts per text;
    ``None`` for every query."""
    if queries is None:
        return None
    return int(select_queries(queries, mask, int(shape[0]), int(shape[1])).sum(-1).max())


def _layer_bar(layers: Sequence[int], enabled: bool) -> Iterator[int]:
    """A progress bar over ``layers`` (desc "contributions"), opened at 0; each ``next`` marks one layer done."""
    bar = iter(progress(layers, desc="contributions", enabled=enabled, total=len(layers)))
    next(bar, None)
    return bar


def contribution_weights_from_cache(
    model: Any,
    cache: Any,
    *,
    layers: int | Sequence[int] | None = None,
    intra: Sequence[str] | None = None,
    inter: Sequence[str] | None = None,
    tokens: Tokens | None = None,
) -> ContributionResult:
    """Deprecated: ``contribution_weights(model, tokens, cache=cache, ...)`` gives the same result."""
    warn_deprecated(
        "contribution_weights_from_cache(model, cache)", "contribution_weights(model, tokens, cache=cache)"
    )
    return contribution_weights(model, tokens, layers=layers, cache=cache, intra=intra, inter=inter)


def reconstruct_attn_out(model: Any, acts: LayerActivations) -> Float[Tensor, "batch pos d_model"]:
    """What ``hook_attn_out`` should read: ``sum_h sum_j alpha[h,i,j] vt[j,h] + b_O + sum_h b_V[h] W_O[h]``
    (:attr:`~mechgeom.hooks.LayerActivations.bias_out`; the value-bias term is zero where the model has none),
    through the model's post-attention norm where it has one (Gemma-2 and -3,
    :meth:`~mechgeom.models.adapter.ModelAdapter.attn_out_norm`).

    Args:
        model: the model the activations were read from.
        acts: one layer's activations (:class:`~mechgeom.hooks.LayerActivations`).

    Returns:
        ``[batch, pos, d_model]``, in the activations' compute dtype (float32 at least).
    """
    geo = LayerGeometry.from_activations(acts)
    mixed = einops.einsum(geo.pattern.to(geo.dtype), geo.v, "b h q k, b k h d -> b q h d")  # float32 in half
    out = head_outputs(mixed, geo.W_O).sum(dim=2) + acts.bias_out
    norm = adapter(model).attn_out_norm(acts.layer)
    if norm is None:
        return out
    with torch.no_grad():
        return norm(out.to(acts.b_O.dtype)).to(out.dtype)
