"""mechgeom: geometry-aware attention analysis on TransformerLens.

Every analysis is a set of hooks on ``blocks.{l}.attn.hook_pattern``, ``hook_v`` and ``hook_z``;
the functions exported here are conveniences on top of those hooks.
"""

from mechgeom.contribution import (
    ContributionCollector,
    ContributionResult,
    contribution_weights,
    contribution_weights_from_cache,
)
from mechgeom.models import list_models, load_model

__version__ = "0.1.0"

__all__ = [
    "ContributionCollector",
    "ContributionResult",
    "__version__",
    "contribution_weights",
    "contribution_weights_from_cache",
    "list_models",
    "load_model",
]
