"""Contribution weights and their baselines (paper A; ``docs/definitions.md`` §1).

A source's share of a head's (or a layer's) attention output, ``c = <o_i, alpha_ij vt_j> / ‖o_i‖²``, beside
raw attention and the value-weighted scores, computed layer by layer by a hook collector.

Modules: :mod:`~.metrics` (the table that declares every metric, :data:`METRICS`), :mod:`~.geometry` (the
per-layer maths, :class:`LayerGeometry`), :mod:`~.weights` (the collector, the result and
:func:`contribution_weights`), :mod:`~.stats` (headline statistics) and :mod:`~.overview` (the same
statistics streamed over a corpus).
"""

from __future__ import annotations

from mechgeom.analyses.contribution.geometry import (
    BLOCK_SIZE,
    FUSED_BLOCK_SIZE,
    INTER_METRICS,
    INTRA_METRICS,
    LayerGeometry,
)
from mechgeom.analyses.contribution.metrics import METRICS, QUANTITIES, Metric, Quantity
from mechgeom.analyses.contribution.overview import (
    ContributionOverview,
    contribution_overview,
)
from mechgeom.analyses.contribution.stats import (
    HEAD_STATISTICS,
    SUMMARY_METRICS,
    ScoreTotals,
    add_sums,
    finish_sums,
    overview_frames,
    overview_summary,
    result_summary,
    score_sums,
    special_token_frame,
    view_layer_of,
)
from mechgeom.analyses.contribution.weights import (
    RANKING_METRICS,
    ContributionCollector,
    ContributionResult,
    contribution_weights,
    contribution_weights_from_cache,
    reconstruct_attn_out,
)

__all__ = [
    "BLOCK_SIZE",
    "FUSED_BLOCK_SIZE",
    "HEAD_STATISTICS",
    "INTER_METRICS",
    "INTRA_METRICS",
    "METRICS",
    "QUANTITIES",
    "RANKING_METRICS",
    "SUMMARY_METRICS",
    "ContributionCollector",
    "ContributionOverview",
    "ContributionResult",
    "LayerGeometry",
    "Metric",
    "Quantity",
    "ScoreTotals",
    "add_sums",
    "contribution_overview",
    "contribution_weights",
    "contribution_weights_from_cache",
    "finish_sums",
    "overview_frames",
    "overview_summary",
    "reconstruct_attn_out",
    "result_summary",
    "score_sums",
    "special_token_frame",
    "view_layer_of",
]
