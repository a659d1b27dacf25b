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

from collections.abc import Callable, Iterator, Sequence
from functools import cached_property

import einops
import torch

from mechgeom.analyses.contribution import metrics
from mechgeom.analyses.contribution.geometry import BLOCK_SIZE, LayerGeometry
from mechgeom.hooks import LayerActivations, Queries, select_queries
from mechgeom.typing import Bool, Float, Int, Tensor

__all__ = ["QueryRows", "query_index", "row_metrics", "source_mask", "top_row_metrics"]


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


def source_mask(
    key_mask: Bool[Tensor, "batch pos"] | None,
    index: Int[Tensor, "batch query_pos"],
    n_keys: int,
    causal: bool,
    device: torch.device,
    window: int | None = None,
) -> Bool[Tensor, "batch query_pos key_pos"]:
    """Which keys are sources of each kept row: real keys of a real query (of a non-empty row), and on a
    decoder (``causal``) no key after the query, nor one ``window`` or more before it (a sliding window)."""
    real = (
        torch.ones(index.shape[0], n_keys, dtype=torch.bool, device=device)
        if key_mask is None
        else key_mask.bool().to(device)
    )
    qpos = index.to(device)
    src = real[:, None, :] & ((qpos >= 0) & real.gather(1, qpos.clamp_min(0)))[..., None]
    if causal:
        src &= torch.arange(n_keys, device=device) <= qpos[..., None]
        if window is not None:
            src &= torch.arange(n_keys, device=device) > qpos[..., None] - window
    return src


RowBlocks = Iterator[tuple[int, int, dict[str, Tensor], Bool[Tensor, "batch query_pos key_pos"]]]


def _row_blocks(
    rows: QueryRows,
    acts: LayerActivations,
    index: Int[Tensor, "batch query_pos"],
    intra: Sequence[str],
    inter: Sequence[str],
    block_size: int,
    out: Callable[[str, int, int], Tensor | None],
) -> RowBlocks:
    """The metrics of the kept rows, one block of rows at a time: ``(r0, r1, {name: tensor}, src)`` with
    intra-head metrics under their name (``[b h r k]``), inter-head ones under ``"layer_" + name``
    (``[b r k]``) and ``src [b r k]`` the sources of the block's rows (:func:`source_mask`); every entry at a
    key that is not a source is exactly 0. ``out(key, r0, r1)`` gives where a formula writes a block
    (``None``: fresh memory)."""
    alpha = rows.pattern
    n = alpha.shape[2]
    keys = [metrics.lookup(m, "intra").key for m in intra if m != "attention"]
    keys += [metrics.lookup(m, "inter").key for m in inter]
    quantities, steps = metrics.plan(keys)
    prepared: dict[str, Tensor] = {}
    for quantity in quantities:
        prepared[quantity.name] = quantity.prepare(rows, prepared)  # type: ignore[arg-type]
    keep = None if rows.modified is None else (~rows.modified).to(alpha.dtype)[..., None]
    step = max(1, int(block_size))
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        block = _RowBlock(rows, prepared, keep, r0, r1)
        for step_ in steps:
            assert step_.formula is not None
            block.done[step_.key] = step_.formula(
                block, out(step_.key, r0, r1) if step_.key in keys else None
            )
        # not sources: keys after the query (a decoder), padding, and the empty rows
        src = source_mask(
            acts.key_mask, index[:, r0:r1], alpha.shape[-1], acts.causal, alpha.device, acts.window
        )
        got: dict[str, Tensor] = {}
        for m in intra:
            t = block.alpha if m == "attention" else block.done[metrics.lookup(m, "intra").key]
            got[m] = t.masked_fill(~src[:, None], 0) if m == "attention" else t.masked_fill_(~src[:, None], 0)
        for m in inter:
            got["layer_" + m] = block.done[metrics.lookup(m, "inter").key].masked_fill_(~src, 0)
        yield r0, r1, got, src


