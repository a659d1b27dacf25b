"""The report's stages: each runs one analysis, takes its tables and ``summary()``, draws its figures with
:mod:`mechgeom.viz` and words the summary. Nothing here computes a statistic: the numbers come from the
analyses (``Result.summary()``, :func:`~mechgeom.analyses.faithfulness.faithfulness_summary`, …)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mechgeom.report.base import ReportSettings, Stage, StageContext, StageOutput
from mechgeom.report.html import panels_html
from mechgeom.sweep import remove_store

__all__ = ["STAGES", "faithfulness_order", "spread_layers"]


# --------------------------------------------------------------------------- stage: contributions


def _contribution_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": s.n_texts,
        "metrics": ["attention", "value_weighted_normalized", "contribution"],
        "batch_size": 4,
    }


def _run_contributions(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom import viz
    from mechgeom.analyses.contribution_overview import contribution_overview

    overview = contribution_overview(
        ctx.model, ctx.tokens[: p["n_texts"]], batch_size=p["batch_size"], verbose=ctx.verbose
    )
    s = overview.summary()
    if overview.view.str_tokens is None:  # a model without a tokenizer: ids as labels
        overview.view.str_tokens = [ctx.str_tokens(0)]
    view = viz.layer_view(overview.view, overview.view_layer)
    out = StageOutput(
        tables={"contributions": overview.heads, "contributions_layers": overview.layers},
        figures={
            "contributions_heatmaps": viz.plot_head_heatmaps(
                overview.heads,
                [
                    ("sink_attention", "sink attention"),
                    ("sink_contribution", "sink contribution weight"),
                    ("tv_attention_contribution", "TV(attention, contribution)"),
                ],
            )
        },
        views=panels_html(view),
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
        "Queries i >= 1. c[h,i,j] = <o[i,h], alpha vt[j,h]> / |o[i,h]|^2 (SPEC.md §A); "
        "contributions_layers.csv holds the inter-head (whole-layer) versions."
    ]
    return out


# --------------------------------------------------------------------------- stage: faithfulness


def _faithfulness_params(s: ReportSettings) -> dict[str, Any]:
    from mechgeom.analyses.faithfulness import FAITHFULNESS_METRICS, MODES

    rates = [0.0, 0.3, 0.6] if s.quick else [0.0, 0.2, 0.4, 0.6, 0.8]
    return {
        "n_texts": min(s.n_texts, 2 if s.quick else 4),
        "metrics": list(FAITHFULNESS_METRICS),
        "modes": list(MODES),
        "rates": rates,
        "scope": "intra",
        "layers": "all",
        "seed": s.seed,
        "n_boot": 200 if s.quick else 1000,
    }


def faithfulness_order(frame: Any, claimed: Sequence[str]) -> list[str]:
    """One sentence per mode wording :func:`mechgeom.analyses.faithfulness.faithfulness_summary`: the metrics
    by mean ΔPPL over the rates > 0 (most faithful first) and whether paper A's order ``claimed[0] <
    claimed[1] < ...`` (least to most faithful) holds, holds only up to ties (identical rankings), or fails."""
    from mechgeom.analyses.faithfulness import faithfulness_summary

    summary = faithfulness_summary(frame, claimed=tuple(claimed))
    lines = []
    for mode, judged in summary["modes"].items():
        higher = judged["higher_is_more_faithful"]
        ranking = " > ".join(f"{m} ({v:+.3g})" for m, v in judged["ranking"])
        verdict = judged["verdict"]
        if verdict == "holds up to ties":
            ties = ", ".join(f"{a} = {b}" for a, b in judged["ties"])
            verdict = f"holds up to ties ({ties}: identical rankings)"
        lines.append(
            f"{mode} (mean ΔPPL over rates > 0; {'higher' if higher else 'lower'} = more faithful), most "
            f"faithful first: {ranking}. Paper A's order {' < '.join(claimed)}: {verdict} here."
        )
    return lines


def _run_faithfulness(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.faithfulness import perplexity_curves
    from mechgeom.viz import plot_curves

    partial = ctx.partial_path("faithfulness", ".csv")
    frame = perplexity_curves(
        ctx.model,
        ctx.tokens[: p["n_texts"]],
        metrics=p["metrics"],
        rates=p["rates"],
        modes=p["modes"],
        scope=p["scope"],
        seed=p["seed"],
        n_boot=p["n_boot"],
        checkpoint=partial,
        verbose=ctx.verbose,
    )
    fig = plot_curves(frame, title=f"{ctx.settings.model}: all layers masked at once")
    summary = faithfulness_order(frame, [m for m in p["metrics"] if m != "random"])
    clean = float(frame["clean_ppl"].iloc[0])
    summary.append(
        f"Clean perplexity {clean:.2f} on {p['n_texts']} windows; rates {p['rates']}; bands are 95% bootstrap "
        "intervals over texts."
    )
    for extra in Path(partial).parent.glob(f"{Path(partial).stem}*"):
        extra.unlink()
    return StageOutput(tables={"faithfulness": frame}, figures={"faithfulness_curves": fig}, summary=summary)


# --------------------------------------------------------------------------- stage: sinks


def _sinks_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 2 if s.quick else 8),
        "sink_positions": [0],
        "convexity_heads": 2 if s.quick else 3,
        "s_values": [0.0, 0.25, 0.5, 0.75, 1.0] if s.quick else [round(0.1 * k, 1) for k in range(11)],
        "ablation_mode": "zero",
        "seed": s.seed,
        "n_boot": 200 if s.quick else 1000,
    }


def _run_sinks(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.sinks import convexity_check, sink_ablation, top_sink_heads
    from mechgeom.viz import (
        plot_cone_shift,
        plot_convexity_curves,
        plot_rate_vs_ratio,
        plot_sink_rate_vs_s_star,
    )

    model, tokens = ctx.model, ctx.tokens[: p["n_texts"]]
    stats = ctx.sinks_and_labels(p["n_texts"], p["sink_positions"])["sinks"]  # = sink_statistics(...)
    chosen = top_sink_heads(stats, p["convexity_heads"])
    check = convexity_check(
        model,
        tokens,
        chosen,
        p["s_values"],
        stats=stats,
        sink_positions=p["sink_positions"],
        verbose=ctx.verbose,
    )
    abl = sink_ablation(
        model, tokens, mode=p["ablation_mode"], sink_positions=p["sink_positions"], seed=p["seed"],
        verbose=ctx.verbose,
    )  # fmt: skip
    summ = abl.summary(n_boot=p["n_boot"], seed=p["seed"])
    st = stats.summary()
    conv = check.summary()
    out = StageOutput(
        tables={
            "sinks": stats.to_frame(),
            "sinks_convexity": check.to_frame(),
            "sinks_ablation": abl.to_frame(),
        },
        figures={
            "sinks_rate_vs_ratio": plot_rate_vs_ratio(stats),
            "sinks_rate_vs_s_star": plot_sink_rate_vs_s_star(stats),
            "sinks_convexity": plot_convexity_curves(stats, chosen, measured=check.measured),
            "sinks_cone_shift": plot_cone_shift(abl),
        },
    )
    out.summary = [
        f"Mean sink rate {st['mean_sink_rate']:.3f} over {st['n_heads']} heads; sink norm ratio "
        f"(projected) median {st['norm_ratio_vt_median']:.3f} (paper B: 3–10× smaller, i.e. 0.1–0.33); "
        f"{st['share_norm_ratio_vt_below_third']:.1%} of heads below 1/3.",
        f"Anti-alignment: mean cos(vt_sink, m) = {st['mean_cos_sink_mean']:.3f}; "
        f"s* lies inside (0, 1) for {st['interior_share_pooled']:.1%} of (head, query) pairs.",
        f"Convexity by intervention on {', '.join(f'L{a}H{b}' for a, b in chosen)} matches the closed form: "
        f"max relative error {conv['max_rel_error']:.2e} over {conv['n_points']} points.",
        f"Sink-value ablation ({p['ablation_mode']}, every layer and head): ΔPPL {summ['dppl_sink']:+.3f} "
        f"(ΔNLL 95% CI [{summ['dnll_sink_lo']:+.3f}, {summ['dnll_sink_hi']:+.3f}]) vs random-position control "
        f"ΔPPL {summ['dppl_control']:+.3f}; mean relative change of the head-output norm "
        f"{summ['d_out_norm_rel_sink']:+.1%} (control {summ['d_out_norm_rel_control']:+.1%}), "
        f"Δcos(o, mu) {summ['d_cone_cos_sink']:+.3f} (control {summ['d_cone_cos_control']:+.3f}).",
    ]
    return out


# --------------------------------------------------------------------------- stage: selection


def _selection_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 1 if s.quick else 4),
        "layers": "spread4" if s.quick else "all",
        "ns": [1, 2, 4, 8] if s.quick else [1, 2, 4, 8, 16, 32],
        "n_random": 2 if s.quick else 4,
        "query_stride": 4,
        "seed": s.seed,
    }


def spread_layers(n_layers: int, k: int) -> list[int]:
    """``k`` layers spread evenly from the first to the last (fewer when the model has fewer).

    >>> spread_layers(30, 4), spread_layers(2, 4)
    ([0, 10, 19, 29], [0, 1])
    """
    return sorted({round(i * (n_layers - 1) / max(k - 1, 1)) for i in range(k)})


def _run_selection(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.selection import token_selection
    from mechgeom.viz import plot_selection_scores

    model = ctx.model
    n_layers = int(model.cfg.n_layers)
    layers = spread_layers(n_layers, 4) if p["layers"] == "spread4" else list(range(n_layers))
    res = token_selection(
        model, ctx.tokens[: p["n_texts"]], layers=layers, ns=p["ns"], n_random=p["n_random"],
        query_stride=p["query_stride"], seed=p["seed"], verbose=False,
    )  # fmt: skip
    df, params = res.to_frame(), res.params_frame()
    s = res.summary()
    out = StageOutput(
        tables={"selection": df, "selection_params": params},
        figures={"selection_f_scores": plot_selection_scores(df, params)},
    )
    out.summary = [
        f"{s['n_layers']} layers × {s['n_heads']} heads, N in {p['ns']}, every {p['query_stride']}th query "
        f"of {p['n_texts']} window(s).",
        f"Top-N sets vs random N-subsets (N <= 4): mean F {s['f_top']:.3f} vs {s['f_random']:.3f} "
        f"(gap {s['f_gap']:+.3f}; paper B: top-N more separable at small N).",
        f"With the sink in I_N: F {s['f_top_sink_in']:.3f} with it vs {s['f_nosink_sink_in']:.3f} "
        "without position 0 (paper B: including it often halves F_N).",
        f"Inversion certificates violated {s['cert_violations']} times, the fitted sink-aware bound "
        f"{s['bound_violations']} times (both must be 0); the constant-norm regime holds for "
        f"{s['regime_share']:.1%} of heads.",
    ]
    return out


# --------------------------------------------------------------------------- stage: taxonomy


def _taxonomy_params(s: ReportSettings) -> dict[str, Any]:
    from mechgeom.data import CORPORA

    other = next(c for c in CORPORA if c != s.corpus and c != "gsm8k") if s.corpus in CORPORA else None
    return {"n_texts": s.n_texts, "second_corpus": other, "sink_positions": [0]}


def _run_taxonomy(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.taxonomy import classify_heads, label_agreement, regime_summary
    from mechgeom.data import load_corpus
    from mechgeom.viz import plot_regime_grid

    model, s = ctx.model, ctx.settings
    res = ctx.sinks_and_labels(p["n_texts"], p["sink_positions"])["taxonomy"]  # = classify_heads(...)
    table = res.to_frame()
    summ = res.summary()
    tables = {"taxonomy": table, "taxonomy_regimes": regime_summary(table)}
    shares = summ["shares"]
    lines = [
        "Heads by regime: "
        + ", ".join(f"{lab} {shares.get(lab, 0.0):.1%}" for lab in ("Retriever", "Mixer", "Reset"))
        + " (paper B: Retrievers are 5.8–17.2% of heads; Mixer vs Reset depends on the model family).",
    ]
    if "cos_out_sink_mixer" in summ:
        lines.append(
            f"Alignment: Mixers' outputs vs the sink value cos {summ['cos_out_sink_mixer']:.3f}; "
            f"Retrievers' outputs vs the current token's value cos {summ['cos_out_cur_retriever']:.3f} "
            "(NaN where a regime has no head)."
        )
    if p["second_corpus"] is not None:
        other_tokens = load_corpus(
            p["second_corpus"], model, n_texts=s.n_texts, seq_len=s.seq_len, seed=s.seed
        )
        other = classify_heads(
            model, other_tokens, sink_positions=p["sink_positions"], corpus=p["second_corpus"],
            verbose=ctx.verbose,
        ).to_frame()  # fmt: skip
        agree = label_agreement({s.corpus: table, p["second_corpus"]: other})
        tables["taxonomy_agreement"] = agree.pairwise
        lines.append(f"Label agreement {s.corpus} vs {p['second_corpus']}: {agree.all_agree:.1%} of heads.")
    fig = plot_regime_grid(table, title=f"{s.model} on {s.corpus}")
    return StageOutput(tables=tables, figures={"taxonomy_regimes": fig}, summary=lines)


# --------------------------------------------------------------------------- stage: pruning


def _pruning_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 2),
        "levels": [1.0, 0.7, 0.4, 0.1] if s.quick else [round(1.0 - 0.1 * k, 1) for k in range(10)],
        "single_head": not s.quick,
        "mode": "zero",
        "seed": s.seed,
        "critical_k": 5.0,
    }


def _run_pruning(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.pruning import head_orders, head_stats, retention_curves, single_head_sweep
    from mechgeom.viz import plot_retention

    model, tokens = ctx.model, ctx.tokens[: p["n_texts"]]
    stats = head_stats(model, tokens, verbose=ctx.verbose)  # also labels the heads, in the same passes
    sweep = None
    tables = {}
    lines = []
    if p["single_head"]:
        sweep = single_head_sweep(
            model, tokens, mode=p["mode"], checkpoint=ctx.partial_path("pruning_single_head", ".csv"),
            verbose=ctx.verbose,
        )  # fmt: skip
        tables["pruning_single_head"] = sweep.to_frame(k=p["critical_k"])
        sh = sweep.summary(k=p["critical_k"])
        crit = sh["critical"]
        (wl, wh), worst = sh["worst_head"], sh["worst_delta_ppl"]
        lines.append(
            f"Single-head ablation: median ΔPPL {sh['median_delta_ppl']:+.3f}; the most harmful head is "
            f"L{wl}H{wh} (ΔPPL {worst:+.3f}); {len(crit)} critical head(s) (ΔPPL > median + "
            f"{p['critical_k']:g}·MAD)"
            + (": " + ", ".join(f"L{a}H{b}" for a, b in crit) if crit else "")
            + "."
        )
    else:
        lines.append("Quick run: no single-head ablation sweep (the single_head order is left out).")
    orders = head_orders(model, stats, sweep=sweep, seed=p["seed"])
    curves = retention_curves(
        model, orders, {ctx.settings.corpus: tokens}, levels=p["levels"], mode=p["mode"],
        checkpoint=ctx.partial_path("pruning_curves", ".csv"), verbose=ctx.verbose,
    )  # fmt: skip
    frame = curves.to_frame()
    tables = {"pruning": frame, **tables}
    means = curves.summary()["mean_delta_ppl"]
    lines.insert(
        0,
        "Mean ΔPPL over retention levels below 100%, least harmful order first: "
        + ", ".join(f"{o} {v:+.3g}" for o, v in sorted(means.items(), key=lambda kv: kv[1]))
        + f" ({p['n_texts']} windows, {p['mode']} ablation of hook_z).",
    )
    png = plot_retention(frame, title=ctx.settings.model)
    for name in ("pruning_single_head", "pruning_curves"):
        remove_store(ctx.partial_path(name, ".csv"))  # the table, its log and its lock file
    return StageOutput(tables=tables, figures={"pruning_retention": png}, summary=lines)


# --------------------------------------------------------------------------- stage registry


STAGES: tuple[Stage, ...] = (
    Stage(
        "contributions",
        "Contribution weights vs attention",
        "mechgeom.viz",
        _contribution_params,
        _run_contributions,
        "How much of each head's output each source token carries (paper A), beside the raw attention.",
    ),
    Stage(
        "faithfulness",
        "Faithfulness curves",
        "mechgeom.analyses.faithfulness",
        _faithfulness_params,
        _run_faithfulness,
        "Remove each query's top- (comprehensiveness) or bottom-ranked (sufficiency) sources by each metric "
        "on hook_pattern, without renormalising, at every layer at once, and measure ΔPPL (paper A).",
    ),
    Stage(
        "sinks",
        "Sinks, convexity and sink-norm ablation",
        "mechgeom.analyses.sinks",
        _sinks_params,
        _run_sinks,
        "Sink rate and value norms, anti-alignment with the non-sink mean, the convex norm curve ‖o(s)‖ "
        "(closed form and intervention), and zeroing the sink's value vs a random position (papers A and B).",
    ),
    Stage(
        "selection",
        "Token-selection geometry",
        "mechgeom.analyses.selection",
        _selection_params,
        _run_selection,
        "Extreme F-scores of top-N source sets vs random sets and without the sink, the inversion "
        "certificates and the sink-aware lower bound (paper B).",
    ),
    Stage(
        "taxonomy",
        "Head taxonomy",
        "mechgeom.analyses.taxonomy",
        _taxonomy_params,
        _run_taxonomy,
        "Parameter-free source-winner labels: Retriever (current token wins), Mixer (sink wins), "
        "Reset (otherwise) (paper B).",
    ),
    Stage(
        "pruning",
        "Head pruning",
        "mechgeom.analyses.pruning",
        _pruning_params,
        _run_pruning,
        "Perplexity as heads are removed (zeroing hook_z) in taxonomy, weight-magnitude, entropy, random "
        "and single-head-ablation orders (paper B).",
    ),
)
