"""Contribution metrics for some queries only (``queries=``): each kept query's row against every key.

A researcher often needs a few queries of a long text (the prediction position, ``queries=[-1]``), not the
``q x k`` square. :func:`query_index` turns the kept queries (:func:`mechgeom.hooks.select_queries`, one
definition of ``queries=`` for every analysis) into the padded position of each row, and :func:`row_metrics`
computes the metrics of those rows only: the pattern rows and ``z`` rows of the kept queries are gathered,
the per-key quantities (value norms, the per-token Gram matrix) are computed once per layer, ``O(k)``, and
every metric is the same formula of :data:`mechgeom.analyses.contribution.metrics.METRICS` that the full
sweep evaluates, on a block of kept rows against every key. The cost per kept query is one row of ``k``
entries per head and metric, never a ``q x k`` square.

Layout: ``[batch, head_index, n, key_pos]`` (intra-head) and ``[batch, n, key_pos]`` (inter-head), where row
``r`` of text ``b`` is the query at padded position ``index[b, r]``; a text with fewer kept queries than
``n`` has empty rows, ``index = -1``, which hold 0. Entries at a key that is not a source of the row's query
(after it on a decoder, or padding) are exactly 0, factors included, as in the full result: the kept rows
equal the same rows of the full computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import einops
import torch

from mechgeom.analyses.contribution import metrics
from mechgeom.analyses.contribution.geometry import BLOCK_SIZE, LayerGeometry
from mechgeom.hooks import LayerActivations, Queries, select_queries
from mechgeom.typing import Bool, Float, Int, Tensor

__all__ = ["QueryRows", "query_index", "row_metrics"]


def query_index(
    queries: Queries, key_mask: Bool[Tensor, "batch pos"] | None, batch: int, pos: int
) -> Int[Tensor, "batch query_pos"]:
    """The padded position of each kept query, ``[batch, n]`` (``n`` the most any text keeps), in order, ``-1``
    in a text's empty rows; ``queries`` as :func:`~mechgeom.hooks.select_queries` takes them (``-1`` is each
    text's last real token).

    >>> m = torch.tensor([[False, True, True], [True, True, True]])  # text 0 is left-padded
    >>> query_index([0, -1], m, 2, 3).tolist()
    [[1, 2], [0, 2]]
    """
    sel = select_queries(queries, key_mask, batch, pos)  # [b pos] bool, CPU
    n = int(sel.sum(-1).max())
    out = torch.full((batch, n), -1, dtype=torch.long)
    for b in range(batch):
        where = sel[b].nonzero().flatten()
        out[b, : len(where)] = where
    return out


class QueryRows:
    """One layer seen through its kept query rows: what the metrics' quantities are prepared from
    (:class:`mechgeom.analyses.contribution.metrics.Layer`).

    ``pattern [b h n k]`` and ``z [b n h d_head]`` are the gathered rows, ``v`` every key; the per-key
    quantities (:attr:`gram`, :attr:`vt_norm`) come from a :class:`LayerGeometry` of the whole layer (they
    have no query axis), the per-query ones are computed on the rows alone.
    """

    def __init__(self, acts: LayerActivations, index: Int[Tensor, "batch query_pos"]) -> None:
        B, H, _, K = acts.pattern.shape
        n = index.shape[1]
        take = index.clamp_min(0).to(acts.pattern.device)
        #: The whole layer, for the quantities on the key axis only (no q x k work is done through it).
        self.geo = LayerGeometry(acts.pattern, acts.v, acts.z, acts.W_O, causal=acts.causal, keys_only=True)
        #: The dtype the rows are computed in: float32 for a half-precision model (as the whole layer's are).
        self.dtype = self.geo.dtype
        self.pattern = acts.pattern.gather(2, take[:, None, :, None].expand(B, H, n, K)).to(self.dtype)
        self.z = acts.z.gather(1, take[:, :, None, None].expand(B, n, H, acts.z.shape[-1])).to(self.dtype)
        self.v = self.geo.v
        mod = acts.modified
        self.modified = (
            None
            if mod is None or not bool(mod.any())
            else mod.to(take.device).gather(2, take[:, None].expand(B, H, n))
        )
        if acts.pattern.dtype != self.dtype:  # half precision: z as the float32 sum it is a rounding of
            mixed = einops.einsum(self.pattern, self.v, "b h n k, b k h d -> b n h d")
            keep = (
                None
                if self.modified is None
                else einops.rearrange(self.modified, "b h n -> b n h")[..., None]
            )
            self.z = mixed if keep is None else torch.where(keep, self.z, mixed)

    @property
    def gram(self) -> Float[Tensor, "batch key_pos head_index head_index2"]:
        return self.geo.gram

    @property
    def vt_norm(self) -> Float[Tensor, "batch head_index key_pos"]:
        return self.geo.vt_norm

    @cached_property
    def head_u(self) -> Float[Tensor, "batch query_pos head_index d_head"]:
        """``o[i,h] @ W_O[h].T = z[i,h] M[h]`` of the kept rows."""
        return einops.einsum(self.z, self.geo.wo_gram, "b q h d, h d e -> b q h e")

    @cached_property
    def layer_u(self) -> Float[Tensor, "batch query_pos head_index d_head"]:
        """``o[i] @ W_O[h].T`` of the kept rows, for every head ``h``."""
        h = self.z.shape[2]
        z = einops.rearrange(self.z, "b q h d -> b q (h d)")
        m = einops.rearrange(self.geo.wo_gram_full, "h d g e -> (h d) (g e)")
        return einops.rearrange(z @ m, "b q (g e) -> b q g e", g=h)

    @cached_property
    def head_out_norm(self) -> Float[Tensor, "batch head_index query_pos"]:
        return einops.einsum(self.z, self.head_u, "b q h d, b q h d -> b h q").clamp_min(0).sqrt()

    @cached_property
    def layer_out_norm(self) -> Float[Tensor, "batch query_pos"]:
        return einops.einsum(self.z, self.layer_u, "b q h d, b q h d -> b q").clamp_min(0).sqrt()

    def modified_share(self) -> Float[Tensor, "batch head_index query_pos"]:
        """``<o[i], o[i,h]> / ‖o[i]‖²`` of each modified head at the kept rows, 0 elsewhere."""
        zeros = torch.zeros_like(self.pattern[..., 0])
        if self.modified is None:
            return zeros
        dots = einops.einsum(self.z, self.layer_u, "b q h d, b q h d -> b h q")
        share = dots * (metrics.inv_or_nan(self.layer_out_norm) ** 2)[:, None, :]
        return torch.where(self.modified, share, zeros)


class _RowBlock:
    """Kept rows ``r0:r1`` against every key, as a formula sees a block (:class:`metrics.Block`)."""

    def __init__(
        self, rows: QueryRows, prepared: dict[str, Tensor], keep: Tensor | None, r0: int, r1: int
    ) -> None:
        self.alpha = rows.pattern[:, :, r0:r1]
        self.modified = None if rows.modified is None else rows.modified[:, :, r0:r1, None]
        self.keep = None if keep is None else keep[:, :, r0:r1]
        self.done: dict[str, Tensor] = {}
        self._prepared, self._rows = prepared, slice(r0, r1)

    def __getitem__(self, name: str) -> Tensor:
        if name in self.done:
            return self.done[name]
        t = self._prepared[name]
        return t[..., self._rows, :] if metrics.QUANTITIES[name].axis == "query" else t


def row_metrics(
    acts: LayerActivations,
    index: Int[Tensor, "batch query_pos"],
    intra: Sequence[str],
    inter: Sequence[str],
    *,
    block_size: int = BLOCK_SIZE,
) -> tuple[dict[str, Tensor], dict[str, Tensor], Bool[Tensor, "batch head_index query_pos"], Tensor]:
    """The metrics ``intra`` (``[b h n k]``) and ``inter`` (``[b n k]``) of the kept rows ``index``
    (:func:`query_index`), with ``modified`` and ``modified_share`` of those rows (``[b h n]``).

    Args:
        acts: one layer's activations; ``acts.key_mask`` marks its real tokens.
        index: ``[batch, n]`` padded positions of the kept queries, ``-1`` for an empty row.
        intra, inter: metric names (:data:`~mechgeom.analyses.contribution.metrics.INTRA_METRICS`,
            :data:`~mechgeom.analyses.contribution.metrics.INTER_METRICS`).
        block_size: kept rows per block (bounds the temporaries).

    Returns:
        ``(intra, inter, modified, modified_share)``, on the activations' device, in the dtype they are
        computed in (float32 for a half-precision model, as the whole layer's).
    """
    rows = QueryRows(acts, index)
    alpha = rows.pattern
    B, H, n, K = alpha.shape
    keys = [metrics.lookup(m, "intra").key for m in intra if m != "attention"]
    keys += [metrics.lookup(m, "inter").key for m in inter]
    quantities, steps = metrics.plan(keys)
    out = {
        k: alpha.new_empty((B, n, K) if metrics.lookup(k).scope == "inter" else (B, H, n, K)) for k in keys
    }
    with torch.no_grad():
        prepared: dict[str, Tensor] = {}
        for quantity in quantities:
            prepared[quantity.name] = quantity.prepare(rows, prepared)  # type: ignore[arg-type]
        keep = None if rows.modified is None else (~rows.modified).to(alpha.dtype)[..., None]
        for r0 in range(0, n, max(1, int(block_size))):
            r1 = min(r0 + max(1, int(block_size)), n)
            block = _RowBlock(rows, prepared, keep, r0, r1)
            for m in steps:
                assert m.formula is not None
                block.done[m.key] = m.formula(block, out[m.key][..., r0:r1, :] if m.key in out else None)
        # not sources: keys after the query (a decoder), padding, and the empty rows
        device = alpha.device
        real = (
            torch.ones(B, K, dtype=torch.bool, device=device)
            if acts.key_mask is None
            else acts.key_mask.bool().to(device)
        )
        qpos = index.to(device)
        src = real[:, None, :] & ((qpos >= 0) & real.gather(1, qpos.clamp_min(0)))[..., None]  # [b n k]
        if acts.causal:
            src &= torch.arange(K, device=device) <= qpos[..., None]
        for k, t in out.items():
            t.masked_fill_(~(src if metrics.lookup(k).scope == "inter" else src[:, None]), 0)
        got_intra = {m: (alpha.masked_fill(~src[:, None], 0) if m == "attention" else out[m]) for m in intra}
        got_inter = {m: out[metrics.lookup(m, "inter").key] for m in inter}
        modified = torch.zeros((B, H, n), dtype=torch.bool, device=device)
        if rows.modified is not None:
            modified = rows.modified & src.any(-1)[:, None]
        share = rows.modified_share().masked_fill(~src.any(-1)[:, None], 0)
    return got_intra, got_inter, modified, share
