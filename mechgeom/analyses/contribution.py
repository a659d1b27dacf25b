"""Contribution weights and their baselines (SPEC.md §A, paper A).

For one layer (batch ``b``, head ``h``, query ``i``, source ``j <= i``), with ``alpha = hook_pattern``,
``v = hook_v`` (GQA-expanded), ``z = hook_z`` and ``W_O`` from the model:

- projected value ``vt[j,h] = v[j,h] @ W_O[h]``; head output ``o[i,h] = z[i,h] @ W_O[h]``;
  layer output ``o[i] = sum_h o[i,h]``, **without** ``b_O``.

Every metric costs one ``q x k`` product in ``d_head`` per head, like attention itself, because
``<o, vt[j,h]> = v[j,h] . (o @ W_O[h].T)``. No ``[batch, head, q, k, d_model]`` tensor is ever built.
The inter-head value norm is ``alpha^T G_j alpha`` with the ``[head, head]`` Gram matrix ``G_j`` of
token ``j``'s projected values. Norms of head outputs and projected values are quadratic forms in
``d_head`` with ``M[h] = W_O[h] W_O[h].T``.

**Causal layout.** Metrics are ``[.., query_pos, key_pos]`` with every entry above the diagonal
(``key > query``, not a source) exactly 0, factors included. They are computed in blocks of queries
(``block_size``), each against only the keys it can see, so about half of the ``q x k`` work of a full
square is skipped. The pattern is assumed causal, as a decoder's is (mechgeom's interventions keep it so).

**Zero output norm.** Where ``‖o[i,h]‖ = 0`` (or ``‖o[i]‖ = 0`` for inter-head metrics and head shares)
the normalised metrics of that row are NaN at every source ``j <= i``: never a crash, never a silent 0.
Where a projected value is zero its cosine factor is 0 (then ``alpha * ratio * cos = c = 0`` still holds).

**Basis.** Geometry is measured on the model as loaded (see :mod:`mechgeom.models`); ``b_O`` is
excluded from ``o``, so ``sum_j c[h,i,j] = 1`` and ``sum_j c[i,j] = 1`` exactly.

**After an intervention** (SPEC.md §A). The metrics describe the output the model actually produced,
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

from collections import OrderedDict
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
    check_indices,
    head_outputs,
    modified_pairs,
    run_hooks,
    to_tokens,
)
from mechgeom.typing import WO, Bool, Float, HeadScores, LayerScores, Pattern, Tensor, Tokens, Values, Z

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

#: Queries per block of the blocked computation (see "Causal layout" above).
BLOCK_SIZE = 128


def _inv_or_nan(den: Tensor) -> Tensor:
    """``1 / den``, NaN where ``den == 0`` (so that a product with it is NaN there, also for a 0 numerator)."""
    return torch.where(den == 0, torch.full_like(den, float("nan")), 1 / torch.where(den == 0, 1, den))


def _inv_or_zero(den: Tensor) -> Tensor:
    """``1 / den``, 0 where ``den == 0``."""
    return torch.where(den == 0, torch.zeros_like(den), 1 / torch.where(den == 0, 1, den))


class LayerGeometry:
    """The shared pieces of one layer's metrics, each computed once and only when asked for.

    Shapes: ``pattern [batch head q k]``, ``v [batch pos head d_head]`` (expanded),
    ``z [batch pos head d_head]``, ``W_O [head d_head d_model]``. :meth:`compute` returns several metrics
    in one blocked sweep (what :class:`ContributionCollector` uses); the per-metric methods return the same
    numbers one at a time and keep them.
    """

    def __init__(
        self,
        pattern: Pattern,
        v: Values,
        z: Z,
        W_O: WO,
        *,
        block_size: int = BLOCK_SIZE,
        modified: Bool[Tensor, "batch head_index query_pos"] | None = None,
    ) -> None:
        if pattern.shape[-1] != pattern.shape[-2]:
            raise ValueError(
                f"the pattern must be square [.., q, k] (no KV cache); got {tuple(pattern.shape)}"
            )
        self.pattern = pattern
        self.v = v
        self.z = z
        self.W_O = W_O
        self.block_size = max(1, int(block_size))
        #: ``[b h q]`` heads whose ``z`` an earlier hook changed (see the module docstring); ``None`` = none.
        self.modified = modified if modified is not None and bool(modified.any()) else None
        self._metrics: dict[str, Tensor] = {}

    @classmethod
    def from_activations(cls, acts: LayerActivations, *, block_size: int = BLOCK_SIZE) -> LayerGeometry:
        return cls(acts.pattern, acts.v, acts.z, acts.W_O, block_size=block_size, modified=acts.modified)

    # ---- outputs and values in d_model (the metrics only need projected_values, for the Gram matrix)
    @cached_property
    def head_out(self) -> Float[Tensor, "batch pos head_index d_model"]:
        """``o[i,h] = z[i,h] @ W_O[h]``."""
        return head_outputs(self.z, self.W_O)

    @cached_property
    def layer_out(self) -> Float[Tensor, "batch pos d_model"]:
        """``o[i] = sum_h o[i,h]`` (no ``b_O``)."""
        return einops.einsum(self.z, self.W_O, "b q h d, h d m -> b q m")

    @cached_property
    def projected_values(self) -> Float[Tensor, "batch pos head_index d_model"]:
        """``vt[j,h] = v[j,h] @ W_O[h]`` (``d_model`` per token and head, no ``q`` axis)."""
        return head_outputs(self.v, self.W_O)

    # ---- norms and products in d_head (never q x k x d_model)
    @cached_property
    def wo_gram_full(self) -> Float[Tensor, "head_index d_head head_index2 d_head2"]:
        """``M[h,:,g,:] = W_O[h] @ W_O[g].T`` (a weight-only quantity, cached per ``W_O``, see :func:`_wo_gram_full`)."""
        return _wo_gram_full(self.W_O)

    @cached_property
    def wo_gram(self) -> Float[Tensor, "head_index d_head d_head2"]:
        """``M[h] = W_O[h] @ W_O[h].T``, so that ``<x @ W_O[h], y @ W_O[h]> = x M[h] y``."""
        return einops.rearrange(torch.diagonal(self.wo_gram_full, dim1=0, dim2=2), "d e h -> h d e")

    @cached_property
    def head_u(self) -> Float[Tensor, "batch pos head_index d_head"]:
        """``o[i,h] @ W_O[h].T = z[i,h] M[h]``."""
        return einops.einsum(self.z, self.wo_gram, "b q h d, h d e -> b q h e")

    @cached_property
    def layer_u(self) -> Float[Tensor, "batch pos head_index d_head"]:
        """``o[i] @ W_O[h].T = sum_g z[i,g] M[g,:,h,:]`` for every head ``h``."""
        h = self.z.shape[2]
        z = einops.rearrange(self.z, "b q h d -> b q (h d)")
        m = einops.rearrange(self.wo_gram_full, "h d g e -> (h d) (g e)")
        return einops.rearrange(z @ m, "b q (g e) -> b q g e", g=h)

    @cached_property
    def vt_norm(self) -> Float[Tensor, "batch head_index key_pos"]:
        """``‖vt[j,h]‖ = sqrt(v[j,h] M[h] v[j,h])``."""
        vm = einops.einsum(self.v, self.wo_gram, "b k h d, h d e -> b k h e")
        sq = einops.einsum(vm, self.v, "b k h d, b k h d -> b h k")
        return sq.clamp_min(0).sqrt()

    @cached_property
    def head_out_norm(self) -> Float[Tensor, "batch head_index query_pos"]:
        """``‖o[i,h]‖ = sqrt(z[i,h] M[h] z[i,h])``."""
        sq = einops.einsum(self.z, self.head_u, "b q h d, b q h d -> b h q")
        return sq.clamp_min(0).sqrt()

    @cached_property
    def layer_out_norm(self) -> Float[Tensor, "batch query_pos"]:
        """``‖o[i]‖ = sqrt(sum_h z[i,h] . (o[i] @ W_O[h].T))``."""
        sq = einops.einsum(self.z, self.layer_u, "b q h d, b q h d -> b q")
        return sq.clamp_min(0).sqrt()

    @cached_property
    def dot_head(self) -> HeadScores:
        """``<o[i,h], vt[j,h]> = v[j,h] . (o[i,h] @ W_O[h].T)``, computed in ``d_head`` (full square)."""
        return einops.einsum(self.head_u, self.v, "b q h d, b k h d -> b h q k")

    @cached_property
    def dot_layer(self) -> HeadScores:
        """``<o[i], vt[j,h]> = v[j,h] . (o[i] @ W_O[h].T)``, computed in ``d_head`` (full square)."""
        return einops.einsum(self.layer_u, self.v, "b q h d, b k h d -> b h q k")

    @cached_property
    def output_share(self) -> Float[Tensor, "batch head_index query_pos"]:
        """``<o[i], o[i,h]> / ‖o[i]‖² = z[i,h] . (o[i] @ W_O[h].T) / ‖o[i]‖²``: head ``h``'s part of ``o[i]``."""
        dots = einops.einsum(self.z, self.layer_u, "b q h d, b q h d -> b h q")
        return dots * (_inv_or_nan(self.layer_out_norm) ** 2)[:, None, :]

    @cached_property
    def modified_share(self) -> Float[Tensor, "batch head_index query_pos"]:
        """The share ``<o[i], o[i,h]> / ‖o[i]‖²`` of each *modified* head (0 for unmodified heads)."""
        if self.modified is None:
            return torch.zeros_like(self.pattern[..., 0])
        return torch.where(self.modified, self.output_share, torch.zeros_like(self.pattern[..., 0]))

    @cached_property
    def gram(self) -> Float[Tensor, "batch key_pos head_index head_index2"]:
        """``G_j[h,g] = <vt[j,h], vt[j,g]>``, the per-token ``[head, head]`` Gram matrix."""
        vt = self.projected_values
        return einops.einsum(vt, vt, "b k h m, b k g m -> b k h g")

    # ---- the metrics of SPEC.md §A, one function each (the formula is in the block kernels below)
    def attention(self) -> HeadScores:
        """Raw attention, intra-head: ``alpha[h,i,j]``."""
        return self.pattern

    def attention_inter(self) -> LayerScores:
        """Raw attention, inter-head: ``mean_h alpha[h,i,j]``."""
        return self._get("attention_inter")

    def value_weighted(self) -> HeadScores:
        """Value-weighted attention (Kobayashi 2020), intra-head: ``alpha[h,i,j] * ‖vt[j,h]‖``."""
        return self._get("value_weighted")

    def value_weighted_inter(self) -> LayerScores:
        """Value-weighted, inter-head: ``‖sum_h alpha[h,i,j] vt[j,h]‖ = sqrt(alpha^T G_j alpha)``."""
        return self._get("value_weighted_inter")

    def value_weighted_normalized(self) -> HeadScores:
        """Value-weighted, output-normalised, intra-head: ``alpha[h,i,j] * ‖vt[j,h]‖ / ‖o[i,h]‖``."""
        return self._get("value_weighted_normalized")

    def value_weighted_normalized_inter(self) -> LayerScores:
        """Value-weighted, output-normalised, inter-head: ``‖sum_h alpha[h,i,j] vt[j,h]‖ / ‖o[i]‖``."""
        return self._get("value_weighted_normalized_inter")

    def contribution(self) -> HeadScores:
        """Contribution weight, intra-head: ``c[h,i,j] = <o[i,h], alpha[h,i,j] vt[j,h]> / ‖o[i,h]‖²``.

        Sums to 1 over ``j``; can be negative. NaN where ``‖o[i,h]‖ = 0``.
        """
        return self._get("contribution")

    def head_share(self) -> HeadScores:
        """Per-head share of the inter-head weight: ``c[h→i,j] = <o[i], alpha[h,i,j] vt[j,h]> / ‖o[i]‖²``.

        Sums to 1 over ``(h, j)``. NaN where ``‖o[i]‖ = 0``.
        """
        return self._get("head_share")

    def contribution_inter(self) -> LayerScores:
        """Contribution weight, inter-head: ``c[i,j] = <o[i], sum_h alpha[h,i,j] vt[j,h]> / ‖o[i]‖² = sum_h c[h→i,j]``."""
        return self._get("contribution_inter")

    def factor_norm_ratio(self) -> HeadScores:
        """Relative magnitude factor ``‖vt[j,h]‖ / ‖o[i,h]‖`` (NaN where ``‖o[i,h]‖ = 0``)."""
        return self._get("factor_norm_ratio")

    def factor_cos(self) -> HeadScores:
        """Directional alignment factor ``cos(o[i,h], vt[j,h])``.

        NaN where ``‖o[i,h]‖ = 0``; 0 where ``‖vt[j,h]‖ = 0``. With the other two factors,
        ``c[h,i,j] = alpha * (‖vt‖/‖o‖) * cos``.
        """
        return self._get("factor_cos")

    def intra(self, name: str) -> HeadScores:
        return getattr(self, name)()

    def inter(self, name: str) -> LayerScores:
        return getattr(self, _inter_key(name))()

    # ---- the blocked sweep
    def _get(self, key: str) -> Tensor:
        if key not in self._metrics:
            self._sweep([key])
        return self._metrics[key]

    def compute(
        self,
        intra: Sequence[str] = INTRA_METRICS,
        inter: Sequence[str] = INTER_METRICS,
        *,
        out_intra: dict[str, Tensor] | None = None,
        out_inter: dict[str, Tensor] | None = None,
    ) -> tuple[dict[str, HeadScores], dict[str, LayerScores]]:
        """Several metrics in one blocked sweep: ``({intra name: [b h q k]}, {inter name: [b q k]})``.

        ``out_intra`` / ``out_inter`` optionally give tensors (or views) of the right shape to write the
        metrics into, e.g. to reuse memory across layers; the returned tensors are then those.
        """
        keys = [m for m in intra if m != "attention"]
        keys += [_inter_key(m) for m in inter]
        buffers = dict(out_intra or {})
        buffers.update({_inter_key(m): t for m, t in (out_inter or {}).items()})
        self._sweep([k for k in keys if k not in self._metrics], buffers)
        return {m: self.intra(m) for m in intra}, {m: self.inter(m) for m in inter}

    def _sweep(self, keys: Sequence[str], buffers: dict[str, Tensor] | None = None) -> None:
        """Compute ``keys`` into ``self._metrics``, one block of queries ``q0:q1`` at a time against keys ``0:q1``.

        Shared products are arranged so that each output costs one pass per block: with
        ``u[i,h] = o[i,h] @ W_O[h].T`` scaled by ``1/‖o[i,h]‖`` and ``v[j,h]`` by ``1/‖vt[j,h]‖``, one matmul
        gives ``cos``; then ``c = (alpha ‖vt‖/‖o‖) * cos``. With ``o[i] @ W_O[h].T`` scaled by ``1/‖o[i]‖²``,
        one matmul times ``alpha`` gives the head shares, whose sum over heads is ``c[i,j]``.
        """
        if not keys:
            return
        with torch.no_grad():
            self._sweep_blocks(set(keys), buffers or {})

    def _sweep_blocks(self, want: set[str], buffers: dict[str, Tensor]) -> None:
        alpha = self.pattern
        B, H, Q, _ = alpha.shape
        need_cos = bool(want & {"factor_cos", "contribution"})
        need_vwn = bool(want & {"value_weighted_normalized", "contribution"})
        need_vw = need_vwn or "value_weighted" in want
        need_share = bool(want & {"head_share", "contribution_inter"})
        need_vwi = bool(want & {"value_weighted_inter", "value_weighted_normalized_inter"})
        need_oh = need_cos or need_vwn or "factor_norm_ratio" in want

        out = {}
        for k in want:
            shape = (B, Q, Q) if k.endswith("_inter") else (B, H, Q, Q)
            buf = buffers.get(k)
            if buf is not None and (tuple(buf.shape) != shape or buf.dtype != alpha.dtype):
                raise ValueError(
                    f"buffer for {k!r} is {tuple(buf.shape)} {buf.dtype}, need {shape} {alpha.dtype}"
                )
            out[k] = alpha.new_empty(shape) if buf is None else buf
        vt_norm = (
            self.vt_norm[:, :, None, :] if (need_vw or "factor_norm_ratio" in want) else None
        )  # [b h 1 k]
        mod = self.modified  # [b h q] or None
        keep = None if mod is None else (~mod).to(alpha.dtype)[..., None]  # [b h q 1]
        inv_oh = _inv_or_nan(self.head_out_norm)[..., None] if need_oh else None  # [b h q 1]
        if inv_oh is not None and mod is not None:  # no per-source terms for a modified head
            inv_oh = inv_oh.masked_fill(mod[..., None], float("nan"))
        inv_ol = _inv_or_nan(self.layer_out_norm) if need_share or need_vwi else None  # [b q]
        v_t = einops.rearrange(self.v, "b k h d -> b h d k").contiguous()  # sliced per block, never copied
        if need_cos:
            assert inv_oh is not None
            u_cos = einops.rearrange(self.head_u, "b q h d -> b h q d") * inv_oh
            v_cos = v_t * _inv_or_zero(self.vt_norm)[:, :, None, :]
        if need_share:
            assert inv_ol is not None
            u_share = einops.rearrange(self.layer_u, "b q h d -> b h q d") * (inv_ol**2)[:, None, :, None]
            if keep is not None:
                u_share = u_share * keep  # a modified head's shares c[h→i,j] are exactly 0
        if need_vwi:
            gram = einops.rearrange(self.gram, "b k h g -> h g b k").contiguous()
        # alpha-weighted outputs are already 0 above the diagonal, except in NaN rows; factors never are
        factors = [out[k] for k in ("factor_norm_ratio", "factor_cos") if k in out]
        others = [t for k, t in out.items() if k not in ("factor_norm_ratio", "factor_cos")]
        nan_h = inv_oh.isnan()[..., 0].any((0, 1)) if inv_oh is not None else torch.zeros(Q, dtype=torch.bool)
        nan_l = inv_ol.isnan().any(0) if inv_ol is not None else torch.zeros(Q, dtype=torch.bool)
        nan_m = mod.any((0, 1)) if mod is not None else torch.zeros(Q, dtype=torch.bool)
        nan_rows = (nan_h.cpu() | nan_l.cpu() | nan_m.cpu()).tolist()

        for q0 in range(0, Q, self.block_size):
            q1 = min(q0 + self.block_size, Q)
            a = alpha[:, :, q0:q1, :q1]

            def dst(key: str, q0: int = q0, q1: int = q1) -> Tensor | None:
                return out[key][..., q0:q1, :q1] if key in out else None

            if need_vw:
                assert vt_norm is not None
                vw = _value_weighted(a, vt_norm[..., :q1], out=dst("value_weighted"))
                if mod is not None:
                    vw.masked_fill_(mod[:, :, q0:q1, None], float("nan"))
            if need_vwn:
                assert inv_oh is not None
                vwn = _value_weighted_normalized(
                    vw, inv_oh[:, :, q0:q1], out=dst("value_weighted_normalized")
                )
            if "factor_norm_ratio" in want:
                assert vt_norm is not None and inv_oh is not None
                _factor_norm_ratio(vt_norm[..., :q1], inv_oh[:, :, q0:q1], out=dst("factor_norm_ratio"))
            if need_cos:
                cos = _factor_cos(u_cos[:, :, q0:q1], v_cos[..., :q1], out=dst("factor_cos"))
            if "contribution" in want:
                _contribution(vwn, cos, out=dst("contribution"))
            if need_share:
                share = _head_share(a, u_share[:, :, q0:q1], v_t[..., :q1], out=dst("head_share"))
            if "contribution_inter" in want:
                _contribution_inter(share, out=dst("contribution_inter"))
            if "attention_inter" in want:
                _attention_inter(a, out=dst("attention_inter"))
            if need_vwi:
                a_kept = a if keep is None else a * keep[:, :, q0:q1]  # unmodified heads only
                vwi = _value_weighted_inter(a_kept, gram[..., :q1], out=dst("value_weighted_inter"))
            if "value_weighted_normalized_inter" in want:
                assert inv_ol is not None
                _value_weighted_normalized_inter(
                    vwi, inv_ol[:, q0:q1, None], out=dst("value_weighted_normalized_inter")
                )

            # not sources: keys after the block, and the block's own upper triangle (key > query)
            for t in out.values():
                t[..., q0:q1, q1:] = 0
            for t in factors + (others if any(nan_rows[q0:q1]) else []):
                t[..., q0:q1, q0:q1].tril_()
        self._metrics.update(out)


