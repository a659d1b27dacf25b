"""Heads as units: the Retriever/Mixer/Reset taxonomy, per-head statistics, removal orders and pruning
(paper B; ``docs/definitions.md`` §5 and §6).

Modules: :mod:`~.taxonomy` (source winners and labels), :mod:`~.stats` (output norm, entropy, weight
magnitude, mean ``z``), :mod:`~.orders` (the removal orders), :mod:`~.removal` (batched single-head removal)
and :mod:`~.pruning` (retention curves and the single-head sweep).
"""

from __future__ import annotations

from mechgeom.analyses.heads.orders import (
    MAD_SCALE,
    ORDERS,
    REGIMES,
    RETENTION_LEVELS,
    compare_orders,
    entropy_order,
    head_orders,
    head_table,
    mad_outliers,
    magnitude_order,
    random_order,
    retention_levels,
    single_head_order,
    taxonomy_order,
    taxonomy_wins,
)
from mechgeom.analyses.heads.pruning import (
    RetentionCurves,
    SingleHeadResult,
    retention_curve,
    retention_curves,
    single_head_sweep,
    sweep_exactness,
)
from mechgeom.analyses.heads.removal import (
    COPIES_PER_BATCH,
    batched_head_nll,
    clean_resid,
    copies_hook,
    head_chunks,
    text_batches,
)
from mechgeom.analyses.heads.stats import (
    HeadStats,
    HeadStatsCollector,
    head_output_norm,
    head_stats,
    head_stats_from_cache,
    pattern_entropy,
    weight_magnitude,
)
from mechgeom.analyses.heads.taxonomy import (
    LABELS,
    TABLE_COLUMNS,
    AgreementResult,
    TaxonomyCollector,
    TaxonomyResult,
    classify_heads,
    classify_heads_from_cache,
    label_agreement,
    label_distribution,
    label_from_fractions,
    layer_taxonomy,
    regime_summary,
    source_winners,
)

__all__ = [
    "COPIES_PER_BATCH",
    "LABELS",
    "MAD_SCALE",
    "ORDERS",
    "REGIMES",
    "RETENTION_LEVELS",
    "TABLE_COLUMNS",
    "AgreementResult",
    "HeadStats",
    "HeadStatsCollector",
    "RetentionCurves",
    "SingleHeadResult",
    "TaxonomyCollector",
    "TaxonomyResult",
    "batched_head_nll",
    "classify_heads",
    "classify_heads_from_cache",
    "clean_resid",
    "compare_orders",
    "copies_hook",
    "entropy_order",
    "head_chunks",
    "head_orders",
    "head_output_norm",
    "head_stats",
    "head_stats_from_cache",
    "head_table",
    "label_agreement",
    "label_distribution",
    "label_from_fractions",
    "layer_taxonomy",
    "mad_outliers",
    "magnitude_order",
    "pattern_entropy",
    "random_order",
    "regime_summary",
    "retention_curve",
    "retention_curves",
    "retention_levels",
    "single_head_order",
    "single_head_sweep",
    "source_winners",
    "sweep_exactness",
    "taxonomy_order",
    "taxonomy_wins",
    "text_batches",
    "weight_magnitude",
]
