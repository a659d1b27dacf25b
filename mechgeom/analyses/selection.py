"""Geometry of token selection (SPEC.md §B, paper B): extreme F-scores, certificates, sink-aware bound.

For one layer, head ``h`` and query ``i`` the contributions are ``y_j = alpha[h,i,j] * v[j,h]`` (value
space, GQA-expanded ``v``; ``projected=True`` uses ``vt[j,h] = v[j,h] @ W_O[h]``). ``I_N`` holds the
``N`` candidate sources with the largest ``alpha``, ``s_N = sum_{j in I_N} y_j`` and
``d_j = ‖y_j − s_N‖`` for every candidate ``j <= i``. A ball ``B(r) = {j : d_j <= r}`` classifies the
sources; :func:`extreme_f_score` is its best F-score over all radii.

Choices fixed here (all keyword arguments):

- **Ties in ``alpha``**: the lower position enters ``I_N`` first (a stable descending sort).
- **Ties in ``d_j``**: a radius ``r`` includes every source with ``d_j <= r``, so equal distances enter
  the ball together; the maximum runs over the ends of the tie groups (exactly equal floats).
- **Too few sources**: a query with fewer candidate sources than ``N`` (``i + 1 < N``, or fewer once
  the sink is excluded) has no ``I_N``; all its outputs for that ``N`` are NaN and the means in
  :meth:`SelectionResult.to_frame` skip it (``n_queries`` counts the rest). A query with exactly ``N``
  sources has ``I_N`` = all of them and ``F_N = 1`` trivially.
- **Sink**: ``sink_positions=(0,)``. "Without the sink" is the same computation with the sink positions
  removed from the candidate sources (neither in ``I_N`` nor classified; ``alpha`` is not renormalised).
- **Random baseline**: ``n_random`` uniformly random ``N``-subsets of the candidates per query (one
  random permutation per draw, reused for every ``N``; seeded by ``seed`` and the layer).
- **Cost**: everything is ``[batch, head, q, k]`` work plus ``[batch, head, q, d]`` vectors. Projected
  distances use the metric ``G_h = W_O[h] W_O[h]ᵀ`` (``d_head x d_head``), so no ``d_model`` tensor
  with a ``q`` and a ``k`` axis is ever built. Precision: ``dtype`` (``float32`` by default in
  :func:`layer_selection` and :func:`token_selection`, ``torch.float64`` for exact tie studies; the
  lower-level functions default to float64).
- **Ties in the certificate and the bound**: their comparisons carry a relative margin
  (``rtol``, ``64 * eps`` of the dtype) that decides every near-tie against the bound, so neither
  can exceed the exact ``F_N`` because of rounding (``docs/selection_bound.md``).

The sink-aware lower bound of :func:`sink_aware_bound` is stated and proved in ``docs/selection_bound.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import einops
import numpy as np
import pandas as pd
import torch

from mechgeom._progress import progress
from mechgeom.hooks import (
    FwdHook,
    LayerActivations,
    LayerCollector,
    check_sink_positions,
    modified_pairs,
    run_hooks,
    to_tokens,
)
from mechgeom.typing import WO, Bool, Float, Int, Pattern, Tensor, Tokens, Values

__all__ = [
    "DEFAULT_NS",
    "BoundParams",
    "SelectionCollector",
    "SelectionResult",
    "bound_radii",
    "candidate_mask",
    "extreme_f_score",
    "fit_bound_params",
    "inversion_certificate",
    "layer_selection",
    "precision_recall_curve",
    "random_ranks",
    "selection_distances",
    "sink_aware_bound",
    "source_ranks",
    "token_selection",
    "token_selection_from_cache",
]

#: The default sweep over ``N``.
DEFAULT_NS = (1, 2, 4, 8, 16, 32)

HQK = Float[Tensor, "batch head_index query_pos key_pos"]
HQ = Float[Tensor, "batch head_index query_pos"]
Mask = Bool[Tensor, "*batch query_pos key_pos"]


# --------------------------------------------------------------------------- input checks


def _check_sinks(sink_positions: int | Sequence[int], n_pos: int) -> list[int]:
    """The sink set in the order given, checked by :func:`mechgeom.hooks.check_sink_positions`."""
    return list(check_sink_positions(sink_positions, n_pos))


def _check_ns(ns: int | Sequence[int]) -> list[int]:
    out = [ns] if isinstance(ns, int) else list(ns)
    if not out:
        raise ValueError("ns is empty; give at least one N (e.g. (1, 2, 4, 8, 16, 32))")
    if any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 for n in out):
        raise ValueError(f"every N must be a positive integer, got {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate N in {out}")
    return [int(n) for n in out]


def _check_pattern_v(pattern: Tensor, v: Tensor) -> None:
    if pattern.ndim != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must be [batch, head, q, k] with q == k, got {tuple(pattern.shape)}")
    if v.ndim != 4:
        raise ValueError(f"v must be [batch, pos, head, d_head], got {tuple(v.shape)}")
    b, h, _, k = pattern.shape
    if v.shape[0] != b or v.shape[1] != k or v.shape[2] != h:
        raise ValueError(
            f"v {tuple(v.shape)} does not match pattern {tuple(pattern.shape)}: expected [{b}, {k}, {h}, d_head] "
            "(expand GQA values with mechgeom.hooks.expand_kv first)"
        )


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"dtype must be torch.float32 (the default) or torch.float64 (exact F_N near ties), got {dtype}"
        )


# --------------------------------------------------------------------------- ranking


def candidate_mask(
    n_pos: int, exclude: Sequence[int] = (), device: torch.device | str = "cpu"
) -> Bool[Tensor, "query_pos key_pos"]:
    """Candidate sources of each query: ``j <= i`` and ``j`` not in ``exclude``.

    >>> candidate_mask(3, exclude=[0]).int().tolist()
    [[0, 0, 0], [0, 1, 0], [0, 1, 1]]
    """
    cand = torch.ones(n_pos, n_pos, dtype=torch.bool, device=device).tril()
    if exclude:
        cand[:, list(exclude)] = False
    return cand


def _ranks_from_keys(keys: Tensor, *, descending: bool) -> Int[Tensor, "*batch key_pos"]:
    order = torch.sort(keys, dim=-1, descending=descending, stable=True).indices
    ar = torch.arange(keys.shape[-1], device=keys.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ar)


def source_ranks(scores: HQK, candidates: Mask) -> Int[Tensor, "batch head_index query_pos key_pos"]:
    """Rank of each source by descending ``scores`` among the candidates (0 = largest).

    Ties: the lower position gets the lower rank (a stable sort). Non-candidates rank after every
    candidate, so ``I_N = {j : rank < N} ∩ candidates``.

    >>> source_ranks(torch.tensor([[[[0.25, 0.5, 0.25]]]]), torch.ones(1, 3, dtype=torch.bool)).tolist()
    [[[[1, 0, 2]]]]
    """
    keys = scores.masked_fill(~candidates, float("-inf"))
    return _ranks_from_keys(keys, descending=True)


def random_ranks(
    shape: Sequence[int], candidates: Mask, generator: torch.Generator, device: torch.device | str = "cpu"
) -> Int[Tensor, "batch head_index query_pos key_pos"]:
    """A uniformly random permutation of the candidates of each row (non-candidates rank last).

    ``{j : rank < N} ∩ candidates`` is then a uniformly random ``N``-subset of the candidates.
    """
    keys = torch.rand(tuple(shape), generator=generator, device=device)
    keys = keys.masked_fill(~candidates, 2.0)
    return _ranks_from_keys(keys, descending=False)


# --------------------------------------------------------------------------- distances and scores


def selection_distances(
    pattern: Pattern,
    v: Values,
    members: Bool[Tensor, "batch head_index query_pos key_pos"],
    *,
    metric: Float[Tensor, "head_index d_head d_head"] | None = None,
    dtype: torch.dtype = torch.float64,
    squared: bool = False,
) -> HQK:
    """``d_j = ‖y_j − s_N‖`` with ``y_j = alpha[h,i,j] * v[j,h]`` and ``s_N = sum_{j in I_N} y_j``.

    ``members`` is ``I_N`` per ``(batch, head, query)``. Computed without a ``[q, k, d]`` tensor:
    ``d_j² = alpha_j² ‖v_j‖² − 2 alpha_j <v_j, s_N> + ‖s_N‖²``. With ``metric = W_O W_Oᵀ`` (per head)
    the inner product is ``<x, y>_G = x G yᵀ``, i.e. distances between projected contributions
    ``alpha_j vt_j``. Entries above the diagonal are meaningless (mask them with the candidates).
    ``squared=True`` returns ``d_j²``: the F-score and the certificate depend on the distances only
    through their order and ties, which the square keeps (and the square root could merge).
    Precision: ``d_j²`` is resolved to about ``eps * ‖s_N‖²``, so ``d_j`` near 0 to ``sqrt(eps) * ‖s_N‖``.
    """
    a = pattern.to(dtype)
    vv = v.to(dtype)
    w = a * members.to(dtype)
    s = einops.einsum(w, vv, "b h q k, b k h d -> b h q d")  # s_N [b h q d]
    if metric is None:
        su = s
        vnorm2 = einops.rearrange((vv * vv).sum(-1), "b k h -> b h k")
    else:
        G = metric.to(dtype)
        su = einops.einsum(s, G, "b h q d, h d e -> b h q e")  # s_N G
        vnorm2 = einops.einsum(vv, G, vv, "b k h d, h d e, b k h e -> b h k")
    vs = einops.einsum(vv, su, "b k h d, b h q d -> b h q k")  # <v_j, s_N>
    ss = (s * su).sum(-1)  # ‖s_N‖² [b h q]
    d2 = (a * a * vnorm2[:, :, None, :] - 2 * a * vs + ss[..., None]).clamp_min(0)
    return d2 if squared else d2.sqrt()


def extreme_f_score(
    d: Float[Tensor, "*rows key_pos"],
    members: Bool[Tensor, "*rows key_pos"],
    valid: Bool[Tensor, "*rows key_pos"],
) -> Float[Tensor, "*rows"]:
    """Extreme F-score ``F_N = max_r 2PR/(P+R)`` of the ball classifier ``B(r) = {j : d_j <= r}``.

    SPEC.md §B: precision ``P(r) = |I_N ∩ B(r)| / |B(r)|``, recall ``R(r) = |I_N ∩ B(r)| / N``, and
    ``2PR/(P+R) = 2|I_N ∩ B(r)| / (N + |B(r)|)``. Exact: the ``d_j`` of the valid sources are sorted and
    every radius equal to a distance is tried; a radius includes all equal distances, so only the end
    of each tie group counts. An empty ball (or no member inside) scores 0. ``N = |I_N ∩ valid|``;
    rows with ``N = 0`` are NaN.
    """
    valid = valid.expand_as(d)
    inside = members.expand_as(d) & valid
    dd = d.masked_fill(~valid, float("inf"))
    ds, idx = torch.sort(dd, dim=-1)
    lab = inside.gather(-1, idx).to(d.dtype)
    tp = lab.cumsum(-1)
    count = torch.arange(1, d.shape[-1] + 1, device=d.device, dtype=d.dtype)
    nxt = torch.cat([ds[..., 1:], torch.full_like(ds[..., :1], float("inf"))], dim=-1)
    end = valid.gather(-1, idx) & (ds != nxt)
    n = inside.sum(-1).to(d.dtype)
    f = torch.where(end, 2 * tp / (n[..., None] + count), torch.zeros_like(ds)).amax(-1)
    return torch.where(n > 0, f, torch.full_like(f, float("nan")))


def precision_recall_curve(
    d: Float[Tensor, "*rows key_pos"],
    members: Bool[Tensor, "*rows key_pos"],
    valid: Bool[Tensor, "*rows key_pos"],
) -> tuple[Float[Tensor, "*rows key_pos"], Float[Tensor, "*rows key_pos"], Float[Tensor, "*rows key_pos"]]:
    """The ball classifier's curve: ``(radius, P, R)`` at each distinct radius, ascending.

    Entry ``t`` is the radius of the ``t``-th smallest valid distance; entries that are not the end of a
    tie group, and invalid sources, are NaN. ``max 2PR/(P+R)`` over the curve is :func:`extreme_f_score`.
    """
    valid = valid.expand_as(d)
    inside = members.expand_as(d) & valid
    ds, idx = torch.sort(d.masked_fill(~valid, float("inf")), dim=-1)
    tp = inside.gather(-1, idx).to(d.dtype).cumsum(-1)
    count = torch.arange(1, d.shape[-1] + 1, device=d.device, dtype=d.dtype)
    nxt = torch.cat([ds[..., 1:], torch.full_like(ds[..., :1], float("inf"))], dim=-1)
    end = valid.gather(-1, idx) & (ds != nxt)
    n = inside.sum(-1, keepdim=True).to(d.dtype)
    nan = torch.full_like(ds, float("nan"))
    return torch.where(end, ds, nan), torch.where(end, tp / count, nan), torch.where(end, tp / n, nan)


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

    SPEC.md §B: ``m = #{k ∉ I_N : d_k <= max_{j∈I_N} d_j}``, ``q = #{j ∈ I_N : d_j < min_{k∉I_N} d_k}``.
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
    sink_positions: Sequence[int] = (0,),
    *,
    metric: Float[Tensor, "head_index d_head d_head"] | None = None,
    dtype: torch.dtype = torch.float64,
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
    """
    vv = v.to(dtype)
    n_pos = vv.shape[1]
    sinks = _check_sinks(sink_positions, n_pos)
    if metric is None:
        gram = einops.einsum(vv, vv, "b j h d, b k h d -> b h j k")
    else:
        gram = einops.einsum(vv, metric.to(dtype), vv, "b j h d, h d e, b k h e -> b h j k")
    norm = torch.diagonal(gram, dim1=-2, dim2=-1).clamp_min(0).sqrt()  # [b h k]
    denom = norm[..., :, None] * norm[..., None, :]
    cos = gram / torch.where(denom > 0, denom, torch.ones_like(denom))
    ok = denom > 0
    is_sink = torch.zeros(n_pos, dtype=torch.bool, device=vv.device)
    is_sink[sinks] = True
    ns = ~is_sink
    nn_pair = ns[:, None] & ns[None, :] & ~torch.eye(n_pos, dtype=torch.bool, device=vv.device)
    ns_norm = norm[:, :, ns]  # [b h n_nonsink]
    h = vv.shape[2]
    if ns_norm.shape[-1]:
        nu = einops.reduce(ns_norm, "b h k -> h", "mean")
        nu_min = einops.reduce(ns_norm, "b h k -> h", "min")
        nu_max = einops.reduce(ns_norm, "b h k -> h", "max")
    else:
        nu = nu_min = nu_max = torch.zeros(h, dtype=dtype, device=vv.device)
    sink_norm = norm[:, :, sinks]
    sink_min = einops.reduce(sink_norm, "b h s -> h", "min")
    sink_max = einops.reduce(sink_norm, "b h s -> h", "max")
    rho = einops.reduce(sink_norm, "b h s -> h", "mean") / torch.where(nu > 0, nu, torch.ones_like(nu))
    pair_cos = cos.masked_fill(~(ok & nn_pair), float("-inf"))
    mu = einops.reduce(pair_cos, "b h j k -> h", "max")
    mu = torch.where(torch.isfinite(mu), mu, torch.ones_like(mu))
    pair_ok = ok & nn_pair
    mu_mean = (cos * pair_ok).sum(dim=(0, 2, 3)) / pair_ok.sum(dim=(0, 2, 3)).clamp_min(1)
    sink_cos = cos[:, :, sinks][..., ns]  # [b h s n_nonsink]
    sink_ok = ok[:, :, sinks][..., ns]
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
    valid: Mask,
    sink_mask: Bool[Tensor, " key_pos"],
    params: BoundParams,
    *,
    dtype: torch.dtype = torch.float64,
    rtol: float | None = None,
) -> tuple[HQK, HQK]:
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
    valid: Mask,
    sink_mask: Bool[Tensor, " key_pos"],
    params: BoundParams,
    *,
    dtype: torch.dtype = torch.float64,
    rtol: float | None = None,
) -> tuple[HQ, Int[Tensor, "batch head_index query_pos"], Int[Tensor, "batch head_index query_pos"]]:
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