def _inter_key(name: str) -> str:
    return "contribution_inter" if name == "contribution" else f"{name}_inter"


_WO_GRAMS: OrderedDict[tuple[Any, ...], tuple[Tensor, Tensor]] = OrderedDict()


def _wo_gram_full(W_O: WO) -> Float[Tensor, "head_index d_head head_index2 d_head2"]:
    """``W_O[h] @ W_O[g].T`` for all head pairs, kept for the last 64 weight tensors seen.

    A weight-only product: computed once per layer rather than once per forward pass. An entry is used
    only if the stored copy of ``W_O`` still equals the tensor given (``torch.equal``), so freed and
    reused memory or an in-place edit of the weights can never return a stale Gram matrix.
    """
    w_o = W_O.detach()
    key = (w_o.data_ptr(), tuple(w_o.shape), tuple(w_o.stride()), w_o.dtype, str(w_o.device))
    hit = _WO_GRAMS.get(key)
    if hit is not None and torch.equal(hit[0], w_o):
        _WO_GRAMS.move_to_end(key)
        return hit[1]
    w = einops.rearrange(w_o, "h d m -> (h d) m")
    gram = einops.rearrange(w @ w.T, "(h d) (g e) -> h d g e", h=w_o.shape[0], g=w_o.shape[0])
    _WO_GRAMS[key] = (w_o.clone(), gram)
    _WO_GRAMS.move_to_end(key)
    while len(_WO_GRAMS) > 64:
        _WO_GRAMS.popitem(last=False)
    return gram


