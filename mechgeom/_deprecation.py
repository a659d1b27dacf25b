"""The one way a public name goes away: it keeps working for one release and says what replaces it."""

from __future__ import annotations

import warnings

__all__ = ["warn_deprecated"]


def warn_deprecated(old: str, new: str, *, removed_in: str = "0.3") -> None:
    """Emit a ``DeprecationWarning`` that ``old`` is replaced by ``new`` and goes away in ``removed_in``.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     warn_deprecated("f_from_cache(model, cache)", "f(model, tokens, cache=cache)")
    >>> print(seen[0].message)
    f_from_cache(model, cache) is deprecated and will be removed in mechgeom 0.3; use f(model, tokens, cache=cache)
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in mechgeom {removed_in}; use {new}",
        DeprecationWarning,
        stacklevel=3,
    )
