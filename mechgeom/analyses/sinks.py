"""Attention sinks as active suppressors (SPEC.md "Sinks"; paper A §3.2–3.3, paper B's sink geometry).

One layer, batch ``b``, head ``h``, query ``i``, source ``j <= i``; ``alpha = hook_pattern``,
``v = hook_v`` (GQA-expanded), ``vt[j,h] = v[j,h] @ W_O[h]``, ``o[i,h] = z[i,h] @ W_O[h]`` (no ``b_O``).
Projected values, norms and head outputs come from :class:`mechgeom.analyses.contribution.LayerGeometry`.

**Sink set.** ``sink_positions`` (default ``[0]``) is the sink set ``S``; every other position is a
non-sink. With more than one sink:

- the *sink rate* is the total mass on the set, ``sum_{s in S} alpha[h,i,s]`` (the mass of each sink
  position is kept beside it as ``sink_rate_pos``);
- the *sink value* statistics (norm ratio, cosine to the non-sink tokens) are per sink position;
- the per-query statistics (anti-alignment with ``m``, convexity) use the *sink vector*
  ``vt_S[i] = sum_{s in S} alpha[h,i,s] vt[s,h] / sum_{s in S} alpha[h,i,s]``, which is ``vt[0,h]``
  for the default single sink, and the non-sink mean
  ``m[i,h] = sum_{j ∉ S} alpha[h,i,j] vt[j,h] / sum_{j ∉ S} alpha[h,i,j]``. Its denominator equals
  ``1 - alpha[h,i,0]`` (rows sum to 1) but is summed explicitly, which stays accurate in float32
  where ``alpha[h,i,0]`` rounds to 1.

**Queries.** Query statistics use ``Q = {i : i > max(S)}``, the queries that see every sink and at
least one non-sink (``i >= 1`` for the default sink, as in SPEC.md). Per-query tensors are NaN for
queries outside ``Q``.

**Short sequences.** A sequence of length 1 (or any sequence with ``max(S) = pos - 1``) has no query
in ``Q`` and no non-sink token: every statistic is NaN and :meth:`SinkResult.to_frame` still returns
one row per (layer, head, sink) with NaN values. At length 2 with ``S = [0]`` the statistics rest on
one query and one non-sink token; variance shares need at least two entries and are NaN otherwise.
A sink position at or beyond the sequence length raises ``ValueError``.

**Basis.** Geometry is measured on the model as loaded (``b_O`` excluded). mechgeom's offline models are
loaded with ``center_writing_weights=True``, a no-op for their RMSNorm, so ``W_O`` is the checkpoint's.

Every analysis is a set of ``(hook_name, fn)`` pairs: readers (:class:`SinkCollector`), the sink-mass
intervention on ``hook_pattern`` (:func:`sink_mass_hooks`) and the sink-value ablation on ``hook_v``
(:func:`sink_value_hooks`). The functions :func:`sink_statistics`, :func:`convexity_by_intervention`
and :func:`sink_ablation` run them; the plotting section at the end only draws their results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import einops
import numpy as np
import pandas as pd
import torch

from mechgeom._progress import progress
from mechgeom.analyses.contribution import LayerGeometry
from mechgeom.analyses.evaluation import bootstrap_ci, text_nll
from mechgeom.hooks import (
    FwdHook,
    LayerActivations,
    LayerCollector,
    ValueAblationMode,
    affected_heads,
    check_indices,
    kv_groups,
    masked_mean,
    modified_pairs,
    n_kv_heads,
    query_mask,
    resolve_heads,
    resolve_layers,
    resolve_sinks,
    run_hooks,
    sink_mask,
    sink_mass_hooks,
    sink_value_hooks,
    to_tokens,
)
from mechgeom.typing import Bool, Float, Pattern, Tensor, Tokens

if TYPE_CHECKING:
    pass

__all__ = [
    "FACTORS",
    "GROUPS",
    "SinkAblationResult",
    "SinkCollector",
    "SinkResult",
    "affected_heads",
    "cone_cos",
    "convex_minimiser",
    "convex_norm",
    "convexity_by_intervention",
    "convexity_terms",
    "factor_moments",
    "factor_shares_from_moments",
    "kv_groups",
    "random_control_positions",
    "resolve_sinks",
    "sink_ablation",
    "sink_mass_hooks",
    "sink_mean_cos",
    "sink_mean_split",
    "sink_norm_ratio",
    "sink_rate",
    "sink_statistics",
    "sink_token_cos",
    "sink_value_hooks",
]

#: The three factors of ``log|c| = log alpha + log ratio + log|cos|``.
FACTORS = ("alpha", "ratio", "cos")
#: Token groups of the factor decomposition: the sink set and the tail (non-sink) tokens.
GROUPS = ("sink", "tail")
#: The sink-value ablation modes (defined with the intervention in :mod:`mechgeom.hooks.interventions`).
AblationMode = ValueAblationMode
# layout of the last axis of the factor moment sums
_MOMENTS = ("n", "x_alpha", "x_ratio", "x_cos", "L", "x_alpha_L", "x_ratio_L", "x_cos_L", "L_L")


# =========================================================================== sink set and queries


# =========================================================================== SPEC formulas


def sink_rate(
    pattern: Pattern, sinks: Sequence[int]
) -> tuple[Float[Tensor, "batch head"], Float[Tensor, "batch head sink"]]:
    """Sink rate of a head: ``mean_{i>=1} alpha[h,i,0]``.

    With a sink set: ``mean_{i in Q} sum_{s in S} alpha[h,i,s]`` (first output) and the mass of each
    sink position ``mean_{i in Q} alpha[h,i,s]`` (second output). NaN when ``Q`` is empty.
    """
    pos = pattern.shape[-1]
    qmask = query_mask(sinks, pos, pattern.device)
    each = pattern[..., list(sinks)]  # [batch head q sink]
    per_sink = masked_mean(each, qmask[None, None, :, None].expand_as(each), dim=2)  # [batch head sink]
    total = each.sum(-1)  # [batch head q]
    return masked_mean(total, qmask[None, None, :].expand_as(total), dim=2), per_sink


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


def sink_mean_split(
    geo: LayerGeometry, sinks: Sequence[int]
) -> tuple[
    Float[Tensor, "batch head q d_head"],
    Float[Tensor, "batch head q d_head"],
    Float[Tensor, "batch head q"],
    Float[Tensor, "batch head q"],
]:
    """The sink vector and the non-sink mean of each query, in ``d_head`` (project with ``W_O[h]``):

    ``vt_S[i,h] = sum_{s in S} alpha[h,i,s] vt[s,h] / sum_{s in S} alpha[h,i,s]`` (``= vt[0,h]`` for one
    sink) and ``m[i,h] = sum_{j>0} alpha vt[j,h] / (1 - alpha[h,i,0])``, the non-sink mean, with the
    denominator summed as ``sum_{j ∉ S} alpha[h,i,j]``. Returns ``(zs, zm, sink_mass, rest_mass)`` with
    ``vt_S = zs @ W_O[h]``, ``m = zm @ W_O[h]`` and ``z[i,h] = sink_mass * zs + rest_mass * zm``
    (float64). A zero mass gives NaN vectors.
    """
    alpha = geo.pattern
    pos = alpha.shape[-1]
    is_sink = sink_mask(sinks, pos, alpha.device)
    a_sink = alpha * is_sink  # [b h q k]
    a_rest = alpha * ~is_sink
    z_sink = einops.einsum(a_sink, geo.v, "b h q k, b k h d -> b h q d").double()
    z_rest = einops.einsum(a_rest, geo.v, "b h q k, b k h d -> b h q d").double()
    sink_mass, rest_mass = a_sink.double().sum(-1), a_rest.double().sum(-1)  # [b h q]

    def per_mass(z: Tensor, mass: Tensor) -> Tensor:
        return torch.where(mass[..., None] > 0, z / mass.clamp_min(1e-300)[..., None], torch.nan)

    return per_mass(z_sink, sink_mass), per_mass(z_rest, rest_mass), sink_mass, rest_mass


def convexity_terms(
    geo: LayerGeometry, sinks: Sequence[int]
) -> tuple[
    Float[Tensor, "batch head q"], Float[Tensor, "batch head q"], Float[Tensor, "batch head q"], Tensor
]:
    """``(‖vt_S‖², <vt_S, m>, ‖m‖², sink_mass)`` per query (float64), the coefficients of the convexity
    curve, computed in ``d_head`` with the Gram matrix ``W_O[h] W_O[h]ᵀ`` (see :func:`sink_mean_split`)."""
    zs, zm, sink_mass, _ = sink_mean_split(geo, sinks)
    W_O = geo.W_O.double()
    gram = einops.einsum(W_O, W_O, "h d m, h e m -> h d e")
    gzm = einops.einsum(zm, gram, "b h q d, h d e -> b h q e")
    sq_sink = einops.einsum(
        zs, einops.einsum(zs, gram, "b h q d, h d e -> b h q e"), "b h q e, b h q e -> b h q"
    )
    return sq_sink, (zs * gzm).sum(-1), (zm * gzm).sum(-1), sink_mass


def sink_mean_cos(sq_sink: Tensor, cross: Tensor, sq_mean: Tensor) -> Tensor:
    """Anti-alignment with the non-sink mean: ``cos(vt[0,h], m[i,h]) = <vt_S, m> / (‖vt_S‖ ‖m‖)``
    from the terms of :func:`convexity_terms`; NaN where a norm is 0."""
    den = (sq_sink * sq_mean).sqrt()
    return torch.where(den > 0, cross / torch.where(den > 0, den, 1), torch.nan)


def convex_norm(
    sq_sink: Tensor, cross: Tensor, sq_mean: Tensor, s: float | Sequence[float] | Tensor
) -> Tensor:
    """Convexity curve: ``o(s) = s vt[0] + (1-s) m[i]``, so
    ``‖o(s)‖ = sqrt(s² ‖vt0‖² + 2 s (1-s) <vt0,m> + (1-s)² ‖m‖²)``.

    ``sq_sink = ‖vt_S‖²``, ``cross = <vt_S, m>``, ``sq_mean = ‖m‖²`` (any shape); ``s`` a scalar or a
    grid, which becomes a new last axis.
    """
    s_t = torch.as_tensor(s, dtype=torch.float64, device=sq_sink.device)
    if s_t.ndim:
        sq_sink, cross, sq_mean = sq_sink[..., None], cross[..., None], sq_mean[..., None]
    sq = s_t**2 * sq_sink + 2 * s_t * (1 - s_t) * cross + (1 - s_t) ** 2 * sq_mean
    return sq.clamp_min(0).sqrt()


def convex_minimiser(sq_sink: Tensor, cross: Tensor, sq_mean: Tensor) -> Tensor:
    """Minimiser of the convex quadratic ``‖o(s)‖²``:
    ``s* = (‖m‖² − <vt0,m>) / (‖vt0‖² − 2<vt0,m> + ‖m‖²)``.

    The denominator is ``‖vt0 − m‖² >= 0``; where it is 0 (the curve is flat) ``s*`` is NaN. ``s*`` is
    interior (in ``(0, 1)``) when ``<vt0,m> < min(‖vt0‖², ‖m‖²)``, e.g. when the sink opposes ``m``.
    """
    den = sq_sink - 2 * cross + sq_mean
    return torch.where(den > 0, (sq_mean - cross) / torch.where(den > 0, den, 1), torch.nan)


def factor_moments(geo: LayerGeometry, sinks: Sequence[int]) -> Float[Tensor, "head group 9"]:
    """Moment sums of the factor decomposition ``log|c| = log alpha + log ratio + log|cos|`` (float64).

    ``c``, ``ratio = ‖vt[j,h]‖/‖o[i,h]‖`` and ``cos = cos(o[i,h], vt[j,h])`` come from
    :class:`LayerGeometry` (``contribution``, ``factor_norm_ratio``, ``factor_cos``). Groups: ``sink``
    = entries ``(b, i in Q, j in S)``; ``tail`` = ``(b, i in Q, j ∉ S, j <= i)``. Entries where a log is
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
    qmask = query_mask(sinks, pos, big_l.device)
    causal = torch.ones(pos, pos, dtype=torch.bool, device=big_l.device).tril()
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
class SinkResult:
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
    ``c``, ratio and cosine are NaN, see :mod:`mechgeom.analyses.contribution`).
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

    @property
    def modified_heads(self) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs whose ``z`` an earlier hook changed at some query of some text."""
        return modified_pairs(self.modified, self.layers)

    @property
    def n_heads(self) -> int:
        return int(self.sink_rate.shape[2])

    def layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise IndexError(f"layer {layer} was not analysed; analysed layers are {self.layers}") from None

    # ---- convexity
    def s_star(self) -> Float[Tensor, "n layer head q"]:
        """Per-query minimiser ``s*`` of ``‖o(s)‖`` (see :func:`convex_minimiser`)."""
        return convex_minimiser(self.sq_sink, self.cross, self.sq_mean)

    def norm_curve(self, s: float | Sequence[float] | Tensor) -> Tensor:
        """Closed-form ``‖o(s)‖``, ``[n, layer, head, q(, grid)]`` (see :func:`convex_norm`)."""
        return convex_norm(self.sq_sink, self.cross, self.sq_mean, s)

    def head_out_norm(self) -> Float[Tensor, "n layer head q"]:
        """``‖o[i,h]‖`` rebuilt as ``‖o(s_i)‖`` at the measured sink rate."""
        return self._norm_at(self.sink_mass)

    def _norm_at(self, s: Tensor) -> Tensor:
        sq = s**2 * self.sq_sink + 2 * s * (1 - s) * self.cross + (1 - s) ** 2 * self.sq_mean
        return sq.clamp_min(0).sqrt()

    def interior_share(self, pooled: bool = False) -> Tensor:
        """Share of (text, query) pairs with ``s*`` in ``(0, 1)`` among those with a finite ``s*``,
        ``[layer, head]`` (``pooled``: one number over every head and layer). NaN without any."""
        st = self.s_star()
        finite = torch.isfinite(st)
        inside = finite & (st > 0) & (st < 1)
        dims = (0, 1, 2, 3) if pooled else (0, 3)
        num, den = inside.sum(dims).double(), finite.sum(dims).double()
        return torch.where(den > 0, num / den.clamp_min(1), torch.nan)

    def norm_excess(self) -> Float[Tensor, "n layer head q"]:
        """``‖o(s_i)‖ / min_{s in [0,1]} ‖o(s)‖``: how far above its norm minimum a head sits (>= 1)."""
        s_opt = self.s_star().clamp(0, 1)
        s_opt = torch.where(torch.isnan(s_opt), self.sink_mass, s_opt)
        best = self._norm_at(s_opt)
        return torch.where(best > 0, self._norm_at(self.sink_mass) / best.clamp_min(1e-300), torch.nan)

    # ---- factor decomposition
    def factor_shares(self, pooled: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``(shares [layer, head, group, factor], mean log-factors, n)``; ``pooled`` sums the moments of
        every head and layer first (``[group, factor]``). See :func:`factor_shares_from_moments`."""
        sums = self.factor_sums.sum((0, 1)) if pooled else self.factor_sums
        return factor_shares_from_moments(sums)

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

    def query_frame(
        self, layers: Sequence[int] | None = None, heads: Sequence[int] | None = None
    ) -> pd.DataFrame:
        """One row per (text, layer, head, query in ``Q``): ``sink_mass`` (measured ``s_i``), ``s_star``,
        ``head_out_norm``, ``sq_sink``, ``cross``, ``sq_mean``, ``modified``. Filters are checked: a layer
        that was not analysed or a head out of range raises ``IndexError`` naming the valid ones."""
        l_sel = self.layers if layers is None else ([layers] if isinstance(layers, int) else list(layers))
        for layer in l_sel:
            self.layer_index(layer)
        h_sel = check_indices(heads, self.n_heads, "head")
        st, norm = self.s_star(), self.head_out_norm()
        q = self.sink_mass.shape[-1]
        queries = np.arange(max(self.sink_positions) + 1, q)
        frames = []
        for layer in l_sel:
            li = self.layer_index(layer)
            for h in h_sel:
                for b in range(self.sink_rate.shape[0]):
                    sl = (b, li, h, torch.as_tensor(queries, dtype=torch.long))
                    frames.append(
                        pd.DataFrame(
                            {
                                "text": b,
                                "layer": layer,
                                "head": h,
                                "query": queries,
                                "sink_mass": self.sink_mass[sl].numpy(),
                                "s_star": st[sl].numpy(),
                                "head_out_norm": norm[sl].numpy(),
                                "sq_sink": self.sq_sink[sl].numpy(),
                                "cross": self.cross[sl].numpy(),
                                "sq_mean": self.sq_mean[sl].numpy(),
                                "modified": (
                                    np.zeros(len(queries), dtype=bool)
                                    if self.modified is None
                                    else self.modified[sl].numpy()
                                ),
                            }
                        )
                    )
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


