"""Attention sinks as active suppressors (papers A and B; ``docs/definitions.md`` §2).

Modules: :mod:`~.geometry` (sink rate, norm ratios, anti-alignment, the factor decomposition; the collector
and result), :mod:`~.convexity` (the convex output-norm curve, closed form and by intervention),
:mod:`~.ablation` (the sink-value ablation), :mod:`~.encoder` (an encoder's ``[CLS]``/``[SEP]`` sinks) and
:mod:`~.statistics` (:func:`sink_statistics` and the head choices the report uses).
"""

from __future__ import annotations

from mechgeom.analyses.sinks.ablation import (
    AblationMode,
    SinkAblationResult,
    cone_cos,
    random_control_positions,
    sink_ablation,
)
from mechgeom.analyses.sinks.convexity import (
    ConvexityCheck,
    ConvexityCurves,
    ConvexityTerms,
    convex_minimiser,
    convex_norm,
    convexity_by_intervention,
    convexity_check,
    convexity_terms,
    query_terms,
    sink_mean_cos,
    sink_mean_split,
)
from mechgeom.analyses.sinks.encoder import (
    encoder_sink_statistics,
    merge_sink_results,
)
from mechgeom.analyses.sinks.geometry import (
    FACTORS,
    GROUPS,
    SinkCollector,
    SinkResult,
    describe_values,
    factor_moments,
    factor_shares_from_moments,
    sink_norm_ratio,
    sink_rate,
    sink_token_cos,
)
from mechgeom.analyses.sinks.statistics import (
    sink_statistics,
    sink_statistics_from_cache,
    spread_sink_heads,
    top_sink_heads,
)

__all__ = [
    "FACTORS",
    "GROUPS",
    "AblationMode",
    "ConvexityCheck",
    "ConvexityCurves",
    "ConvexityTerms",
    "SinkAblationResult",
    "SinkCollector",
    "SinkResult",
    "cone_cos",
    "convex_minimiser",
    "convex_norm",
    "convexity_by_intervention",
    "convexity_check",
    "convexity_terms",
    "describe_values",
    "encoder_sink_statistics",
    "factor_moments",
    "factor_shares_from_moments",
    "merge_sink_results",
    "query_terms",
    "random_control_positions",
    "sink_ablation",
    "sink_mean_cos",
    "sink_mean_split",
    "sink_norm_ratio",
    "sink_rate",
    "sink_statistics",
    "sink_statistics_from_cache",
    "sink_token_cos",
    "spread_sink_heads",
    "top_sink_heads",
]
