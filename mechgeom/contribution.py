"""Contribution weights and their baselines (SPEC.md §A, paper A).

For one layer (batch ``b``, head ``h``, query ``i``, source ``j <= i``), with ``alpha = hook_pattern``,
``v = hook_v`` (GQA-expanded), ``z = hook_z`` and ``W_O`` from the model:

- projected value ``vt[j,h] = v[j,h] @ W_O[h]``; head output ``o[i,h] = z[i,h] @ W_O[h]``;
  layer output ``o[i] = sum_h o[i,h]``, **without** ``b_O``.

Every metric costs one ``q x k`` product in ``d_head`` per head, like attention itself, because
``<o, vt[j,h]> = v[j,h] . (o @ W_O[h].T)``. No ``[batch, head, q, k, d_model]`` tensor is ever built.
The inter-head value norm is ``alpha^T G_j alpha`` with the ``[head, head]`` Gram matrix ``G_j`` of
token ``j``'s projected values.

**Zero output norm.** Where ``‖o[i,h]‖ = 0`` (or ``‖o[i]‖ = 0`` for inter-head metrics) the normalised
metrics of that row are NaN: never a crash, never a silent 0. Where a projected value is zero its
cosine factor is 0 (then ``alpha * ratio * cos = c = 0`` still holds).

**Basis.** Geometry is measured on the model as loaded (see :mod:`mechgeom.models`); ``b_O`` is
excluded from ``o``, so ``sum_j c[h,i,j] = 1`` and ``sum_j c[i,j] = 1`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import einops
import pandas as pd
import torch

from mechgeom.hooks import (
    FwdHook,
    LayerActivations,
    LayerCollector,
    head_outputs,
    run_hooks,
    to_tokens,
)
from mechgeom.typing import WO, Float, HeadScores, LayerScores, Pattern, Tensor, Tokens, Values, Z

__all__ = [
    "INTER_METRICS",
    "INTRA_METRICS",
    "RANKING_METRICS",
    "ContributionCollector",
    "ContributionResult",
    "LayerGeometry",
    "contribution_weights",
    "contribution_weights_from_cache",
    "reconstruct_attn_out",
]

#: Per-head metrics, ``[batch, layer, head_index, query_pos, key_pos]``.
INTRA_METRICS = (
    "attention",
    "value_weighted",
    "value_weighted_normalized",
    "contribution",
    "head_share",
    "factor_norm_ratio",
    "factor_cos",
)
#: Whole-layer metrics, ``[batch, layer, query_pos, key_pos]``.
INTER_METRICS = ("attention", "value_weighted", "value_weighted_normalized", "contribution")
#: The four metrics compared by paper A, in its claimed order of faithfulness.
RANKING_METRICS = ("attention", "value_weighted", "value_weighted_normalized", "contribution")


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with NaN (not inf, not 0) where ``den == 0``."""
    return torch.where(den == 0, torch.full_like(num, float("nan")), num / torch.where(den == 0, 1, den))


