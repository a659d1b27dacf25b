"""The convexity of a head's output norm in its sink mass (``docs/definitions.md`` §4.5; paper A §3.3).

``docs/definitions.md`` §4.5: ``o(s) = s vt[0] + (1-s) m[i]`` for sink rate ``s``; ``‖o(s)‖²`` is a convex quadratic with
minimiser ``s* = (‖m‖² − <vt0,m>) / (‖vt0‖² − 2<vt0,m> + ‖m‖²)``, interior when the sink opposes ``m``. [...]
The same curve measured by an intervention on ``hook_pattern`` (sink mass set to ``s``, the rest rescaled
to ``1-s``) must match the closed form.

With a sink set ``S`` the sink vector is ``vt_S[i] = sum_{s in S} alpha[h,i,s] vt[s,h] / sum_{s in S}
alpha[h,i,s]`` (``vt[0,h]`` for the default sink) and ``m[i,h]`` the non-sink mean (see
:mod:`mechgeom.analyses.sinks.statistics`). The closed form needs three numbers per query, ``‖vt_S‖²``,
``<vt_S, m>`` and ``‖m‖²`` (:func:`convexity_terms`, in ``d_head`` with the Gram matrices
:func:`mechgeom.maths.wo_gram`); :func:`convexity_by_intervention` measures the curve with
:func:`mechgeom.hooks.sink_mass_hooks`, and :func:`convexity_check` sets the two side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import einops
import numpy as np
import pandas as pd
import torch

from mechgeom._deprecation import keyword_only
from mechgeom._progress import progress
from mechgeom.analyses.base import Collector, Result, collect
from mechgeom.analyses.contribution import LayerGeometry
from mechgeom.hooks import (
    LayerActivations,
    LayerCollector,
    Queries,
    TokensOrText,
    align_texts,
    check_index,
    check_indices,
    check_sinks_in_texts,
    head_outputs,
    query_mask,
    resolve_layers,
    resolve_sinks,
    run_hooks,
    select_queries,
    sink_mask,
    sink_mass_hooks,
    text_spans,
    texts_first,
    to_batch,
)
from mechgeom.maths import wo_gram
from mechgeom.typing import Bool, Float, Tensor, Tokens

__all__ = [
    "ConvexityCheck",
    "ConvexityCurves",
    "ConvexityTerms",
    "convex_minimiser",
    "convex_norm",
    "convexity_by_intervention",
    "convexity_check",
    "convexity_terms",
    "query_terms",
    "sink_mean_cos",
    "sink_mean_split",
]


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
    alpha = geo.pattern.to(geo.v.dtype)  # a half-precision pattern, upcast as the values are (§1.8)
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
    geo: LayerGeometry, sinks: Sequence[int], *, gram: Float[Tensor, "head d_head d_head2"] | None = None
) -> tuple[
    Float[Tensor, "batch head q"], Float[Tensor, "batch head q"], Float[Tensor, "batch head q"], Tensor
]:
    """``(‖vt_S‖², <vt_S, m>, ‖m‖², sink_mass)`` per query (float64), the coefficients of the convexity
    curve, computed in ``d_head`` with the Gram matrix ``W_O[h] W_O[h]ᵀ`` of the float64 ``W_O``
    (``gram``; default :func:`mechgeom.maths.wo_gram` of ``geo.W_O.double()``; see :func:`sink_mean_split`)."""
    zs, zm, sink_mass, _ = sink_mean_split(geo, sinks)
    if gram is None:
        gram = wo_gram(geo.W_O, dtype=torch.float64)  # [h d e], float64
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


def query_terms(
    geo: LayerGeometry, sinks: Sequence[int], *, gram: Float[Tensor, "head d_head d_head2"] | None = None
) -> dict[str, Tensor]:
    """The per-query tensors of :class:`ConvexityTerms` for one layer, ``[batch, head, q]``: ``sink_mass``,
    ``sq_sink``, ``cross``, ``sq_mean`` (:func:`convexity_terms`, float64, NaN outside ``Q``) and
    ``modified`` (the heads whose ``z`` an earlier hook changed; all False without one). ``geo`` may be a
    :class:`~mechgeom.analyses.sinks.geometry.QueryRows` (some query rows only, at positions ``geo.rows``):
    the terms are then those rows' (``q = len(rows)``)."""
    sq_sink, cross, sq_mean, sink_mass = convexity_terms(geo, sinks, gram=gram)  # type: ignore[arg-type]
    qmask = query_mask(sinks, geo.pattern.shape[-1], geo.pattern.device, causal=geo.causal)
    rows = getattr(geo, "rows", None)
    if rows is not None:
        qmask = qmask[rows.to(qmask.device)]

    def nan_out(x: Tensor) -> Tensor:  # NaN outside Q
        return torch.where(qmask, x, torch.full_like(x, torch.nan))

    return {
        "sink_mass": nan_out(sink_mass),
        "sq_sink": nan_out(sq_sink),
        "cross": nan_out(cross),
        "sq_mean": nan_out(sq_mean),
        "modified": (
            torch.zeros(geo.pattern.shape[:3], dtype=torch.bool) if geo.modified is None else geo.modified
        ),
    }


