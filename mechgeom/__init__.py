"""mechgeom: geometry-aware attention analysis on TransformerLens.

Every analysis is a set of hooks on ``blocks.{l}.attn.hook_pattern``, ``hook_v`` and ``hook_z``;
the functions exported here are conveniences on top of those hooks. The entry points of every analysis and
every hook factory are exported here; the layers are ``mechgeom.hooks`` (readers and interventions), the
analysis modules, ``mechgeom.viz`` (views and figures) and ``mechgeom.report`` (see ``docs/architecture.md``).
"""

from mechgeom.analyses.contribution.overview import contribution_overview
from mechgeom.analyses.contribution.weights import (
    ContributionCollector,
    ContributionResult,
    contribution_weights,
    contribution_weights_from_cache,
)
from mechgeom.analyses.faithfulness import faithfulness_summary, source_rankings
from mechgeom.analyses.faithfulness.curves import perplexity_curves, task_accuracy_curves
from mechgeom.analyses.faithfulness.embedding import embedding_curves
from mechgeom.analyses.heads import HeadStatsCollector, head_orders, head_stats, head_stats_from_cache
from mechgeom.analyses.heads.pruning import retention_curves, single_head_sweep, task_accuracy
from mechgeom.analyses.heads.taxonomy import TaxonomyCollector, classify_heads, classify_heads_from_cache
from mechgeom.analyses.scoring import encode_choices, perplexity, score_choices, text_nll, token_nll
from mechgeom.analyses.selection.collector import (
    SelectionCollector,
    token_selection,
    token_selection_from_cache,
)
from mechgeom.analyses.sinks import convexity_by_intervention, convexity_check, sink_ablation
from mechgeom.analyses.sinks.encoder import encoder_sink_statistics
from mechgeom.analyses.sinks.statistics import SinkCollector, sink_statistics, sink_statistics_from_cache
from mechgeom.hooks import (
    LayerCollector,
    ablate_value_hook,
    collect,
    head_ablation_hooks,
    mask_sources_hook,
    masking_hooks,
    modified_mask,
    ranked_mask_hook,
    replace_z_hook,
    set_sink_mass_hook,
    sink_mass_hooks,
    sink_value_hooks,
    to_tokens,
)
from mechgeom.models import list_models, load_model
from mechgeom.models.encoders import sentence_embedding

__version__ = "0.1.0"

__all__ = [
    "ContributionCollector",
    "ContributionResult",
    "HeadStatsCollector",
    "LayerCollector",
    "SelectionCollector",
    "SinkCollector",
    "TaxonomyCollector",
    "__version__",
    "ablate_value_hook",
    "classify_heads",
    "classify_heads_from_cache",
    "collect",
    "contribution_overview",
    "contribution_weights",
    "contribution_weights_from_cache",
    "convexity_by_intervention",
    "convexity_check",
    "embedding_curves",
    "encode_choices",
    "encoder_sink_statistics",
    "faithfulness_summary",
    "head_ablation_hooks",
    "head_orders",
    "head_stats",
    "head_stats_from_cache",
    "list_models",
    "load_model",
    "mask_sources_hook",
    "masking_hooks",
    "modified_mask",
    "perplexity",
    "perplexity_curves",
    "ranked_mask_hook",
    "replace_z_hook",
    "retention_curves",
    "score_choices",
    "sentence_embedding",
    "set_sink_mass_hook",
    "single_head_sweep",
    "sink_ablation",
    "sink_mass_hooks",
    "sink_statistics",
    "sink_statistics_from_cache",
    "sink_value_hooks",
    "source_rankings",
    "task_accuracy",
    "task_accuracy_curves",
    "text_nll",
    "to_tokens",
    "token_nll",
    "token_selection",
    "token_selection_from_cache",
]