# --------------------------------------------------------------------------- one layer


#: Per-query outputs of :func:`layer_selection`, ``[batch, head_index, query_pos, n_N]``.
PER_QUERY = (
    "f_top",
    "f_random",
    "f_nosink",
    "certificate",
    "m_inv",
    "q_inv",
    "sink_in_top",
    "bound",
    "bound_ideal",
)


def _query_positions(n_pos: int, query_stride: int) -> list[int]:
    if isinstance(query_stride, bool) or int(query_stride) != query_stride or query_stride < 1:
        raise ValueError(f"query_stride must be a positive integer, got {query_stride}")
    return list(range(n_pos - 1, -1, -int(query_stride)))[::-1]


def layer_selection(
    pattern: Pattern,
    v: Values,
    *,
    W_O: WO | None = None,
    projected: bool = False,
    ns: Sequence[int] = DEFAULT_NS,
    sink_positions: Sequence[int] = (0,),
    n_random: int = 4,
    seed: int = 0,
    bound: bool = True,
    query_stride: int = 1,
    dtype: torch.dtype = torch.float32,
    batch_chunk: int | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Every §B quantity of one layer, vectorised over batch, heads and queries (a loop over ``N``).

    Returns ``{"per_query": {name: [batch, head, n_queries, n_N] float32}, "params": {name: [head]},
    "queries": [positions]}`` with the names of :data:`PER_QUERY`: ``f_top`` (``F_N`` of the top-``N``
    set), ``f_random`` (mean ``F_N`` of ``n_random`` random ``N``-subsets; NaN when ``n_random == 0``),
    ``f_nosink`` (top-``N`` without the sink positions), ``certificate``, ``m_inv``, ``q_inv`` (for
    ``f_top``), ``sink_in_top`` (1.0 if a sink is in ``I_N``), ``bound`` (the sink-aware bound with
    parameters fitted by their extremes; guaranteed) and ``bound_ideal`` (the constant-norm
    prediction). Queries with fewer than ``N`` candidates are NaN.

    ``query_stride`` analyses every ``query_stride``-th query, counted back from the last one (which
    is always included); the parameters of the bound are still fitted on every position. ``dtype``
    is the precision of distances, F-scores, certificates and bounds: ``float32`` by default,
    ``torch.float64`` for (near-)exact ``F_N`` near ties (float32 resolves ``d_j²`` only to about
    ``1e-7 ‖s_N‖²``, so exactly tied distances can split); the bound's parameters are always fitted
    in float64, and the outputs are stored as float32 either way (rounding keeps ``bound <= F_N``).
    ``batch_chunk`` bounds memory (rows processed together).
    """
    _check_dtype(dtype)
    _check_pattern_v(pattern, v)
    ns = _check_ns(ns)
    if n_random < 0:
        raise ValueError(f"n_random must be >= 0, got {n_random}")
    b, h, _, k = pattern.shape
    sinks = _check_sinks(sink_positions, k)
    queries = _query_positions(k, query_stride)
    metric = None
    if projected:
        if W_O is None:
            raise ValueError("projected=True needs W_O")
        if W_O.shape[0] != h or W_O.shape[1] != v.shape[-1]:
            raise ValueError(f"W_O {tuple(W_O.shape)} does not match {h} heads of d_head={v.shape[-1]}")
        w_o = W_O.to(dtype)
        metric = einops.einsum(w_o, w_o, "h d m, h e m -> h d e")
    device = pattern.device
    qsel = torch.tensor(queries, device=device)
    cand = candidate_mask(k, device=device)[qsel]  # [nq k]
    cand_ns = candidate_mask(k, sinks, device=device)[qsel]
    sink_mask = torch.zeros(k, dtype=torch.bool, device=device)
    sink_mask[sinks] = True
    n_src = cand.sum(-1)  # [nq]
    n_src_ns = cand_ns.sum(-1)
    params = fit_bound_params(v, sinks, metric=metric) if bound else None
    gen = torch.Generator(device=device).manual_seed(int(seed))
    nan = float("nan")
    out = {name: torch.full((b, h, len(queries), len(ns)), nan, dtype=torch.float32) for name in PER_QUERY}
    step = b if batch_chunk is None else max(1, int(batch_chunk))
    for b0 in range(0, b, step):
        sl = slice(b0, min(b, b0 + step))
        pat, val = pattern[sl][:, :, qsel].to(dtype), v[sl].to(dtype)
        r_top = source_ranks(pat, cand)
        r_ns = source_ranks(pat, cand_ns)
        r_rand = [random_ranks(pat.shape, cand, gen, device) for _ in range(n_random)]
        for t, n in enumerate(progress(ns, desc="N", enabled=verbose)):
            undefined = (n_src < n)[None, None, :]
            mem = (r_top < n) & cand
            d = selection_distances(pat, val, mem, metric=metric, dtype=dtype, squared=True)
            f = extreme_f_score(d, mem, cand)
            cert, m, q = inversion_certificate(d, mem, cand)
            res: dict[str, Tensor] = {
                "f_top": f,
                "certificate": cert,
                "m_inv": m.to(dtype),
                "q_inv": q.to(dtype),
                "sink_in_top": mem[..., sinks].any(-1).to(dtype),
            }
            if params is not None:
                res["bound"] = sink_aware_bound(pat, mem, cand, sink_mask, params, dtype=dtype)[0]
                ideal = params.constant_norm()
                res["bound_ideal"] = sink_aware_bound(pat, mem, cand, sink_mask, ideal, dtype=dtype)[0]
            if r_rand:
                acc = torch.zeros_like(f)
                for rr in r_rand:
                    mem_r = (rr < n) & cand
                    d_r = selection_distances(pat, val, mem_r, metric=metric, dtype=dtype, squared=True)
                    acc += extreme_f_score(d_r, mem_r, cand)
                res["f_random"] = acc / len(r_rand)
            mem_ns = (r_ns < n) & cand_ns
            d_ns = selection_distances(pat, val, mem_ns, metric=metric, dtype=dtype, squared=True)
            f_ns = extreme_f_score(d_ns, mem_ns, cand_ns)
            res["f_nosink"] = torch.where((n_src_ns < n)[None, None, :], nan, f_ns)
            for name, val_t in res.items():
                out[name][sl, ..., t] = torch.where(undefined, nan, val_t).float().cpu()
    par = {} if params is None else {name: t.float().cpu() for name, t in params.as_dict().items()}
    return {"per_query": out, "params": par, "queries": queries}


# --------------------------------------------------------------------------- result and collector


@dataclass
class SelectionResult:
    """Token-selection geometry of a batch of texts.

    ``per_query[name]`` is ``[batch, layer, head_index, query, n_N]`` (names: :data:`PER_QUERY`);
    ``params[name]`` is ``[layer, head_index]`` (:class:`BoundParams` fields); ``layers[k]`` is the
    model layer at index ``k``; ``ns[t]`` the ``N`` at index ``t`` of the last axis; ``queries[u]``
    the query position at index ``u`` of the query axis (every position unless ``query_stride > 1``).
    ``modified[b, l, h, u]`` marks the heads whose ``z`` an earlier hook changed at query ``queries[u]``
    (:func:`mechgeom.hooks.modified_mask`): their geometry is still that of ``alpha`` and ``v``, which no
    longer make the head's output. ``tokens`` is ``None`` for a result built from a cache without them.
    """

    layers: list[int]
    ns: list[int]
    tokens: Tokens | None
    queries: list[int]
    per_query: dict[str, Float[Tensor, "batch layer head_index query_pos n"]]
    params: dict[str, Float[Tensor, "layer head_index"]]
    projected: bool = False
    sink_positions: tuple[int, ...] = (0,)
    n_random: int = 4
    basis: str = "as loaded"
    model_name: str = ""
    modified: Bool[Tensor, "batch layer head_index query_pos"] | None = None

    @property
    def modified_heads(self) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs whose ``z`` an earlier hook changed at some analysed query."""
        return modified_pairs(self.modified, self.layers)

    def to_frame(self, *, tol: float = 1e-6) -> pd.DataFrame:
        """One row per ``(layer, head, N)``; means over the batch and the queries where defined.

        Columns: ``layer, head, N, n_queries, f_top, f_random, f_gap (= f_top − f_random), f_nosink,
        sink_in_top`` (share of queries whose ``I_N`` holds a sink), ``f_top_sink_in``/``f_nosink_sink_in``
        (both over the queries with a sink in ``I_N``: the sink's effect, paired), ``certificate``,
        ``cert_violations`` (queries with certificate > F_N + tol; 0 by theorem), ``m_inv, q_inv, bound,
        bound_violations, bound_ideal, ideal_violations`` (the constant-norm prediction is not a
        guarantee). ``modified`` is ``True`` for a head whose ``z`` an earlier hook changed.
        """
        pq = self.per_query
        f = pq["f_top"]
        defined = ~torch.isnan(f)
        sink_in = (pq["sink_in_top"] > 0.5) & defined

        def mean(x: Tensor, mask: Tensor) -> Tensor:
            return (torch.where(mask, x, 0.0).sum(dim=(0, 3)) / mask.sum(dim=(0, 3))).float()

        def viol(x: Tensor) -> Tensor:
            return ((x > f + tol) & defined).sum(dim=(0, 3))

        cols = {
            "n_queries": defined.sum(dim=(0, 3)),
            "f_top": mean(f, defined),
            "f_random": mean(pq["f_random"], defined & ~torch.isnan(pq["f_random"])),
            "f_nosink": mean(pq["f_nosink"], ~torch.isnan(pq["f_nosink"])),
            "sink_in_top": mean(pq["sink_in_top"], defined),
            "f_top_sink_in": mean(f, sink_in),
            "f_nosink_sink_in": mean(pq["f_nosink"], sink_in & ~torch.isnan(pq["f_nosink"])),
            "certificate": mean(pq["certificate"], defined),
            "cert_violations": viol(pq["certificate"]),
            "m_inv": mean(pq["m_inv"], defined),
            "q_inv": mean(pq["q_inv"], defined),
            "bound": mean(pq["bound"], defined & ~torch.isnan(pq["bound"])),
            "bound_violations": viol(pq["bound"]),
            "bound_ideal": mean(pq["bound_ideal"], defined & ~torch.isnan(pq["bound_ideal"])),
            "ideal_violations": viol(pq["bound_ideal"]),
        }
        n_l, n_h, n_n = f.shape[1], f.shape[2], f.shape[4]
        ll, hh, tt = torch.meshgrid(torch.arange(n_l), torch.arange(n_h), torch.arange(n_n), indexing="ij")
        frame = pd.DataFrame(
            {
                "layer": np.asarray(self.layers)[ll.flatten().numpy()],
                "head": hh.flatten().numpy(),
                "N": np.asarray(self.ns)[tt.flatten().numpy()],
                **{k: c.flatten().numpy() for k, c in cols.items()},
            }
        )
        frame["f_gap"] = frame["f_top"] - frame["f_random"]
        if self.modified is not None:
            mod = self.modified.any(dim=3).any(dim=0)  # [layer head]
            frame["modified"] = mod[ll.flatten(), hh.flatten()].numpy()
        else:
            frame["modified"] = False
        return frame

    def params_frame(self, *, norm_tolerance: float = 2.0) -> pd.DataFrame:
        """One row per ``(layer, head)``: the fitted regime parameters and whether the regime holds.

        ``sink_small``: every sink norm below ``nu`` (``sink_max < nu``, i.e. ``rho < 1`` throughout);
        ``sink_opposed``: ``kappa > 0`` (the sink's cosine to every non-sink value is negative);
        ``near_constant``: ``nu_max / nu_min <= norm_tolerance``; ``regime`` = all three.
        """
        if not self.params:
            raise ValueError("no bound parameters: the selection ran with bound=False")
        n_l, n_h = self.params["nu"].shape
        ll, hh = torch.meshgrid(torch.arange(n_l), torch.arange(n_h), indexing="ij")
        df = pd.DataFrame(
            {
                "layer": np.asarray(self.layers)[ll.flatten().numpy()],
                "head": hh.flatten().numpy(),
                **{k: t.flatten().numpy() for k, t in self.params.items()},
            }
        )
        df["sink_small"] = df["sink_max"] < df["nu"]
        df["sink_opposed"] = df["kappa"] > 0
        df["near_constant"] = df["nu_max"] <= norm_tolerance * df["nu_min"]
        df["regime"] = df["sink_small"] & df["sink_opposed"] & df["near_constant"]
        return df


class SelectionCollector:
    """A hook collector that computes :func:`layer_selection` layer by layer during a forward pass.

    Built on :class:`mechgeom.hooks.LayerCollector` (``hook_pattern``, ``hook_v``, ``hook_z``); use
    ``collector.fwd_hooks`` with ``model.run_with_hooks`` / ``model.hooks(...)``, or
    :meth:`feed_cache` with an ``ActivationCache``; then :meth:`result`. Keyword arguments are those of
    :func:`layer_selection`; the random draws of layer ``l`` are seeded with ``seed * 1_000_003 + l``.
    """

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        projected: bool = False,
        ns: Sequence[int] = DEFAULT_NS,
        sink_positions: Sequence[int] = (0,),
        n_random: int = 4,
        seed: int = 0,
        bound: bool = True,
        query_stride: int = 1,
        dtype: torch.dtype = torch.float32,
        batch_chunk: int | None = 2,
        verbose: bool = False,
    ) -> None:
        self.model = model
        self.ns = _check_ns(ns)
        if n_random < 0:
            raise ValueError(f"n_random must be >= 0, got {n_random}")
        self.kwargs: dict[str, Any] = {
            "projected": projected,
            "ns": self.ns,
            "sink_positions": tuple(sink_positions),
            "n_random": n_random,
            "bound": bound,
            "query_stride": query_stride,
            "dtype": dtype,
            "batch_chunk": batch_chunk,
        }
        self.seed = seed
        self.verbose = verbose
        self.collector = LayerCollector(model, layers, self._on_layer)
        self.layers = self.collector.layers
        self._done: dict[int, dict[str, Any]] = {}

    @property
    def fwd_hooks(self) -> list[FwdHook]:
        return self.collector.fwd_hooks

    def _on_layer(self, acts: LayerActivations) -> None:
        n_pos = acts.pattern.shape[-1]
        too_big = [n for n in self.ns if n > n_pos]
        if too_big:
            warnings.warn(
                f"N={too_big} is larger than every query's source count (at most {n_pos} in sequences of "
                f"{n_pos} positions): F_N is NaN there",
                stacklevel=2,
            )
        with torch.no_grad():
            self._done[acts.layer] = layer_selection(
                acts.pattern,
                acts.v,
                W_O=acts.W_O,
                seed=self.seed * 1_000_003 + acts.layer,
                verbose=self.verbose,
                **self.kwargs,
            )
            queries = torch.tensor(self._done[acts.layer]["queries"], dtype=torch.long)
            mod = acts.modified
            self._done[acts.layer]["modified"] = (
                torch.zeros((*acts.pattern.shape[:2], len(queries)), dtype=torch.bool)
                if mod is None
                else mod[:, :, queries.to(mod.device)].cpu()
            )

    def feed_cache(self, cache: Any) -> None:
        self.collector.feed_cache(cache)

    def result(self, tokens: Tokens | None = None) -> SelectionResult:
        missing = [layer for layer in self.layers if layer not in self._done]
        if missing:
            raise RuntimeError(
                f"no activations were collected for layer(s) {missing}; run the model with "
                "collector.fwd_hooks first (or feed_cache)"
            )
        per_query = {
            name: torch.stack([self._done[la]["per_query"][name] for la in self.layers], dim=1)
            for name in PER_QUERY
        }
        params: dict[str, Tensor] = {}
        if self.kwargs["bound"]:
            keys = self._done[self.layers[0]]["params"].keys()
            params = {k: torch.stack([self._done[la]["params"][k] for la in self.layers]) for k in keys}
        return SelectionResult(
            layers=list(self.layers),
            ns=list(self.ns),
            tokens=None if tokens is None else tokens.detach().cpu(),
            queries=list(self._done[self.layers[0]]["queries"]),
            per_query=per_query,
            params=params,
            projected=bool(self.kwargs["projected"]),
            sink_positions=tuple(self.kwargs["sink_positions"]),
            n_random=int(self.kwargs["n_random"]),
            model_name=str(getattr(self.model.cfg, "model_name", "")),
            modified=torch.stack([self._done[la]["modified"] for la in self.layers], dim=1),
        )