def convex_norm(
    sq_sink: Tensor, cross: Tensor, sq_mean: Tensor, s: float | Sequence[float] | Tensor
) -> Tensor:
    """Convexity curve: ``o(s) = s vt[0] + (1-s) m[i]``, so
    ``‖o(s)‖ = sqrt(s² ‖vt0‖² + 2 s (1-s) <vt0,m> + (1-s)² ‖m‖²)``.

    ``sq_sink = ‖vt_S‖²``, ``cross = <vt_S, m>``, ``sq_mean = ‖m‖²`` (any shape); ``s`` a scalar or a
    grid, which becomes a new last axis.

    >>> one = torch.tensor(1.0, dtype=torch.float64)
    >>> convex_norm(one, -one, one, [0.0, 0.5, 1.0]).tolist()  # vt0 = -m: o(1/2) = 0
    [1.0, 0.0, 1.0]
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

    >>> t = torch.tensor
    >>> convex_minimiser(t(1.0), t(-1.0), t(1.0)).item(), convex_minimiser(t(1.0), t(1.0), t(1.0)).item()
    (0.5, nan)
    """
    den = sq_sink - 2 * cross + sq_mean
    return torch.where(den > 0, (sq_mean - cross) / torch.where(den > 0, den, 1), torch.nan)


@keyword_only("s_values")
def convexity_by_intervention(
    model: Any,
    tokens_or_text: TokensOrText,
    *,
    s_values: Sequence[float],
    layer: int,
    heads: int | Sequence[int] | None = None,
    sink_positions: int | Sequence[int] | None = None,
    attention_mask: Tensor | None = None,
) -> Float[Tensor, "grid batch head q"]:
    """The convexity curve measured by intervention: for each ``s``, one pass with
    :func:`sink_mass_hooks` on ``layer`` and ``‖z'[i,h] @ W_O[h]‖`` read from the same layer's
    ``hook_z`` (float64 norm of the float32 output). Heads outside ``heads`` keep their clean output.
    Compare with :meth:`SinkResult.norm_curve` of the same texts.

    **Padding** (``attention_mask``, or a list of texts padded on the model's padding side, left or right):
    ``sink_positions`` are positions inside each text (``0`` = its first real token) and the intervention
    acts at each text's own padded positions; a pad is never a sink, a source or a query. The query axis is
    laid out as the sink statistics lay it out: positions inside each text (each text first, NaN after its
    length), so a padded text's curve equals the text run alone.

    Args:
        model: a decoder.
        tokens_or_text: text, texts or token ids (:func:`mechgeom.hooks.to_batch`).
        s_values: the sink masses, each in ``[0, 1]``.
        layer: the layer intervened on and read.
        heads: the heads intervened on (default: all).
        sink_positions: the sink set ``S`` (default ``[0]``), inside every text.
        attention_mask: ``[batch, pos]``, 1 at real tokens (default: the padding of a list of texts).

    Returns:
        ``[grid, batch, head, q]`` norms (float64, CPU), NaN outside ``Q`` and beyond each text.

    Raises:
        SinkPositionError: a sink position beyond the shortest text.
    """
    tokens, mask = to_batch(
        model, tokens_or_text, attention_mask=attention_mask, what="convexity_by_intervention"
    )
    layer = resolve_layers(model, layer)[0]
    sinks = resolve_sinks(sink_positions, tokens.shape[1])
    check_sinks_in_texts(sinks, text_spans(mask, *tokens.shape)[1].tolist())
    out = []
    for s in s_values:
        col = LayerCollector(model, layer)
        hooks = sink_mass_hooks(model, s, layers=layer, heads=heads, sink_positions=sinks)
        run_hooks(model, tokens, [*hooks, *col.fwd_hooks], stop_at_layer=layer + 1, attention_mask=mask)
        aligned = align_texts(col.captured[layer])  # each text at the start of its row
        o = head_outputs(aligned.acts.z, aligned.acts.W_O).double()  # [b q h m]
        norm = einops.rearrange(o.norm(dim=-1), "b q h -> b h q")
        keep = query_mask(sinks, tokens.shape[1], norm.device) & aligned.real.to(norm.device)  # [b q]
        out.append(torch.where(keep[:, None, :], norm, torch.nan).cpu())
    return torch.stack(out)


