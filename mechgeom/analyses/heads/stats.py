"""Per-head reference statistics for pruning (``docs/definitions.md`` §7.2): output norm, entropy, weight magnitude.

**Reference statistics** (:func:`head_stats`, one forward pass per batch of reference windows, no
unembedding). For every layer and head, averaged over *every window of the reference tokens and every
position* ``i >= start_pos`` (default ``start_pos=0``: all positions, the sink position 0 included):

- ``z_mean[l,h] = mean_{b, i} z[b,i,h]`` (``d_head``) — the value substituted by mean ablation at
  every position;
- ``out_norm[l,h] = mean_{b, i} ‖z[b,i,h] @ W_O[h]‖`` — the head-output norm of the taxonomy order;
- ``entropy[l,h] = mean_{b, i} H(alpha[b,h,i,:])`` with ``H(p) = -sum_j p_j log p_j`` (nats, ``0 log 0 = 0``).
  Query 0 attends only to itself, so its entropy is 0 for every head; including it rescales every head's
  mean by the same factor and leaves the entropy order unchanged.

With ``taxonomy=True`` the same passes also feed a
:class:`~mechgeom.analyses.heads.taxonomy.TaxonomyCollector`, so the labels of the taxonomy order come without a
second pass (:attr:`HeadStats.taxonomy`).

The weights give the magnitude baseline, ``‖W_V[h] W_O[h]‖_F`` (:func:`weight_magnitude`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import einops
import numpy as np
import pandas as pd
import torch

from mechgeom._deprecation import warn_deprecated
from mechgeom.analyses.base import Collector, PassOptions, Result, entry_point, run_collector
from mechgeom.analyses.heads.taxonomy import TaxonomyCollector, TaxonomyResult
from mechgeom.hooks import (
    LayerActivations,
    TokensOrText,
    align_texts,
    check_sink_positions,
    head_outputs,
    hook_name,
    layer_W_O,
    to_batch,
)
from mechgeom.maths import wo_gram
from mechgeom.typing import WO, Float, Pattern, Tensor, Tokens, Z

__all__ = [
    "HeadStats",
    "HeadStatsCollector",
    "head_output_norm",
    "head_stats",
    "head_stats_from_cache",
    "pattern_entropy",
    "weight_magnitude",
]


# --------------------------------------------------------------------------- per-head formulas


def head_output_norm(z: Z, W_O: WO) -> Float[Tensor, "batch pos head_index"]:
    """Head-output norm ``‖o[i,h]‖ = ‖z[i,h] @ W_O[h]‖`` (bias excluded).

    >>> head_output_norm(torch.ones(1, 1, 1, 2), torch.eye(2)[None]).tolist()
    [[[1.4142135381698608]]]
    """
    return head_outputs(z, W_O).norm(dim=-1)


def pattern_entropy(pattern: Pattern) -> Float[Tensor, "batch head_index query_pos"]:
    """Attention entropy of each pattern row, ``H(alpha[h,i,:]) = -sum_j alpha[h,i,j] log alpha[h,i,j]`` (nats, ``0 log 0 = 0``).

    >>> pattern_entropy(torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])).abs().tolist()  # query 0: one source, H = 0
    [[[0.0, 0.6931471805599453]]]
    """
    p = pattern.double()
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.0)), torch.zeros_like(p))
    return -plogp.sum(dim=-1)


def weight_magnitude(model: Any) -> Float[Tensor, "layer head_index"]:
    """``‖W_V[h] W_O[h]‖_F`` per layer and head (float64 products, returned as float32).

    GQA: ``W_V`` is stored per KV head (``blocks[l].attn._W_V``, ``[n_kv, d_model, d_head]``); query head
    ``h`` uses KV head ``h // (n_heads // n_kv)`` (``repeat_interleave``, as TransformerLens). Computed
    without the ``d_model x d_model`` product: ``‖W_V W_O‖_F² = sum((W_Vᵀ W_V) ⊙ (W_O W_Oᵀ))``, with
    ``W_O W_Oᵀ`` from :func:`mechgeom.maths.wo_gram`.
    """
    n_heads = int(model.cfg.n_heads)
    rows = []
    for layer in range(int(model.cfg.n_layers)):
        attn = model.blocks[layer].attn
        W_V = getattr(attn, "_W_V", None)
        if not isinstance(W_V, Tensor):
            W_V = attn.W_V
        W_V = W_V.detach().double()  # [kv_head d_model d_head]
        if W_V.shape[0] != n_heads:
            W_V = W_V.repeat_interleave(n_heads // W_V.shape[0], dim=0)
        gram_v = einops.einsum(W_V, W_V, "head d_model a, head d_model b -> head a b")
        gram_o = wo_gram(layer_W_O(model, layer), dtype=torch.float64)  # [head d_head d_head]
        rows.append((gram_v * gram_o).sum(dim=(1, 2)).clamp_min(0).sqrt())
    return torch.stack(rows).float()


# --------------------------------------------------------------------------- reference statistics


@dataclass
class HeadStats(Result):
    """Per-head reference statistics (see the module docstring for exactly which positions are averaged).

    Tensors are indexed ``[i, head]`` where ``layers[i]`` is the model layer (every layer by default, as
    pruning needs). ``taxonomy`` holds the labels of the same passes (:func:`head_stats` with
    ``taxonomy=True``).
    """

    z_mean: Float[Tensor, "layer head_index d_head"]
    out_norm: Float[Tensor, "layer head_index"]
    entropy: Float[Tensor, "layer head_index"]
    n_positions: int
    start_pos: int = 0
    taxonomy: TaxonomyResult | None = None
    layers: list[int] = field(default_factory=list)
    model_name: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = list(range(int(self.out_norm.shape[0])))

    def to_frame(self) -> pd.DataFrame:
        """One row per head: ``layer, head, out_norm, entropy``."""
        n_layers, n_heads = self.out_norm.shape
        return pd.DataFrame(
            {
                "layer": np.repeat(np.asarray(self.layers, dtype=np.int64), n_heads),
                "head": np.tile(np.arange(n_heads), n_layers),
                "out_norm": self.out_norm.flatten().cpu().numpy(),
                "entropy": self.entropy.flatten().cpu().numpy(),
            }
        )

    def summary(self) -> dict[str, Any]:
        """``n_positions``, ``start_pos``, the mean ``out_norm`` and ``entropy`` over heads and, with a
        taxonomy, ``taxonomy_counts`` (heads per label, most frequent first)."""
        out: dict[str, Any] = {
            "n_positions": int(self.n_positions),
            "start_pos": int(self.start_pos),
            "mean_out_norm": float(self.out_norm.double().mean()),
            "mean_entropy": float(self.entropy.double().mean()),
        }
        if self.taxonomy is not None:
            counts = self.taxonomy.to_frame()["label"].value_counts()
            out["taxonomy_counts"] = {str(k): int(v) for k, v in counts.items()}
        return out


class HeadStatsCollector(Collector):
    """Collector of :class:`HeadStats` (every layer by default: pruning needs them all).

    Sums add up over forward passes (or :meth:`feed_cache` calls); :meth:`result` divides. With
    ``taxonomy=True`` a :class:`~mechgeom.analyses.heads.taxonomy.TaxonomyCollector` of the same layers is fed
    the same activations (its :meth:`~mechgeom.analyses.base.Collector.receive`), so it adds no hooks and the
    reader stays shared in :func:`~mechgeom.analyses.base.collect`.
    """

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        start_pos: int = 0,
        taxonomy: bool = False,
        sink_positions: int | Sequence[int] | None = None,
    ) -> None:
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        super().__init__(model, layers)
        n_layers, n_heads, d_head = len(self.layers), int(model.cfg.n_heads), int(model.cfg.d_head)
        self.start_pos = start_pos
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        self.z_sum = torch.zeros(n_layers, n_heads, d_head, dtype=torch.float64)
        self.norm_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.entropy_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.n_z = 0
        self.n_q = 0
        self.taxonomy = (
            TaxonomyCollector(model, self.layers, sink_positions=sink_positions) if taxonomy else None
        )

    def on_layer(self, acts: LayerActivations) -> None:
        li = self._index[acts.layer]
        if acts.key_mask is None:
            al = None
            pattern, z = acts.pattern, acts.z
        else:  # each text at the start of its row; positions >= start_pos inside each text, padding out
            al = align_texts(acts)
            pattern, z = al.acts.pattern, al.acts.z
        real = None if al is None else al.real[:, self.start_pos :].to(z.device)  # [batch pos]
        zs = z[:, self.start_pos :]  # [batch pos head_index d_head]
        norms = head_output_norm(zs, acts.W_O).double()  # [batch pos head_index]
        ent = pattern_entropy(pattern[:, :, self.start_pos :])  # [batch head_index query_pos]
        if real is not None:
            zs = torch.where(real[:, :, None, None], zs, 0.0)
            norms = torch.where(real[:, :, None], norms, 0.0)
            ent = torch.where(real[:, None, :], ent, 0.0)
        self.z_sum[li] += zs.double().sum(dim=(0, 1)).cpu()
        self.norm_sum[li] += norms.sum(dim=(0, 1)).cpu()
        self.entropy_sum[li] += ent.sum(dim=(0, 2)).cpu()
        if li == 0:
            n = zs.shape[0] * zs.shape[1] if real is None else int(real.sum())
            self.n_z += n
            self.n_q += n
        if self.taxonomy is not None:
            self.taxonomy.receive(acts)

    def build(self, tokens: Tokens | None) -> HeadStats:
        """The means of every pass so far."""
        return HeadStats(
            z_mean=(self.z_sum / self.n_z).float(),
            out_norm=(self.norm_sum / self.n_z).float(),
            entropy=(self.entropy_sum / self.n_q).float(),
            n_positions=self.n_z,
            start_pos=self.start_pos,
            taxonomy=None if self.taxonomy is None else self.taxonomy.result(tokens),  # type: ignore[arg-type]
            layers=list(self.layers),
            model_name=self.model_name,
        )


def _check_positions(
    n_pos: int, start_pos: int, taxonomy: bool, sink_positions: int | Sequence[int] | None
) -> None:
    if not 0 <= start_pos < n_pos:
        raise ValueError(f"start_pos={start_pos} leaves no position of {n_pos}")
    if taxonomy:
        sinks = check_sink_positions(sink_positions, n_pos)
        if max(sinks) + 1 >= n_pos:
            raise ValueError(
                f"the taxonomy needs a query after the sink position(s) {list(sinks)}: "
                f"sequences of {n_pos} positions have none (or pass taxonomy=False)"
            )


@entry_point
def head_stats(
    model: Any,
    tokens_or_text: TokensOrText | None,
    *,
    layers: int | Sequence[int] | None = None,
    start_pos: int = 0,
    batch_size: int = 8,
    taxonomy: bool = True,
    sink_positions: int | Sequence[int] | None = None,
    **run: Unpack[PassOptions],
) -> HeadStats:
    """Reference statistics of every head of ``layers`` over ``tokens`` ``[n_texts, pos]``, one pass per batch.

    Averages over every window and every position ``i >= start_pos``: ``z_mean`` (mean ``z[b,i,h]``),
    ``out_norm`` (mean ``‖z[b,i,h] @ W_O[h]‖``, :func:`head_output_norm`) and ``entropy`` (mean
    :func:`pattern_entropy` over query rows ``i >= start_pos``). The forward stops after the last layer read.

    Args:
        model: a causal decoder.
        tokens_or_text: text, texts or token ids (the cached texts with ``cache``, optional there).
        layers: ``None`` (every layer, what pruning needs), an int or a sequence of ints.
        start_pos: the first position averaged, a position inside each text (padding is never averaged).
        batch_size: texts per forward pass.
        taxonomy: also label every head from the same passes
            (:class:`~mechgeom.analyses.heads.taxonomy.TaxonomyCollector` with ``sink_positions``), kept in
            :attr:`HeadStats.taxonomy`.

    Returns:
        A :class:`HeadStats`.
    """
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    col = HeadStatsCollector(
        model, layers, start_pos=start_pos, taxonomy=taxonomy, sink_positions=sink_positions
    )
    what = f"head statistics from start_pos={start_pos}"
    if run["cache"] is not None:
        _check_positions(
            int(run["cache"][hook_name(col.layers[0], "z")].shape[1]), start_pos, taxonomy, sink_positions
        )
    elif tokens_or_text is not None:
        tokens, mask = to_batch(
            model, tokens_or_text, attention_mask=run["attention_mask"], min_pos=start_pos + 1, what=what
        )
        n_pos = int(tokens.shape[1]) if mask is None else int(mask.sum(-1).max())
        _check_positions(n_pos, start_pos, taxonomy, sink_positions)
        tokens_or_text, run["attention_mask"] = tokens, mask
    return run_collector(  # type: ignore[no-any-return]
        model,
        tokens_or_text,
        col,
        batch_size=batch_size,
        desc="head stats",
        min_pos=start_pos + 1,
        what=what,
        **run,
    )


def head_stats_from_cache(
    model: Any,
    cache: Any,
    *,
    start_pos: int = 0,
    taxonomy: bool = True,
    sink_positions: int | Sequence[int] | None = None,
) -> HeadStats:
    """Deprecated: ``head_stats(model, None, cache=cache, ...)`` gives the same statistics."""
    warn_deprecated("head_stats_from_cache(model, cache)", "head_stats(model, tokens, cache=cache)")
    return head_stats(
        model, None, cache=cache, start_pos=start_pos, taxonomy=taxonomy, sink_positions=sink_positions
    )