class SinkCollector:
    """Reader hooks (via :class:`LayerCollector`) that compute the sink statistics layer by layer.

    Pass ``collector.fwd_hooks`` to ``run_with_hooks`` / ``model.hooks(...)`` for one or more forward
    passes over equal-length batches (texts are appended in order), then call :meth:`result`.
    """

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        sink_positions: int | Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.sinks = resolve_sinks(sink_positions)
        self.collector = LayerCollector(model, layers, self._on_layer)
        self.layers = self.collector.layers
        self._per_text: dict[int, list[dict[str, Tensor]]] = {la: [] for la in self.layers}
        self._moments: dict[int, Tensor] = {}

    @property
    def fwd_hooks(self) -> list[FwdHook]:
        return self.collector.fwd_hooks

    def feed_cache(self, cache: Any) -> None:
        self.collector.feed_cache(cache)

    def _on_layer(self, acts: LayerActivations) -> None:
        with torch.no_grad():
            geo = LayerGeometry.from_activations(acts)
            self._per_text[acts.layer].append(self._layer_stats(geo))
            mom = factor_moments(geo, self.sinks).cpu()
            prev = self._moments.get(acts.layer)
            self._moments[acts.layer] = mom if prev is None else prev + mom

    def _layer_stats(self, geo: LayerGeometry) -> dict[str, Tensor]:
        pos = geo.pattern.shape[-1]
        sinks = resolve_sinks(self.sinks, pos)  # raises inside the hook: run_hooks removes the hooks
        rate, rate_pos = sink_rate(geo.pattern, sinks)
        v_norm = einops.rearrange(geo.v.norm(dim=-1), "b k h -> b h k")
        sq_sink, cross, sq_mean, sink_mass = convexity_terms(geo, sinks)  # [b h q] each
        cos_q = sink_mean_cos(sq_sink, cross, sq_mean)
        qmask = query_mask(sinks, pos, geo.pattern.device)

        def nan_out(x: Tensor) -> Tensor:  # NaN outside Q
            return torch.where(qmask, x, torch.full_like(x, torch.nan))

        out = {
            "sink_rate": rate,
            "sink_rate_pos": rate_pos,
            "norm_ratio_v": sink_norm_ratio(v_norm, sinks),
            "norm_ratio_vt": sink_norm_ratio(geo.vt_norm, sinks),
            "cos_sink_tokens": sink_token_cos(geo.projected_values, geo.vt_norm, sinks),
            "cos_sink_mean": masked_mean(cos_q, qmask.expand_as(cos_q), dim=-1),
            "sink_mass": nan_out(sink_mass),
            "sq_sink": nan_out(sq_sink),
            "cross": nan_out(cross),
            "sq_mean": nan_out(sq_mean),
            "modified": (
                torch.zeros(geo.pattern.shape[:3], dtype=torch.bool) if geo.modified is None else geo.modified
            ),
        }
        return {k: v.detach().cpu() for k, v in out.items()}

    def result(self) -> SinkResult:
        missing = [la for la in self.layers if not self._per_text[la]]
        if missing:
            raise RuntimeError(
                f"no activations were collected for layer(s) {missing}; run collector.fwd_hooks first"
            )
        lengths = {t["sink_mass"].shape[-1] for la in self.layers for t in self._per_text[la]}
        if len(lengths) > 1:
            raise ValueError(
                f"batches of different sequence lengths {sorted(lengths)}; use equal-length windows"
            )
        keys = self._per_text[self.layers[0]][0].keys()
        stacked: dict[str, Any] = {
            k: torch.stack([torch.cat([t[k] for t in self._per_text[la]]) for la in self.layers], dim=1)
            for k in keys
        }
        cfg = self.model.cfg
        n_kv = n_kv_heads(self.model)
        return SinkResult(
            layers=list(self.layers),
            sink_positions=list(self.sinks),
            n_kv_heads=n_kv,
            factor_sums=torch.stack([self._moments[la] for la in self.layers]),
            model_name=str(getattr(cfg, "model_name", "")),
            **stacked,
        )


