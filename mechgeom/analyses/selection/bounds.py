"""Certificates and the sink-aware lower bound on ``F_N`` (``docs/definitions.md`` §5.3, §5.4), with their tie tolerances.

``F_N`` (:func:`mechgeom.analyses.selection.geometry.extreme_f_score`) is bounded from below twice:

- the **inversion certificate** (:func:`inversion_certificate`) from the distances ``d_j`` themselves;
- the **sink-aware bound** (:func:`sink_aware_bound`) from ``alpha`` and the per-head regime parameters of
  :class:`BoundParams` only (fitted by :func:`fit_bound_params`, radii by :func:`bound_radii`); statement and
  proof in ``docs/selection_bound.md``.

**Ties**: every comparison carries a relative margin (``rtol``, ``64 * eps`` of the dtype by default,
:func:`_tie_rtol`) that decides each near-tie against the bound, so neither can exceed the exact ``F_N``
because of rounding. :func:`bound_vs_measured` tabulates the bound against the measured ``F_N`` per ``N``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import einops
import numpy as np
import pandas as pd
import torch

from mechgeom.hooks import check_sink_positions
from mechgeom.typing import Bool, Float, HeadQueries, HeadScores, Int, Pattern, QueryKeyMask, Tensor, Values

__all__ = [
    "BoundParams",
    "bound_radii",
    "bound_vs_measured",
    "fit_bound_params",
    "inversion_certificate",
    "sink_aware_bound",
]


# --------------------------------------------------------------------------- tie tolerance and certificate


def _tie_rtol(rtol: float | None, dtype: torch.dtype) -> float:
    """The relative tie margin: ``rtol``, or ``64 * eps`` of ``dtype`` (float32 ``7.6e-6``, float64 ``1.4e-14``)."""
    if rtol is None:
        return 64 * torch.finfo(dtype).eps
    if not 0 <= rtol < 1:
        raise ValueError(f"rtol must be in [0, 1), got {rtol}")
    return float(rtol)


def inversion_certificate(
    d: Float[Tensor, "*rows key_pos"],
    members: Bool[Tensor, "*rows key_pos"],
    valid: Bool[Tensor, "*rows key_pos"],
    *,
    rtol: float | None = None,
) -> tuple[Float[Tensor, "*rows"], Int[Tensor, "*rows"], Int[Tensor, "*rows"]]:
    """Inversion certificate ``F_N >= max(2N/(2N+m), 2q/(N+q))``; returns ``(certificate, m, q)``.

    ``docs/definitions.md`` §5.3: ``m = #{k ∉ I_N : d_k <= max_{j∈I_N} d_j}``, ``q = #{j ∈ I_N : d_j < min_{k∉I_N} d_k}``.
    (The radius ``max_{I_N} d`` catches all ``N`` members and ``m`` others; a radius just below
    ``min_{k∉I_N} d_k`` catches ``q`` members and nothing else.) Rows with ``N = 0`` are NaN.

    Ties: both comparisons carry the margin ``t = rtol * max_j |d_j|`` (the row's distance scale;
    ``rtol`` defaults to ``64 * eps`` of ``d``'s dtype): ``m`` counts ``d_k <= max d_j + t`` and ``q``
    counts ``d_j < min d_k − t``, so a near-tie that rounding may have split is resolved against
    the certificate (``m`` can only grow, ``q`` only shrink). The certificate is still attained by a
    radius of the ball classifier, so it never exceeds :func:`extreme_f_score` of the same ``d``.

    >>> d = torch.tensor([[0.0, 1.0, 1.0 + 1e-15, 3.0]], dtype=torch.float64)  # 1 vs 1 + 1e-15: a tie
    >>> mem = torch.tensor([[True, True, False, False]])
    >>> cert, m, q = inversion_certificate(d, mem, torch.ones_like(mem))
    >>> (m.item(), q.item(), round(cert.item(), 4))
    (1, 1, 0.8)
    """
    valid = valid.expand_as(d)
    inside = members.expand_as(d) & valid
    outside = valid & ~inside
    max_in = d.masked_fill(~inside, float("-inf")).amax(-1, keepdim=True)
    min_out = d.masked_fill(~outside, float("inf")).amin(-1, keepdim=True)
    tie = _tie_rtol(rtol, d.dtype) * d.abs().masked_fill(~valid, 0).amax(-1, keepdim=True)
    m = (outside & (d <= max_in + tie)).sum(-1)
    q = (inside & (d < min_out - tie)).sum(-1)
    return _certificate(inside.sum(-1), m, q, d.dtype), m, q


def _certificate(n: Tensor, m: Tensor, q: Tensor, dtype: torch.dtype) -> Tensor:
    nf, mf, qf = n.to(dtype), m.to(dtype), q.to(dtype)
    cert = torch.maximum(2 * nf / (2 * nf + mf), 2 * qf / (nf + qf).clamp_min(1))
    return torch.where(nf > 0, cert, torch.full_like(cert, float("nan")))


# --------------------------------------------------------------------------- sink-aware bound


@dataclass
class BoundParams:
    """Per-head parameters of the sink-aware regime (each a ``[head_index]`` tensor).

    Assumptions the bound needs (``docs/selection_bound.md``): every non-sink value has norm in
    ``[nu_min, nu_max]``; every sink value has norm in ``[sink_min, sink_max]`` (``= rho * nu``);
    ``cos(v_j, v_k) <= mu`` for distinct non-sink values of a sequence; ``cos(v_sink, v_j) <= -kappa``
    for every non-sink ``j``. ``nu`` is the mean non-sink norm and ``rho = mean sink norm / nu``.
    """

    nu: Tensor
    nu_min: Tensor
    nu_max: Tensor
    sink_min: Tensor
    sink_max: Tensor
    mu: Tensor
    kappa: Tensor
    rho: Tensor
    kappa_mean: Tensor = field(default_factory=lambda: torch.empty(0))
    mu_mean: Tensor = field(default_factory=lambda: torch.empty(0))

    def constant_norm(self) -> BoundParams:
        """The idealised constant-norm regime: every non-sink norm ``nu``, the sink norm ``rho * nu``.

        Its bound is the regime's prediction; it is guaranteed only where norms really are constant.
        """
        sink = self.rho * self.nu
        return BoundParams(
            nu=self.nu,
            nu_min=self.nu,
            nu_max=self.nu,
            sink_min=sink,
            sink_max=sink,
            mu=self.mu,
            kappa=self.kappa,
            rho=self.rho,
            kappa_mean=self.kappa_mean,
            mu_mean=self.mu_mean,
        )

    def as_dict(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fit_bound_params(
    v: Values,
    sink_positions: int | Sequence[int] | None = None,
    *,
    metric: Float[Tensor, "head_index d_head d_head"] | None = None,
    dtype: torch.dtype = torch.float64,
    real: Bool[Tensor, "batch pos"] | None = None,
) -> BoundParams:
    """Fit the regime's parameters per head over every sequence and position of ``v``.

    ``nu`` = mean non-sink norm, ``nu_min``/``nu_max`` its extremes, ``mu`` = the largest cosine between
    two distinct non-sink values of one sequence, ``kappa = min_j −cos(v_sink, v_j)`` (so the sink's
    cosine to every non-sink value is at most ``−kappa``), ``rho`` = mean sink norm / ``nu``,
    ``kappa_mean = mean_j −cos(v_sink, v_j)``, ``mu_mean`` = mean non-sink pairwise cosine (both
    descriptive only). The extremes make the assumptions hold exactly on the
    fitted activations, so :func:`sink_aware_bound` with these parameters is a guarantee there.
    ``metric`` (``W_O W_Oᵀ``) measures in projected space. Zero-norm values are left out of the cosines.
    Without a pair of non-sink values ``mu = 1``; without a non-sink value ``kappa = -1``.
    ``real`` (``[batch, pos]``, default all True) marks the real tokens of a padded batch whose texts start
    at position 0 (:func:`mechgeom.hooks.align_texts`): padding is never a sink or a non-sink value, so the
    fit pools the real tokens of every text.
    """
    vv = v.to(dtype)
    b, n_pos = vv.shape[0], vv.shape[1]
    sinks = list(check_sink_positions(sink_positions, n_pos))
    if metric is None:
        gram = einops.einsum(vv, vv, "b j h d, b k h d -> b h j k")
    else:
        gram = einops.einsum(vv, metric.to(dtype), vv, "b j h d, h d e, b k h e -> b h j k")
    norm = torch.diagonal(gram, dim1=-2, dim2=-1).clamp_min(0).sqrt()  # [b h k]
    denom = norm[..., :, None] * norm[..., None, :]
    cos = gram / torch.where(denom > 0, denom, torch.ones_like(denom))
    ok = denom > 0
    dev = vv.device
    is_real = torch.ones(b, n_pos, dtype=torch.bool, device=dev) if real is None else real.to(dev).bool()
    is_sink = torch.zeros(n_pos, dtype=torch.bool, device=dev)
    is_sink[sinks] = True
    ns = ~is_sink[None, :] & is_real  # [b k]: the non-sink values
    eye = torch.eye(n_pos, dtype=torch.bool, device=dev)
    nn_pair = (ns[:, :, None] & ns[:, None, :] & ~eye)[:, None]  # [b 1 j k]
    h = vv.shape[2]
    ns_h = ns[:, None, :].expand_as(norm)  # [b h k]
    n_ns = ns.sum()
    if int(n_ns):
        nu = torch.where(ns_h, norm, 0.0).sum(dim=(0, 2)) / n_ns
        nu_min = einops.reduce(norm.masked_fill(~ns_h, float("inf")), "b h k -> h", "min")
        nu_max = einops.reduce(norm.masked_fill(~ns_h, float("-inf")), "b h k -> h", "max")
    else:
        nu = nu_min = nu_max = torch.zeros(h, dtype=dtype, device=dev)
    sink_norm = norm[:, :, sinks]
    sink_min = einops.reduce(sink_norm, "b h s -> h", "min")
    sink_max = einops.reduce(sink_norm, "b h s -> h", "max")
    rho = einops.reduce(sink_norm, "b h s -> h", "mean") / torch.where(nu > 0, nu, torch.ones_like(nu))
    pair_ok = ok & nn_pair
    pair_cos = cos.masked_fill(~pair_ok, float("-inf"))
    mu = einops.reduce(pair_cos, "b h j k -> h", "max")
    mu = torch.where(torch.isfinite(mu), mu, torch.ones_like(mu))
    mu_mean = (cos * pair_ok).sum(dim=(0, 2, 3)) / pair_ok.sum(dim=(0, 2, 3)).clamp_min(1)
    sink_cos = cos[:, :, sinks]  # [b h s k]
    sink_ok = ok[:, :, sinks] & ns[:, None, None, :]
    worst = sink_cos.masked_fill(~sink_ok, float("-inf"))
    kappa = -einops.reduce(worst, "b h s k -> h", "max")
    kappa = torch.where(torch.isfinite(kappa), kappa, -torch.ones_like(kappa))
    n_ok = sink_ok.sum(dim=(0, 2, 3)).clamp_min(1)
    kappa_mean = -(sink_cos * sink_ok).sum(dim=(0, 2, 3)) / n_ok
    return BoundParams(nu, nu_min, nu_max, sink_min, sink_max, mu, kappa, rho, kappa_mean, mu_mean)


def _p_plus(c: Tensor, lo1: Tensor, hi1: Tensor, lo2: Tensor, hi2: Tensor) -> Tensor:
    """``max n1 n2 c`` over ``n1 ∈ [lo1, hi1]``, ``n2 ∈ [lo2, hi2]``: bounds ``<x, y>`` when ``cos <= c``."""
    return torch.where(c >= 0, c * hi1 * hi2, c * lo1 * lo2)


def bound_radii(
    pattern: Pattern,
    members: Bool[Tensor, "batch head_index query_pos key_pos"],
    valid: QueryKeyMask,
    sink_mask: Bool[Tensor, " key_pos"],
    params: BoundParams,
    *,
    dtype: torch.dtype = torch.float64,
    rtol: float | None = None,
) -> tuple[HeadScores, HeadScores]:
    """``(U, L)``: ``U_j >= d_j`` for members ``j ∈ I_N``, ``L_k <= d_k`` for the other candidates.

    Under the regime's assumptions (``docs/selection_bound.md``, steps 2-5); ``U`` is NaN outside
    ``I_N``, ``L`` is NaN outside the non-member candidates. With ``n⁻, n⁺`` the norm bands and
    ``P(l, l')`` the largest possible ``<v_l, v_l'>``: ``U_j² = Q⁺(I_N∖{j})`` where
    ``Q⁺(T) = sum_T a² n⁺² + sum_{l≠l'∈T} a_l a_l' P(l, l')``; ``S⁻ = max(0, max_{l∈I_N} a_l n⁻_l − U_l)``,
    ``S⁺ = sqrt(Q⁺(I_N))``, ``X_k = sum_{l∈I_N} a_l P(k, l)`` and
    ``L_k² = max(a_k² n⁻_k² − 2 a_k X_k + S⁻², (S⁻ − a_k n⁺_k)₊², (a_k n⁻_k − S⁺)₊², 0)``.

    Rounding: each of these squares is a sum of terms of size up to ``A²`` (``A = sum_{I_N} a n⁺``,
    ``A_j = A − a_j n⁺_j``), computed with a relative error of a few ``eps``; the ones that cancel
    (``U_j²``, the first term of ``L_k²``) are resolved only to ``eps·A²``. So ``U_j²`` gets
    ``+ rtol·A·(A_j + rtol·A)``, ``S^±`` and the terms of ``L_k²`` move by ``rtol`` times their
    scale (``A``, ``a_k n⁺_k + A``), each in the safe direction (``rtol``: ``64 * eps`` of ``dtype``
    by default). A tie that exact arithmetic would decide in the bound's favour is then decided
    against it, and the computed ``U``, ``L`` bound the exact ``d``.
    """
    tol = _tie_rtol(rtol, dtype)
    a = pattern.to(dtype)
    valid = valid.expand_as(a)
    inside = members & valid
    outside = valid & ~inside
    pr = {
        k: t.to(dtype=dtype, device=a.device)[None, :, None, None]
        for k, t in params.as_dict().items()
        if t.numel()
    }
    sk = sink_mask.to(a.device)[None, None, None, :]  # [1 1 1 k]
    n_lo = torch.where(sk, pr["sink_min"], pr["nu_min"])  # [1 h 1 k]
    n_hi = torch.where(sk, pr["sink_max"], pr["nu_max"])
    p_nn = _p_plus(pr["mu"], pr["nu_min"], pr["nu_max"], pr["nu_min"], pr["nu_max"])
    p_sn = _p_plus(-pr["kappa"], pr["sink_min"], pr["sink_max"], pr["nu_min"], pr["nu_max"])
    p_ss = pr["sink_max"] ** 2  # two sinks: cos <= 1
    w = a * inside
    ws, wn = w * sk, w * ~sk
    an, bn = wn.sum(-1, keepdim=True), (wn * wn).sum(-1, keepdim=True)  # [b h q 1]
    as_, bs = ws.sum(-1, keepdim=True), (ws * ws).sum(-1, keepdim=True)

    def q_plus(an: Tensor, bn: Tensor, as_: Tensor, bs: Tensor) -> Tensor:
        diag = bn * pr["nu_max"] ** 2 + bs * pr["sink_max"] ** 2
        cross = (an * an - bn) * p_nn + 2 * as_ * an * p_sn + (as_ * as_ - bs) * p_ss
        return diag + cross

    # rounding scales: A = sum_{I_N} a n+ bounds ‖s_N‖ and every term of a Q+; A_j = A − a_j n+_j
    a_hi = a * n_hi
    big_a = (a_hi * inside).sum(-1, keepdim=True)  # [b h q 1]
    a_rest = (big_a - a_hi).clamp_min(0)
    # U_j for j in I_N: Q+ of I_N without j (exactly 0 for N = 1, where A_j = 0)
    aj_s, aj_n = a * sk, a * ~sk
    u2 = q_plus(an - aj_n, bn - aj_n**2, as_ - aj_s, bs - aj_s**2).clamp_min(0)
    u = (u2 + tol * big_a * (a_rest + tol * big_a)).sqrt()  # [b h q k]
    best = (a * n_lo - u).masked_fill(~inside, float("-inf")).amax(-1, keepdim=True)
    s_minus = (best - tol * big_a).clamp_min(0)
    s_plus = (q_plus(an, bn, as_, bs).clamp_min(0) + tol * big_a * big_a * (1 + tol)).sqrt()
    # X_k >= <v_k, s_N> for k not in I_N; every term of L_k² is at most scale² = (a_k n+_k + A)²
    x = torch.where(sk, an * p_sn + as_ * p_ss, an * p_nn + as_ * p_sn)
    scale = a_hi + big_a
    e1 = a * a * n_lo**2 - 2 * a * x + s_minus**2 - tol * scale**2
    e2 = (s_minus - a_hi - tol * scale).clamp_min(0) ** 2
    e3 = (a * n_lo - s_plus - tol * scale).clamp_min(0) ** 2
    low = torch.maximum(torch.maximum(e1, e2), e3).clamp_min(0).sqrt()
    nan = float("nan")
    return u.masked_fill(~inside, nan), low.masked_fill(~outside, nan)


def sink_aware_bound(
    pattern: Pattern,
    members: Bool[Tensor, "batch head_index query_pos key_pos"],
    valid: QueryKeyMask,
    sink_mask: Bool[Tensor, " key_pos"],
    params: BoundParams,
    *,
    dtype: torch.dtype = torch.float64,
    rtol: float | None = None,
) -> tuple[HeadQueries, Int[Tensor, "batch head_index query_pos"], Int[Tensor, "batch head_index query_pos"]]:
    """Deterministic lower bound on ``F_N`` from ``alpha`` and the regime's parameters only.

    Returns ``(bound, m_plus, q_minus)``; statement and proof in ``docs/selection_bound.md``. With
    ``(U, L)`` from :func:`bound_radii`: ``m⁺ = #{k ∉ I_N : L_k <= max_{I_N} U} >= m``,
    ``q⁻ = #{j ∈ I_N : U_j < min_{k∉I_N} L_k} <= q``, and ``F_N >= max(2N/(2N+m⁺), 2q⁻/(N+q⁻))``.
    Rows with ``N = 0`` are NaN.

    Ties: ``U`` and ``L`` already absorb rounding (:func:`bound_radii`); both comparisons add the
    relative margin ``t = rtol * max(max U, min L)``, i.e. ``L_k <= max U + t`` and
    ``U_j < min L − t``, so an (exact or rounded) tie never raises the bound: it stays a lower
    bound on the exact ``F_N`` in float32 as in float64. ``rtol`` defaults to ``64 * eps`` of ``dtype``.
    """
    u, low = bound_radii(pattern, members, valid, sink_mask, params, dtype=dtype, rtol=rtol)
    inside, outside = ~torch.isnan(u), ~torch.isnan(low)
    max_u = u.masked_fill(~inside, 0.0).amax(-1, keepdim=True)  # U >= 0; rows with N = 0 are NaN
    min_l = low.masked_fill(~outside, float("inf")).amin(-1, keepdim=True)
    top = torch.maximum(max_u, torch.where(torch.isfinite(min_l), min_l, torch.zeros_like(min_l)))
    tie = _tie_rtol(rtol, dtype) * top
    m_plus = (outside & (low <= max_u + tie)).sum(-1)
    q_minus = (inside & (u < min_l - tie)).sum(-1)
    return _certificate(inside.sum(-1), m_plus, q_minus, dtype), m_plus, q_minus


# --------------------------------------------------------------------------- predicted vs measured


def bound_vs_measured(frame: pd.DataFrame, params: pd.DataFrame) -> pd.DataFrame:
    """Measured ``F_N`` vs the guaranteed bound and the constant-norm prediction, per ``N``.

    ``docs/definitions.md`` §5.4: the bound predicted against the ``F_N`` measured. ``frame`` is
    :meth:`mechgeom.analyses.selection.SelectionResult.to_frame`, ``params`` its ``params_frame()``. Two
    scopes, ``"all heads"`` and ``"regime heads"`` (``params.regime``); per ``N`` the means of ``f_top``
    (``measured``), ``bound`` and ``bound_ideal`` weighted by each row's ``n_queries`` (NaN without a
    query), the summed ``bound_violations`` / ``ideal_violations``, ``n_heads`` and ``n_queries``.
    """
    merged = frame.merge(params[["layer", "head", "regime"]], on=["layer", "head"])
    rows = []
    for scope, part in (("all heads", merged), ("regime heads", merged[merged.regime])):
        for n, g in part.groupby("N"):
            w = g["n_queries"]
            rows.append(
                {
                    "scope": scope,
                    "N": n,
                    "n_heads": len(g),
                    "measured": np.average(g.f_top, weights=w) if w.sum() else np.nan,
                    "bound": np.average(g.bound, weights=w) if w.sum() else np.nan,
                    "bound_ideal": np.average(g.bound_ideal, weights=w) if w.sum() else np.nan,
                    "bound_violations": int(g.bound_violations.sum()),
                    "ideal_violations": int(g.ideal_violations.sum()),
                    "n_queries": int(w.sum()),
                }
            )
    return pd.DataFrame(rows)
