"""Maths shared by the hooks and the analyses, written once: ``W_O`` Gram matrices and stable rankings.

Imports nothing of mechgeom above the foundation, so both :mod:`mechgeom.hooks` and
:mod:`mechgeom.analyses` may use it.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import einops
import torch

from mechgeom.typing import WO, Float, Int, Tensor

__all__ = [
    "WOGramLayouts",
    "rank_dtype",
    "stable_ranks",
    "wo_gram",
    "wo_gram_circulant",
    "wo_gram_full",
    "wo_gram_layouts",
]

_WO_GRAMS: OrderedDict[tuple[Any, ...], tuple[Tensor, Tensor]] = OrderedDict()
_CACHE_SIZE = 64


def _memcmp() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn  # type: ignore[no-any-return]


_MEMCMP = _memcmp()


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values: their bytes, compared with ``memcmp`` for contiguous CPU
    tensors (about 3x faster than :func:`torch.equal`, and stricter: ``-0.0`` and ``0.0`` differ), else
    :func:`torch.equal`."""
    if (
        _MEMCMP is not None
        and a.device.type == b.device.type == "cpu"
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.is_contiguous()
        and b.is_contiguous()
    ):
        return a.numel() == 0 or _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0
    return torch.equal(a, b)


def wo_gram_full(
    W_O: WO, *, dtype: torch.dtype | None = None
) -> Float[Tensor, "head_index d_head head_index2 d_head2"]:
    """``M[h,:,g,:] = W_O[h] @ W_O[g].T`` for all head pairs, kept for the last 64 weight tensors seen.

    A weight-only product: computed once per layer rather than once per forward pass. An entry is used
    only if the stored copy of ``W_O`` still equals the tensor given (bit for bit), so freed and
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
    if hit is not None and _same_bits(hit[0], w_o):
        _WO_GRAMS.move_to_end(key)
        return hit[1]
    w = einops.rearrange(w_o.to(target), "h d m -> (h d) m")
    gram = einops.rearrange(w @ w.T, "(h d) (g e) -> h d g e", h=w_o.shape[0], g=w_o.shape[0])
    _WO_GRAMS[key] = (w_o.clone(memory_format=torch.contiguous_format), gram)
    _WO_GRAMS.move_to_end(key)
    while len(_WO_GRAMS) > _CACHE_SIZE:
        _WO_GRAMS.popitem(last=False)
    return gram


_DERIVED: OrderedDict[tuple[str, int], tuple[weakref.ref[Tensor], Any]] = OrderedDict()


def _derived(kind: str, full: Tensor, make: Callable[[Tensor], Any]) -> Any:
    """``make(full)``, kept while ``full`` (a :func:`wo_gram_full` result) lives, for the last 64 of each kind."""
    key = (kind, id(full))
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is full:
        return hit[1]
    value = make(full)
    _DERIVED[key] = (weakref.ref(full), value)
    while len(_DERIVED) > 2 * _CACHE_SIZE:
        _DERIVED.popitem(last=False)
    return value


def _circulant_pairs(H: int) -> tuple[list[int], list[int], list[int]]:
    """Head ``h`` with heads ``g = (h + r) % H``, ``r = 0 .. H // 2``: the columns ``h * R + r`` that give each
    unordered pair once (an even ``H`` meets ``r = H / 2`` from both sides) and their flat indices ``h * H + g``
    and ``g * H + h``."""
    R = H // 2 + 1
    seen: set[tuple[int, int]] = set()
    cols, hg, gh = [], [], []
    for h in range(H):
        for r in range(R):
            g = (h + r) % H
            if (min(h, g), max(h, g)) not in seen:
                seen.add((min(h, g), max(h, g)))
                cols.append(h * R + r)
                hg.append(h * H + g)
                gh.append(g * H + h)
    return cols, hg, gh


def _circulant(full: Tensor) -> Tensor:
    """``M[h,:,(h+r)%H,:]`` as ``[h d (r e)]``, ``r = 0 .. H // 2``."""
    H = full.shape[0]
    heads = torch.arange(H)
    g_of = (heads[:, None] + torch.arange(H // 2 + 1)[None, :]) % H  # [h r]
    return einops.rearrange(full[heads[:, None], :, g_of, :], "h r d e -> h d (r e)").contiguous()


def wo_gram_circulant(
    full: Float[Tensor, "head_index d_head head_index2 d_head2"],
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """For the per-token Gram of projected values (each unordered head pair once): ``M[h,:,(h+r)%H,:]`` as ``[h d (r e)]`` (``r = 0 .. H // 2``), the columns
    ``h * R + r`` of the pairs to keep (``None``: all of them, an odd ``H``) and their flat indices ``h * H + g``
    and ``g * H + h`` in ``G``. Weight-only: kept per :func:`wo_gram_full` result (64 at most).

    >>> mc, keep, hg, gh = wo_gram_circulant(wo_gram_full(torch.ones(3, 2, 4)))
    >>> tuple(mc.shape), keep, hg.tolist(), gh.tolist()  # H = 3: r = 0, 1 covers the 6 pairs
    ((3, 2, 4), None, [0, 1, 4, 5, 8, 6], [0, 3, 4, 7, 8, 2])"""

    def make(full: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        H = full.shape[0]
        cols, hg, gh = _circulant_pairs(H)
        dev = full.device
        keep = None if len(cols) == H * (H // 2 + 1) else torch.tensor(cols, device=dev)
        return _circulant(full), keep, torch.tensor(hg, device=dev), torch.tensor(gh, device=dev)

    return _derived("circulant", full, make)  # type: ignore[no-any-return]


class WOGramLayouts(NamedTuple):
    """The blocks of ``M = W_O W_Oᵀ`` (:func:`wo_gram_full`) laid out for batched matmuls over heads."""

    #: ``[h d e]``: ``M[h,:,h,:]``, so that ``z[i,h] @ diag[h] = o[i,h] @ W_O[h].T`` (a view of ``M``).
    diag: Tensor
    #: ``[(g d) (h e)]``: ``M`` as one square matrix, so that ``z[i] @ square = o[i] @ W_O[h].T`` for every ``h`` at
    #: once (the ``h``-th block of ``d_head`` columns; a view).
    square: Tensor
    #: ``[h d (r e)]``: ``M[h,:,(h+r)%H,:]`` for ``r = 0 .. H // 2`` (:func:`wo_gram_circulant`'s, kept with it).
    circulant: Tensor


def wo_gram_layouts(full: Float[Tensor, "head_index d_head head_index2 d_head2"]) -> WOGramLayouts:
    """:class:`WOGramLayouts` of a contiguous :func:`wo_gram_full` result: two views of it and the circulant
    blocks, so that nothing but :func:`wo_gram_circulant`'s tensor is kept beside ``M``.

    >>> lay = wo_gram_layouts(wo_gram_full(torch.randn(3, 2, 4)))
    >>> tuple(lay.diag.shape), tuple(lay.square.shape), tuple(lay.circulant.shape)
    ((3, 2, 2), (6, 6), (3, 2, 4))"""
    H, D = full.shape[0], full.shape[1]
    diag = einops.rearrange(torch.diagonal(full, dim1=0, dim2=2), "d e h -> h d e")
    return WOGramLayouts(diag, full.view(H * D, H * D), wo_gram_circulant(full)[0])


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
