"""Lazy package exports (PEP 562): a package names what it exports and where, and imports it on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str], submodules: Sequence[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose names are imported on first use.

    Args:
        package: the package's name (``__name__``).
        namespace: its ``globals()``, where an imported name is kept so the next access is direct.
        exports: public name -> the module that defines it.
        submodules: subpackages or modules reachable as attributes.

    >>> ns = {}
    >>> getattr_, dir_ = lazy_exports("pkg", ns, {"sqrt": "math"}, ["json"])
    >>> getattr_("sqrt")(4.0), "sqrt" in ns, dir_()
    (2.0, True, ['json', 'sqrt'])
    """

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}" if "." not in name else name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports, *submodules})

    return __getattr__, __dir__