class LayerGeometry:
    """The shared pieces of one layer's metrics, each computed once and only when asked for.

    Shapes: ``pattern [batch head q k]``, ``v [batch pos head d_head]`` (expanded),
    ``z [batch pos head d_head]``, ``W_O [head d_head d_model]``.
    """

    def __init__(self, pattern: Pattern, v: Values, z: Z, W_O: WO) -> None:
        self.pattern = pattern
        self.v = v
        self.z = z
        self.W_O = W_O

    @classmethod
    def from_activations(cls, acts: LayerActivations) -> LayerGeometry:
        return cls(acts.pattern, acts.v, acts.z, acts.W_O)

    # ---- norms and products (all in d_head or d_model, never q x k x d_model)
    @cached_property
    def head_out(self) -> Float[Tensor, "batch pos head_index d_model"]:
        """``o[i,h] = z[i,h] @ W_O[h]``."""
        return head_outputs(self.z, self.W_O)

    @cached_property
    def layer_out(self) -> Float[Tensor, "batch pos d_model"]:
        """``o[i] = sum_h o[i,h]`` (no ``b_O``)."""
        return self.head_out.sum(dim=2)

    @cached_property
    def projected_values(self) -> Float[Tensor, "batch pos head_index d_model"]:
        """``vt[j,h] = v[j,h] @ W_O[h]`` (``d_model`` per token and head, no ``q`` axis)."""
        return head_outputs(self.v, self.W_O)

    @cached_property
    def vt_norm(self) -> Float[Tensor, "batch head_index key_pos"]:
        """``‖vt[j,h]‖``."""
        return einops.rearrange(self.projected_values.norm(dim=-1), "b k h -> b h k")

    @cached_property
    def head_out_norm(self) -> Float[Tensor, "batch head_index query_pos"]:
        """``‖o[i,h]‖``."""
        return einops.rearrange(self.head_out.norm(dim=-1), "b q h -> b h q")

    @cached_property
    def layer_out_norm(self) -> Float[Tensor, "batch query_pos"]:
        """``‖o[i]‖``."""
        return self.layer_out.norm(dim=-1)

    @cached_property
    def dot_head(self) -> HeadScores:
        """``<o[i,h], vt[j,h]> = v[j,h] . (o[i,h] @ W_O[h].T)``, computed in ``d_head``."""
        u = einops.einsum(self.head_out, self.W_O, "b q h m, h d m -> b q h d")
        return einops.einsum(u, self.v, "b q h d, b k h d -> b h q k")

    @cached_property
    def dot_layer(self) -> HeadScores:
        """``<o[i], vt[j,h]> = v[j,h] . (o[i] @ W_O[h].T)``, computed in ``d_head``."""
        u = einops.einsum(self.layer_out, self.W_O, "b q m, h d m -> b q h d")
        return einops.einsum(u, self.v, "b q h d, b k h d -> b h q k")

    @cached_property
    def gram(self) -> Float[Tensor, "batch key_pos head_index head_index2"]:
        """``G_j[h,g] = <vt[j,h], vt[j,g]>``, the per-token ``[head, head]`` Gram matrix."""
        vt = self.projected_values
        return einops.einsum(vt, vt, "b k h m, b k g m -> b k h g")

    # ---- the metrics of SPEC.md §A, one function each
    def attention(self) -> HeadScores:
        """Raw attention, intra-head: ``alpha[h,i,j]``."""
        return self.pattern

    def attention_inter(self) -> LayerScores:
        """Raw attention, inter-head: ``mean_h alpha[h,i,j]``."""
        return self.pattern.mean(dim=1)

    def value_weighted(self) -> HeadScores:
        """Value-weighted attention (Kobayashi 2020), intra-head: ``alpha[h,i,j] * ‖vt[j,h]‖``."""
        return self.pattern * self.vt_norm[:, :, None, :]

    def value_weighted_inter(self) -> LayerScores:
        """Value-weighted, inter-head: ``‖sum_h alpha[h,i,j] vt[j,h]‖ = sqrt(alpha^T G_j alpha)``."""
        sq = einops.einsum(self.pattern, self.gram, self.pattern, "b h q k, b k h g, b g q k -> b q k")
        return sq.clamp_min(0).sqrt()

    def value_weighted_normalized(self) -> HeadScores:
        """Value-weighted, output-normalised, intra-head: ``alpha[h,i,j] * ‖vt[j,h]‖ / ‖o[i,h]‖``."""
        return _safe_div(self.value_weighted(), self.head_out_norm[..., None])

    def value_weighted_normalized_inter(self) -> LayerScores:
        """Value-weighted, output-normalised, inter-head: ``‖sum_h alpha[h,i,j] vt[j,h]‖ / ‖o[i]‖``."""
        return _safe_div(self.value_weighted_inter(), self.layer_out_norm[..., None])

    def contribution(self) -> HeadScores:
        """Contribution weight, intra-head: ``c[h,i,j] = <o[i,h], alpha[h,i,j] vt[j,h]> / ‖o[i,h]‖²``.

        Sums to 1 over ``j``; can be negative. NaN where ``‖o[i,h]‖ = 0``.
        """
        return _safe_div(self.pattern * self.dot_head, (self.head_out_norm**2)[..., None])

    def head_share(self) -> HeadScores:
        """Per-head share of the inter-head weight: ``c[h→i,j] = <o[i], alpha[h,i,j] vt[j,h]> / ‖o[i]‖²``.

        Sums to 1 over ``(h, j)``. NaN where ``‖o[i]‖ = 0``.
        """
        return _safe_div(self.pattern * self.dot_layer, (self.layer_out_norm**2)[:, None, :, None])

    def contribution_inter(self) -> LayerScores:
        """Contribution weight, inter-head: ``c[i,j] = <o[i], sum_h alpha[h,i,j] vt[j,h]> / ‖o[i]‖² = sum_h c[h→i,j]``."""
        return self.head_share().sum(dim=1)

    def factor_norm_ratio(self) -> HeadScores:
        """Relative magnitude factor ``‖vt[j,h]‖ / ‖o[i,h]‖`` (NaN where ``‖o[i,h]‖ = 0``)."""
        return _safe_div(
            self.vt_norm[:, :, None, :].expand_as(self.pattern), self.head_out_norm[..., None].expand_as(self.pattern)
        )

    def factor_cos(self) -> HeadScores:
        """Directional alignment factor ``cos(o[i,h], vt[j,h])``.

        NaN where ``‖o[i,h]‖ = 0``; 0 where ``‖vt[j,h]‖ = 0``. With the other two factors,
        ``c[h,i,j] = alpha * (‖vt‖/‖o‖) * cos``.
        """
        den = self.head_out_norm[..., None] * self.vt_norm[:, :, None, :]
        cos = _safe_div(self.dot_head, den)
        zero_v = (self.vt_norm == 0)[:, :, None, :].expand_as(cos)
        return torch.where(zero_v & (self.head_out_norm[..., None] > 0), torch.zeros_like(cos), cos)

    def intra(self, name: str) -> HeadScores:
        return getattr(self, name)()

    def inter(self, name: str) -> LayerScores:
        return getattr(self, "contribution_inter" if name == "contribution" else f"{name}_inter")()


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
class ContributionResult:
    """Contribution weights and baselines for a batch of texts.

    ``intra[name]`` is ``[batch, layer, head_index, query_pos, key_pos]``; ``inter[name]`` is
    ``[batch, layer, query_pos, key_pos]``; ``layers[k]`` is the model layer at index ``k`` of the
    layer axis. Entries above the diagonal (``key > query``) are 0.
    """

    layers: list[int]
    tokens: Tokens
    intra: dict[str, Float[Tensor, "batch layer head_index query_pos key_pos"]]
    inter: dict[str, Float[Tensor, "batch layer query_pos key_pos"]]
    str_tokens: list[list[str]] | None = None
    basis: str = "as loaded, b_O excluded"
    model_name: str = ""
    extras: dict[str, Any] = field(default_factory=dict)

    def layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise IndexError(f"layer {layer} was not analysed; analysed layers are {self.layers}") from None

    def to_frame(
        self,
        *,
        batch: int | None = 0,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        query: int | None = None,
    ) -> pd.DataFrame:
        """A tidy table: one row per (batch, layer, head, query, key) with ``key <= query``.

        Columns: ``batch, layer, head, query, key, query_token, key_token``, every intra-head metric
        and factor kept (``factor_attention`` is ``attention``), then the inter-head metrics of the
        same ``(layer, query, key)`` prefixed ``layer_``. Filters keep the table small.
        """
        b_sel = range(self.tokens.shape[0]) if batch is None else [batch]
        l_sel = self.layers if layers is None else list(layers)
        n_heads = next(iter(self.intra.values())).shape[2] if self.intra else 0
        h_sel = list(range(n_heads)) if heads is None else list(heads)
        pos = self.tokens.shape[1]
        q_sel = list(range(pos)) if query is None else [query]
        qq, kk = torch.tril_indices(pos, pos)
        keep = torch.isin(qq, torch.tensor(q_sel))
        qq, kk = qq[keep], kk[keep]
        frames = []
        for b in b_sel:
            for layer in l_sel:
                li = self.layer_index(layer)
                inter_cols = {f"layer_{k}": v[b, li, qq, kk].numpy() for k, v in self.inter.items()}
                for h in h_sel:
                    cols: dict[str, Any] = {
                        "batch": b,
                        "layer": layer,
                        "head": h,
                        "query": qq.numpy(),
                        "key": kk.numpy(),
                    }
                    if self.str_tokens is not None:
                        st = self.str_tokens[b]
                        cols["query_token"] = [st[i] for i in qq.tolist()]
                        cols["key_token"] = [st[j] for j in kk.tolist()]
                    for k, v in self.intra.items():
                        cols[k] = v[b, li, h, qq, kk].numpy()
                    if "attention" in self.intra:
                        cols["factor_attention"] = cols["attention"]
                    cols.update(inter_cols)
                    frames.append(pd.DataFrame(cols))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


