"""mechgeom: geometry-aware attention analysis on TransformerLens.

Every analysis is a set of hooks on ``blocks.{l}.attn.hook_pattern``, ``hook_v`` and ``hook_z``; the
functions exported here are conveniences on top of those hooks, each of the shape
``analysis(model, tokens_or_text, *, layers=None, cache=None, extra_hooks=(), verbose=False, ...)``.
The layers are :mod:`mechgeom.models`, :mod:`mechgeom.hooks` (readers and interventions),
:mod:`mechgeom.analyses` (one package per idea, on the contract of :mod:`mechgeom.analyses.base`),
:mod:`mechgeom.viz` and :mod:`mechgeom.report` (see ``docs/architecture.md``). The definitions of every
quantity are in ``docs/definitions.md``.

Names are imported on first use, so ``import mechgeom`` (and the command line) stays fast.

>>> import mechgeom
>>> mechgeom.contribution_weights.__module__
'mechgeom.analyses.contribution.weights'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mechgeom._lazy import lazy_exports

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # the contract
    "Collector": "mechgeom.analyses.base",
    "Result": "mechgeom.analyses.base",
    "collect": "mechgeom.analyses.base",
    # attribution methods of the field
    "RolloutCollector": "mechgeom.analyses.attribution.rollout",
    "RolloutResult": "mechgeom.analyses.attribution.rollout",
    "attention_rollout": "mechgeom.analyses.attribution.rollout",
    # contribution weights
    "ContributionCollector": "mechgeom.analyses.contribution.weights",
    "ContributionResult": "mechgeom.analyses.contribution.weights",
    "contribution_weights": "mechgeom.analyses.contribution.weights",
    "contribution_weights_from_cache": "mechgeom.analyses.contribution.weights",
    "contribution_overview": "mechgeom.analyses.contribution.overview",
    # faithfulness
    "faithfulness_summary": "mechgeom.analyses.faithfulness.rankings",
    "source_rankings": "mechgeom.analyses.faithfulness.rankings",
    "perplexity_curves": "mechgeom.analyses.faithfulness.curves",
    "task_accuracy_curves": "mechgeom.analyses.faithfulness.curves",
    "embedding_curves": "mechgeom.analyses.faithfulness.embedding",
    # heads
    "HeadStatsCollector": "mechgeom.analyses.heads.stats",
    "head_stats": "mechgeom.analyses.heads.stats",
    "head_stats_from_cache": "mechgeom.analyses.heads.stats",
    "head_orders": "mechgeom.analyses.heads.orders",
    "retention_curves": "mechgeom.analyses.heads.pruning",
    "single_head_sweep": "mechgeom.analyses.heads.pruning",
    "TaxonomyCollector": "mechgeom.analyses.heads.taxonomy",
    "classify_heads": "mechgeom.analyses.heads.taxonomy",
    "classify_heads_from_cache": "mechgeom.analyses.heads.taxonomy",
    # scoring
    "encode_choices": "mechgeom.analyses.scoring",
    "perplexity": "mechgeom.analyses.scoring",
    "score_choices": "mechgeom.analyses.scoring",
    "task_accuracy": "mechgeom.analyses.scoring",
    "text_nll": "mechgeom.analyses.scoring",
    "token_nll": "mechgeom.analyses.scoring",
    # selection
    "SelectionCollector": "mechgeom.analyses.selection.collector",
    "token_selection": "mechgeom.analyses.selection.collector",
    "token_selection_from_cache": "mechgeom.analyses.selection.collector",
    # sinks
    "SinkCollector": "mechgeom.analyses.sinks.geometry",
    "sink_statistics": "mechgeom.analyses.sinks.statistics",
    "sink_statistics_from_cache": "mechgeom.analyses.sinks.statistics",
    "encoder_sink_statistics": "mechgeom.analyses.sinks.encoder",
    "convexity_by_intervention": "mechgeom.analyses.sinks.convexity",
    "convexity_check": "mechgeom.analyses.sinks.convexity",
    "sink_ablation": "mechgeom.analyses.sinks.ablation",
    # hooks: readers and interventions
    "LayerCollector": "mechgeom.hooks",
    "ablate_value_hook": "mechgeom.hooks",
    "head_ablation_hooks": "mechgeom.hooks",
    "mask_sources_hook": "mechgeom.hooks",
    "masking_hooks": "mechgeom.hooks",
    "modified_mask": "mechgeom.hooks",
    "ranked_mask_hook": "mechgeom.hooks",
    "replace_z_hook": "mechgeom.hooks",
    "set_sink_mass_hook": "mechgeom.hooks",
    "sink_mass_hooks": "mechgeom.hooks",
    "sink_value_hooks": "mechgeom.hooks",
    "to_tokens": "mechgeom.hooks",
    # models
    "list_models": "mechgeom.models",
    "load_model": "mechgeom.models",
    "sentence_embedding": "mechgeom.models.encoders",
}
_SUBPACKAGES = ("analyses", "data", "hooks", "maths", "models", "report", "sweep", "typing", "viz")

__all__ = ["__version__", *sorted(_EXPORTS)]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS, _SUBPACKAGES)


if TYPE_CHECKING:  # the same names, for type checkers and editors (``X as X``: an explicit re-export)
    from mechgeom.analyses.attribution.rollout import (
        RolloutCollector as RolloutCollector,
        RolloutResult as RolloutResult,
        attention_rollout as attention_rollout,
    )
    from mechgeom.analyses.base import (
        Collector as Collector,
        Result as Result,
        collect as collect,
    )
    from mechgeom.analyses.contribution.overview import (
        contribution_overview as contribution_overview,
    )
    from mechgeom.analyses.contribution.weights import (
        ContributionCollector as ContributionCollector,
        ContributionResult as ContributionResult,
        contribution_weights as contribution_weights,
        contribution_weights_from_cache as contribution_weights_from_cache,
    )
    from mechgeom.analyses.faithfulness.curves import (
        perplexity_curves as perplexity_curves,
        task_accuracy_curves as task_accuracy_curves,
    )
    from mechgeom.analyses.faithfulness.embedding import (
        embedding_curves as embedding_curves,
    )
    from mechgeom.analyses.faithfulness.rankings import (
        faithfulness_summary as faithfulness_summary,
        source_rankings as source_rankings,
    )
    from mechgeom.analyses.heads.orders import (
        head_orders as head_orders,
    )
    from mechgeom.analyses.heads.pruning import (
        retention_curves as retention_curves,
        single_head_sweep as single_head_sweep,
    )
    from mechgeom.analyses.heads.stats import (
        HeadStatsCollector as HeadStatsCollector,
        head_stats as head_stats,
        head_stats_from_cache as head_stats_from_cache,
    )
    from mechgeom.analyses.heads.taxonomy import (
        TaxonomyCollector as TaxonomyCollector,
        classify_heads as classify_heads,
        classify_heads_from_cache as classify_heads_from_cache,
    )
    from mechgeom.analyses.scoring import (
        encode_choices as encode_choices,
        perplexity as perplexity,
        score_choices as score_choices,
        task_accuracy as task_accuracy,
        text_nll as text_nll,
        token_nll as token_nll,
    )
    from mechgeom.analyses.selection.collector import (
        SelectionCollector as SelectionCollector,
        token_selection as token_selection,
        token_selection_from_cache as token_selection_from_cache,
    )
    from mechgeom.analyses.sinks.ablation import (
        sink_ablation as sink_ablation,
    )
    from mechgeom.analyses.sinks.convexity import (
        convexity_by_intervention as convexity_by_intervention,
        convexity_check as convexity_check,
    )
    from mechgeom.analyses.sinks.encoder import (
        encoder_sink_statistics as encoder_sink_statistics,
    )
    from mechgeom.analyses.sinks.geometry import (
        SinkCollector as SinkCollector,
    )
    from mechgeom.analyses.sinks.statistics import (
        sink_statistics as sink_statistics,
        sink_statistics_from_cache as sink_statistics_from_cache,
    )
    from mechgeom.hooks import (
        LayerCollector as LayerCollector,
        ablate_value_hook as ablate_value_hook,
        head_ablation_hooks as head_ablation_hooks,
        mask_sources_hook as mask_sources_hook,
        masking_hooks as masking_hooks,
        modified_mask as modified_mask,
        ranked_mask_hook as ranked_mask_hook,
        replace_z_hook as replace_z_hook,
        set_sink_mass_hook as set_sink_mass_hook,
        sink_mass_hooks as sink_mass_hooks,
        sink_value_hooks as sink_value_hooks,
        to_tokens as to_tokens,
    )
    from mechgeom.models import (
        list_models as list_models,
        load_model as load_model,
    )
    from mechgeom.models.encoders import (
        sentence_embedding as sentence_embedding,
    )
