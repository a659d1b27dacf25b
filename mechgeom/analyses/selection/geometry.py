"""Geometry of token selection (``docs/definitions.md`` §5): candidate sets, rankings, distances and the extreme F-score.

For one head and query ``i`` the contributions are ``y_j = alpha[h,i,j] * v[j,h]`` (value space,
GQA-expanded ``v``; with the metric ``G_h = W_O[h] W_O[h]ᵀ``, the projected ``vt[j,h] = v[j,h] @ W_O[h]``).
``I_N`` holds the ``N`` candidate sources with the largest ``alpha``, ``s_N = sum_{j in I_N} y_j`` and
``d_j = ‖y_j − s_N‖`` for every candidate ``j <= i``. A ball ``B(r) = {j : d_j <= r}`` classifies the
sources; :func:`extreme_f_score` is its best F-score over all radii.

Choices fixed here:

- **Ties in ``alpha``**: the lower position enters ``I_N`` first (a stable descending sort,
  :func:`mechgeom.maths.stable_ranks`).
- **Ties in ``d_j``**: a radius ``r`` includes every source with ``d_j <= r``, so equal distances enter
  the ball together; the maximum runs over the ends of the tie groups (exactly equal floats).
- **Random subsets**: :func:`random_ranks` is one uniformly random permutation of the candidates per row.
- **Cost**: everything is ``[batch, head, q, k]`` work plus ``[batch, head, q, d]`` vectors; no ``[q, k, d]``
  tensor is built.

The certificate and the sink-aware bound are in :mod:`mechgeom.analyses.selection.bounds`; one layer's
quantities together in :func:`mechgeom.analyses.selection.layer_selection`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import einops
import numpy as np
import pandas as pd
import torch

from mechgeom.maths import stable_ranks
from mechgeom.typing import Bool, Float, HeadScores, Int, Pattern, QueryKeyMask, Tensor, Values

__all__ = [
    "candidate_mask",
    "extreme_f_score",
    "precision_recall_curve",
    "random_ranks",
    "scores_by_n",
    "selection_distances",
    "sink_effect",
    "source_ranks",
]


# --------------------------------------------------------------------------- input checks


def check_ns(ns: int | Sequence[int]) -> list[int]:
    out = [ns] if isinstance(ns, int) else list(ns)
    if not out:
        raise ValueError("ns is empty; give at least one N (e.g. (1, 2, 4, 8, 16, 32))")
    if any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 for n in out):
        raise ValueError(f"every N must be a positive integer, got {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate N in {out}")
    return [int(n) for n in out]


def check_pattern_v(pattern: Tensor, v: Tensor) -> None:
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


def check_dtype(dtype: torch.dtype) -> None:
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


def source_ranks(
    scores: HeadScores, candidates: QueryKeyMask
) -> Int[Tensor, "batch head_index query_pos key_pos"]:
    """Rank of each source by descending ``scores`` among the candidates (0 = largest).

    Ties: the lower position gets the lower rank (a stable sort). Non-candidates rank after every
    candidate, so ``I_N = {j : rank < N} ∩ candidates``.

    >>> source_ranks(torch.tensor([[[[0.25, 0.5, 0.25]]]]), torch.ones(1, 3, dtype=torch.bool)).tolist()
    [[[[1, 0, 2]]]]
    """
    keys = scores.masked_fill(~candidates, float("-inf"))
    return stable_ranks(keys, descending=True)


def random_ranks(
    shape: Sequence[int],
    candidates: QueryKeyMask,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> Int[Tensor, "batch head_index query_pos key_pos"]:
    """A uniformly random permutation of the candidates of each row (non-candidates rank last).

    ``{j : rank < N} ∩ candidates`` is then a uniformly random ``N``-subset of the candidates.
    """
    keys = torch.rand(tuple(shape), generator=generator, device=device)
    keys = keys.masked_fill(~candidates, 2.0)
    return stable_ranks(keys, descending=False)


# --------------------------------------------------------------------------- distances and scores


def selection_distances(
    pattern: Pattern,
    v: Values,
    members: Bool[Tensor, "batch head_index query_pos key_pos"],
    *,
    metric: Float[Tensor, "head_index d_head d_head"] | None = None,
    dtype: torch.dtype = torch.float64,
    squared: bool = False,
) -> HeadScores:
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

    ``docs/definitions.md`` §5.2: precision ``P(r) = |I_N ∩ B(r)| / |B(r)|``, recall ``R(r) = |I_N ∩ B(r)| / N``, and
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


# --------------------------------------------------------------------------- with vs without the sink


def sink_effect(per_query: Mapping[str, Tensor], ns: Sequence[int]) -> pd.DataFrame:
    """Per ``N``: ``F_N`` with the sink in ``I_N`` vs the same computation without the sink positions.

    ``docs/definitions.md`` §5.6: ``F_N`` when the sink is in ``I_N`` vs the same computation with position 0 excluded.
    ``per_query`` holds ``f_top``, ``f_nosink`` and ``sink_in_top`` (``[..., n_N]``, as
    :attr:`mechgeom.analyses.selection.SelectionResult.per_query`); the pairs are the entries (text,
    layer, head, query) whose ``I_N`` holds a sink and where both scores are defined. Columns: ``N``,
    ``share_sink_in_top`` (pairs / defined ``f_top``), ``n_pairs``, ``f_with_sink``, ``f_without_sink``
    (means over the pairs, float64), ``ratio_of_means``, ``share_halved`` (``F_N <= F_N^nosink / 2``) and
    ``share_lower`` (``F_N < F_N^nosink``).
    """
    rows = []
    for t, n in enumerate(ns):
        f, f_ns = per_query["f_top"][..., t], per_query["f_nosink"][..., t]
        sel = (per_query["sink_in_top"][..., t] > 0.5) & ~torch.isnan(f) & ~torch.isnan(f_ns)
        a, b = f[sel].double(), f_ns[sel].double()
        rows.append(
            {
                "N": int(n),
                "share_sink_in_top": float(sel.sum() / (~torch.isnan(f)).sum()),
                "n_pairs": int(sel.sum()),
                "f_with_sink": float(a.mean()),
                "f_without_sink": float(b.mean()),
                "ratio_of_means": float(a.mean() / b.mean()),
                "share_halved": float((a <= 0.5 * b).double().mean()),
                "share_lower": float((a < b).double().mean()),
            }
        )
    return pd.DataFrame(rows)


#: The columns :func:`scores_by_n` averages over heads, and those it sums.
BY_N_MEANS = (
    "f_top",
    "f_random",
    "f_gap",
    "f_nosink",
    "sink_in_top",
    "f_top_sink_in",
    "f_nosink_sink_in",
    "certificate",
    "bound",
    "bound_ideal",
)
BY_N_SUMS = ("cert_violations", "bound_violations", "ideal_violations")


def scores_by_n(frame: pd.DataFrame) -> pd.DataFrame:
    """Per ``N``: the unweighted means over the heads of :data:`BY_N_MEANS` and the sums of :data:`BY_N_SUMS`.

    ``frame`` is :meth:`mechgeom.analyses.selection.SelectionResult.to_frame` (one row per layer, head, ``N``);
    one row per ``N`` comes back, ``N`` first. The means skip NaN (heads without a defined query).
    """
    by_n = frame.groupby("N")[list(BY_N_MEANS)].mean()
    by_n[list(BY_N_SUMS)] = frame.groupby("N")[list(BY_N_SUMS)].sum()
    return by_n.reset_index()