def sink_statistics(
    model: Any,
    tokens_or_text: str | Sequence[str] | Tensor,
    *,
    layers: int | Sequence[int] | None = None,
    sink_positions: int | Sequence[int] | None = None,
    batch_size: int = 8,
    extra_hooks: Sequence[FwdHook] = (),
    verbose: bool = False,
) -> SinkResult:
    """Sink rate, norm ratios, anti-alignment, convexity terms and factor moments of every head of
    ``layers`` (default: all), in batches of ``batch_size`` texts. ``extra_hooks`` run first in each pass
    (e.g. an intervention). The pass stops after the last analysed layer (no unembedding)."""
    tokens = to_tokens(model, tokens_or_text)
    col = SinkCollector(model, layers, sink_positions=sink_positions)
    starts = range(0, tokens.shape[0], batch_size)
    for start in progress(starts, desc="sinks", enabled=verbose, total=len(starts)):
        batch = tokens[start : start + batch_size]
        run_hooks(model, batch, [*extra_hooks, *col.fwd_hooks], stop_at_layer=max(col.layers) + 1)
    return col.result()


# =========================================================================== sink-mass intervention


def convexity_by_intervention(
    model: Any,
    tokens_or_text: str | Sequence[str] | Tensor,
    s_values: Sequence[float],
    *,
    layer: int,
    heads: int | Sequence[int] | None = None,
    sink_positions: int | Sequence[int] | None = None,
) -> Float[Tensor, "grid batch head q"]:
    """The convexity curve measured by intervention: for each ``s``, one pass with
    :func:`sink_mass_hooks` on ``layer`` and ``‖z'[i,h] @ W_O[h]‖`` read from the same layer's
    ``hook_z`` (float64 norm of the float32 output). Heads outside ``heads`` keep their clean output;
    queries outside ``Q`` are NaN. Compare with :meth:`SinkResult.norm_curve`."""
    tokens = to_tokens(model, tokens_or_text)
    layer = resolve_layers(model, layer)[0]
    sinks = resolve_sinks(sink_positions, tokens.shape[1])
    out = []
    for s in s_values:
        col = LayerCollector(model, layer)
        hooks = sink_mass_hooks(model, s, layers=layer, heads=heads, sink_positions=sinks)
        run_hooks(model, tokens, [*hooks, *col.fwd_hooks], stop_at_layer=layer + 1)
        acts = col.captured[layer]
        o = LayerGeometry.from_activations(acts).head_out.double()  # [b q h m]
        norm = einops.rearrange(o.norm(dim=-1), "b q h -> b h q")
        qmask = query_mask(sinks, tokens.shape[1], norm.device)
        out.append(torch.where(qmask, norm, torch.nan).cpu())
    return torch.stack(out)


