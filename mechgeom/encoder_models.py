"""Deprecated alias of :mod:`mechgeom.models.encoders` (the offline encoder and the encoder forward pass).

Importing it warns with a ``DeprecationWarning``; every name resolves to the one in
:mod:`mechgeom.models.encoders`. The alias goes away in the next release: import
``mechgeom.models.encoders`` instead.
"""

from __future__ import annotations

import warnings
from typing import Any

from mechgeom.models import encoders
from mechgeom.models.encoders import *  # noqa: F403

warnings.warn(
    "mechgeom.encoder_models moved to mechgeom.models.encoders; the old name goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = list(encoders.__all__)


def __getattr__(name: str) -> Any:
    """Names outside ``__all__`` (constants such as ``MINILM_MODULE``) from :mod:`mechgeom.models.encoders`."""
    return getattr(encoders, name)
