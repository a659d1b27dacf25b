"""Attention sinks on WikiText-2 windows: statistics, convexity, factor decomposition, sink-value ablation.

Writes under ``<out>/<model>/``:

- ``heads.csv``: per (layer, head, sink) statistics (:meth:`mechgeom.analyses.sinks.SinkResult.to_frame`);
- ``convexity_check.csv``: closed-form vs intervention ``‖o(s)‖`` on the first two windows, for three heads
  spread from the strongest sink head to the weakest (:mod:`mechgeom.report.drivers.sinks`, as the report);
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
from typing import Any

from mechgeom.report.options import common_arguments
from mechgeom.report.runs import RunDir, run_with_threads

__all__ = ["HELP", "add_arguments", "run"]

HELP = "attention sinks: statistics, convexity, factor decomposition, sink-value ablation"

logger = logging.getLogger("mechgeom")

#: The number of texts the convexity check runs on.
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
    from mechgeom.data import load_corpus
    from mechgeom.hooks import token_strings
    from mechgeom.models import load_model
    from mechgeom.report.drivers.sinks import S_VALUES, sinks

    t_start = time.time()
    model = load_model(args.model)
    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
    first = token_strings(model, tokens[:1, :1])
    logger.info(
        "%s: %d windows x %d tokens; position 0 of text 0 = %r",
        args.model, tokens.shape[0], tokens.shape[1], first[0][0] if first else int(tokens[0, 0]),
    )  # fmt: skip
    out = sinks(
        model, tokens, convexity_heads=3, s_values=S_VALUES, convexity_texts=_CONVEXITY_TEXTS,
        ablation_modes=args.modes, per_layer_texts=args.per_layer_texts, seed=args.seed,
        batch_size=args.batch_size, verbose=True,
    )  # fmt: skip
    files = RunDir(args)
    files.write(
        out,
        {
            "heads": "heads",
            "convexity_max_error": "convexity_check",
            **{f"ablation_{mode}": f"ablation_all_layers_{mode}" for mode in args.modes},
            "ablation_summary": "ablation_summary",
        },
        {
            "rate_vs_ratio": "rate_vs_ratio",
            "s_star": "s_star_vs_rate",
            "convexity": "convexity_curves",
            "cone_shift": "cone_shift",
        },
    )
    summary: dict[str, Any] = {
        "model": args.model,
        "n_texts": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1]),
        "corpus": f"wikitext2 (test), seed {args.seed}",
        "position0_is_bos": bool(getattr(model.cfg, "default_prepend_bos", False)),
        **out.data,
        "runtime_s": round(time.time() - t_start, 1),
    }
    files.write_summary(summary)
    table = out.tables["ablation_summary"][_ABLATION_COLUMNS]
    logger.info("%s", table.to_string(index=False, float_format="%.4g"))
    for key in _LOGGED:
        logger.info("%s: %s", key, json.dumps(summary[key], default=float))
