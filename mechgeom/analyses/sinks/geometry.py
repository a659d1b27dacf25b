"""The sink statistics of one layer and their collector (``docs/definitions.md`` §4): the formulas, :class:`SinkCollector`
and :class:`SinkResult`. The runs (:func:`~mechgeom.analyses.sinks.sink_statistics`, also on an encoder) and
the head choices are :mod:`mechgeom.analyses.sinks.statistics`, which re-exports everything here; the conventions (sink
set, queries ``Q``, short sequences, basis) are in its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import einops
import numpy as np
import pandas as pd
import torch

from mechgeom.analyses.base import Collector, Result
from mechgeom.analyses.contribution import LayerGeometry
from mechgeom.analyses.sinks.convexity import ConvexityTerms, query_terms, sink_mean_cos
from mechgeom.hooks import (
    LayerActivations,
    Queries,
    batch_queries,
    check_sinks_in_texts,
    masked_mean,
    modified_pairs,
    n_kv_heads,
    query_mask,
    resolve_sinks,
    sink_mask,
    text_spans,
    texts_first,
    token_strings,
)
from mechgeom.maths import wo_gram
from mechgeom.typing import Bool, Float, Int, Pattern, Tensor, Tokens

__all__ = [
    "FACTORS",
    "GROUPS",
    "QueryRows",
    "SinkCollector",
    "SinkResult",
    "describe_values",
    "factor_moments",
    "factor_shares_from_moments",
    "query_rows_mask",
    "sink_norm_ratio",
    "sink_rate",
    "sink_token_cos",
]

#: The three factors of ``log|c| = log alpha + log ratio + log|cos|``.
FACTORS = ("alpha", "ratio", "cos")
#: Token groups of the factor decomposition: the sink set and the tail (non-sink) tokens.
GROUPS = ("sink", "tail")
# layout of the last axis of the factor moment sums
_MOMENTS = ("n", "x_alpha", "x_ratio", "x_cos", "L", "x_alpha_L", "x_ratio_L", "x_cos_L", "L_L")


# ============================================================ the formulas of docs/definitions.md §4


def sink_rate(
    pattern: Pattern,
    sinks: Sequence[int],
    *,
    causal: bool = True,
    rows: Int[Tensor, " q"] | None = None,
) -> tuple[Float[Tensor, "batch head"], Float[Tensor, "batch head sink"]]:
    """Sink rate of a head: ``mean_{i>=1} alpha[h,i,0]``.

    With a sink set: ``mean_{i in Q} sum_{s in S} alpha[h,i,s]`` (first output) and the mass of each
    sink position ``mean_{i in Q} alpha[h,i,s]`` (second output). NaN when ``Q`` is empty. On an encoder
    (``causal=False``) ``Q`` is every query. ``rows`` (the positions of ``pattern``'s query rows, for a
    pattern of some rows only, ``[batch, head, len(rows), k]``) restricts the means to those queries.
    """
    qmask = query_rows_mask(sinks, pattern, rows, causal=causal)
    each = pattern[..., list(sinks)]  # [batch head q sink]
    per_sink = masked_mean(each, qmask[None, None, :, None].expand_as(each), dim=2)  # [batch head sink]
    total = each.sum(-1)  # [batch head q]
    return masked_mean(total, qmask[None, None, :].expand_as(total), dim=2), per_sink


def query_rows_mask(
    sinks: Sequence[int], pattern: Tensor, rows: Tensor | None, *, causal: bool = True
) -> Bool[Tensor, " q"]:
    """``Q`` on the query rows of ``pattern``: :func:`mechgeom.hooks.query_mask` of the full sequence, or of
    the positions ``rows`` where ``pattern`` holds some query rows only."""
    pos = pattern.shape[-1]
    full = query_mask(sinks, pos, pattern.device, causal=causal)
    return full if rows is None else full[rows.to(pattern.device)]


def sink_norm_ratio(
    norms: Float[Tensor, "batch head pos"], sinks: Sequence[int]
) -> Float[Tensor, "batch head sink"]:
    """Sink norm ratio: ``‖v[0,h]‖ / mean_{j>0} ‖v[j,h]‖`` (pass ``‖v‖`` or ``‖vt‖`` per token).

    Per sink position ``s``: ``‖v[s,h]‖ / mean_{j ∉ S} ‖v[j,h]‖``. NaN without a non-sink token or
    with a zero non-sink mean. Paper B reports 3–10× smaller sinks (ratio 0.1–0.33).
    """
    pos = norms.shape[-1]
    nonsink = ~sink_mask(sinks, pos, norms.device)
    ref = masked_mean(norms, nonsink.expand_as(norms), dim=-1)  # [batch head]
    ref = torch.where(ref == 0, torch.full_like(ref, float("nan")), ref)
    return norms[..., list(sinks)] / ref[..., None]


def sink_token_cos(
    vt: Float[Tensor, "batch pos head d_model"],
    vt_norm: Float[Tensor, "batch head pos"],
    sinks: Sequence[int],
) -> Float[Tensor, "batch head sink"]:
    """Anti-alignment with the tokens: ``mean_{j>0} cos(vt[0,h], vt[j,h])``.

    Per sink position ``s``: ``mean_{j ∉ S} cos(vt[s,h], vt[j,h])``; a zero vector gives a NaN cosine,
    skipped in the mean.
    """
    pos = vt.shape[1]
    dots = einops.einsum(vt[:, list(sinks)], vt, "b s h m, b k h m -> b h s k")
    den = vt_norm[..., list(sinks), None] * vt_norm[:, :, None, :]  # [b h s k]
    cos = torch.where(
        den > 0, dots / den.clamp_min(torch.finfo(den.dtype).tiny), torch.full_like(dots, float("nan"))
    )
    nonsink = ~sink_mask(sinks, pos, vt.device)
    return masked_mean(cos, nonsink.expand_as(cos), dim=-1)


def factor_moments(geo: LayerGeometry | QueryRows, sinks: Sequence[int]) -> Float[Tensor, "head group 9"]:
    """Moment sums of the factor decomposition ``log|c| = log alpha + log ratio + log|cos|`` (float64).

    ``c``, ``ratio = ‖vt[j,h]‖/‖o[i,h]‖`` and ``cos = cos(o[i,h], vt[j,h])`` come from
    :class:`LayerGeometry` (``contribution``, ``factor_norm_ratio``, ``factor_cos``), or from
    :class:`QueryRows` for some queries only. Groups: ``sink``
    = entries ``(b, i in Q, j in S)``; ``tail`` = ``(b, i in Q, j ∉ S, j <= i)`` (any ``j`` on an encoder). Entries where a log is
    not finite (``alpha = 0``, ``cos = 0``, ``‖o‖ = 0``) are dropped. With ``L = log|c|`` the last axis
    holds the sums ``n, ΣX_alpha, ΣX_ratio, ΣX_cos, ΣL, ΣX_alpha·L, ΣX_ratio·L, ΣX_cos·L, ΣL²``; they add
    over batches and heads, and :func:`factor_shares_from_moments` turns them into shares.
    """
    pos = geo.pattern.shape[-1]
    xs = [geo.pattern.log(), geo.factor_norm_ratio().log(), geo.factor_cos().abs().log()]  # [b h q k] each
    big_l = geo.contribution().abs().log()
    finite = torch.isfinite(big_l)
    for x in xs:
        finite &= torch.isfinite(x)
    is_sink = sink_mask(sinks, pos, big_l.device)
    rows = getattr(geo, "rows", None)
    qpos = torch.arange(geo.pattern.shape[-2], device=big_l.device) if rows is None else rows.to(big_l.device)
    qmask = query_rows_mask(sinks, geo.pattern, rows, causal=geo.causal)
    causal = torch.ones(len(qpos), pos, dtype=torch.bool, device=big_l.device)
    if geo.causal:
        causal = torch.arange(pos, device=big_l.device)[None, :] <= qpos[:, None]
    groups = (qmask[:, None] & is_sink[None, :], qmask[:, None] & ~is_sink[None, :] & causal)  # [q k]
    out = []
    for group in groups:
        keep = finite & group  # [b h q k]
        lk = torch.where(keep, big_l, 0.0)
        xk = [torch.where(keep, x, 0.0) for x in xs]

        def total(t: Tensor) -> Tensor:  # [b h q k] -> [h], accumulated in float64
            return t.sum((0, 2, 3), dtype=torch.float64)

        cols = [total(keep), *(total(x) for x in xk), total(lk), *(total(x * lk) for x in xk), total(lk * lk)]
        out.append(torch.stack(cols, dim=-1))  # [h 9]
    return torch.stack(out, dim=1)  # [h group 9]


class QueryRows:
    """The per-query side of a :class:`LayerGeometry` on some query rows only (``queries=``): the cost is
    that of the kept rows, ``O(k)`` per kept query and head, never ``O(q·k)``.

    ``rows`` are the kept positions (sorted); ``pattern`` is ``[batch, head, len(rows), k]``, ``z`` and
    ``modified`` those rows; ``v``, ``W_O``, ``vt_norm`` are the full sequence's. The factor metrics follow
    :class:`LayerGeometry`'s definitions (``c = <o_i, alpha vt_j> / ‖o_i‖²``, ``ratio = ‖vt_j‖ / ‖o_i‖``,
    ``cos = cos(o_i, vt_j)``, 0 where ``‖vt_j‖ = 0``), NaN where ``‖o_i‖ = 0`` or at a modified query.
    """

    def __init__(self, geo: LayerGeometry, rows: Int[Tensor, " r"]) -> None:
        dev = geo.pattern.device
        self.rows = rows.to(dev)
        self.pattern = geo.pattern[:, :, self.rows].to(geo.v.dtype)  # half precision: upcast, as v is
        self.v = geo.v
        self.z = geo.z[:, self.rows]
        self.W_O = geo.W_O
        self.causal = geo.causal
        self.modified = None if geo.modified is None else geo.modified[:, :, self.rows]
        self.vt_norm = geo.vt_norm  # [b h k]
        u = einops.einsum(self.z, geo.wo_gram, "b q h d, h d e -> b q h e")  # o_i @ W_O[h].T
        self._out_norm = einops.einsum(self.z, u, "b q h d, b q h d -> b h q").clamp_min(0).sqrt()
        self._dot = einops.einsum(u, self.v, "b q h e, b k h e -> b h q k")  # <o_i, vt_j>
        bad = self._out_norm == 0
        if self.modified is not None:
            bad = bad | self.modified
        self._bad = bad[..., None]  # [b h q 1]

    def _nan(self, x: Tensor) -> Tensor:
        return torch.where(self._bad, torch.full_like(x, torch.nan), x)

    def contribution(self) -> Tensor:
        on = self._out_norm[..., None]
        return self._nan(self.pattern * self._dot / torch.where(on > 0, on, 1) ** 2)

    def factor_norm_ratio(self) -> Tensor:
        on = self._out_norm[..., None]
        return self._nan(self.vt_norm[:, :, None, :] / torch.where(on > 0, on, 1))

    def factor_cos(self) -> Tensor:
        den = self._out_norm[..., None] * self.vt_norm[:, :, None, :]
        return self._nan(torch.where(den > 0, self._dot / torch.where(den > 0, den, 1), 0.0))


def factor_shares_from_moments(
    moments: Float[Tensor, "... 9"],
) -> tuple[Float[Tensor, "... 3"], Float[Tensor, "... 3"], Float[Tensor, "..."]]:
    """Factor decomposition of ``log|c|`` (variance decomposition, covariance split equally):

    ``share_f = Cov(X_f, L) / Var(L)`` with ``L = log|c| = X_alpha + X_ratio + X_cos`` and
    ``X_alpha = log alpha``, ``X_ratio = log(‖vt_j‖/‖o_i‖)``, ``X_cos = log|cos(o_i, vt_j)|``, over the
    entries of one group (population moments). The shares sum to 1 (up to float32 rounding of ``L``)
    because ``Var(L) = sum_f Cov(X_f, L)``: each pairwise covariance is split equally between its factors. A share
    is negative (or above 1) where a factor offsets the others. Returns ``(shares, mean log-factors, n)``;
    NaN for fewer than 2 entries or ``Var(L) = 0``.
    """
    n = moments[..., 0]
    safe_n = n.clamp_min(1)
    mean_x = moments[..., 1:4] / safe_n[..., None]
    mean_l = moments[..., 4] / safe_n
    cov = moments[..., 5:8] / safe_n[..., None] - mean_x * mean_l[..., None]
    var = moments[..., 8] / safe_n - mean_l**2
    ok = (n >= 2) & (var > 1e-12 * (1 + mean_l**2))
    shares = torch.where(ok[..., None], cov / torch.where(ok, var, 1)[..., None], torch.nan)
    mean_x = torch.where((n >= 1)[..., None], mean_x, torch.nan)
    return shares, mean_x, n


# =========================================================================== collector and result


@dataclass
class SinkResult(ConvexityTerms, Result):
    """Sink statistics of ``layers`` over ``n`` texts (axis 0), per head.

    Per text: ``sink_rate [n, layer, head]`` (mass on the sink set), ``sink_rate_pos [n, layer, head,
    sink]``, ``norm_ratio_v`` / ``norm_ratio_vt`` / ``cos_sink_tokens [n, layer, head, sink]``,
    ``cos_sink_mean [n, layer, head]`` (``mean_{i in Q} cos(vt_S[i], m[i])``, NaN cosines skipped).
    Per query (float64, NaN outside ``Q``): ``sink_mass`` (the measured sink rate ``s_i``),
    ``sq_sink = ‖vt_S‖²``, ``cross = <vt_S, m>``, ``sq_mean = ‖m‖²``, each ``[n, layer, head, q]``.
    ``factor_sums [layer, head, group, 9]``: see :func:`factor_moments`.
    ``modified [n, layer, head, q]`` marks the heads whose ``z`` an earlier hook changed
    (:func:`mechgeom.hooks.modified_mask`): the statistics above still describe ``alpha`` and ``v``, but
    those no longer make the head's output, and the factor moments leave such queries out (their
    ``c``, ratio and cosine are NaN, see :mod:`mechgeom.analyses.contribution.weights`).
    ``tokens [n, pos]`` and ``str_tokens`` (from the model's tokenizer) when the texts were given.

    With padding, ``sink_positions``, the query axis and ``tokens`` are positions *inside each text* (each
    text first, its padding after it; per-query tensors NaN there) and ``extras["lengths"]`` holds each
    text's real tokens; padding is never a query, a source or a sink.
    """

    layers: list[int]
    sink_positions: list[int]
    n_kv_heads: int
    sink_rate: Float[Tensor, "n layer head"]
    sink_rate_pos: Float[Tensor, "n layer head sink"]
    norm_ratio_v: Float[Tensor, "n layer head sink"]
    norm_ratio_vt: Float[Tensor, "n layer head sink"]
    cos_sink_tokens: Float[Tensor, "n layer head sink"]
    cos_sink_mean: Float[Tensor, "n layer head"]
    sink_mass: Float[Tensor, "n layer head q"]
    sq_sink: Float[Tensor, "n layer head q"]
    cross: Float[Tensor, "n layer head q"]
    sq_mean: Float[Tensor, "n layer head q"]
    factor_sums: Float[Tensor, "layer head group 9"]
    model_name: str = ""
    basis: str = "as loaded, b_O excluded"
    extras: dict[str, Any] = field(default_factory=dict)
    modified: Bool[Tensor, "n layer head q"] | None = None
    tokens: Tokens | None = None
    str_tokens: list[list[str]] | None = None

    @property
    def modified_heads(self) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs whose ``z`` an earlier hook changed at some query of some text."""
        return modified_pairs(self.modified, self.layers)

    # ---- factor decomposition
    def factor_shares(self, pooled: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``(shares [layer, head, group, factor], mean log-factors, n)``; ``pooled`` sums the moments of
        every head and layer first (``[group, factor]``). See :func:`factor_shares_from_moments`."""
        sums = self.factor_sums.sum((0, 1)) if pooled else self.factor_sums
        return factor_shares_from_moments(sums)

    # ---- headline numbers
    def summary(self) -> dict[str, Any]:
        """The headline numbers (plain floats, ints, lists and dicts), from the rows of :meth:`to_frame`.

        Head-level columns (sink rate, ``cos_sink_mean``, ``s*``, interior share, norm excess, factor
        shares) count each (layer, head) once; per-sink-position columns (norm ratios, ``cos_sink_tokens``)
        count each (layer, head, sink). Groups: ``all_heads``, ``sink_heads`` (sink rate >= 0.5) and
        ``layers_ge1``. ``*_per_head`` and the group blocks are :func:`describe_values`; ``share_*`` are
        fractions of the group's rows (a NaN counts as not in the range); ``mean_*`` are means over heads
        and ``norm_ratio_vt_median`` the median over rows (NaN skipped); ``*_pooled`` pool every head and
        layer.
        """
        rows = self.to_frame()
        heads = rows.drop_duplicates(["layer", "head"])
        out: dict[str, Any] = {
            "n_texts": int(self.sink_rate.shape[0]),
            "seq_len": int(self.sink_mass.shape[-1]),
            "sink_positions": list(self.sink_positions),
            "basis": self.basis,
        }
        for name, keep in (
            ("all_heads", None),
            ("sink_heads", "sink_rate >= 0.5"),
            ("layers_ge1", "layer >= 1"),
        ):
            per_sink, per_head = (rows, heads) if keep is None else (rows.query(keep), heads.query(keep))
            ratio_vt, cos_tok = per_sink["norm_ratio_vt"], per_sink["cos_sink_tokens"]
            out |= {
                f"norm_ratio_v_{name}": describe_values(per_sink["norm_ratio_v"]),
                f"norm_ratio_vt_{name}": describe_values(ratio_vt),
                f"share_ratio_vt_in_0.1_0.33_{name}": float(ratio_vt.between(0.1, 1 / 3).mean()),
                f"share_ratio_vt_below_1_{name}": float((ratio_vt < 1).mean()),
                f"cos_sink_tokens_{name}": describe_values(cos_tok),
                f"share_cos_sink_tokens_negative_{name}": float((cos_tok < 0).mean()),
                f"cos_sink_mean_{name}": describe_values(per_head["cos_sink_mean"]),
                f"share_cos_sink_mean_negative_{name}": float((per_head["cos_sink_mean"] < 0).mean()),
            }
        out["n_sink_heads"] = int((heads["sink_rate"] >= 0.5).sum())
        out["n_heads"] = len(heads)
        out["mean_sink_rate"] = float(heads["sink_rate"].mean())
        out["mean_cos_sink_mean"] = float(heads["cos_sink_mean"].mean())
        out["norm_ratio_vt_median"] = float(rows["norm_ratio_vt"].median())
        out["share_norm_ratio_vt_below_third"] = float((rows["norm_ratio_vt"] < 1 / 3).mean())
        out["interior_share_pooled"] = float(self.interior_share(pooled=True))
        for col in ("interior_share", "sink_rate", "s_star_median", "sink_rate_minus_s_star"):
            out[f"{col}_per_head"] = describe_values(heads[col])
        out["corr_sink_rate_s_star_heads"] = float(
            heads[["sink_rate", "s_star_median"]].corr().to_numpy()[0, 1]
        )
        out["norm_excess_median_per_head"] = describe_values(heads["norm_excess_median"])
        shares, means, _ = self.factor_shares(pooled=True)
        for g, gname in enumerate(GROUPS):
            out[f"factor_shares_{gname}_pooled"] = dict(zip(FACTORS, shares[g].tolist(), strict=True))
            out[f"factor_mean_log_{gname}_pooled"] = dict(zip(FACTORS, means[g].tolist(), strict=True))
            for f in FACTORS:
                out[f"factor_share_{gname}_{f}_per_head"] = describe_values(heads[f"{gname}_share_{f}"])
        return out

    # ---- tables
    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, head, sink position); means over texts.

        Head-level columns (the sink set as a whole; repeated on the rows of one head when there are
        several sinks): ``sink_rate``, ``cos_sink_mean``, ``s_star_median``, ``sink_rate_minus_s_star``
        (median over queries of ``s_i − s*_i``), ``interior_share``, ``norm_excess_median``,
        ``{sink,tail}_share_{alpha,ratio,cos}``, ``{sink,tail}_mean_log_{alpha,ratio,cos}``,
        ``{sink,tail}_n``. Per sink position: ``sink_rate_pos``, ``norm_ratio_v``, ``norm_ratio_vt``,
        ``cos_sink_tokens``.
        """
        st = self.s_star()
        gap = self.sink_mass - st
        excess = self.norm_excess()
        interior = self.interior_share()
        shares, means, counts = self.factor_shares()
        group = max(self.n_heads // max(self.n_kv_heads, 1), 1)

        def nanmedian(x: Tensor) -> Tensor:  # over texts and queries -> [layer, head]
            flat = einops.rearrange(x, "n l h q -> l h (n q)")
            return flat.nanmedian(dim=-1).values if flat.shape[-1] else torch.full(flat.shape[:2], torch.nan)

        med_s, med_gap, med_ex = nanmedian(st), nanmedian(gap), nanmedian(excess)
        head_mod = (
            torch.zeros(self.sink_rate.shape[1:], dtype=torch.bool)
            if self.modified is None
            else self.modified.any(dim=3).any(dim=0)
        )
        mean = partial(torch.nanmean, dim=0)
        rate, cos_mean = mean(self.sink_rate), mean(self.cos_sink_mean)
        rate_pos, ratio_v, ratio_vt, cos_tok = (
            mean(t) for t in (self.sink_rate_pos, self.norm_ratio_v, self.norm_ratio_vt, self.cos_sink_tokens)
        )
        rows = []
        for li, layer in enumerate(self.layers):
            for h in range(self.n_heads):
                head_cols: dict[str, Any] = {
                    "layer": layer,
                    "head": h,
                    "kv_head": h // group,
                    "sink_rate": float(rate[li, h]),
                    "cos_sink_mean": float(cos_mean[li, h]),
                    "s_star_median": float(med_s[li, h]),
                    "sink_rate_minus_s_star": float(med_gap[li, h]),
                    "interior_share": float(interior[li, h]),
                    "norm_excess_median": float(med_ex[li, h]),
                    "modified": bool(head_mod[li, h]),
                }
                for g, gname in enumerate(GROUPS):
                    for f, fname in enumerate(FACTORS):
                        head_cols[f"{gname}_share_{fname}"] = float(shares[li, h, g, f])
                    for f, fname in enumerate(FACTORS):
                        head_cols[f"{gname}_mean_log_{fname}"] = float(means[li, h, g, f])
                    head_cols[f"{gname}_n"] = int(counts[li, h, g])
                for si, s in enumerate(self.sink_positions):
                    rows.append(
                        {
                            **head_cols,
                            "sink": s,
                            "sink_rate_pos": float(rate_pos[li, h, si]),
                            "norm_ratio_v": float(ratio_v[li, h, si]),
                            "norm_ratio_vt": float(ratio_vt[li, h, si]),
                            "cos_sink_tokens": float(cos_tok[li, h, si]),
                        }
                    )
        df = pd.DataFrame(rows)
        df.attrs.update(model=self.model_name, basis=self.basis, sink_positions=list(self.sink_positions))
        return df


#: The per-query entries of a collector's per-text statistics (``[n, head, q]``), NaN (False) where not kept.
_PER_QUERY = ("sink_mass", "sq_sink", "cross", "sq_mean", "modified")


class SinkCollector(Collector):
    """Reader hooks (via :class:`LayerCollector`) that compute the sink statistics layer by layer.

    Pass ``collector.fwd_hooks`` to ``run_with_hooks`` / ``model.hooks(...)`` for one or more forward
    passes (texts are appended in order), then call :meth:`result`.

    **Padding** (``LayerActivations.key_mask``, left or right): each text is analysed on its real tokens
    alone, so its statistics are those of the text run alone; ``sink_positions`` and the query axis of the
    per-query tensors are positions *inside each text* (position 0 is its first real token), the per-query
    tensors NaN beyond its length. **Queries** (``queries=``, :func:`mechgeom.hooks.select_queries`): only
    the kept queries enter the per-query tensors, the query means and the factor moments, and only their
    rows are computed (:class:`QueryRows`); the sink-value statistics (norm ratios, ``cos_sink_tokens``)
    have no query axis and use every token of the text.
    """

    supports_encoders = True  # each text on its real tokens (sink_statistics groups an encoder's texts)

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        sink_positions: int | Sequence[int] | None = None,
        queries: Queries = None,
    ) -> None:
        super().__init__(model, layers)
        self.sinks = resolve_sinks(sink_positions)
        self.queries = queries
        self._per_text: dict[int, list[dict[str, Tensor]]] = {la: [] for la in self.layers}
        self._moments: dict[int, Tensor] = {}
        self._grams: dict[int, Tensor] = {}  # float64 W_O Gram matrices, once per layer
        self._offset: dict[int, int] = {}  # texts seen per layer (rows of a [n_texts, pos] queries mask)
        self._starts: list[Tensor] = []  # each batch's first real positions (left padding), first layer
        self._lengths: list[Tensor] = []  # each text's real tokens (extras["lengths"] of the result)

    def on_layer(self, acts: LayerActivations) -> None:
        batch, pos = int(acts.pattern.shape[0]), int(acts.pattern.shape[-1])
        offset = self._offset.get(acts.layer, 0)
        self._offset[acts.layer] = offset + batch
        keep = batch_queries(self.queries, acts.key_mask, batch, pos, offset)  # [b pos], padded coordinates
        starts, lengths = text_spans(acts.key_mask, batch, pos)
        if acts.layer == self.layers[0]:
            self._starts.append(starts)
            self._lengths.append(lengths)
        with torch.no_grad():
            if acts.layer not in self._grams:
                self._grams[acts.layer] = wo_gram(acts.W_O, dtype=torch.float64)
            gram = self._grams[acts.layer]
            if acts.key_mask is None and bool(keep.all()):  # the whole batch at once, as before
                geo = LayerGeometry.from_activations(acts)
                self._add(
                    acts.layer, self._layer_stats(geo, gram, None, pos), factor_moments(geo, self.sinks)
                )
                return
            for b in range(batch):  # each text on its real tokens: its numbers are those of the text alone
                s, n = int(starts[b]), int(lengths[b])
                check_sinks_in_texts(self.sinks, [n], offset + b)
                geo = LayerGeometry(
                    acts.pattern[b : b + 1, :, s : s + n, s : s + n],
                    acts.v[b : b + 1, s : s + n],
                    acts.z[b : b + 1, s : s + n],
                    acts.W_O,
                    modified=None if acts.modified is None else acts.modified[b : b + 1, :, s : s + n],
                    causal=acts.causal,
                )
                kept = keep[b, s : s + n]
                rows = None if bool(kept.all()) else kept.nonzero().flatten()
                part: LayerGeometry | QueryRows = geo if rows is None else QueryRows(geo, rows)
                stats = self._layer_stats(geo, gram, rows, pos)
                self._add(acts.layer, stats, factor_moments(part, self.sinks))

    def _add(self, layer: int, stats: dict[str, Tensor], moments: Tensor) -> None:
        self._per_text[layer].append(stats)
        prev = self._moments.get(layer)
        self._moments[layer] = moments.cpu() if prev is None else prev + moments.cpu()

    def _layer_stats(
        self, geo: LayerGeometry, gram: Tensor, rows: Tensor | None, width: int
    ) -> dict[str, Tensor]:
        """The statistics of ``geo`` (a batch, or one text on its real tokens); with ``rows`` only those
        queries; the per-query tensors NaN-padded to ``width`` positions (text positions)."""
        pos = geo.pattern.shape[-1]
        sinks = resolve_sinks(self.sinks, pos)  # raises inside the hook: run_hooks removes the hooks
        part: Any = geo if rows is None else QueryRows(geo, rows)
        rate, rate_pos = sink_rate(part.pattern, sinks, causal=geo.causal, rows=rows)
        v_norm = einops.rearrange(geo.v.norm(dim=-1), "b k h -> b h k")
        terms = query_terms(part, sinks, gram=gram)  # [b h q] each, NaN outside Q
        cos_q = sink_mean_cos(terms["sq_sink"], terms["cross"], terms["sq_mean"])
        qmask = query_rows_mask(sinks, geo.pattern, rows, causal=geo.causal)
        if rows is not None or pos < width:  # the kept rows at their positions, NaN (False) elsewhere
            at = torch.arange(pos, device=qmask.device) if rows is None else rows.to(qmask.device)
            for key, t in terms.items():
                full = torch.full(
                    (*t.shape[:2], width), False if t.dtype == torch.bool else torch.nan, dtype=t.dtype
                )
                full[..., at.cpu()] = t.cpu()
                terms[key] = full
        out = {
            "sink_rate": rate,
            "sink_rate_pos": rate_pos,
            "norm_ratio_v": sink_norm_ratio(v_norm, sinks),
            "norm_ratio_vt": sink_norm_ratio(geo.vt_norm, sinks),
            "cos_sink_tokens": sink_token_cos(geo.projected_values, geo.vt_norm, sinks),
            "cos_sink_mean": masked_mean(cos_q, qmask.expand_as(cos_q), dim=-1),
            **terms,
        }
        return {k: v.detach().cpu() for k, v in out.items()}

    def build(self, tokens: Tokens | None) -> SinkResult:
        """The statistics of every text seen so far; ``tokens`` (those texts, in order) are kept with
        their string tokens from the model's tokenizer. Per-query tensors of passes of different lengths
        are NaN-padded to the longest."""
        width = max(t["sink_mass"].shape[-1] for la in self.layers for t in self._per_text[la])

        def widen(k: str, t: Tensor) -> Tensor:
            if k not in _PER_QUERY:
                return t
            fill: Any = False if t.dtype == torch.bool else float("nan")
            return torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=fill)

        keys = self._per_text[self.layers[0]][0].keys()
        stacked: dict[str, Any] = {
            k: torch.stack(
                [torch.cat([widen(k, t[k]) for t in self._per_text[la]]) for la in self.layers], dim=1
            )
            for k in keys
        }
        extras: dict[str, Any] = {"lengths": torch.cat(self._lengths).tolist()} if self._lengths else {}
        if tokens is not None and tokens.shape[-1] == width:  # left padding: tokens in text positions too
            tokens = texts_first(tokens, self._starts)
        n_kv = n_kv_heads(self.model)
        if tokens is not None and tokens.shape != (stacked["sink_mass"].shape[0], width):
            raise ValueError(
                f"tokens of shape {tuple(tokens.shape)} are not the texts collected "
                f"({stacked['sink_mass'].shape[0]} x {width})"
            )
        return SinkResult(
            layers=list(self.layers),
            sink_positions=list(self.sinks),
            n_kv_heads=n_kv,
            factor_sums=torch.stack([self._moments[la] for la in self.layers]),
            model_name=self.model_name,
            tokens=tokens,
            str_tokens=token_strings(self.model, tokens),
            extras=extras,
            **stacked,
        )


def describe_values(x: Any) -> dict[str, Any]:
    """Quantiles of the finite values of ``x`` (NaN dropped): ``min, p05, median, p95, max`` (linear
    interpolation, ``numpy.quantile``) and their count ``n``; NaN quantiles when none is left.

    >>> describe_values([4.0, 0.0, float("nan"), 2.0])
    {'min': 0.0, 'p05': 0.2, 'median': 2.0, 'p95': 3.8, 'max': 4.0, 'n': 3}
    """
    v = pd.Series(np.asarray(x, dtype=float)).dropna().to_numpy()
    q = np.quantile(v, [0.0, 0.05, 0.5, 0.95, 1.0]) if len(v) else [np.nan] * 5
    return {
        **{k: float(val) for k, val in zip(("min", "p05", "median", "p95", "max"), q, strict=True)},
        "n": len(v),
    }
