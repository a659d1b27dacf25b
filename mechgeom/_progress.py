"""The one progress helper: ``tqdm.auto`` bars with a ``desc`` and an off switch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

__all__ = ["progress"]


def progress(
    iterable: Iterable[T], *, desc: str, enabled: bool = True, total: int | None = None
) -> Iterable[T]:
    """Wrap ``iterable`` in a ``tqdm.auto`` bar, or return it unchanged when ``enabled`` is False.

    >>> list(progress(range(3), desc="demo", enabled=False))
    [0, 1, 2]
    """
    if not enabled:
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False)