def token_selection(
    model: Any,
    tokens_or_text: str | Sequence[str] | Tensor,
    *,
    layers: int | Sequence[int] | None = None,
    extra_hooks: Sequence[FwdHook] = (),
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> SelectionResult:
    """Token-selection geometry of every head of ``layers`` (default: all) in one forward pass.

    ``kwargs`` go to :class:`SelectionCollector` (``projected``, ``ns``, ``sink_positions``,
    ``n_random``, ``seed``, ``bound``, ``query_stride``, ``batch_chunk``, ``verbose``). ``extra_hooks`` run in the same
    pass, before mechgeom's readers on the same hook point (e.g. a pattern intervention). ``dtype``:
    the precision of distances, scores and bounds, ``float32`` by default; ``torch.float64`` gives
    (near-)exact ``F_N`` where distances tie (see :func:`layer_selection`).
    """
    _check_dtype(dtype)
    col = SelectionCollector(model, layers, dtype=dtype, **kwargs)
    sinks = col.kwargs["sink_positions"]
    tokens = to_tokens(
        model,
        tokens_or_text,
        min_pos=max(sinks, default=0) + 2,
        what="token selection (a query after the sinks)",
    )
    _check_sinks(col.kwargs["sink_positions"], tokens.shape[1])
    run_hooks(model, tokens, [*extra_hooks, *col.fwd_hooks], stop_at_layer=max(col.layers) + 1)
    return col.result(tokens)


def token_selection_from_cache(
    model: Any,
    cache: Any,
    *,
    layers: int | Sequence[int] | None = None,
    tokens: Tokens | None = None,
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> SelectionResult:
    """The same result from an ``ActivationCache`` holding ``hook_pattern``, ``hook_v``, ``hook_z``.

    ``dtype`` as in :func:`token_selection` (``float32`` by default, ``torch.float64`` near ties).
    """
    _check_dtype(dtype)
    col = SelectionCollector(model, layers, dtype=dtype, **kwargs)
    col.feed_cache(cache)
    return col.result(None if tokens is None else to_tokens(model, tokens))
