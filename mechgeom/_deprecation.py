"""The one way a public name goes away: it keeps working for one release and says what replaces it."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["keyword_only", "warn_deprecated"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


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


def keyword_only(*names: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Make ``names`` keyword-only while calls that still pass them by position (after the function's
    positional parameters, in that order) keep working for one release, with a ``DeprecationWarning``.

    >>> @keyword_only("b", "c")
    ... def f(a, *, b=1, c=2):
    ...     return a, b, c
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     f(0, 5), f(0, b=5)
    ((0, 5, 2), (0, 5, 2))
    >>> print(seen[0].message)
    f(..., b) by position is deprecated and will be removed in mechgeom 0.3; use f(..., b=...)
    """

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        params = inspect.signature(fn).parameters.values()
        n_positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)

        @functools.wraps(fn)
        def inner(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            extra = args[n_positional:]
            if extra:
                if len(extra) > len(names):
                    raise TypeError(
                        f"{fn.__name__}() takes {n_positional} positional arguments (then "
                        f"{', '.join(names)} by keyword) but {len(args)} were given"
                    )
                for name, value in zip(names, extra, strict=False):
                    if name in kwargs:
                        raise TypeError(f"{fn.__name__}() got multiple values for argument {name!r}")
                    kwargs[name] = value
                given = ", ".join(names[: len(extra)])
                warn_deprecated(
                    f"{fn.__name__}(..., {given}) by position",
                    f"{fn.__name__}(..., {'=..., '.join(names[: len(extra)])}=...)",
                )
                args = args[:n_positional]  # type: ignore[assignment]
            return fn(*args, **kwargs)

        return inner

    return wrap
