"""Geometry of token selection (paper B; ``docs/definitions.md`` §4): precision, recall and the extreme
F-score of top-N selections, inversion certificates and the sink-aware bound.

Modules: :mod:`~.geometry` (per-query maths), :mod:`~.bounds` (certificates and the sink-aware bound) and
:mod:`~.collector` (the collector, the result and :func:`token_selection`).
"""

from __future__ import annotations

from mechgeom.analyses.selection.bounds import (
    BoundParams,
    bound_radii,
    bound_vs_measured,
    fit_bound_params,
    inversion_certificate,
    sink_aware_bound,
)
from mechgeom.analyses.selection.collector import (
    DEFAULT_NS,
    PER_QUERY,
    SelectionCollector,
    SelectionResult,
    layer_selection,
    token_selection,
    token_selection_from_cache,
)
from mechgeom.analyses.selection.geometry import (
    candidate_mask,
    extreme_f_score,
    precision_recall_curve,
    random_ranks,
    scores_by_n,
    selection_distances,
    sink_effect,
    source_ranks,
)

__all__ = [
    "DEFAULT_NS",
    "PER_QUERY",
    "BoundParams",
    "SelectionCollector",
    "SelectionResult",
    "bound_radii",
    "bound_vs_measured",
    "candidate_mask",
    "extreme_f_score",
    "fit_bound_params",
    "inversion_certificate",
    "layer_selection",
    "precision_recall_curve",
    "random_ranks",
    "scores_by_n",
    "selection_distances",
    "sink_aware_bound",
    "sink_effect",
    "source_ranks",
    "token_selection",
    "token_selection_from_cache",
]
