"""Maths shared by the hooks and the analyses, written once: ``W_O`` Gram matrices and stable rankings.

Imports nothing of mechgeom above the foundation, so both :mod:`mechgeom.hooks` and
:mod:`mechgeom.analyses` may use it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import einops
import torch

from mechgeom.typing import WO, Float, Int, Tensor

__all__ = ["rank_dtype", "stable_ranks", "wo_gram", "wo_gram_circulant", "wo_gram_full"]

_WO_GRAMS: OrderedDict[tuple[Any, ...], tuple[Tensor, Tensor]] = OrderedDict()
_CACHE_SIZE = 64


def wo_gram_full(
    W_O: WO, *, dtype: torch.dtype | None = None
) -> Float[Tensor, "head_index d_head head_index2 d_head2"]:
    """``M[h,:,g,:] = W_O[h] @ W_O[g].T`` for all head pairs, kept for the last 64 weight tensors seen.

    A weight-only product: computed once per layer rather than once per forward pass. An entry is used
    only if the stored copy of ``W_O`` still equals the tensor given (``torch.equal``), so freed and
    reused memory or an in-place edit of the weights can never return a stale Gram matrix. ``dtype``
    computes it from ``W_O`` cast to that precision (e.g. float64), cached under the weights given.

    >>> w = torch.eye(2).reshape(2, 1, 2)  # two heads, d_head 1, orthogonal outputs
    >>> wo_gram_full(w).reshape(2, 2).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    w_o = W_O.detach()
    target = w_o.dtype if dtype is None else dtype
    key = (w_o.data_ptr(), tuple(w_o.shape), tuple(w_o.stride()), w_o.dtype, str(w_o.device), target)
    hit = _WO_GRAMS.get(key)
    if hit is not None and torch.equal(hit[0], w_o):
        _WO_GRAMS.move_to_end(key)
        return hit[1]
    w = einops.rearrange(w_o.to(target), "h d m -> (h d) m")
    gram = einops.rearrange(w @ w.T, "(h d) (g e) -> h d g e", h=w_o.shape[0], g=w_o.shape[0])
    _WO_GRAMS[key] = (w_o.clone(), gram)
    _WO_GRAMS.move_to_end(key)
    while len(_WO_GRAMS) > _CACHE_SIZE:
        _WO_GRAMS.popitem(last=False)
    return gram


_CIRCULANT: OrderedDict[int, tuple[weakref.ref[Tensor], tuple[Tensor, Tensor | None, Tensor, Tensor]]] = (
    OrderedDict()
)


def wo_gram_circulant(
    full: Float[Tensor, "head_index d_head head_index2 d_head2"],
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """For the per-token Gram of projected values (each unordered head pair once): ``M[h,:,(h+r)%H,:]`` as ``[h d (r e)]`` (``r = 0 .. H // 2``), the columns
    ``h * R + r`` of the pairs to keep (``None``: all of them, an odd ``H``) and their flat indices ``h * H + g``
    and ``g * H + h`` in ``G``. Weight-only: kept per :func:`wo_gram_full` result (64 at most).

    >>> mc, keep, hg, gh = wo_gram_circulant(wo_gram_full(torch.ones(3, 2, 4)))
    >>> tuple(mc.shape), keep, hg.tolist(), gh.tolist()  # H = 3: r = 0, 1 covers the 6 pairs
    ((3, 2, 4), None, [0, 1, 4, 5, 8, 6], [0, 3, 4, 7, 8, 2])"""
    hit = _CIRCULANT.get(id(full))
    if hit is not None and hit[0]() is full:
        return hit[1]
    H = full.shape[0]
    R = H // 2 + 1
    heads = torch.arange(H)
    g_of = (heads[:, None] + torch.arange(R)[None, :]) % H  # [h r]
    mc = einops.rearrange(full[heads[:, None], :, g_of, :], "h r d e -> h d (r e)").contiguous()
    seen: set[tuple[int, int]] = set()  # each unordered pair once (an even H meets r = H/2 from both sides)
    cols, hg, gh = [], [], []
    for h in range(H):
        for r in range(R):
            g = (h + r) % H
            if (min(h, g), max(h, g)) not in seen:
                seen.add((min(h, g), max(h, g)))
                cols.append(h * R + r)
                hg.append(h * H + g)
                gh.append(g * H + h)
    dev = full.device
    keep = None if len(cols) == H * R else torch.tensor(cols, device=dev)
    entry = (mc, keep, torch.tensor(hg, device=dev), torch.tensor(gh, device=dev))
    _CIRCULANT[id(full)] = (weakref.ref(full), entry)
    while len(_CIRCULANT) > 64:
        _CIRCULANT.popitem(last=False)
    return entry


def wo_gram(W_O: WO, *, dtype: torch.dtype | None = None) -> Float[Tensor, "head_index d_head d_head2"]:
    """``M[h] = W_O[h] @ W_O[h].T``, so that ``<x @ W_O[h], y @ W_O[h]> = x M[h] yᵀ`` in ``d_head``.

    The diagonal blocks of :func:`wo_gram_full`, in the dtype of ``W_O`` or in ``dtype``.

    >>> w = torch.tensor([[[3.0, 4.0]]])  # one head, d_head 1: ‖W_O[0]‖² = 25
    >>> wo_gram(w).tolist()
    [[[25.0]]]
    """
    full = wo_gram_full(W_O, dtype=dtype)
    return einops.rearrange(torch.diagonal(full, dim1=0, dim2=2), "d e h -> h d e")


def rank_dtype(n_keys: int) -> torch.dtype:
    """The smallest integer dtype that holds ranks ``0..n_keys-1`` (uint8, int16 or int32).

    >>> rank_dtype(10), rank_dtype(1000), rank_dtype(100_000)
    (torch.uint8, torch.int16, torch.int32)
    """
    if n_keys <= 256:
        return torch.uint8
    if n_keys <= 2**15:
        return torch.int16
    return torch.int32


def stable_ranks(
    keys: Float[Tensor, "*batch key_pos"], *, descending: bool = True, dtype: torch.dtype = torch.long
) -> Int[Tensor, "*batch key_pos"]:
    """The rank of each entry of the last dimension by a **stable** sort of ``keys`` (0 = first).

    Ties go to the lower position first. Callers mask what must rank last (``-inf`` when descending).

    >>> stable_ranks(torch.tensor([0.25, 0.5, 0.25])).tolist()
    [1, 0, 2]
    >>> stable_ranks(torch.tensor([0.3, 0.1, 0.2]), descending=False, dtype=torch.uint8).tolist()
    [2, 0, 1]
    """
    order = torch.sort(keys, dim=-1, descending=descending, stable=True).indices
    n = keys.shape[-1]
    ranks = torch.empty(order.shape, dtype=dtype, device=keys.device)
    ranks.scatter_(
        -1, order, torch.arange(n, device=keys.device, dtype=dtype).expand(order.shape).contiguous()
    )
    return ranks
