"""The report's stages for an encoder (a bidirectional model such as ``"minilm-l6"``).

An encoder has no next-token prediction and no causal pattern, so the decoder stages that need either
(ΔPPL faithfulness, token selection, the taxonomy, pruning by perplexity) are skipped with a line that says
why (:data:`DECODER_ONLY`). In their place: contribution weights over every key, with ``[CLS]`` and
``[SEP]`` where a decoder has its sink; the sink statistics of ``[CLS]`` and ``[SEP]`` resolved in each
window; and faithfulness as ``1 − cos`` of the mean-pooled sentence embedding. As in
:mod:`mechgeom.report.stages`, each stage calls its driver (:mod:`mechgeom.report.drivers`, the code of
``mechgeom run encoder`` too) and names the files.
"""

from __future__ import annotations

from typing import Any

from mechgeom.report.base import ReportSettings, Stage, StageContext, StageOutput
from mechgeom.report.options import FAITHFULNESS_METRICS

__all__ = ["DECODER_ONLY", "ENCODER_STAGES"]

#: Decoder stages an encoder skips, and why (the report shows the reason as the stage's line).
DECODER_ONLY = {
    "faithfulness": "needs next-token prediction (ΔPPL); an encoder's faithfulness is the embedding stage",
    "selection": "token-selection geometry is defined here on causal patterns (sources j <= i)",
    "taxonomy": "the Retriever/Mixer/Reset labels need a causal pattern with a position-0 sink",
    "pruning": "needs next-token prediction (perplexity as heads are removed)",
}
_SPECIALS = ["[CLS]", "[SEP]"]


def _contribution_params(s: ReportSettings) -> dict[str, Any]:
    return {"n_texts": min(s.n_texts, 2 if s.quick else 8), "view_layer": "last"}


def _run_contributions(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.report.drivers.contributions import special_tokens

    out = special_tokens(ctx.model, ctx.tokens[: p["n_texts"]], verbose=ctx.verbose)
    return out.renamed(
        {"special_tokens": "contributions_special_tokens"}, {"heatmaps": "contributions_heatmaps"}
    )


def _sinks_params(s: ReportSettings) -> dict[str, Any]:
    return {"n_texts": s.n_texts, "sink_positions": list(_SPECIALS)}


def _run_sinks(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.report.drivers.sinks import encoder_sinks

    corpus = ctx.settings.corpus
    out = encoder_sinks(
        ctx.model,
        {corpus: ctx.tokens[: p["n_texts"]]},
        sink_positions=p["sink_positions"],
        verbose=ctx.verbose,
    )
    return out.renamed({f"heads_{corpus}": "sinks"}, {"rate_vs_ratio": "sinks_rate_vs_ratio"})


def _embedding_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 2 if s.quick else 8),
        "metrics": list(FAITHFULNESS_METRICS),
        "rates": [0.0, 0.3, 0.6] if s.quick else [0.0, 0.1, 0.25, 0.5, 0.75, 0.9],
        "scope": "intra",
        "seed": s.seed,
        "n_boot": 200 if s.quick else 1000,
    }


def _run_embedding(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.report.drivers.faithfulness import embedding

    out = embedding(
        ctx.model, ctx.tokens[: p["n_texts"]], metrics=p["metrics"], rates=p["rates"], scope=p["scope"],
        seed=p["seed"], n_boot=p["n_boot"], verbose=ctx.verbose,
        title=f"{ctx.settings.model}: all layers masked at once",
    )  # fmt: skip
    return out.renamed({"curves": "embedding_faithfulness"}, {"curves": "embedding_curves"})


ENCODER_STAGES: tuple[Stage, ...] = (
    Stage(
        "contributions",
        "Contribution weights vs attention ([CLS] and [SEP])",
        "mechgeom.viz",
        _contribution_params,
        _run_contributions,
        "How much of each head's output each source token carries (paper A), every key of every query.",
    ),
    Stage(
        "sinks",
        "[CLS] and [SEP] as sinks",
        "mechgeom.analyses.sinks.statistics",
        _sinks_params,
        _run_sinks,
        "Attention mass, value-norm ratio and anti-alignment of [CLS] and [SEP], resolved in each window.",
    ),
    Stage(
        "embedding_faithfulness",
        "Faithfulness of the sentence embedding",
        "mechgeom.analyses.faithfulness.embedding",
        _embedding_params,
        _run_embedding,
        "Remove each query's top- or bottom-ranked sources by each metric, without renormalising, at every "
        "layer at once, and measure 1 − cos(embedding masked, clean) of the mean-pooled embedding.",
    ),
)