# ---- the formulas of SPEC.md §A on one block of queries (views, ``out=`` a view of the result)


def _value_weighted(alpha: Tensor, vt_norm: Tensor, out: Tensor | None) -> Tensor:
    """``alpha[h,i,j] * ‖vt[j,h]‖``."""
    return torch.mul(alpha, vt_norm, out=out)


def _value_weighted_normalized(vw: Tensor, inv_o: Tensor, out: Tensor | None) -> Tensor:
    """``alpha[h,i,j] * ‖vt[j,h]‖ / ‖o[i,h]‖`` (``inv_o = 1/‖o[i,h]‖``, NaN where ``‖o[i,h]‖ = 0``)."""
    return torch.mul(vw, inv_o, out=out)


def _factor_norm_ratio(vt_norm: Tensor, inv_o: Tensor, out: Tensor | None) -> Tensor:
    """``‖vt[j,h]‖ / ‖o[i,h]‖``."""
    return torch.mul(vt_norm, inv_o, out=out)


def _factor_cos(u_unit: Tensor, v_unit: Tensor, out: Tensor | None) -> Tensor:
    """``cos(o[i,h], vt[j,h]) = (o[i,h] @ W_O[h].T / ‖o[i,h]‖) . (v[j,h] / ‖vt[j,h]‖)``, one matmul in ``d_head``.

    ``u_unit [b h q d]`` is ``o @ W_O[h].T / ‖o‖`` (NaN rows where ``‖o‖ = 0``); ``v_unit [b h d k]`` is
    ``v / ‖vt‖`` (0 where ``‖vt‖ = 0``, giving a cosine of 0).
    """
    return torch.matmul(u_unit, v_unit, out=out)


