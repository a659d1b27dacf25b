"""The contribution metrics as data: one table, :data:`METRICS`, declares every metric of ``docs/definitions.md`` §2.1.

A row (:class:`Metric`) gives a metric's name, its scope (``"intra"``: per head, ``[batch, head_index,
query_pos, key_pos]``; ``"inter"``: the whole layer, ``[batch, query_pos, key_pos]``), what it needs and its
formula on one block of queries. What it needs are per-layer :data:`QUANTITIES` (norms, Gram matrices, the
rows and columns of a product, prepared once per layer) and other metrics of the same block (computed once
per block, whether they are kept or not). :data:`INTRA_METRICS`, :data:`INTER_METRICS` and what the plain
sweep of :class:`~mechgeom.analyses.contribution.geometry.LayerGeometry` computes (:func:`plan`, the closure
of the needs) are read off the table. The fused sweep (:mod:`mechgeom._kernels.fused`) computes the metrics
its C kernel has slots for; the plain sweep computes any other row, with the same conventions.

Notation (that of :mod:`~mechgeom.analyses.contribution.geometry`): ``alpha[h,i,j]`` the pattern, ``vt[j,h] =
v[j,h] @ W_O[h]``, ``o[i,h] = z[i,h] @ W_O[h]``, ``o[i] = sum_h o[i,h]``, ``G_j[h,g] = <vt[j,h], vt[j,g]>``.
A block is the queries ``q0:q1`` against the keys ``0:k1`` they can see; a quantity on the query axis is
``[.., q, 1 or d]`` and sliced to ``q0:q1``, one on the key axis ``[.., 1 or d, k]`` and sliced to ``0:k1``.

Conventions every formula keeps: NaN where an output norm it divides by is 0 (never inf); a *factor*
(``factor=True``) is not weighted by ``alpha`` and so is not 0 by itself at a key after its query (the sweep
writes 0 there); a head whose ``z`` an earlier hook modified (``Block.modified``) has no per-source terms.

>>> [m.key for m in METRICS if m.scope == "inter"]
['attention_inter', 'value_weighted_inter', 'value_weighted_normalized_inter', 'contribution_inter']
>>> [n.name for n in plan({"contribution"})[0]]
['vt_norm', 'inv_head_norm', 'values', 'unit_values', 'unit_head_u']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

import einops
import torch

from mechgeom.typing import Bool, Float, Tensor

__all__ = [
    "INTER_METRICS",
    "INTRA_METRICS",
    "METRICS",
    "QUANTITIES",
    "Block",
    "Layer",
    "Metric",
    "Quantity",
    "inv_or_nan",
    "inv_or_zero",
    "lookup",
    "plan",
]

Scope = Literal["intra", "inter"]
Axis = Literal["query", "key"]


class Layer(Protocol):
    """What a quantity is prepared from: :class:`~mechgeom.analyses.contribution.geometry.LayerGeometry`."""

    #: As the model gave it: possibly half precision, sliced and upcast per block (:attr:`Block.alpha`).
    pattern: Float[Tensor, "batch head_index query_pos key_pos"]
    #: In :attr:`dtype`.
    v: Float[Tensor, "batch key_pos head_index d_head"]
    modified: Bool[Tensor, "batch head_index query_pos"] | None
    #: The dtype of every quantity and metric (float32 for a half-precision model).
    dtype: torch.dtype

    @property
    def gram(self) -> Float[Tensor, "batch key_pos head_index head_index2"]: ...
    @property
    def vt_norm(self) -> Float[Tensor, "batch head_index key_pos"]: ...
    @property
    def head_out_norm(self) -> Float[Tensor, "batch head_index query_pos"]: ...
    @property
    def layer_out_norm(self) -> Float[Tensor, "batch query_pos"]: ...
    @property
    def head_u(self) -> Float[Tensor, "batch query_pos head_index d_head"]: ...
    @property
    def layer_u(self) -> Float[Tensor, "batch query_pos head_index d_head"]: ...


class Block(Protocol):
    """One block of queries ``q0:q1`` (``n`` of them) against keys ``0:k1``, as a formula sees it."""

    #: ``[b h n k1]``: the pattern of the block, in the layer's compute dtype.
    alpha: Tensor
    #: ``[b h n 1]``, True for a modified head (see the module docstring); ``None``: no head is.
    modified: Tensor | None
    #: ``[b h n 1]``, 0 for a modified head and 1 for the others (``alpha``'s dtype); ``None``: no head is.
    keep: Tensor | None

    def __getitem__(self, name: str) -> Tensor:
        """A quantity sliced to the block, or a metric of the block (by :attr:`Metric.key`)."""
        ...


#: ``formula(block, out)``: a metric on one block, written into ``out`` (a view of the result) when given.
Formula = Callable[[Block, "Tensor | None"], Tensor]


@dataclass(frozen=True)
class Quantity:
    """A per-layer input of the formulas, prepared once per layer by the plain sweep.

    Attributes:
        name: How :attr:`Metric.needs` and :meth:`Block.__getitem__` name it.
        axis: ``"query"`` (``[.., q, 1 or d]``) or ``"key"`` (``[.., 1 or d, k]``): the axis a block slices.
        needs: Quantities it is prepared from (earlier in :data:`QUANTITIES`).
        prepare: ``prepare(layer, prepared)`` -> the tensor, from the layer and the quantities before it.
        doc: What it is.
    """

    name: str
    axis: Axis
    needs: tuple[str, ...]
    prepare: Callable[[Layer, dict[str, Tensor]], Tensor]
    doc: str


@dataclass(frozen=True)
class Metric:
    """One contribution metric: a row of :data:`METRICS`.

    Attributes:
        name: The public name (in :data:`INTRA_METRICS` or :data:`INTER_METRICS`).
        scope: ``"intra"`` (per head) or ``"inter"`` (the whole layer).
        needs: The quantities (:data:`QUANTITIES`) and metrics (by :attr:`key`) its formula reads.
        formula: ``formula(block, out)`` on one block; ``None``: not computed by a sweep, but returned by the
            :class:`~mechgeom.analyses.contribution.geometry.LayerGeometry` method of that name.
        doc: Its definition.
        factor: Not weighted by ``alpha``, so not 0 by itself at a key after its query.
    """

    name: str
    scope: Scope
    needs: tuple[str, ...]
    formula: Formula | None
    doc: str
    factor: bool = False

    @property
    def key(self) -> str:
        """The name in a sweep: ``name`` intra-head, ``name + "_inter"`` inter-head."""
        return self.name if self.scope == "intra" else f"{self.name}_inter"


def inv_or_nan(den: Tensor) -> Tensor:
    """``1 / den``, NaN where ``den == 0`` (so that a product with it is NaN there, also for a 0 numerator)."""
    return torch.where(den == 0, torch.full_like(den, float("nan")), 1 / torch.where(den == 0, 1, den))


def inv_or_zero(den: Tensor) -> Tensor:
    """``1 / den``, 0 where ``den == 0``."""
    return torch.where(den == 0, torch.zeros_like(den), 1 / torch.where(den == 0, 1, den))


# ---- the quantities: prepared once per layer


def _inv_head_norm(layer: Layer, q: dict[str, Tensor]) -> Tensor:
    inv = inv_or_nan(layer.head_out_norm)[..., None]
    return inv if layer.modified is None else inv.masked_fill(layer.modified[..., None], float("nan"))


def _share_u(layer: Layer, q: dict[str, Tensor]) -> Tensor:
    u = einops.rearrange(layer.layer_u, "b q h d -> b h q d") * (q["inv_layer_norm"][:, None] ** 2)
    return u if layer.modified is None else u * (~layer.modified).to(layer.dtype)[..., None]


#: Every quantity, each after those it needs. The Gram comes first: :attr:`Layer.vt_norm` is then read off its
#: diagonal, as the fused sweep reads it.
QUANTITIES: dict[str, Quantity] = {
    q.name: q
    for q in (
        Quantity(
            "gram", "key", (),
            lambda layer, q: einops.rearrange(layer.gram, "b k h g -> h g b k").contiguous(),
            "[h g b k] G_j[h,g]",
        ),
        Quantity("vt_norm", "key", (), lambda layer, q: layer.vt_norm[:, :, None, :], "[b h 1 k] ‖vt[j,h]‖"),
        Quantity(
            "inv_head_norm", "query", (), _inv_head_norm,
            "[b h q 1] 1/‖o[i,h]‖: NaN where it is 0 and for a modified head (no per-source terms)",
        ),
        Quantity(
            "inv_layer_norm", "query", (), lambda layer, q: inv_or_nan(layer.layer_out_norm)[..., None],
            "[b q 1] 1/‖o[i]‖: NaN where it is 0",
        ),
        Quantity(
            "values", "key", (), lambda layer, q: einops.rearrange(layer.v, "b k h d -> b h d k").contiguous(),
            "[b h d k] v[j,h]",
        ),
        Quantity(
            "unit_values", "key", ("values", "vt_norm"), lambda layer, q: q["values"] * inv_or_zero(q["vt_norm"]),
            "[b h d k] v[j,h] / ‖vt[j,h]‖, 0 where that is 0",
        ),
        Quantity(
            "unit_head_u", "query", ("inv_head_norm",),
            lambda layer, q: einops.rearrange(layer.head_u, "b q h d -> b h q d") * q["inv_head_norm"],
            "[b h q d] o[i,h] @ W_O[h].T / ‖o[i,h]‖",
        ),
        Quantity(
            "share_u", "query", ("inv_layer_norm",), _share_u,
            "[b h q d] o[i] @ W_O[h].T / ‖o[i]‖², 0 for a modified head",
        ),
    )
}  # fmt: skip


# ---- the formulas: one block each, ``out`` a view of the result or None


def _value_weighted(b: Block, out: Tensor | None) -> Tensor:
    vw = torch.mul(b.alpha, b["vt_norm"], out=out)
    return vw if b.modified is None else vw.masked_fill_(b.modified, float("nan"))


def _value_weighted_normalized(b: Block, out: Tensor | None) -> Tensor:
    return torch.mul(b.alpha, b["factor_norm_ratio"], out=out)


def _contribution(b: Block, out: Tensor | None) -> Tensor:
    return torch.mul(b["value_weighted_normalized"], b["factor_cos"], out=out)


def _head_share(b: Block, out: Tensor | None) -> Tensor:
    return torch.matmul(b["share_u"], b["values"], out=out).mul_(b.alpha)


def _factor_norm_ratio(b: Block, out: Tensor | None) -> Tensor:
    return torch.mul(b["vt_norm"], b["inv_head_norm"], out=out)


def _factor_cos(b: Block, out: Tensor | None) -> Tensor:
    return torch.matmul(b["unit_head_u"], b["unit_values"], out=out)


def _attention_inter(b: Block, out: Tensor | None) -> Tensor:
    return torch.mean(b.alpha, dim=1, out=out)


def _value_weighted_inter(b: Block, out: Tensor | None) -> Tensor:
    """``sqrt(sum_{h,g} alpha[h,i,j] alpha[g,i,j] G_j[h,g])`` over the kept heads (``G`` symmetric)."""
    alpha = b.alpha if b.keep is None else b.alpha * b.keep
    gram = b["gram"]  # [h g b k]
    twice = gram * 2.0  # pre-scaled, since addcmul_(value=2) with broadcasting is a slow path
    sq = torch.zeros_like(alpha[:, 0]) if out is None else out.zero_()
    acc = torch.empty_like(alpha[:, 0])  # [b n k]
    for h in range(alpha.shape[1]):
        torch.mul(alpha[:, h], gram[h, h][:, None, :], out=acc)
        for g in range(h + 1, alpha.shape[1]):
            acc.addcmul_(alpha[:, g], twice[h, g][:, None, :])
        sq.addcmul_(acc, alpha[:, h])
    return sq.clamp_min_(0).sqrt_()


def _value_weighted_normalized_inter(b: Block, out: Tensor | None) -> Tensor:
    return torch.mul(b["value_weighted_inter"], b["inv_layer_norm"], out=out)


def _contribution_inter(b: Block, out: Tensor | None) -> Tensor:
    return torch.sum(b["head_share"], dim=1, out=out)


#: The table: every contribution metric, intra-head then inter-head, in the order of :data:`INTRA_METRICS`
#: and :data:`INTER_METRICS`.
METRICS: tuple[Metric, ...] = (
    Metric("attention", "intra", (), None, "alpha[h,i,j], the pattern itself"),
    Metric("value_weighted", "intra", ("vt_norm",), _value_weighted, "alpha[h,i,j] ‖vt[j,h]‖ (Kobayashi 2020)"),
    Metric(
        "value_weighted_normalized", "intra", ("factor_norm_ratio",), _value_weighted_normalized,
        "alpha[h,i,j] ‖vt[j,h]‖ / ‖o[i,h]‖",
    ),
    Metric(
        "contribution", "intra", ("value_weighted_normalized", "factor_cos"), _contribution,
        "<o[i,h], alpha[h,i,j] vt[j,h]> / ‖o[i,h]‖² = alpha (‖vt‖ / ‖o_h‖) cos",
    ),
    Metric(
        "head_share", "intra", ("share_u", "values"), _head_share,
        "<o[i], alpha[h,i,j] vt[j,h]> / ‖o[i]‖² (sums to 1 over heads and sources)",
    ),
    Metric(
        "factor_norm_ratio", "intra", ("vt_norm", "inv_head_norm"), _factor_norm_ratio,
        "‖vt[j,h]‖ / ‖o[i,h]‖", factor=True,
    ),
    Metric(
        "factor_cos", "intra", ("unit_head_u", "unit_values"), _factor_cos,
        "cos(o[i,h], vt[j,h]), 0 where ‖vt[j,h]‖ = 0", factor=True,
    ),
    Metric("attention", "inter", (), _attention_inter, "mean_h alpha[h,i,j]"),
    Metric(
        "value_weighted", "inter", ("gram",), _value_weighted_inter,
        "‖sum_h alpha[h,i,j] vt[j,h]‖ = sqrt(alpha^T G_j alpha)",
    ),
    Metric(
        "value_weighted_normalized", "inter", ("value_weighted_inter", "inv_layer_norm"),
        _value_weighted_normalized_inter, "‖sum_h alpha[h,i,j] vt[j,h]‖ / ‖o[i]‖",
    ),
    Metric(
        "contribution", "inter", ("head_share",), _contribution_inter,
        "<o[i], sum_h alpha[h,i,j] vt[j,h]> / ‖o[i]‖² = sum_h head_share",
    ),
)  # fmt: skip

#: Per-head metrics, ``[batch, layer, head_index, query_pos, key_pos]``.
INTRA_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.scope == "intra")
#: Whole-layer metrics, ``[batch, layer, query_pos, key_pos]``.
INTER_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.scope == "inter")


def lookup(name: str, scope: Scope | None = None) -> Metric:
    """The row of a metric: by ``name`` and ``scope``, or by its :attr:`Metric.key` (``scope=None``).

    Raises:
        ValueError: No such row; the message lists the valid names.
    """
    for m in METRICS:
        if (m.name, m.scope) == (name, scope) or (scope is None and m.key == name):
            return m
    valid = [m.name for m in METRICS if m.scope == scope] if scope else [m.key for m in METRICS]
    raise ValueError(f"no {scope or 'contribution'} metric {name!r}; valid: {valid}")


def plan(keys: Iterable[str]) -> tuple[list[Quantity], list[Metric]]:
    """What computing the metrics ``keys`` (:attr:`Metric.key`) takes: ``(quantities, metrics)``.

    The closure of their needs: the quantities in :data:`QUANTITIES`'s order, and every metric with a formula
    among them and those they need, each after what it needs.

    Raises:
        ValueError: A metric or a need that is in neither table, or needs that go round in a circle.
    """
    quantities: set[str] = set()
    order: list[Metric] = []
    seen: set[str] = set()

    def visit(key: str, path: tuple[str, ...]) -> None:
        if key in path:
            raise ValueError(f"the metrics' needs go round in a circle: {' -> '.join((*path, key))}")
        if key in QUANTITIES:
            quantities.add(key)
            for need in QUANTITIES[key].needs:
                visit(need, (*path, key))
            return
        if key in seen:
            return
        m = lookup(key)
        for need in m.needs:
            visit(need, (*path, key))
        seen.add(key)
        if m.formula is not None:
            order.append(m)

    for key in keys:
        visit(key, ())
    return [q for name, q in QUANTITIES.items() if name in quantities], order