class ConvexityTerms:
    """The per-query terms of the convexity curve and what follows from them: ``s*``, ``‖o(s)‖``, the
    interior share, the norm excess and the per-query table. The base of
    :class:`mechgeom.analyses.sinks.SinkResult`, which holds the tensors (``[n, layer, head, q]``, float64,
    NaN outside ``Q``): ``sink_mass`` (the measured sink rate ``s_i``), ``sq_sink = ‖vt_S‖²``,
    ``cross = <vt_S, m>``, ``sq_mean = ‖m‖²``, ``modified`` (or ``None``) and the texts ``tokens`` (or
    ``None``). :class:`ConvexityCurves` holds these tensors alone.
    """

    layers: list[int]
    sink_positions: list[int]
    sink_mass: Float[Tensor, "n layer head q"]
    sq_sink: Float[Tensor, "n layer head q"]
    cross: Float[Tensor, "n layer head q"]
    sq_mean: Float[Tensor, "n layer head q"]
    modified: Bool[Tensor, "n layer head q"] | None
    tokens: Tokens | None

    @property
    def n_heads(self) -> int:
        return int(self.sink_mass.shape[2])

    def layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise IndexError(f"layer {layer} was not analysed; analysed layers are {self.layers}") from None

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
        """``‖o(s)‖`` at the rates ``s``. At ``s = 0`` the output is the non-sink mean alone and at ``s = 1`` the
        sink alone: there the other part's terms are left out, since they are NaN (``vt_S`` has no mass to be
        a mean of at ``s = 0``, e.g. where a sliding window hides the sink, and ``m`` none at ``s = 1``)."""
        sink = torch.where(s == 0, 0.0, s**2 * self.sq_sink + 2 * s * (1 - s) * self.cross)
        mean = torch.where(s == 1, 0.0, (1 - s) ** 2 * self.sq_mean)
        return (sink + mean).clamp_min(0).sqrt()

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

    def query_frame(
        self,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        *,
        queries: Queries = None,
    ) -> pd.DataFrame:
        """One row per (text, layer, head, query in ``Q``): ``sink_mass`` (measured ``s_i``), ``s_star``,
        ``head_out_norm``, ``sq_sink``, ``cross``, ``sq_mean``, ``modified``. Filters are checked: a layer
        that was not analysed or a head out of range raises ``IndexError`` naming the valid ones.

        Only real, kept queries have rows (padding and queries left out by ``queries=`` have none); ``query``
        is the position inside the text. ``queries`` keeps some of them (:func:`mechgeom.hooks.select_queries`:
        positions inside each text, ``-1`` its last token, a slice, a boolean mask)."""
        l_sel = self.layers if layers is None else ([layers] if isinstance(layers, int) else list(layers))
        for layer in l_sel:
            self.layer_index(layer)
        h_sel = check_indices(heads, self.n_heads, "head")
        st, norm = self.s_star(), self.head_out_norm()
        n_texts, q = int(self.sink_mass.shape[0]), int(self.sink_mass.shape[-1])
        lengths = getattr(self, "extras", {}).get("lengths") or [q] * n_texts
        real = torch.arange(q)[None, :] < torch.tensor(lengths)[:, None]
        chosen = select_queries(queries, None if bool(real.all()) else real, n_texts, q)
        positions = np.arange(q)  # those outside Q (NaN) are dropped below
        frames = []
        for layer in l_sel:
            li = self.layer_index(layer)
            for h in h_sel:
                for b in range(self.sink_mass.shape[0]):
                    at = torch.as_tensor(positions, dtype=torch.long)
                    ok = ~torch.isnan(self.sink_mass[b, li, h, at]) & chosen[b, at]
                    at = at[ok]  # real, kept queries only
                    sl = (b, li, h, at)
                    queries_b = at.numpy()
                    frames.append(
                        pd.DataFrame(
                            {
                                "text": b,
                                "layer": layer,
                                "head": h,
                                "query": queries_b,
                                "sink_mass": self.sink_mass[sl].numpy(),
                                "s_star": st[sl].numpy(),
                                "head_out_norm": norm[sl].numpy(),
                                "sq_sink": self.sq_sink[sl].numpy(),
                                "cross": self.cross[sl].numpy(),
                                "sq_mean": self.sq_mean[sl].numpy(),
                                "modified": (
                                    np.zeros(len(queries_b), dtype=bool)
                                    if self.modified is None
                                    else self.modified[sl].numpy()
                                ),
                            }
                        )
                    )
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