def _contribution(vwn: Tensor, cos: Tensor, out: Tensor | None) -> Tensor:
    """``c[h,i,j] = <o[i,h], alpha[h,i,j] vt[j,h]> / ‖o[i,h]‖² = (alpha ‖vt[j,h]‖ / ‖o[i,h]‖) * cos(o[i,h], vt[j,h])``."""
    return torch.mul(vwn, cos, out=out)


def _head_share(alpha: Tensor, u_share: Tensor, v_t: Tensor, out: Tensor | None) -> Tensor:
    """``c[h→i,j] = <o[i], alpha[h,i,j] vt[j,h]> / ‖o[i]‖² = alpha * v[j,h] . (o[i] @ W_O[h].T / ‖o[i]‖²)``.

    ``u_share [b h q d]`` is ``o[i] @ W_O[h].T / ‖o[i]‖²``; ``v_t [b h d k]``.
    """
    share = torch.matmul(u_share, v_t, out=out)
    return share.mul_(alpha)


def _contribution_inter(share: Tensor, out: Tensor | None) -> Tensor:
    """``c[i,j] = <o[i], sum_h alpha[h,i,j] vt[j,h]> / ‖o[i]‖² = sum_h c[h→i,j]``."""
    return torch.sum(share, dim=1, out=out)