# =========================================================================== sink-value ablation


def random_control_positions(
    n_texts: int, pos: int, sink_positions: int | Sequence[int] | None = None, *, seed: int = 0
) -> Tensor:
    """One random non-sink position per text, ``[n_texts, 1]``, uniform over ``{j < pos : j ∉ S}``
    (``torch.Generator`` seeded with ``seed``)."""
    sinks = resolve_sinks(sink_positions, pos)
    nonsink = torch.tensor([j for j in range(pos) if j not in sinks], dtype=torch.long)
    if not len(nonsink):
        raise ValueError(f"no non-sink position in a sequence of length {pos} with sinks {sinks}")
    g = torch.Generator().manual_seed(seed)
    return nonsink[torch.randint(len(nonsink), (n_texts, 1), generator=g)]


def cone_cos(geo: LayerGeometry, sinks: Sequence[int]) -> Float[Tensor, "batch head q"]:
    """``cos(o[i,h], mu_h)`` with ``mu_h`` the mean direction of the non-sink projected values (the
    "semantic cone"): ``mu_h = mean_{j ∉ S} vt[j,h]`` of the same text and pass. NaN where a norm is 0."""
    pos = geo.pattern.shape[-1]
    nonsink = ~sink_mask(sinks, pos, geo.pattern.device)
    mu = geo.projected_values[:, nonsink].mean(dim=1)  # [b h m]
    dots = einops.einsum(geo.head_out, mu, "b q h m, b h m -> b h q")
    den = geo.head_out_norm * mu.norm(dim=-1)[..., None]  # [b h q]
    return torch.where(den > 0, dots / den.clamp_min(1e-30), torch.nan)