@dataclass
class ConvexityCurves(ConvexityTerms, Result):
    """The convexity terms of :class:`ConvexityTerms` for ``layers`` over ``n`` texts, without the rest of
    the sink statistics (what :func:`convexity_check` computes when it is not given them).

    With padding, laid out as :class:`~mechgeom.analyses.sinks.SinkResult`: the query axis and ``tokens`` are
    positions inside each text (each text first, NaN after it) and ``extras["lengths"]`` holds each text's
    real tokens."""

    layers: list[int]
    sink_positions: list[int]
    sink_mass: Float[Tensor, "n layer head q"]
    sq_sink: Float[Tensor, "n layer head q"]
    cross: Float[Tensor, "n layer head q"]
    sq_mean: Float[Tensor, "n layer head q"]
    modified: Bool[Tensor, "n layer head q"] | None = None
    tokens: Tokens | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        """One row per (text, layer, head, query in ``Q``): :meth:`ConvexityTerms.query_frame`."""
        return self.query_frame()

    def summary(self) -> dict[str, Any]:
        """``n_texts``, the ``layers``, and ``interior_share``: the share of (text, head, query) with ``s*`` in
        ``(0, 1)``, pooled over every analysed head."""
        return {
            "n_texts": int(self.sink_mass.shape[0]),
            "layers": list(self.layers),
            "interior_share": float(self.interior_share(pooled=True)),
        }


class _ConvexityCollector(Collector):
    """The tensors of :class:`ConvexityCurves` by reader hooks, batch after batch (as
    :class:`~mechgeom.analyses.sinks.geometry.SinkCollector` computes them beside the other sink statistics).
    A padded batch is read with each text moved to the start of its row (:func:`mechgeom.hooks.align_texts`),
    so the query axis holds positions inside each text, NaN beyond it."""

    def __init__(self, model: Any, layers: list[int], sinks: list[int]) -> None:
        super().__init__(model, layers)
        self.sinks = sinks
        self._per_text: dict[int, list[dict[str, Tensor]]] = {layer: [] for layer in self.layers}
        self._grams: dict[int, Tensor] = {}
        self._starts: list[Tensor] = []  # each batch's first real positions (left padding), first layer
        self._lengths: list[Tensor] = []

    def on_layer(self, acts: LayerActivations) -> None:
        with torch.no_grad():
            aligned = align_texts(acts)
            if acts.layer == self.layers[0]:
                check_sinks_in_texts(self.sinks, aligned.lengths.tolist(), sum(len(t) for t in self._lengths))
                self._starts.append(text_spans(acts.key_mask, *aligned.real.shape)[0])
                self._lengths.append(aligned.lengths)
            geo = LayerGeometry.from_activations(aligned.acts)
            if acts.layer not in self._grams:
                self._grams[acts.layer] = wo_gram(geo.W_O, dtype=torch.float64)
            terms = query_terms(geo, self.sinks, gram=self._grams[acts.layer])
            real = aligned.real[:, None, :]  # [b 1 q]: a pad is no query
            self._per_text[acts.layer].append(
                {
                    k: torch.where(real, v.detach().cpu(), False if v.dtype == torch.bool else torch.nan)
                    for k, v in terms.items()
                }
            )

    def build(self, tokens: Tokens | None) -> ConvexityCurves:
        per_text = self._per_text
        stacked = {
            k: torch.stack([torch.cat([t[k] for t in per_text[layer]]) for layer in self.layers], dim=1)
            for k in per_text[self.layers[0]][0]
        }
        return ConvexityCurves(
            layers=list(self.layers),
            sink_positions=list(self.sinks),
            tokens=texts_first(tokens, self._starts),
            extras={"lengths": torch.cat(self._lengths).tolist()},
            **stacked,
        )


