"""Position sets shared by the analyses and the interventions: the sink set ``S``, the queries after it, masks.

>>> sink_mask([0], 3).tolist(), query_mask([0], 3).tolist()
([True, False, False], [False, True, True])
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from mechgeom.typing import Tensor

__all__ = [
    "SinkPositionError",
    "check_sink_positions",
    "masked_mean",
    "query_mask",
    "resolve_sinks",
    "sink_mask",
]


class SinkPositionError(IndexError, ValueError):
    """A sink position outside the sequence (an ``IndexError`` and, for older callers, a ``ValueError``)."""


def check_sink_positions(
    sink_positions: int | Sequence[int] | None, pos: int | None = None
) -> tuple[int, ...]:
    """The one sink-set validation, positions in the order given; ``None`` means ``(0,)``.

    Raises ``ValueError`` for an empty set or duplicates, and :class:`SinkPositionError` for a negative
    position or (when ``pos`` is given) one at or beyond the sequence length.

    >>> check_sink_positions([2, 0], pos=5)
    (2, 0)
    >>> check_sink_positions(5, pos=5)
    Traceback (most recent call last):
    ...
    mechgeom.hooks.masks.SinkPositionError: sink position(s) [5] beyond the sequence (length 5, positions 0..4)
    """
    if sink_positions is None:
        return (0,)
    out: tuple[int, ...]
    if isinstance(sink_positions, int) or hasattr(sink_positions, "__index__"):
        out = (operator.index(sink_positions),)  # type: ignore[arg-type]
    else:
        out = tuple(operator.index(s) for s in sink_positions)
    if not out:
        raise ValueError("sink_positions is empty; give at least one position (default [0])")
    if any(s < 0 for s in out):
        raise SinkPositionError(f"sink positions must be non-negative, got {list(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate sink positions in {list(out)}")
    if pos is not None and max(out) >= pos:
        bad = [s for s in out if s >= pos]
        raise SinkPositionError(
            f"sink position(s) {bad} beyond the sequence (length {pos}, positions 0..{pos - 1})"
        )
    return out


def resolve_sinks(sink_positions: int | Sequence[int] | None, pos: int | None = None) -> list[int]:
    """The sorted sink set ``S`` (:func:`check_sink_positions`); ``None`` means ``[0]``.

    >>> resolve_sinks(None), resolve_sinks([2, 0])
    ([0], [0, 2])
    """
    return sorted(check_sink_positions(sink_positions, pos))


def sink_mask(sinks: Sequence[int], pos: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[pos]`` bool, True on the sink set."""
    mask = torch.zeros(pos, dtype=torch.bool, device=device)
    mask[list(sinks)] = True
    return mask


def query_mask(sinks: Sequence[int], pos: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[pos]`` bool, True on ``Q = {i : i > max(S)}``."""
    return torch.arange(pos, device=device) > max(sinks)


def masked_mean(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    """Mean of ``x`` over ``mask`` along ``dim`` (NaN entries skipped); NaN where nothing is left."""
    keep = mask & ~torch.isnan(x)
    num = torch.where(keep, x, torch.zeros_like(x)).sum(dim)
    den = keep.sum(dim)
    return torch.where(den > 0, num / den.clamp_min(1), torch.full_like(num, float("nan")))
