"""Geometry of token selection (``docs/definitions.md`` §5, paper B): extreme F-scores, certificates, sink-aware bound.

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
- **Sink**: ``sink_positions`` (default ``None``: each text's first position, ``(0,)``). "Without the sink"
  is the same computation with the sink positions removed from the candidate sources (neither in ``I_N``
  nor classified; ``alpha`` is not renormalised).
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

Layout: :mod:`mechgeom.analyses.selection.geometry` (candidates, rankings, distances, ``F_N``),
:mod:`mechgeom.analyses.selection.bounds` (tie tolerances, certificate, regime parameters, the bound); this
module holds one layer's sweep (:func:`layer_selection`), :class:`SelectionResult`,
:class:`SelectionCollector` and the entry points, and re-exports the public names of both.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom._deprecation import warn_deprecated
from mechgeom._progress import progress
from mechgeom.analyses.base import Collector, Result, run_collector
from mechgeom.analyses.selection.bounds import (
    BoundParams,
    bound_vs_measured,
    fit_bound_params,
    inversion_certificate,
    sink_aware_bound,
)
from mechgeom.analyses.selection.geometry import (
    candidate_mask,
    check_dtype,
    check_ns,
    check_pattern_v,
    extreme_f_score,
    random_ranks,
    scores_by_n,
    selection_distances,
    sink_effect,
    source_ranks,
)
from mechgeom.hooks import (
    FwdHook,
    LayerActivations,
    Queries,
    TokensOrText,
    align_texts,
    check_sink_positions,
    modified_pairs,
    text_spans,
    texts_first,
    to_batch,
)
from mechgeom.maths import wo_gram
from mechgeom.typing import WO, Bool, Float, Pattern, Tensor, Tokens, Values

__all__ = [
    "DEFAULT_NS",
    "PER_QUERY",
    "SelectionCollector",
    "SelectionResult",
    "layer_selection",
    "token_selection",
    "token_selection_from_cache",
]

#: The default sweep over ``N``.
DEFAULT_NS = (1, 2, 4, 8, 16, 32)

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


@dataclass
class _Ranks:
    """The rankings of one chunk of rows that every ``N`` reads: top-``N`` by attention, the same without the
    sinks, and the random draws; the candidate sources with and without the sinks."""

    top: Tensor
    no_sink: Tensor
    random: list[Tensor]
    cand: Tensor
    cand_ns: Tensor
    sinks: list[int]
    sink_mask: Tensor


def _selection_at_n(
    pat: Tensor,
    val: Tensor,
    ranks: _Ranks,
    n: int,
    params: BoundParams | None,
    *,
    metric: Tensor | None,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """Every per-query quantity of one ``N`` for one chunk of rows (before the undefined rows are set to NaN)."""
    cand, cand_ns = ranks.cand, ranks.cand_ns
    mem = (ranks.top < n) & cand
    d = selection_distances(pat, val, mem, metric=metric, dtype=dtype, squared=True)
    f = extreme_f_score(d, mem, cand)
    cert, m, q = inversion_certificate(d, mem, cand)
    res: dict[str, Tensor] = {
        "f_top": f,
        "certificate": cert,
        "m_inv": m.to(dtype),
        "q_inv": q.to(dtype),
        "sink_in_top": mem[..., ranks.sinks].any(-1).to(dtype),
    }
    if params is not None:
        res["bound"] = sink_aware_bound(pat, mem, cand, ranks.sink_mask, params, dtype=dtype)[0]
        ideal = params.constant_norm()
        res["bound_ideal"] = sink_aware_bound(pat, mem, cand, ranks.sink_mask, ideal, dtype=dtype)[0]
    if ranks.random:
        acc = torch.zeros_like(f)
        for rr in ranks.random:
            mem_r = (rr < n) & cand
            d_r = selection_distances(pat, val, mem_r, metric=metric, dtype=dtype, squared=True)
            acc += extreme_f_score(d_r, mem_r, cand)
        res["f_random"] = acc / len(ranks.random)
    mem_ns = (ranks.no_sink < n) & cand_ns
    d_ns = selection_distances(pat, val, mem_ns, metric=metric, dtype=dtype, squared=True)
    res["f_nosink"] = extreme_f_score(d_ns, mem_ns, cand_ns)
    return res


def layer_selection(
    pattern: Pattern,
    v: Values,
    *,
    W_O: WO | None = None,
    projected: bool = False,
    ns: Sequence[int] = DEFAULT_NS,
    sink_positions: int | Sequence[int] | None = None,
    n_random: int = 4,
    seed: int = 0,
    bound: bool = True,
    query_stride: int = 1,
    dtype: torch.dtype = torch.float32,
    batch_chunk: int | None = None,
    verbose: bool = False,
    generator: torch.Generator | None = None,
    keep: Bool[Tensor, "batch query_pos"] | None = None,
    real: Bool[Tensor, "batch pos"] | None = None,
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
    ``batch_chunk`` bounds memory (rows processed together). ``generator`` (default: a new one seeded with
    ``seed``) draws the random subsets, chunk after chunk of texts; a collector passes the same one for every
    batch, so the draws do not depend on how the texts were batched (for batches that are whole chunks).

    Padding and query subsets: the texts start at position 0 (:func:`mechgeom.hooks.align_texts` moves
    left-padded ones), ``real`` marks their real tokens (never a value of the bound's fit) and ``keep`` the
    queries analysed (padding and the queries left out by ``queries=`` are False; their outputs are NaN).
    Only the rows of queries kept in some text are computed.
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 53 lines.
    check_dtype(dtype)
    check_pattern_v(pattern, v)
    ns = check_ns(ns)
    if n_random < 0:
        raise ValueError(f"n_random must be >= 0, got {n_random}")
    b, h, _, k = pattern.shape
    sinks = list(check_sink_positions(sink_positions, k))
    queries = _query_positions(k, query_stride)
    metric = None
    if projected:
        if W_O is None:
            raise ValueError("projected=True needs W_O")
        if W_O.shape[0] != h or W_O.shape[1] != v.shape[-1]:
            raise ValueError(f"W_O {tuple(W_O.shape)} does not match {h} heads of d_head={v.shape[-1]}")
        metric = wo_gram(W_O, dtype=dtype)  # G_h = W_O[h] W_O[h]ᵀ, cached per layer and dtype
    device = pattern.device
    qsel = torch.tensor(queries, device=device)
    cand = candidate_mask(k, device=device)[qsel]  # [nq k]
    cand_ns = candidate_mask(k, sinks, device=device)[qsel]
    sink_mask = torch.zeros(k, dtype=torch.bool, device=device)
    sink_mask[sinks] = True
    n_src = cand.sum(-1)  # [nq]
    n_src_ns = cand_ns.sum(-1)
    params = fit_bound_params(v, sinks, metric=metric, real=real) if bound else None
    gen = torch.Generator(device=device).manual_seed(int(seed)) if generator is None else generator
    nan = float("nan")
    out = {name: torch.full((b, h, len(queries), len(ns)), nan, dtype=torch.float32) for name in PER_QUERY}
    kept = None if keep is None else keep.detach().cpu().bool()[:, qsel.cpu()]  # [b nq]
    if kept is not None:  # only the rows kept in some text
        cols = kept.any(0).nonzero().flatten()
        qsel, cand, cand_ns = qsel[cols.to(device)], cand[cols.to(device)], cand_ns[cols.to(device)]
        n_src, n_src_ns, kept = n_src[cols.to(device)], n_src_ns[cols.to(device)], kept[:, cols]
    else:
        cols = torch.arange(len(queries))
    step = b if batch_chunk is None else max(1, int(batch_chunk))
    for b0 in range(0, b, step):
        sl = slice(b0, min(b, b0 + step))
        dropped = None if kept is None else ~kept[sl][:, None, :].to(device)  # [b 1 nq]
        pat, val = pattern[sl][:, :, qsel].to(dtype), v[sl].to(dtype)
        r_top = source_ranks(pat, cand)
        r_ns = source_ranks(pat, cand_ns)
        r_rand = [random_ranks(pat.shape, cand, gen, device) for _ in range(n_random)]
        for t, n in enumerate(progress(ns, desc="N", enabled=verbose)):
            undefined = (n_src < n)[None, None, :]
            if dropped is not None:
                undefined = undefined | dropped
            ranks = _Ranks(r_top, r_ns, r_rand, cand, cand_ns, sinks, sink_mask)
            res = _selection_at_n(pat, val, ranks, n, params, metric=metric, dtype=dtype)
            res["f_nosink"] = torch.where((n_src_ns < n)[None, None, :], nan, res["f_nosink"])
            for name, val_t in res.items():
                out[name][sl, :, cols, t] = torch.where(undefined, nan, val_t).float().cpu()
    par = {} if params is None else {name: t.float().cpu() for name, t in params.as_dict().items()}
    return {"per_query": out, "params": par, "queries": queries}


# --------------------------------------------------------------------------- result and collector


@dataclass
class SelectionResult(Result):
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
    kept: Bool[Tensor, "batch query_pos"] | None = None

    @property
    def modified_heads(self) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs whose ``z`` an earlier hook changed at some analysed query."""
        return modified_pairs(self.modified, self.layers)

    @property
    def n_analysed(self) -> int:
        """The analysed (text, query) pairs: real queries of each text kept by ``queries=`` (``kept``), never
        padding; every (text, query) pair of the query axis for a result without ``kept``."""
        if self.kept is not None:
            return int(self.kept.sum())
        return int(self.per_query["f_top"].shape[0]) * len(self.queries)

    def _queries_per_text(self) -> int | list[int]:
        """Analysed queries per text: one number when every text has as many, else one per text."""
        if self.kept is None:
            return len(self.queries)
        counts = [int(n) for n in self.kept.sum(-1).tolist()]
        return counts[0] if len(set(counts)) == 1 else counts

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

    def by_n_frame(self) -> pd.DataFrame:
        """Per ``N``: the means over heads of the scores of :meth:`to_frame` and the summed violations.

        The top-``N`` vs random table, :func:`scores_by_n` of :meth:`to_frame`.
        """
        return scores_by_n(self.to_frame())

    def sink_effect_frame(self) -> pd.DataFrame:
        """Per ``N``, ``F_N`` with the sink in ``I_N`` vs without it (:func:`sink_effect` of :attr:`per_query`)."""
        return sink_effect(self.per_query, self.ns)

    def bound_frame(self) -> pd.DataFrame:
        """Measured ``F_N`` vs the bound and its prediction per ``N`` (:func:`bound_vs_measured`)."""
        return bound_vs_measured(self.to_frame(), self.params_frame())

    def summary(self, *, small_n: int = 4) -> dict[str, Any]:
        """The headline numbers, JSON-serialisable (NaN where nothing is defined).

        Sizes: ``n_layers``, ``n_heads`` (per layer), ``ns``, ``n_texts``, ``queries_per_text`` (one number, or
        one per text with padding or ``queries=``), ``n_queries`` (analysed (text, query) pairs per head, real
        kept queries only: :attr:`n_analysed`), ``windows`` (``[n_texts, n_pos]``), ``n_random``,
        ``projected``, ``sink_positions``. Over the :meth:`to_frame` rows with ``N <= small_n``: the means
        ``f_top``, ``f_random``, ``f_gap``; over the rows where both are defined: the means ``f_top_sink_in``,
        ``f_nosink_sink_in``; the sums ``cert_violations``, ``bound_violations``; ``regime_share`` (share of
        heads in the regime, :meth:`params_frame`). Then ``largest_mean_gap`` (the ``N`` of
        :meth:`by_n_frame` with the largest ``f_gap``), ``largest_head_gap`` (the row with the largest
        ``f_gap``; ``None`` without a random baseline), ``sink_effect`` and ``bound_by_n`` (the records of
        :meth:`sink_effect_frame`, :meth:`bound_frame`), ``violations`` (certificate, bound, constant-norm
        prediction and its share of queries), ``regime_flags_share_of_heads`` and ``bound_params_median``.
        """
        df = self.to_frame()
        small = df[df["N"] <= small_n]
        sink_rows = df.dropna(subset=["f_top_sink_in", "f_nosink_sink_in"])
        n_texts = int(self.per_query["f_top"].shape[0])
        params = self.params_frame() if self.params else None
        out: dict[str, Any] = {
            "n_layers": len(self.layers),
            "n_heads": int(self.per_query["f_top"].shape[2]),
            "ns": list(self.ns),
            "n_texts": n_texts,
            "queries_per_text": self._queries_per_text(),
            "n_queries": self.n_analysed,
            "windows": [n_texts, int(self.queries[-1]) + 1],
            "n_random": int(self.n_random),
            "projected": bool(self.projected),
            "sink_positions": list(self.sink_positions),
            "small_n": int(small_n),
            **{k: float(small[k].mean()) for k in ("f_top", "f_random", "f_gap")},
            **{k: float(sink_rows[k].mean()) for k in ("f_top_sink_in", "f_nosink_sink_in")},
            "cert_violations": int(df.cert_violations.sum()),
            "bound_violations": int(df.bound_violations.sum()),
            "regime_share": float(params.regime.mean()) if params is not None else float("nan"),
        }
        by_n = scores_by_n(df)
        out["largest_mean_gap"] = None
        if by_n["f_gap"].notna().any():
            row = by_n.iloc[int(np.nanargmax(by_n["f_gap"].to_numpy()))]  # the first largest, as idxmax
            out["largest_mean_gap"] = {
                "N": int(row["N"]),
                "f_top": float(row["f_top"]),
                "f_random": float(row["f_random"]),
                "gap": float(row["f_gap"]),
            }
        out["largest_head_gap"] = None
        if df.f_gap.notna().any():
            head = df.iloc[int(np.nanargmax(df.f_gap.to_numpy()))]
            out["largest_head_gap"] = {
                **{k: int(head[k]) for k in ("layer", "head", "N")},
                **{k: float(head[k]) for k in ("f_top", "f_random", "f_gap")},
            }
        out["sink_effect"] = self.sink_effect_frame().to_dict(orient="records")
        out["violations"] = {
            "certificate": int(df.cert_violations.sum()),
            "bound": int(df.bound_violations.sum()),
            "bound_ideal": int(df.ideal_violations.sum()),
            "bound_ideal_share_of_queries": float(df.ideal_violations.sum() / df.n_queries.sum()),
        }
        flags, medians, bounds = {}, {}, []
        if params is not None:
            flags = {
                k: float(params[k].mean()) for k in ("sink_small", "sink_opposed", "near_constant", "regime")
            }
            medians = {
                k: float(params[k].median()) for k in ("nu", "rho", "kappa", "kappa_mean", "mu", "mu_mean")
            }
            bounds = bound_vs_measured(df, params).to_dict(orient="records")
        out["regime_flags_share_of_heads"] = flags
        out["bound_params_median"] = medians
        out["bound_by_n"] = bounds
        return out