def _curves(
    model: Any,
    tokens: Tokens,
    layers: list[int],
    sinks: list[int],
    batch_size: int = 8,
    attention_mask: Tensor | None = None,
) -> ConvexityCurves:
    """:class:`ConvexityCurves` of ``layers``, in batches of ``batch_size`` texts (``attention_mask``: the
    real tokens, ``None`` for all)."""
    collector = _ConvexityCollector(model, layers, sinks)
    return collect(model, tokens, collector, batch_size=batch_size, attention_mask=attention_mask)  # type: ignore[no-any-return]


# =========================================================================== closed form vs intervention


_COLUMNS = ("layer", "head", "s", "text", "query", "norm_measured", "norm_closed_form")


@dataclass
class ConvexityCheck(Result):
    """The convexity curve of a few heads, measured by intervention beside the closed form.

    ``norms[(layer, head)]`` is the measured ``‖o(s)‖`` of that head, ``[grid, n, q]`` (NaN outside ``Q``);
    the closed form is ``stats.norm_curve(s_values)`` of the same texts. With padding the query axis holds
    positions inside each text (as in the statistics), NaN beyond each text.
    """

    heads: list[tuple[int, int]]
    s_values: list[float]
    norms: dict[tuple[int, int], Float[Tensor, "grid n q"]]
    stats: ConvexityTerms

    @property
    def measured(self) -> dict[tuple[int, int], tuple[Sequence[float], Float[Tensor, "grid q"]]]:
        """``{(layer, head): (s_values, norms of text 0 [grid, q])}``, the overlay of
        :func:`mechgeom.viz.plot_convexity_curves`."""
        return {key: (self.s_values, norm[:, 0]) for key, norm in self.norms.items()}

    def to_frame(self) -> pd.DataFrame:
        """One row per (head, ``s``, text, query) where the measured norm is finite, in that order:
        ``layer, head, s, text, query, norm_measured, norm_closed_form``; ``query`` is the position inside
        the text, and only real queries in ``Q`` have rows (a pad has none)."""
        closed = self.stats.norm_curve(torch.tensor(self.s_values, dtype=torch.float64))  # [n l h q grid]
        s_arr = np.asarray(self.s_values)
        frames = []
        for layer, head in self.heads:
            meas = self.norms[(layer, head)]  # [grid n q]
            ref = einops.rearrange(closed[:, self.stats.layer_index(layer), head], "n q g -> g n q")
            g, b, q = torch.nonzero(torch.isfinite(meas), as_tuple=True)  # row-major: s, text, query
            frames.append(
                pd.DataFrame(
                    {
                        "layer": layer,
                        "head": head,
                        "s": s_arr[g.numpy()],
                        "text": b.numpy(),
                        "query": q.numpy(),
                        "norm_measured": meas[g, b, q].numpy(),
                        "norm_closed_form": ref[g, b, q].numpy(),
                    },
                    columns=list(_COLUMNS),
                )
            )
        return pd.concat(frames, ignore_index=True)

    def max_error_frame(self) -> pd.DataFrame:
        """One row per (head, ``s``): ``layer, head, s, max_abs_err``, the largest ``|measured − closed|``
        over texts and queries (0 where no point is finite)."""
        df = self.to_frame()
        err = (df["norm_measured"] - df["norm_closed_form"]).abs()
        rows = []
        for layer, head in self.heads:
            for s in self.s_values:
                sel = err[(df["layer"] == layer) & (df["head"] == head) & (df["s"] == s)]
                top = sel.max() if len(sel) else 0.0
                rows.append({"layer": layer, "head": head, "s": s, "max_abs_err": float(np.nan_to_num(top))})
        return pd.DataFrame(rows)

    def summary(self) -> dict[str, Any]:
        """``heads``, ``n_points`` (rows of :meth:`to_frame`), ``max_abs_error = max |m − c|`` and
        ``max_rel_error = max |m − c| / max(|c|, 1e-12)`` over every point (``m`` measured, ``c`` closed form)."""
        df = self.to_frame()
        abs_err = (df["norm_measured"] - df["norm_closed_form"]).abs()
        rel_err = abs_err / df["norm_closed_form"].abs().clip(lower=1e-12)
        return {
            "heads": [[int(layer), int(head)] for layer, head in self.heads],
            "n_points": len(df),
            "max_rel_error": float(rel_err.max()),
            "max_abs_error": float(abs_err.max()),
        }


