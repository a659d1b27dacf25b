"""Causal faithfulness of source rankings (paper A's masking test; ``docs/definitions.md`` §3).

Rank each query's sources by a score, remove the top (comprehensiveness) or bottom (sufficiency) share of
them at ``hook_pattern`` without renormalising, and measure the damage: ΔPPL for a decoder, task accuracy on
multiple-choice items, or the sentence embedding's cosine for an encoder.

Modules: :mod:`~.rankings` (source rankings and the verdict on paper A's claimed order), :mod:`~.curves`
(the decoder sweeps) and :mod:`~.embedding` (the encoder curves).
"""

from __future__ import annotations

from mechgeom.analyses.faithfulness.curves import (
    DEFAULT_RATES,
    perplexity_curves,
    task_accuracy_curves,
)
from mechgeom.analyses.faithfulness.embedding import (
    EMBEDDING_RATES,
    EmbeddingFaithfulness,
    EmbeddingFn,
    embedding_curves,
    embedding_effect,
    embedding_summary,
)
from mechgeom.analyses.faithfulness.rankings import (
    FAITHFULNESS_METRICS,
    SCOPES,
    SourceRanking,
    area_ordering,
    faithfulness_summary,
    source_rankings,
)

__all__ = [
    "DEFAULT_RATES",
    "EMBEDDING_RATES",
    "FAITHFULNESS_METRICS",
    "SCOPES",
    "EmbeddingFaithfulness",
    "EmbeddingFn",
    "SourceRanking",
    "area_ordering",
    "embedding_curves",
    "embedding_effect",
    "embedding_summary",
    "faithfulness_summary",
    "perplexity_curves",
    "source_rankings",
    "task_accuracy_curves",
]