def _attention_inter(alpha: Tensor, out: Tensor | None) -> Tensor:
    """``mean_h alpha[h,i,j]``."""
    return torch.mean(alpha, dim=1, out=out)


def _value_weighted_inter(
    alpha: Float[Tensor, "batch head_index q k"],
    gram: Float[Tensor, "head_index head_index2 batch k"],
    out: Tensor | None = None,
) -> Float[Tensor, "batch q k"]:
    """``‖sum_h alpha[h,i,j] vt[j,h]‖ = sqrt(sum_{h,g} alpha[h,i,j] alpha[g,i,j] G_j[h,g])`` (``G`` symmetric)."""
    n_heads = alpha.shape[1]
    twice = gram * 2.0  # [h g b k]: pre-scaled, since addcmul_(value=2) with broadcasting is a slow path
    sq = torch.zeros_like(alpha[:, 0]) if out is None else out.zero_()
    acc = torch.empty_like(alpha[:, 0])  # [b q k]
    for h in range(n_heads):
        torch.mul(alpha[:, h], gram[h, h][:, None, :], out=acc)
        for g in range(h + 1, n_heads):
            acc.addcmul_(alpha[:, g], twice[h, g][:, None, :])
        sq.addcmul_(acc, alpha[:, h])
    return sq.clamp_min_(0).sqrt_()