class ContributionCollector:
    """A hook collector that computes the metric family layer by layer during a forward pass.

    Use ``collector.fwd_hooks`` with ``model.run_with_hooks``, ``model.hooks(...)`` or next to
    ``run_with_cache``; after the pass, :meth:`result` returns a :class:`ContributionResult`. With
    ``on_layer`` given, each layer's metrics go to that callback instead and nothing is stored
    (``{"intra": {...}, "inter": {...}}`` per layer), so memory stays at one layer's worth.

    >>> import torch
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=1, d_model=8, n_ctx=8, d_head=4, n_heads=2,
    ...                               attn_only=True, d_vocab=10, seed=0)
    >>> model = HookedTransformer(cfg)
    >>> col = ContributionCollector(model, intra=["contribution"], inter=["contribution"])
    >>> _ = model.run_with_hooks(torch.tensor([[1, 2, 3]]), fwd_hooks=col.fwd_hooks)
    >>> res = col.result(torch.tensor([[1, 2, 3]]))
    >>> res.intra["contribution"].sum(-1).allclose(torch.ones(1, 1, 2, 3))
    True
    """

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        intra: Sequence[str] | None = None,
        inter: Sequence[str] | None = None,
        on_layer: Callable[[int, dict[str, dict[str, Tensor]]], None] | None = None,
        store_device: str | torch.device = "cpu",
    ) -> None:
        self.model = model
        self.intra_metrics = _check_metrics(intra, INTRA_METRICS, "intra-head")
        self.inter_metrics = _check_metrics(inter, INTER_METRICS, "inter-head")
        self.collector = LayerCollector(model, layers, self._on_layer)
        self.layers = self.collector.layers
        self.user_on_layer = on_layer
        self.store_device = store_device
        self._intra: dict[int, dict[str, Tensor]] = {}
        self._inter: dict[int, dict[str, Tensor]] = {}

    @property
    def fwd_hooks(self) -> list[FwdHook]:
        return self.collector.fwd_hooks

    def _on_layer(self, acts: LayerActivations) -> None:
        geo = LayerGeometry.from_activations(acts)
        with torch.no_grad():
            intra = {m: geo.intra(m).to(self.store_device) for m in self.intra_metrics}
            inter = {m: geo.inter(m).to(self.store_device) for m in self.inter_metrics}
        if self.user_on_layer is not None:
            self.user_on_layer(acts.layer, {"intra": intra, "inter": inter})
        else:
            self._intra[acts.layer] = intra
            self._inter[acts.layer] = inter

    def feed_cache(self, cache: Any) -> None:
        self.collector.feed_cache(cache)

    def result(self, tokens: Tokens, str_tokens: list[list[str]] | None = None) -> ContributionResult:
        missing = [layer for layer in self.layers if layer not in self._intra]
        if missing:
            raise RuntimeError(
                f"no activations were collected for layer(s) {missing}; run the model with "
                "collector.fwd_hooks first (or feed_cache)"
            )
        intra = {m: torch.stack([self._intra[la][m] for la in self.layers], dim=1) for m in self.intra_metrics}
        inter = {m: torch.stack([self._inter[la][m] for la in self.layers], dim=1) for m in self.inter_metrics}
        return ContributionResult(
            layers=list(self.layers),
            tokens=tokens.detach().cpu(),
            intra=intra,
            inter=inter,
            str_tokens=str_tokens,
            model_name=str(getattr(self.model.cfg, "model_name", "")),
        )


