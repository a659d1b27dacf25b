"""Causal faithfulness of source rankings (paper A's masking test; ``docs/definitions.md`` §3).

Rank each query's sources by a score, remove the top (comprehensiveness) or bottom (sufficiency) share of
them at ``hook_pattern`` without renormalising, and measure the damage: ΔPPL for a decoder, task accuracy on
multiple-choice items, or the sentence embedding's cosine for an encoder.

Modules: :mod:`~.rankings` (the registry of source ranking methods, the rankings of a clean pass and the
verdict on paper A's claimed order), :mod:`~.harness` (the one masking engine, on the sweep engine),
:mod:`~.curves` (the decoder sweeps) and :mod:`~.embedding` (the encoder curves). A new ranking method is one
function registered with :func:`register_ranking`; every sweep then takes its name in ``metrics``.
"""

from __future__ import annotations

from mechgeom.analyses.faithfulness.curves import (
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
from mechgeom.analyses.faithfulness.harness import masking_sweep
from mechgeom.analyses.faithfulness.rankings import (
    DEFAULT_RATES,
    FAITHFULNESS_METRICS,
    SCOPES,
    RankingMethod,
    RankingRequest,
    SourceRanking,
    area_ordering,
    faithfulness_summary,
    ranking_methods,
    register_ranking,
    source_rankings,
)

__all__ = [
    "DEFAULT_RATES",
    "EMBEDDING_RATES",
    "FAITHFULNESS_METRICS",
    "SCOPES",
    "EmbeddingFaithfulness",
    "EmbeddingFn",
    "RankingMethod",
    "RankingRequest",
    "SourceRanking",
    "area_ordering",
    "embedding_curves",
    "embedding_effect",
    "embedding_summary",
    "faithfulness_summary",
    "masking_sweep",
    "perplexity_curves",
    "ranking_methods",
    "register_ranking",
    "source_rankings",
    "task_accuracy_curves",
]