class SelectionCollector(Collector):
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
        sink_positions: int | Sequence[int] | None = None,
        n_random: int = 4,
        seed: int = 0,
        bound: bool = True,
        query_stride: int = 1,
        dtype: torch.dtype = torch.float32,
        batch_chunk: int | None = 2,
        verbose: bool = False,
        queries: Queries = None,
    ) -> None:
        super().__init__(model, layers)
        self.queries = queries
        self._offset: dict[int, int] = {}
        self._kept: list[Tensor] = []
        self._starts: list[Tensor] = []  # each batch's first real positions (left padding)
        self.ns = check_ns(ns)
        if n_random < 0:
            raise ValueError(f"n_random must be >= 0, got {n_random}")
        self.kwargs: dict[str, Any] = {
            "projected": projected,
            "ns": self.ns,
            "sink_positions": check_sink_positions(sink_positions),
            "n_random": n_random,
            "bound": bound,
            "query_stride": query_stride,
            "dtype": dtype,
            "batch_chunk": batch_chunk,
        }
        self.seed = seed
        self.verbose = verbose
        self._done: dict[int, list[dict[str, Any]]] = {}
        self._generators: dict[int, torch.Generator] = {}

    def on_layer(self, acts: LayerActivations) -> None:
        n_pos = acts.pattern.shape[-1]
        too_big = [n for n in self.ns if n > n_pos]
        if too_big:
            warnings.warn(
                f"N={too_big} is larger than every query's source count (at most {n_pos} in sequences of "
                f"{n_pos} positions): F_N is NaN there",
                stacklevel=2,
            )
        if self.kwargs["bound"] and self._done.get(acts.layer):
            raise ValueError(
                "the sink-aware bound fits its parameters over every text of one pass, and this collector "
                f"already read layer {acts.layer} in an earlier pass: put all texts in one batch "
                "(token_selection does; collect(..., batch_size=len(texts))), or pass bound=False to "
                "accumulate the other quantities over batches"
            )
        gen = self._generators.get(acts.layer)
        if gen is None:
            gen = torch.Generator(device=acts.pattern.device).manual_seed(self.seed * 1_000_003 + acts.layer)
            self._generators[acts.layer] = gen
        offset = self._offset.get(acts.layer, 0)
        self._offset[acts.layer] = offset + int(acts.pattern.shape[0])
        with torch.no_grad():
            al = align_texts(acts, self.queries, offset)  # each text at the start of its row
            padded = acts.key_mask is not None
            keep = al.keep & al.real
            done = layer_selection(
                al.acts.pattern,
                al.acts.v,
                W_O=acts.W_O,
                verbose=self.verbose,
                generator=gen,
                keep=None if bool(keep.all()) else keep,
                real=al.real if padded else None,
                **self.kwargs,
            )
            queries = torch.tensor(done["queries"], dtype=torch.long)
            if acts.layer == self.layers[0]:
                self._kept.append(keep[:, queries])
                self._starts.append(text_spans(acts.key_mask, *keep.shape)[0])
            mod = al.acts.modified
            done["modified"] = (
                torch.zeros((*acts.pattern.shape[:2], len(queries)), dtype=torch.bool)
                if mod is None
                else mod[:, :, queries.to(mod.device)].cpu()
            )
        self._done.setdefault(acts.layer, []).append(done)

    def build(self, tokens: Tokens | None) -> SelectionResult:
        """The selection geometry of every text read so far (passes in order); ``tokens`` are kept."""
        lengths = {d["per_query"]["f_top"].shape[2] for la in self.layers for d in self._done[la]}
        if len(lengths) > 1:
            raise ValueError(
                f"batches of different sequence lengths {sorted(lengths)}; use equal-length texts"
            )
        per_query = {
            name: torch.stack(
                [torch.cat([d["per_query"][name] for d in self._done[la]]) for la in self.layers], dim=1
            )
            for name in PER_QUERY
        }
        params: dict[str, Tensor] = {}
        if self.kwargs["bound"]:  # one pass (see on_layer)
            keys = self._done[self.layers[0]][0]["params"].keys()
            params = {k: torch.stack([self._done[la][0]["params"][k] for la in self.layers]) for k in keys}
        return SelectionResult(
            layers=list(self.layers),
            ns=list(self.ns),
            tokens=texts_first(tokens, self._starts),  # positions inside each text, as the query axis
            queries=list(self._done[self.layers[0]][0]["queries"]),
            per_query=per_query,
            params=params,
            projected=bool(self.kwargs["projected"]),
            sink_positions=tuple(self.kwargs["sink_positions"]),
            n_random=int(self.kwargs["n_random"]),
            model_name=self.model_name,
            modified=torch.stack(
                [torch.cat([d["modified"] for d in self._done[la]]) for la in self.layers], dim=1
            ),
            kept=torch.cat(self._kept) if self._kept else None,
        )


