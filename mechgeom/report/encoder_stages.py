"""The report's stages for an encoder (a bidirectional model such as ``"minilm-l6"``).

An encoder has no next-token prediction and no causal pattern, so the decoder stages that need either
(ΔPPL faithfulness, token selection, the taxonomy, pruning by perplexity) are skipped with a line that says
why (:data:`DECODER_ONLY`). In their place: contribution weights over every key, with ``[CLS]`` and
``[SEP]`` where a decoder has its sink; the sink statistics of ``[CLS]`` and ``[SEP]`` resolved in each
window; and faithfulness as ``1 − cos`` of the mean-pooled sentence embedding. As in
:mod:`mechgeom.report.stages`, nothing here computes a statistic.
"""

from __future__ import annotations

from typing import Any

from mechgeom.report.base import ReportSettings, Stage, StageContext, StageOutput
from mechgeom.report.html import panels_html

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
    from mechgeom import viz
    from mechgeom.analyses.contribution.stats import SUMMARY_METRICS
    from mechgeom.analyses.contribution.weights import contribution_weights

    model = ctx.model
    res = contribution_weights(
        model, ctx.tokens[: p["n_texts"]], intra=SUMMARY_METRICS, inter=SUMMARY_METRICS, verbose=ctx.verbose
    )
    s = res.summary()
    frame = res.special_token_frame()
    wide = frame.pivot_table(index=["layer", "head"], columns="token", values=list(SUMMARY_METRICS))
    wide.columns = [f"{col[1]}_{col[0]}" for col in wide.columns]  # (metric, token) -> "[CLS]_attention"
    wide = wide.reset_index()
    layer = int(model.cfg.n_layers) - 1
    out = StageOutput(
        tables={"contributions_special_tokens": frame},
        figures={
            "contributions_heatmaps": viz.plot_head_heatmaps(
                wide,
                [
                    ("[CLS]_attention", "[CLS] attention"),
                    ("[CLS]_contribution", "[CLS] contribution weight"),
                    ("[SEP]_attention", "[SEP] attention"),
                    ("[SEP]_contribution", "[SEP] contribution weight"),
                ],
            )
        },
        views=panels_html(viz.layer_view(res, layer)),
    )
    out.summary = [
        f"Every query sees every key (bidirectional). Averaged over {s['n_heads']} heads and {s['n_texts']} "
        f"windows: [CLS] receives {s['cls_attention']:.3f} of the attention but {s['cls_contribution']:.3f} of "
        f"the contribution weight ({s['cls_value_weighted_normalized']:.3f} output-normalised value weight); "
        f"[SEP] {s['sep_attention']:.3f} of the attention, {s['sep_contribution']:.3f} of the contribution.",
        f"Contribution weights are negative for {s['negative_share']:.1%} of (query, source) pairs. "
        f"Layer {layer}'s heads for window 0 are shown below.",
    ]
    out.notes = ["c[h,i,j] = <o[i,h], alpha vt[j,h]> / |o[i,h]|^2 over every key j (docs/definitions.md §2)."]
    return out


def _sinks_params(s: ReportSettings) -> dict[str, Any]:
    return {"n_texts": s.n_texts, "sink_positions": list(_SPECIALS)}


def _run_sinks(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.sinks.statistics import sink_statistics
    from mechgeom.viz.figures import plot_rate_vs_ratio

    stats = sink_statistics(
        ctx.model, ctx.tokens[: p["n_texts"]], sink_positions=p["sink_positions"], verbose=ctx.verbose
    )
    table = stats.to_frame()
    per_token = stats.summary()
    out = StageOutput(tables={"sinks": table}, figures={"sinks_rate_vs_ratio": plot_rate_vs_ratio(stats)})
    by = table.groupby("sink", sort=False)[["sink_rate_pos", "norm_ratio_vt", "cos_sink_tokens"]].mean()
    out.summary = [
        f"{name}: attention mass {row['sink_rate_pos']:.3f} (mean over heads and every query), value norm "
        f"{row['norm_ratio_vt']:.3f}× the mean of the other tokens (projected), mean cosine to the other "
        f"tokens' values {row['cos_sink_tokens']:+.3f}."
        for name, row in by.iterrows()
    ]
    out.summary.append(
        f"Anti-alignment of the sink vector with the non-sink mean: mean cos {per_token['mean_cos_sink_mean']:+.3f}. "
        "Kobayashi et al. (2020) on BERT: [CLS] and [SEP] draw much attention but carry small value norms."
    )
    return out


def _embedding_params(s: ReportSettings) -> dict[str, Any]:
    from mechgeom.analyses.faithfulness.curves import FAITHFULNESS_METRICS

    return {
        "n_texts": min(s.n_texts, 2 if s.quick else 8),
        "metrics": list(FAITHFULNESS_METRICS),
        "rates": [0.0, 0.3, 0.6] if s.quick else [0.0, 0.1, 0.25, 0.5, 0.75, 0.9],
        "scope": "intra",
        "seed": s.seed,
        "n_boot": 200 if s.quick else 1000,
    }


def _run_embedding(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.faithfulness.embedding import embedding_curves
    from mechgeom.viz.figures import plot_curves

    res = embedding_curves(
        ctx.model,
        ctx.tokens[: p["n_texts"]],
        metrics=p["metrics"],
        rates=p["rates"],
        scope=p["scope"],
        seed=p["seed"],
        verbose=ctx.verbose,
    )
    frame = res.to_frame(n_boot=p["n_boot"])
    summ = res.summary()
    lines = []
    for mode, judged in summ["modes"].items():
        ranking = " > ".join(f"{m} ({v:.3g})" for m, v in judged["ranking"])
        lines.append(
            f"{mode} (area under 1 − cos vs rate; {'higher' if judged['higher_is_more_faithful'] else 'lower'} = "
            f"more faithful), most faithful first: {ranking}. Paper A's order "
            f"{' < '.join(summ['claimed'])}: {judged['verdict']} here."
        )
    lines.append(f"{p['n_texts']} windows, rates {p['rates']}; bands are 95% bootstrap intervals over texts.")
    fig = plot_curves(frame, y="effect", title=f"{ctx.settings.model}: all layers masked at once")
    return StageOutput(
        tables={"embedding_faithfulness": frame}, figures={"embedding_curves": fig}, summary=lines
    )


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