class _OutputMeter:
    """Reads every layer's head outputs; per text and head: ``mean_{i in Q} ‖o[i,h]‖`` and
    ``mean_{i in Q} cos(o[i,h], mu_h)`` with ``mu_h = mean_{j ∉ S} vt[j,h]`` of the same pass."""

    def __init__(self, model: Any, sinks: list[int], n_texts: int) -> None:
        self.model, self.sinks = model, sinks
        shape = (n_texts, int(model.cfg.n_layers), int(model.cfg.n_heads))
        self.norm = torch.full(shape, torch.nan)
        self.cone = torch.full(shape, torch.nan)

    def hooks(self, sl: slice) -> list[FwdHook]:
        return LayerCollector(self.model, None, partial(self._on_layer, sl=sl)).fwd_hooks

    def _on_layer(self, acts: LayerActivations, *, sl: slice) -> None:
        geo = LayerGeometry.from_activations(acts)
        qmask = query_mask(self.sinks, geo.pattern.shape[-1], geo.pattern.device)
        cos = cone_cos(geo, self.sinks)  # [b h q]
        self.norm[sl, acts.layer] = masked_mean(geo.head_out_norm, qmask.expand_as(cos), -1).cpu()
        self.cone[sl, acts.layer] = masked_mean(cos, qmask.expand_as(cos), -1).cpu()