@keyword_only("heads", "s_values")
def convexity_check(
    model: Any,
    tokens_or_text: TokensOrText,
    *,
    heads: Sequence[tuple[int, int]],
    s_values: Sequence[float],
    stats: ConvexityTerms | None = None,
    sink_positions: int | Sequence[int] | None = None,
    verbose: bool = False,
    attention_mask: Tensor | None = None,
) -> ConvexityCheck:
    """Measured ``‖o(s)‖`` (:func:`convexity_by_intervention`, one head at a time) against the closed
    form ``stats.norm_curve(s_values)`` for each ``(layer, head)`` of ``heads``.

    ``stats`` are the sink statistics of the same texts (a :class:`mechgeom.analyses.sinks.SinkResult`
    or any :class:`ConvexityTerms`); without them the :class:`ConvexityCurves` of the layers of ``heads``
    are computed. ``sink_positions`` default to those of ``stats`` and must agree with them.

    **Padding** (``attention_mask``, or a list of texts padded on the model's padding side): as in
    :func:`convexity_by_intervention`, the sink set and the queries are positions inside each text, so each
    text gets what it gets run alone; ``stats`` must be those of the same padded batch.

    Args:
        model: a decoder.
        tokens_or_text: text, texts or token ids (:func:`mechgeom.hooks.to_batch`).
        heads: ``(layer, head)`` pairs.
        s_values: the sink masses, each in ``[0, 1]``.
        stats: the statistics of the same texts (default: computed).
        sink_positions: the sink set ``S`` (default: that of ``stats``, else ``[0]``).
        verbose: a progress bar over heads.
        attention_mask: ``[batch, pos]``, 1 at real tokens (default: the padding of a list of texts).

    Returns:
        A :class:`ConvexityCheck`.

    Raises:
        ValueError: no heads, duplicate heads, ``stats`` of other texts or another sink set.
        IndexError: a layer or head out of range, or not in ``stats``.
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body (checks of the heads and of the given statistics, then one loop) is 48 lines.
    tokens, mask = to_batch(model, tokens_or_text, attention_mask=attention_mask, what="convexity_check")
    pairs = [(int(layer), int(head)) for layer, head in heads]
    if not pairs:
        raise ValueError("heads is empty; give (layer, head) pairs")
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"duplicate (layer, head) pairs in {pairs}")
    layers = sorted({layer for layer, _ in pairs})
    resolve_layers(model, layers)
    for _, head in pairs:
        check_index(head, int(model.cfg.n_heads), "head")
    if stats is None:
        stats = _curves(
            model, tokens, layers, resolve_sinks(sink_positions, tokens.shape[1]), attention_mask=mask
        )
    else:
        for layer in layers:
            stats.layer_index(layer)
        if sink_positions is not None and resolve_sinks(sink_positions) != stats.sink_positions:
            raise ValueError(
                f"sink_positions {sink_positions} differ from the statistics' {stats.sink_positions}"
            )
        n_texts, seq_len = stats.sink_mass.shape[0], stats.sink_mass.shape[-1]
        starts, lengths = text_spans(mask, *tokens.shape)
        first = texts_first(tokens.cpu(), [starts])  # the statistics' tokens: each text first
        their_lengths = getattr(stats, "extras", {}).get("lengths")
        if (
            (n_texts, seq_len) != tuple(tokens.shape)
            or (stats.tokens is not None and first is not None and not torch.equal(stats.tokens, first))
            or (their_lengths is not None and list(their_lengths) != lengths.tolist())
        ):
            raise ValueError(
                "`stats` come from other tokens or another attention_mask: compute them from the same batch "
                "and mask (e.g. sink_statistics(model, tokens, attention_mask=mask)) or leave stats out"
            )
    s_list = [float(s) for s in s_values]
    norms = {}
    for layer, head in progress(pairs, desc="convexity", enabled=verbose):
        meas = convexity_by_intervention(
            model,
            tokens,
            s_values=s_list,
            layer=layer,
            heads=[head],
            sink_positions=stats.sink_positions,
            attention_mask=mask,
        )  # [grid batch head q], positions inside each text
        norms[(layer, head)] = meas[:, :, head]
    return ConvexityCheck(heads=pairs, s_values=s_list, norms=norms, stats=stats)
