"""Attention sinks on WikiText-2 windows: statistics, convexity, factor decomposition, sink-value ablation.

Writes under ``<out>/<model>/``:

- ``heads.csv``: per (layer, head, sink) statistics (:meth:`mechgeom.analyses.sinks.SinkResult.to_frame`);
- ``convexity_check.csv``: closed-form vs intervention ``‖o(s)‖`` for a few heads;
- ``ablation_all_layers_<mode>.csv``: per-head changes when the sink value is ablated in every layer and head;
- ``ablation_summary.csv``: one row per ablation (all layers, then each layer alone) with ΔPPL and controls;
- ``summary.json``: the headline numbers; figures ``rate_vs_ratio.png``, ``convexity_curves.png``,
  ``s_star_vs_rate.png``, ``cone_shift.png``.

Run Gemma under the locks: ``flock /tmp/gemma.lock flock /tmp/heavy.lock mechgeom run sinks --model gemma-3-270m``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import pandas as pd

from mechgeom._io import atomic_write, write_frame
from mechgeom._progress import progress
from mechgeom.analyses.sinks import convexity_check, sink_ablation
from mechgeom.analyses.sinks.statistics import sink_statistics, spread_sink_heads
from mechgeom.data import load_corpus
from mechgeom.models import load_model
from mechgeom.report.runs import common_arguments, run_with_threads
from mechgeom.viz import (
    plot_cone_shift,
    plot_convexity_curves,
    plot_rate_vs_ratio,
    plot_sink_rate_vs_s_star,
    save_png,
)

__all__ = ["HELP", "add_arguments", "run"]

HELP = "attention sinks: statistics, convexity, factor decomposition, sink-value ablation"

logger = logging.getLogger("mechgeom")

#: The sink-mass grid of the convexity check, and the number of texts it runs on.
_GRID = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
_CONVEXITY_TEXTS = 2
#: The summary.json entries logged at the end.
_LOGGED = (
    "norm_ratio_v_all_heads",
    "norm_ratio_vt_all_heads",
    "norm_ratio_vt_sink_heads",
    "share_ratio_vt_below_1_all_heads",
    "share_ratio_vt_in_0.1_0.33_all_heads",
    "cos_sink_tokens_all_heads",
    "share_cos_sink_tokens_negative_all_heads",
    "cos_sink_mean_all_heads",
    "interior_share_pooled",
    "sink_rate_minus_s_star_per_head",
    "corr_sink_rate_s_star_heads",
    "factor_shares_sink_pooled",
    "factor_shares_tail_pooled",
    "convexity_check_max_abs_err",
    "runtime_s",
)
_ABLATION_COLUMNS = [
    "scope",
    "mode",
    "n_texts",
    "ppl_clean",
    "dppl_sink",
    "dppl_control",
    "dnll_sink",
    "dnll_control",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechgeom run sinks`` (those of ``scripts/run_sinks.py``)."""
    common_arguments(parser, out="results/sinks", batch_size=8, threads=1)
    parser.add_argument("--n-texts", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["zero", "mean_norm"], help="all-layer ablation modes")
    parser.add_argument(
        "--per-layer-texts", type=int, default=8, help="windows for the per-layer sweep (0: skip)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the sinks analysis of ``args`` and write its files under ``args.out/args.model``; returns 0."""
    return run_with_threads(args, _run)


def _run(args: argparse.Namespace) -> None:
    t_start = time.time()
    model = load_model(args.model)
    out = Path(args.out) / args.model
    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
    first_tok = model.to_str_tokens(tokens[0, :1])[0]
    logger.info(
        "%s: %d windows x %d tokens; position 0 of text 0 = %r",
        args.model,
        tokens.shape[0],
        tokens.shape[1],
        first_tok,
    )

    # ---- statistics, convexity, factor decomposition
    t0 = time.time()
    stats = sink_statistics(model, tokens, batch_size=args.batch_size, verbose=True)
    write_frame(stats.to_frame(), out / "heads.csv")
    logger.info("statistics: %.0f s", time.time() - t0)
    summary: dict[str, Any] = {
        "model": args.model,
        "n_texts": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1]),
        "corpus": f"wikitext2 (test), seed {args.seed}",
        "sink_positions": stats.sink_positions,
        "position0_is_bos": bool(getattr(model.cfg, "default_prepend_bos", False)),
        "basis": stats.basis,
        **stats.summary(),
    }
    save_png(plot_rate_vs_ratio(stats, space="vt"), out / "rate_vs_ratio.png")
    save_png(plot_sink_rate_vs_s_star(stats), out / "s_star_vs_rate.png")

    # ---- convexity by intervention on a few heads (the first texts)
    t0 = time.time()
    chosen = spread_sink_heads(stats)
    sub = tokens[:_CONVEXITY_TEXTS]
    sub_stats = sink_statistics(model, sub, layers=sorted({layer for layer, _ in chosen}))
    check = convexity_check(model, sub, chosen, _GRID, stats=sub_stats)
    write_frame(check.max_error_frame(), out / "convexity_check.csv")
    check_summary = check.summary()
    summary["convexity_check_heads"] = check_summary["heads"]
    summary["convexity_check_max_abs_err"] = check_summary["max_abs_error"]
    save_png(plot_convexity_curves(sub_stats, chosen, measured=check.measured), out / "convexity_curves.png")
    logger.info(
        "convexity check: %.0f s, max |closed - measured| = %.2e",
        time.time() - t0,
        check_summary["max_abs_error"],
    )

    # ---- sink-value ablation: all layers and heads at once
    t0 = time.time()
    summary_rows = []
    clean = None
    for mode in args.modes:
        res = sink_ablation(
            model, tokens, mode=mode, seed=args.seed, batch_size=args.batch_size, clean=clean, verbose=True
        )
        clean = res
        write_frame(res.to_frame(), out / f"ablation_all_layers_{mode}.csv")
        summary_rows.append({"scope": "all layers", **res.summary(seed=args.seed)})
        if mode == args.modes[0]:
            save_png(plot_cone_shift(res), out / "cone_shift.png")
    logger.info("all-layer ablations: %.0f s", time.time() - t0)

    # ---- per-layer sweep (zero mode) on the first --per-layer-texts windows
    if args.per_layer_texts > 0:
        t0 = time.time()
        few = tokens[: args.per_layer_texts]
        clean_few = None
        for layer in progress(range(model.cfg.n_layers), desc="per-layer ablation"):
            res = sink_ablation(
                model,
                few,
                layers=layer,
                mode="zero",
                seed=args.seed,
                batch_size=args.batch_size,
                clean=clean_few,
            )
            clean_few = res
            summary_rows.append({"scope": f"layer {layer}", **res.summary(seed=args.seed)})
        logger.info("per-layer ablations: %.0f s", time.time() - t0)
    abl = pd.DataFrame(summary_rows)
    write_frame(abl, out / "ablation_summary.csv")
    summary["ablation"] = abl.to_dict(orient="records")
    summary["runtime_s"] = round(time.time() - t_start, 1)
    with atomic_write(out / "summary.json") as f:
        json.dump(summary, f, indent=1, default=float)

    with pd.option_context("display.width", 160, "display.max_rows", 100):
        logger.info("%s", abl[_ABLATION_COLUMNS].to_string(index=False, float_format="%.4g"))
    for key in _LOGGED:
        logger.info("%s: %s", key, json.dumps(summary[key], default=float))