def _value_weighted_normalized_inter(vwi: Tensor, inv_o: Tensor, out: Tensor | None) -> Tensor:
    """``‖sum_h alpha[h,i,j] vt[j,h]‖ / ‖o[i]‖``."""
    return torch.mul(vwi, inv_o, out=out)


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
    layer axis. Entries above the diagonal (``key > query``, not sources) are 0 in every metric, factors
    included; a row whose output norm is 0 is NaN at its sources ``key <= query`` (see the module docstring).

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

    @property
    def modified_heads(self) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs whose ``z`` was changed by an earlier hook at some query of some text."""
        return modified_pairs(self.modified, self.layers)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(batch, n_heads, pos)`` of the analysed texts."""
        t = next(iter(self.intra.values())) if self.intra else None
        if t is None:
            t4 = next(iter(self.inter.values()))
            return int(t4.shape[0]), 0, int(t4.shape[-1])
        return int(t.shape[0]), int(t.shape[2]), int(t.shape[-1])

    def layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise IndexError(f"layer {layer} was not analysed; analysed layers are {self.layers}") from None

    def to_frame(
        self,
        *,
        batch: int | None = 0,
        layers: int | Sequence[int] | None = None,
        heads: int | Sequence[int] | None = None,
        query: int | None = None,
    ) -> pd.DataFrame:
        """A tidy table: one row per (batch, layer, head, query, key) with ``key <= query``.

        Columns: ``batch, layer, head, query, key``, then ``query_token, key_token`` when the result has
        tokens (a result built from a cache without tokens has none), every intra-head metric and
        factor kept (``factor_attention`` is ``attention``), ``modified`` and ``modified_share`` of the
        head at that query, then the inter-head metrics of the same ``(layer, query, key)`` prefixed
        ``layer_``. Filters keep the table small; each is checked, and an index out of range raises
        ``IndexError`` naming the valid range (a layer that was not analysed names the analysed ones).
        """
        n_batch, n_heads, pos = self.shape
        b_sel = check_indices(batch, n_batch, "batch")
        if layers is None:
            l_sel = list(self.layers)
        else:
            l_sel = [layers] if isinstance(layers, int) else list(layers)
            for layer in l_sel:
                self.layer_index(layer)
        h_sel = check_indices(heads, n_heads, "head")
        q_sel = check_indices(query, pos, "query")
        qq, kk = torch.tril_indices(pos, pos)
        keep = torch.isin(qq, torch.tensor(q_sel))
        qq, kk = qq[keep], kk[keep]
        str_tokens = self.str_tokens if self.tokens is not None else None
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
                    if str_tokens is not None:
                        st = str_tokens[b]
                        cols["query_token"] = [st[i] for i in qq.tolist()]
                        cols["key_token"] = [st[j] for j in kk.tolist()]
                    for k, v in self.intra.items():
                        cols[k] = v[b, li, h, qq, kk].numpy()
                    if "attention" in self.intra:
                        cols["factor_attention"] = cols["attention"]
                    if self.modified is not None and self.modified_share is not None:
                        cols["modified"] = self.modified[b, li, h, qq].numpy()
                        cols["modified_share"] = self.modified_share[b, li, h, qq].numpy()
                    cols.update(inter_cols)
                    frames.append(pd.DataFrame(cols))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