def _modified_rows(
    rows: QueryRows, src: Bool[Tensor, "batch query_pos key_pos"]
) -> tuple[Bool[Tensor, "batch head_index query_pos"], Float[Tensor, "batch head_index query_pos"]]:
    """``(modified, modified_share)`` of the kept rows (``[b h n]``), 0 at rows with no source."""
    B, H, n, _ = rows.pattern.shape
    any_src = src.any(-1)[:, None]
    modified = torch.zeros((B, H, n), dtype=torch.bool, device=src.device)
    if rows.modified is not None:
        modified = rows.modified & any_src
    return modified, rows.modified_share().masked_fill(~any_src, 0)


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
    full = {m: alpha.new_empty((B, H, n, K)) for m in intra}
    full.update({"layer_" + m: alpha.new_empty((B, n, K)) for m in inter})
    owner = {metrics.lookup(m, "intra").key: m for m in intra if m != "attention"}
    owner.update({metrics.lookup(m, "inter").key: "layer_" + m for m in inter})

    def out(key: str, r0: int, r1: int) -> Tensor:
        return full[owner[key]][..., r0:r1, :]

    srcs = []
    with torch.no_grad():
        for r0, r1, got, src in _row_blocks(rows, acts, index, intra, inter, block_size, out):
            for name, t in got.items():
                dst = full[name][..., r0:r1, :]
                if (
                    t.data_ptr() != dst.data_ptr()
                ):  # attention (the pattern itself), or a formula's own tensor
                    dst.copy_(t)
            srcs.append(src)
        modified, share = _modified_rows(rows, torch.cat(srcs, dim=1) if srcs else _no_rows(alpha))
    return {m: full[m] for m in intra}, {m: full["layer_" + m] for m in inter}, modified, share


def _no_rows(alpha: Tensor) -> Tensor:
    B, _, n, K = alpha.shape
    return torch.zeros((B, n, K), dtype=torch.bool, device=alpha.device)


def top_row_metrics(
    acts: LayerActivations,
    index: Int[Tensor, "batch query_pos"],
    intra: Sequence[str],
    inter: Sequence[str],
    top_k: int,
    *,
    block_size: int = BLOCK_SIZE,
) -> tuple[dict[str, tuple[Tensor, Tensor]], dict[str, tuple[Tensor, Tensor]], Tensor, Tensor]:
    """The ``top_k`` largest sources by absolute value of each kept row, per head and metric: the metrics of
    :func:`row_metrics`, reduced block by block, so the memory is ``O(top_k)`` per kept row and head (plus
    one block of ``block_size`` rows against every key).

    Args:
        acts, index, intra, inter, block_size: as :func:`row_metrics`.
        top_k: sources kept per row (at most the number of keys).

    Returns:
        ``(intra, inter, modified, modified_share)``: ``intra[name] = (values [b h n k], keys [b h n k])`` and
        ``inter[name] = (values [b n k], keys [b n k])`` with ``k = min(top_k, key_pos)``, in decreasing
        ``|value|`` (a NaN, the metric of a row with no output, first); ``keys`` are padded key positions,
        ``-1`` (with value 0) where the row has fewer than ``k`` sources. ``modified`` and ``modified_share``
        as :func:`row_metrics`.
    """
    rows = QueryRows(acts, index)
    alpha = rows.pattern
    B, H, n, K = alpha.shape
    k = min(int(top_k), K)
    dev = alpha.device
    shapes: dict[str, tuple[int, ...]] = {m: (B, H, n, k) for m in intra}
    shapes.update({"layer_" + m: (B, n, k) for m in inter})
    values = {name: alpha.new_zeros(shape) for name, shape in shapes.items()}
    keys = {name: torch.full(shape, -1, dtype=torch.long, device=dev) for name, shape in shapes.items()}
    any_src = torch.zeros((B, n), dtype=torch.bool, device=dev)
    with torch.no_grad():
        for r0, r1, got, src in _row_blocks(rows, acts, index, intra, inter, block_size, lambda *_: None):
            any_src[:, r0:r1] = src.any(-1)
            for name, t in got.items():
                s = src if name.startswith("layer_") else src[:, None]
                score = t.abs().masked_fill(~s, -1.0)  # |value| >= 0 at a source, NaN first (topk's order)
                top, where = score.topk(k, dim=-1)
                kept = (top >= 0) | top.isnan()
                values[name][..., r0:r1, :] = torch.where(kept, t.gather(-1, where), 0)
                keys[name][..., r0:r1, :] = torch.where(kept, where, -1)
        modified, share = _modified_rows(rows, any_src[..., None])
    got_intra = {m: (values[m], keys[m]) for m in intra}
    got_inter = {m: (values["layer_" + m], keys["layer_" + m]) for m in inter}
    return got_intra, got_inter, modified, share