def _str_tokens(model: Any, tokens: Tokens) -> list[list[str]] | None:
    if getattr(model, "tokenizer", None) is None:
        return None
    return [list(model.to_str_tokens(row)) for row in tokens]


def contribution_weights(
    model: Any,
    tokens_or_text: str | Sequence[str] | Tensor,
    *,
    layers: int | Sequence[int] | None = None,
    intra: Sequence[str] | None = None,
    inter: Sequence[str] | None = None,
    extra_hooks: Sequence[FwdHook] = (),
) -> ContributionResult:
    """Contribution weights and baselines of every head of ``layers`` (default: all) in one pass.

    ``intra``/``inter`` choose the metrics kept (default: all of :data:`INTRA_METRICS` and
    :data:`INTER_METRICS`); each costs ``batch * layers * heads * q * k`` floats. ``extra_hooks`` run in
    the same pass (e.g. a patching hook), before mechgeom's readers on the same hook point.
    """
    tokens = to_tokens(model, tokens_or_text)
    col = ContributionCollector(model, layers, intra=intra, inter=inter)
    run_hooks(model, tokens, [*extra_hooks, *col.fwd_hooks], stop_at_layer=max(col.layers) + 1)
    return col.result(tokens, _str_tokens(model, tokens))


def contribution_weights_from_cache(
    model: Any,
    cache: Any,
    *,
    layers: int | Sequence[int] | None = None,
    intra: Sequence[str] | None = None,
    inter: Sequence[str] | None = None,
    tokens: Tokens | None = None,
) -> ContributionResult:
    """The same result from an ``ActivationCache`` the user already has (needs ``hook_pattern``,
    ``hook_v`` and ``hook_z`` of ``layers``)."""
    col = ContributionCollector(model, layers, intra=intra, inter=inter)
    col.feed_cache(cache)
    if tokens is None:
        first = cache[f"blocks.{col.layers[0]}.attn.hook_pattern"]
        tokens = torch.zeros(first.shape[0], first.shape[-1], dtype=torch.long)
        str_toks = None
    else:
        str_toks = _str_tokens(model, tokens)
    return col.result(tokens, str_toks)


def reconstruct_attn_out(model: Any, acts: LayerActivations) -> Float[Tensor, "batch pos d_model"]:
    """``sum_h sum_j alpha[h,i,j] vt[j,h] + b_O``: what ``hook_attn_out`` should read."""
    geo = LayerGeometry.from_activations(acts)
    mixed = einops.einsum(geo.pattern, geo.v, "b h q k, b k h d -> b q h d")
    return head_outputs(mixed, geo.W_O).sum(dim=2) + acts.b_O