_CONDITIONS = ("clean", "sink", "control")


@dataclass
class SinkAblationResult:
    """Sink-value ablation vs clean vs a random-position control, on ``n`` texts.

    ``nll[cond]`` is the per-text mean next-token NLL ``[n]``; ``out_norm[cond]`` and ``cone_cos[cond]``
    are ``[n, n_layers, head]`` (every layer of the model, so downstream effects show too): the mean
    over ``i in Q`` of ``‖o[i,h]‖`` and of ``cos(o[i,h], mu_h)``. ``cond`` is ``"clean"``, ``"sink"``
    or ``"control"``. ``affected_heads`` are the query heads of the ablated KV groups. In layers after the
    first ablated one, the changes include the effect of the upstream ablation.
    """

    layers: list[int]
    heads: list[int]
    affected_heads: list[int]
    mode: str
    scale: float
    sink_positions: list[int]
    control_positions: Tensor
    tokens: Tokens
    nll: dict[str, Tensor]
    out_norm: dict[str, Tensor]
    cone_cos: dict[str, Tensor]
    model_name: str = ""

    def ppl(self, cond: str = "clean") -> float:
        """``exp(mean NLL)`` over every predicted token of every text."""
        return float(torch.exp(self.nll[cond].mean()))

    def delta_ppl(self, cond: str = "sink") -> float:
        """``PPL(cond) − PPL(clean)``."""
        return self.ppl(cond) - self.ppl("clean")

    def summary(self, *, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
        """PPL of each condition, ``ΔPPL`` and ``ΔNLL`` (with a per-text bootstrap 95% interval) of the sink
        ablation and of its control, and the mean ``Δ‖o‖`` / ``Δcos(o, mu)`` over the ablated heads."""
        out: dict[str, Any] = {
            "layers": " ".join(map(str, self.layers)),
            "n_layers_ablated": len(self.layers),
            "heads": " ".join(map(str, self.affected_heads)),
            "mode": self.mode,
            "scale": self.scale,
            "n_texts": int(self.nll["clean"].shape[0]),
            "ppl_clean": self.ppl("clean"),
        }
        frame = self.to_frame()
        abl = frame[frame["ablated"]]
        for cond in ("sink", "control"):
            d = (self.nll[cond] - self.nll["clean"]).numpy()
            lo, hi = bootstrap_ci(d, n_boot=n_boot, seed=seed)
            out |= {
                f"ppl_{cond}": self.ppl(cond),
                f"dppl_{cond}": self.delta_ppl(cond),
                f"dnll_{cond}": float(d.mean()),
                f"dnll_{cond}_lo": lo,
                f"dnll_{cond}_hi": hi,
                f"d_out_norm_rel_{cond}": float(abl[f"d_out_norm_rel_{cond}"].mean()),
                f"d_cone_cos_{cond}": float(abl[f"d_cone_cos_{cond}"].mean()),
            }
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, head) of the model (means over texts): ``ablated`` (the layer was ablated
        and the head is in an ablated KV group), ``out_norm_{cond}``, ``cone_cos_{cond}``, and for
        ``sink``/``control`` the changes ``d_out_norm_*`` (absolute), ``d_out_norm_rel_*``
        (``‖o'‖/‖o‖ − 1`` of the text means) and ``d_cone_cos_*``."""
        n_layers, n_heads = self.out_norm["clean"].shape[1:]
        norm = {c: torch.nanmean(self.out_norm[c], dim=0) for c in _CONDITIONS}
        cone = {c: torch.nanmean(self.cone_cos[c], dim=0) for c in _CONDITIONS}
        rel = {
            c: torch.nanmean(self.out_norm[c] / self.out_norm["clean"] - 1, dim=0)
            for c in ("sink", "control")
        }
        rows = []
        for layer in range(n_layers):
            for h in range(n_heads):
                row: dict[str, Any] = {
                    "layer": layer,
                    "head": h,
                    "ablated": layer in self.layers and h in self.affected_heads,
                }
                for c in _CONDITIONS:
                    row[f"out_norm_{c}"] = float(norm[c][layer, h])
                    row[f"cone_cos_{c}"] = float(cone[c][layer, h])
                for c in ("sink", "control"):
                    row[f"d_out_norm_{c}"] = row[f"out_norm_{c}"] - row["out_norm_clean"]
                    row[f"d_out_norm_rel_{c}"] = float(rel[c][layer, h])
                    row[f"d_cone_cos_{c}"] = row[f"cone_cos_{c}"] - row["cone_cos_clean"]
                rows.append(row)
        df = pd.DataFrame(rows)
        df.attrs.update(model=self.model_name, mode=self.mode, scale=self.scale, layers=list(self.layers))
        return df


def sink_ablation(
    model: Any,
    tokens: Tokens,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    mode: AblationMode = "zero",
    scale: float = 1.0,
    sink_positions: int | Sequence[int] | None = None,
    seed: int = 0,
    batch_size: int = 8,
    clean: SinkAblationResult | None = None,
    verbose: bool = False,
) -> SinkAblationResult:
    """Ablate the sink value (:func:`sink_value_hooks`) in ``layers`` × ``heads`` (default: all of them,
    at once) and, as a control, the value of one random non-sink position per text
    (:func:`random_control_positions` with ``seed``) in the same layers and heads with the same mode.

    Three passes (clean, sink, control; each one NLL pass with readers attached) measure the NLL
    (``mechgeom.analyses.evaluation.text_nll``), the head-output norms and the cone cosines. ``clean`` reuses
    the clean pass of an earlier result on the same tokens and sink set (for per-layer sweeps).
    """
    tokens = to_tokens(model, tokens)
    n, pos = tokens.shape
    sinks = resolve_sinks(sink_positions, pos)
    layer_list = resolve_layers(model, layers)
    head_list = resolve_heads(model, heads)
    control = random_control_positions(n, pos, sinks, seed=seed)
    common = {"layers": layer_list, "heads": head_list, "mode": mode, "scale": scale, "sink_positions": sinks}

    def measure(cond: str, make_hooks: Callable[[slice], list[FwdHook]]) -> tuple[Tensor, Tensor, Tensor]:
        meter = _OutputMeter(model, sinks, n)
        nll = text_nll(
            model,
            tokens,
            lambda sl: [*make_hooks(sl), *meter.hooks(sl)],
            batch_size=batch_size,
            verbose=verbose,
            desc=f"sink ablation: {cond}",
        )
        return nll, meter.norm, meter.cone

    results: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    if clean is not None:
        if clean.sink_positions != sinks or not torch.equal(clean.tokens, tokens.cpu()):
            raise ValueError("`clean` comes from other tokens or another sink set")
        results["clean"] = (clean.nll["clean"], clean.out_norm["clean"], clean.cone_cos["clean"])
    else:
        results["clean"] = measure("clean", lambda sl: [])
    results["sink"] = measure("sink", lambda sl: sink_value_hooks(model, **common))  # type: ignore[arg-type]
    results["control"] = measure(
        "control",
        lambda sl: sink_value_hooks(model, positions=control[sl], **common),  # type: ignore[arg-type]
    )
    return SinkAblationResult(
        layers=layer_list,
        heads=head_list,
        affected_heads=affected_heads(model, head_list),
        mode=mode,
        scale=float(scale),
        sink_positions=sinks,
        control_positions=control[:, 0],
        tokens=tokens.cpu(),
        nll={c: r[0] for c, r in results.items()},
        out_norm={c: r[1] for c, r in results.items()},
        cone_cos={c: r[2] for c, r in results.items()},
        model_name=str(getattr(model.cfg, "model_name", "")),
    )
