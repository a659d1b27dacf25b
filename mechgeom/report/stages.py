"""The report's stages for a decoder: each stage's settings (``params``, part of its resume key) and a run
that calls the analysis' driver (:mod:`mechgeom.report.drivers`, the same code as ``mechgeom run``) and
names the driver's tables and figures as the report's files. Nothing here computes anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mechgeom.report.base import ReportSettings, Stage, StageContext, StageOutput
from mechgeom.report.options import CORPORA, FAITHFULNESS_METRICS, MODES
from mechgeom.sweep import remove_store

__all__ = ["STAGES"]


# --------------------------------------------------------------------------- contributions


def _contribution_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": s.n_texts,
        "metrics": ["attention", "value_weighted_normalized", "contribution"],
        "batch_size": 4,
    }


def _run_contributions(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.report.drivers.contributions import contributions

    out = contributions(
        ctx.model, ctx.tokens[: p["n_texts"]], batch_size=p["batch_size"], str_tokens=ctx.str_tokens(0),
        verbose=ctx.verbose,
    )  # fmt: skip
    return out.renamed(
        {"heads": "contributions", "layers": "contributions_layers"}, {"heatmaps": "contributions_heatmaps"}
    )


# --------------------------------------------------------------------------- faithfulness


def _faithfulness_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 2 if s.quick else 4),
        "metrics": list(FAITHFULNESS_METRICS),
        "modes": list(MODES),
        "rates": [0.0, 0.3, 0.6] if s.quick else [0.0, 0.2, 0.4, 0.6, 0.8],
        "scope": "intra",
        "layers": "all",
        "seed": s.seed,
        "n_boot": 200 if s.quick else 1000,
    }


def _run_faithfulness(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.report.drivers.faithfulness import perplexity

    partial = ctx.partial_path("faithfulness", ".csv")
    out = perplexity(
        ctx.model, ctx.tokens[: p["n_texts"]], metrics=p["metrics"], rates=p["rates"], modes=p["modes"],
        scope=p["scope"], seed=p["seed"], n_boot=p["n_boot"], checkpoint=partial, verbose=ctx.verbose,
        title=f"{ctx.settings.model}: all layers masked at once",
    )  # fmt: skip
    for extra in Path(partial).parent.glob(f"{Path(partial).stem}*"):
        extra.unlink()
    return out.renamed({"curves": "faithfulness"}, {"curves": "faithfulness_curves"})


# --------------------------------------------------------------------------- sinks


def _sinks_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 2 if s.quick else 8),
        "convexity_heads": 2 if s.quick else 3,
        "convexity_choice": "spread",
        "s_values": [0.0, 0.25, 0.5, 0.75, 1.0] if s.quick else [round(0.1 * k, 1) for k in range(11)],
        "ablation_mode": "zero",
        "seed": s.seed,
        "n_boot": 200 if s.quick else 1000,
    }


def _run_sinks(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.report.drivers.sinks import sinks

    out = sinks(
        ctx.model, ctx.tokens[: p["n_texts"]], stats=ctx.sinks_and_labels(p["n_texts"])["sinks"],
        convexity_heads=p["convexity_heads"], s_values=p["s_values"], ablation_modes=[p["ablation_mode"]],
        n_boot=p["n_boot"], seed=p["seed"], verbose=ctx.verbose,
    )  # fmt: skip
    return out.renamed(
        {
            "heads": "sinks",
            "convexity": "sinks_convexity",
            f"ablation_{p['ablation_mode']}": "sinks_ablation",
        },
        {
            "rate_vs_ratio": "sinks_rate_vs_ratio",
            "s_star": "sinks_rate_vs_s_star",
            "convexity": "sinks_convexity",
            "cone_shift": "sinks_cone_shift",
        },
    )


# --------------------------------------------------------------------------- selection


def _selection_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 1 if s.quick else 4),
        "layers": "spread4" if s.quick else "all",
        "ns": [1, 2, 4, 8] if s.quick else [1, 2, 4, 8, 16, 32],
        "n_random": 2 if s.quick else 4,
        "query_stride": 4,
        "seed": s.seed,
    }


def _run_selection(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.report.drivers.selection import selection, spread_layers

    n_layers = int(ctx.model.cfg.n_layers)
    layers = spread_layers(n_layers, 4) if p["layers"] == "spread4" else list(range(n_layers))
    out = selection(
        ctx.model, ctx.tokens[: p["n_texts"]], layers=layers, ns=p["ns"], n_random=p["n_random"],
        query_stride=p["query_stride"], seed=p["seed"], title=f"{ctx.settings.model}: extreme F-score vs N",
    )  # fmt: skip
    return out.renamed({"heads": "selection", "params": "selection_params"}, {"f_vs_n": "selection_f_scores"})


# --------------------------------------------------------------------------- taxonomy


def _taxonomy_params(s: ReportSettings) -> dict[str, Any]:
    other = next(c for c in CORPORA if c != s.corpus and c != "gsm8k") if s.corpus in CORPORA else None
    return {"n_texts": s.n_texts, "second_corpus": other}


def _run_taxonomy(ctx: StageContext, p: dict[str, Any]) -> StageOutput:
    from mechgeom.data import load_corpus
    from mechgeom.report.drivers.selection import taxonomy

    s = ctx.settings
    corpora: dict[str, Any] = {s.corpus: ctx.sinks_and_labels(p["n_texts"])["taxonomy"]}
    if p["second_corpus"] is not None:
        corpora[p["second_corpus"]] = load_corpus(
            p["second_corpus"], ctx.model, n_texts=s.n_texts, seq_len=s.seq_len, seed=s.seed
        )
    out = taxonomy(ctx.model, corpora, verbose=ctx.verbose, title=f"{s.model} on {s.corpus}")
    return out.renamed(
        {
            f"labels_{s.corpus}": "taxonomy",
            f"regimes_{s.corpus}": "taxonomy_regimes",
            "agreement": "taxonomy_agreement",
        },
        {"regimes": "taxonomy_regimes"},
    )


# --------------------------------------------------------------------------- pruning


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
    from mechgeom.report.drivers.pruning import pruning

    tokens = ctx.tokens[: p["n_texts"]]
    checkpoints = {name: ctx.partial_path(name, ".csv") for name in ("pruning_single_head", "pruning_curves")}
    out = pruning(
        ctx.model, tokens, {ctx.settings.corpus: tokens}, mode=p["mode"], levels=p["levels"],
        sweep=p["single_head"], k=p["critical_k"], seed=p["seed"],
        sweep_checkpoint=checkpoints["pruning_single_head"], retention_checkpoint=checkpoints["pruning_curves"],
        verbose=ctx.verbose, title=ctx.settings.model,
    )  # fmt: skip
    if not p["single_head"]:
        out.summary.append("Quick run: no single-head ablation sweep (the single_head order is left out).")
    for path in checkpoints.values():
        remove_store(path)  # the table, its log and its lock file
    return out.renamed(
        {"retention": "pruning", "single_head": "pruning_single_head"}, {"retention": "pruning_retention"}
    )


# --------------------------------------------------------------------------- the stages


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
        "mechgeom.analyses.faithfulness.curves",
        _faithfulness_params,
        _run_faithfulness,
        "Remove each query's top- (comprehensiveness) or bottom-ranked (sufficiency) sources by each metric "
        "on hook_pattern, without renormalising, at every layer at once, and measure ΔPPL (paper A).",
    ),
    Stage(
        "sinks",
        "Sinks, convexity and sink-norm ablation",
        "mechgeom.analyses.sinks.statistics",
        _sinks_params,
        _run_sinks,
        "Sink rate and value norms, anti-alignment with the non-sink mean, the convex norm curve ‖o(s)‖ "
        "(closed form and intervention on strong to weak sink heads), and zeroing the sink's value vs a "
        "random position (papers A and B).",
    ),
    Stage(
        "selection",
        "Token-selection geometry",
        "mechgeom.analyses.selection.collector",
        _selection_params,
        _run_selection,
        "Extreme F-scores of top-N source sets vs random sets and without the sink, the inversion "
        "certificates and the sink-aware lower bound (paper B).",
    ),
    Stage(
        "taxonomy",
        "Head taxonomy",
        "mechgeom.analyses.heads.taxonomy",
        _taxonomy_params,
        _run_taxonomy,
        "Parameter-free source-winner labels: Retriever (current token wins), Mixer (sink wins), "
        "Reset (otherwise) (paper B).",
    ),
    Stage(
        "pruning",
        "Head pruning",
        "mechgeom.analyses.heads.pruning",
        _pruning_params,
        _run_pruning,
        "Perplexity as heads are removed (zeroing hook_z) in taxonomy, weight-magnitude, entropy, random "
        "and single-head-ablation orders (paper B).",
    ),
)