def token_selection(
    model: Any,
    tokens_or_text: TokensOrText | None,
    *,
    layers: int | Sequence[int] | None = None,
    cache: Any = None,
    extra_hooks: Sequence[FwdHook] = (),
    verbose: bool = False,
    dtype: torch.dtype = torch.float32,
    attention_mask: Tensor | None = None,
    queries: Queries = None,
    **kwargs: Any,
) -> SelectionResult:
    """Token-selection geometry of every head of ``layers``, all texts in one forward pass.

    Args:
        model: a causal decoder.
        tokens_or_text: text, texts or token ids (the cached texts with ``cache``, optional there).
        layers: an int or a sequence of ints; ``None`` is every layer.
        cache: an ``ActivationCache`` with ``hook_pattern``, ``hook_v``, ``hook_z`` of ``layers``; nothing runs.
        extra_hooks: interventions run in the same pass, before mechgeom's readers on the same hook point.
        verbose: progress over ``N`` inside each layer.
        dtype: the precision of distances, scores and bounds, ``float32`` by default; ``torch.float64`` gives
            (near-)exact ``F_N`` where distances tie (see :func:`layer_selection`).
        attention_mask: ``[batch, pos]``, 1 at real tokens, 0 at padding (left or right); by default the
            padding of a list of texts (the tokenizer's ``padding_side``). Padding is never a query, a source
            or a sink; each text's per-query numbers are those of the text run alone, at positions inside it.
        queries: the queries analysed (:func:`mechgeom.hooks.select_queries`: positions inside each text,
            ``-1`` its last token; a slice; a boolean mask); ``None`` is every real query. Only their rows are
            computed; the bound's parameters are still fitted on every real token.
        **kwargs: the options of :class:`SelectionCollector` (``projected``, ``ns``, ``sink_positions``,
            ``n_random``, ``seed``, ``bound``, ``query_stride``, ``batch_chunk``).

    Returns:
        A :class:`SelectionResult`. The sink-aware bound's parameters are fitted over all the texts, which is
        why they run in one pass.
    """
    check_dtype(dtype)
    col = SelectionCollector(model, layers, dtype=dtype, verbose=verbose, queries=queries, **kwargs)
    sinks = col.kwargs["sink_positions"]
    what = "token selection (a query after the sinks)"
    min_pos = max(sinks, default=0) + 2
    n_texts = 1
    if cache is None and tokens_or_text is not None:
        tokens, mask = to_batch(
            model, tokens_or_text, attention_mask=attention_mask, min_pos=min_pos, what=what
        )
        check_sink_positions(sinks, tokens.shape[1])
        tokens_or_text, n_texts, attention_mask = tokens, tokens.shape[0], mask
    return run_collector(  # type: ignore[no-any-return]
        model,
        tokens_or_text,
        col,
        cache=cache,
        extra_hooks=extra_hooks,
        batch_size=n_texts,
        min_pos=min_pos,
        what=what,
        attention_mask=attention_mask,
    )


def token_selection_from_cache(
    model: Any,
    cache: Any,
    *,
    layers: int | Sequence[int] | None = None,
    tokens: Tokens | None = None,
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> SelectionResult:
    """Deprecated: ``token_selection(model, tokens, cache=cache, ...)`` gives the same result."""
    warn_deprecated("token_selection_from_cache(model, cache)", "token_selection(model, tokens, cache=cache)")
    return token_selection(model, tokens, layers=layers, cache=cache, dtype=dtype, **kwargs)
