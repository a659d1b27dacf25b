"""The contribution-weight drivers (:mod:`mechgeom.analyses.contribution`): a decoder's overview (per-head and
per-layer headline statistics, the layer that differs most from attention) and an encoder's view of
``[CLS]`` and ``[SEP]``. The report's contributions stages and ``mechgeom run encoder`` call these functions.

Tables: ``heads`` and ``layers`` (decoder), ``special_tokens`` (encoder). Figures: ``heatmaps``. Views: the
circuitsvis layer view of text 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mechgeom import viz
from mechgeom.analyses.contribution.overview import contribution_overview
from mechgeom.analyses.contribution.stats import SUMMARY_METRICS
from mechgeom.analyses.contribution.weights import contribution_weights
from mechgeom.report.base import StageOutput
from mechgeom.report.html import panels_html
from mechgeom.typing import Tokens

__all__ = ["contributions", "special_tokens"]


def contributions(
    model: Any,
    tokens: Tokens,
    *,
    batch_size: int = 8,
    str_tokens: Sequence[str] | None = None,
    verbose: bool = False,
) -> StageOutput:
    """A decoder's contribution weights against attention over ``tokens``
    (:func:`~mechgeom.analyses.contribution.contribution_overview`): the per-head and per-layer tables,
    their heatmaps, and the view of the layer that differs most from attention (``str_tokens`` label text
    0 where the model has no tokenizer)."""
    overview = contribution_overview(model, tokens, batch_size=batch_size, verbose=verbose)
    s = overview.summary()
    if overview.view.str_tokens is None and str_tokens is not None:  # no tokenizer: the caller's labels
        overview.view.str_tokens = [list(str_tokens)]
    heatmaps = viz.plot_head_heatmaps(
        overview.heads,
        [
            ("sink_attention", "sink attention"),
            ("sink_contribution", "sink contribution weight"),
            ("tv_attention_contribution", "TV(attention, contribution)"),
        ],
    )
    out = StageOutput(
        tables={"heads": overview.heads, "layers": overview.layers},
        figures={"heatmaps": heatmaps},
        views=panels_html(viz.layer_view(overview.view, overview.view_layer)),
        data=s,
    )
    out.summary = [
        f"Averaged over {s['n_heads']} heads and {s['n_texts']} texts: the sink (position 0) receives "
        f"{s['sink_attention']:.3f} of the attention but {s['sink_contribution']:.3f} of the "
        f"contribution weight ({s['sink_value_weighted_normalized']:.3f} of the output-normalised "
        "value weight).",
        f"Contribution weights are negative for {s['negative_share']:.1%} of (query, source) pairs; "
        f"attention's top source is the contribution's top source for {s['top1_agreement']:.1%} of "
        "queries.",
        f"Layer {s['view_layer']} differs most from attention (whole-layer total-variation distance "
        f"{s['view_layer_tv']:.3f}); its heads for text 0 are shown below.",
    ]
    out.notes = [
        "Queries i >= 1. c[h,i,j] = <o[i,h], alpha vt[j,h]> / |o[i,h]|^2 (docs/definitions.md §2.1); "
        "contributions_layers.csv holds the inter-head (whole-layer) versions."
    ]
    return out


def special_tokens(model: Any, tokens: Tokens, *, verbose: bool = False) -> StageOutput:
    """An encoder's contribution weights over every key of ``tokens``: attention vs contribution of
    ``[CLS]`` and ``[SEP]`` per head (:meth:`~mechgeom.analyses.contribution.ContributionResult.special_token_frame`),
    as a table and heatmaps, and the last layer's view of text 0. ``data``: the result's ``summary()``."""
    res = contribution_weights(model, tokens, intra=SUMMARY_METRICS, inter=SUMMARY_METRICS, verbose=verbose)
    s = res.summary()
    frame = res.special_token_frame()
    wide = frame.pivot_table(index=["layer", "head"], columns="token", values=list(SUMMARY_METRICS))
    wide.columns = [f"{col[1]}_{col[0]}" for col in wide.columns]  # (metric, token) -> "[CLS]_attention"
    wide = wide.reset_index()
    layer = int(model.cfg.n_layers) - 1
    heatmaps = viz.plot_head_heatmaps(
        wide,
        [
            ("[CLS]_attention", "[CLS] attention"),
            ("[CLS]_contribution", "[CLS] contribution weight"),
            ("[SEP]_attention", "[SEP] attention"),
            ("[SEP]_contribution", "[SEP] contribution weight"),
        ],
    )
    out = StageOutput(
        tables={"special_tokens": frame},
        figures={"heatmaps": heatmaps},
        views=panels_html(viz.layer_view(res, layer)),
        data=s,
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