class ContributionCollector:
    """A hook collector that computes the metric family layer by layer during a forward pass.

    Use ``collector.fwd_hooks`` with ``model.run_with_hooks``, ``model.hooks(...)`` or next to
    ``run_with_cache``; after the pass, :meth:`result` returns a :class:`ContributionResult`. With
    ``on_layer`` given, each layer's metrics go to that callback instead and nothing is stored
    (``{"intra": {...}, "inter": {...}}`` per layer), so memory stays at one layer's worth; with
    ``reuse_buffers=True`` as well, every layer is written into the same tensors (no fresh memory per
    layer), so the callback must copy whatever it keeps. Without ``on_layer``, the metrics are written
    straight into the ``[batch, layer, ...]`` tensors of the result (no second copy).

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

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        intra: Sequence[str] | None = None,
        inter: Sequence[str] | None = None,
        on_layer: Callable[[int, dict[str, Any]], None] | None = None,
        store_device: str | torch.device = "cpu",
        reuse_buffers: bool = False,
    ) -> None:
        if reuse_buffers and on_layer is None:
            raise ValueError(
                "reuse_buffers=True needs an on_layer callback (the buffers are overwritten per layer)"
            )
        self.model = model
        self.intra_metrics = _check_metrics(intra, INTRA_METRICS, "intra-head")
        self.inter_metrics = _check_metrics(inter, INTER_METRICS, "inter-head")
        self.collector = LayerCollector(model, layers, self._on_layer)
        self.layers = self.collector.layers
        self.user_on_layer = on_layer
        self.store_device = torch.device(store_device)
        self.reuse_buffers = reuse_buffers
        self._intra: dict[int, dict[str, Tensor]] = {}
        self._inter: dict[int, dict[str, Tensor]] = {}
        self._modified: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> (modified [b h q], share [b h q])
        self._buffers: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        self._store: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None

    @property
    def fwd_hooks(self) -> list[FwdHook]:
        return self.collector.fwd_hooks

    def _out_tensors(self, acts: LayerActivations) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Where this layer's metrics are written: reused buffers, a slice of the result, or fresh memory."""
        B, H, Q, _ = acts.pattern.shape
        intra_metrics = [m for m in self.intra_metrics if m != "attention"]
        dtype = acts.pattern.dtype
        if self.user_on_layer is not None:
            if not self.reuse_buffers:
                return {}, {}
            bufs = self._buffers
            if bufs is None or any(t.shape != (B, H, Q, Q) for t in bufs[0].values()):
                new = acts.pattern.new_empty
                bufs = (
                    {m: new((B, H, Q, Q)) for m in intra_metrics},
                    {m: new((B, Q, Q)) for m in self.inter_metrics},
                )
                self._buffers = bufs
            return bufs
        if acts.pattern.device != self.store_device:
            return {}, {}
        L = len(self.layers)
        store = self._store
        if store is None or acts.layer in self._intra:  # first layer of a (new) pass: fresh result tensors
            dev = self.store_device
            store = (
                {m: torch.empty((B, L, H, Q, Q), dtype=dtype, device=dev) for m in self.intra_metrics},
                {m: torch.empty((B, L, Q, Q), dtype=dtype, device=dev) for m in self.inter_metrics},
            )
            self._store = store
            self._intra, self._inter = {}, {}
        li = self.layers.index(acts.layer)
        return ({m: t[:, li] for m, t in store[0].items()}, {m: t[:, li] for m, t in store[1].items()})

    def _on_layer(self, acts: LayerActivations) -> None:
        geo = LayerGeometry.from_activations(acts)
        out_intra, out_inter = self._out_tensors(acts)
        with torch.no_grad():
            intra, inter = geo.compute(
                self.intra_metrics, self.inter_metrics, out_intra=out_intra, out_inter=out_inter
            )
            if "attention" in out_intra:
                intra["attention"] = out_intra["attention"].copy_(intra["attention"])
            intra = {m: t.to(self.store_device) for m, t in intra.items()}
            inter = {m: t.to(self.store_device) for m, t in inter.items()}
            if geo.modified is None:
                modified = torch.zeros(acts.pattern.shape[:3], dtype=torch.bool, device=self.store_device)
                share = torch.zeros(
                    acts.pattern.shape[:3], dtype=acts.pattern.dtype, device=self.store_device
                )
            else:
                modified = geo.modified.to(self.store_device)
                share = geo.modified_share.to(self.store_device)
        if self.user_on_layer is not None:
            self.user_on_layer(
                acts.layer, {"intra": intra, "inter": inter, "modified": modified, "modified_share": share}
            )
        else:
            self._intra[acts.layer] = intra
            self._inter[acts.layer] = inter
            self._modified[acts.layer] = (modified, share)

    def feed_cache(self, cache: Any) -> None:
        self.collector.feed_cache(cache)

    def result(
        self, tokens: Tokens | None = None, str_tokens: list[list[str]] | None = None
    ) -> ContributionResult:
        missing = [layer for layer in self.layers if layer not in self._intra]
        if missing:
            raise RuntimeError(
                f"no activations were collected for layer(s) {missing}; run the model with "
                "collector.fwd_hooks first (or feed_cache)"
            )
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
        return ContributionResult(
            layers=list(self.layers),
            tokens=None if tokens is None else tokens.detach().cpu(),
            intra=intra,
            inter=inter,
            str_tokens=str_tokens,
            model_name=str(getattr(self.model.cfg, "model_name", "")),
            modified=torch.stack([self._modified[la][0] for la in self.layers], dim=1),
            modified_share=torch.stack([self._modified[la][1] for la in self.layers], dim=1),
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
    ``hook_v`` and ``hook_z`` of ``layers``). Without ``tokens`` the result's ``tokens`` is ``None`` and its
    table has no token columns. A cache taken under a ``hook_z`` patch is marked like a live pass."""
    col = ContributionCollector(model, layers, intra=intra, inter=inter)
    col.feed_cache(cache)
    if tokens is None:
        return col.result(None, None)
    tokens = to_tokens(model, tokens)
    return col.result(tokens, _str_tokens(model, tokens))


def reconstruct_attn_out(model: Any, acts: LayerActivations) -> Float[Tensor, "batch pos d_model"]:
    """``sum_h sum_j alpha[h,i,j] vt[j,h] + b_O``: what ``hook_attn_out`` should read."""
    geo = LayerGeometry.from_activations(acts)
    mixed = einops.einsum(geo.pattern, geo.v, "b h q k, b k h d -> b q h d")
    return head_outputs(mixed, geo.W_O).sum(dim=2) + acts.b_O
