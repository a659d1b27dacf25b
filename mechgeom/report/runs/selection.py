"""Token-selection geometry and the Retriever/Mixer/Reset taxonomy (``docs/definitions.md`` §5, §6) on WikiText-2 windows.

Writes under ``<out>/<model>/``:

- ``selection_heads.csv``: per (layer, head, N) mean F_N of the top-N set, of random N-subsets, without the
  sink, the certificate, the sink-aware bound and its constant-norm prediction
  (:meth:`mechgeom.analyses.selection.SelectionResult.to_frame`);
- ``selection_by_n.csv``: the same averaged over heads, per N (the top-N vs random table);
- ``sink_effect.csv``: per N, over the queries whose I_N holds the sink: F_N with it vs without position 0;
- ``bound_params.csv``: fitted regime parameters per head and whether the regime holds;
- ``bound_by_n.csv``: predicted (guaranteed and constant-norm) vs measured F_N per N, all heads and regime heads;
- ``taxonomy_<corpus>.csv``: per-head labels; ``taxonomy_distribution.csv``, ``taxonomy_regimes.csv``
  (shares and output alignments), ``taxonomy_agreement.csv`` (pairwise between corpora);
- ``summary.json``; figures ``selection_f_vs_n.png`` and ``taxonomy_regimes.png``.

Geometry is measured on the model as loaded (value space, GQA-expanded ``hook_v``); position 0 is the sink
(SmolLM2: the first text token; Gemma: BOS). Run Gemma under the locks:
``flock /tmp/gemma.lock flock /tmp/heavy.lock mechgeom run selection --model gemma-3-270m``.
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
from mechgeom.analyses.heads.taxonomy import (
    classify_heads,
    label_agreement,
    label_distribution,
    regime_summary,
)
from mechgeom.analyses.selection.collector import token_selection
from mechgeom.data import load_corpus
from mechgeom.models import load_model
from mechgeom.report.runs import common_arguments, run_with_threads
from mechgeom.viz import plot_regime_grid, plot_selection_vs_n, save_png

__all__ = ["HELP", "add_arguments", "run"]

HELP = "token-selection geometry (F_N, certificates, the sink-aware bound) and the head taxonomy"

logger = logging.getLogger("mechgeom")

#: What the run measures on: the basis of summary.json.
_BASIS = "value space (hook_v, GQA-expanded), model as loaded"
#: The summary.json entries logged at the end.
_LOGGED = (
    "largest_mean_gap",
    "largest_head_gap",
    "violations",
    "regime_flags_share_of_heads",
    "retriever_share",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechgeom run selection`` (those of ``scripts/run_selection.py``)."""
    common_arguments(parser, out="results/selection", batch_size=8, threads=1)
    parser.add_argument("--n-texts", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--n-random", type=int, default=2, help="random N-subsets per query (the baseline)")
    parser.add_argument("--query-stride", type=int, default=1, help="analyse every k-th query (1: all)")
    parser.add_argument("--corpora", nargs="+", default=["wikitext2", "c4", "gsm8k"], help="taxonomy corpora")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Run the selection analysis of ``args`` and write its files under ``args.out/args.model``; returns 0."""
    return run_with_threads(args, _run)


def _table(frame: pd.DataFrame) -> str:
    return frame.to_string(index=False, float_format="%.4f")


def _run(args: argparse.Namespace) -> None:
    t_start = time.time()
    verbose = not getattr(args, "no_progress", False)
    model = load_model(args.model)
    out = Path(args.out) / args.model
    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
    first_tokens = sorted({model.to_string(t[:1]) for t in tokens})
    logger.info(
        "%s: %d x %d WikiText-2 windows; position 0 = %s",
        args.model,
        tokens.shape[0],
        tokens.shape[1],
        first_tokens,
    )

    # ---------------------------------------------------------------- selection geometry
    t0 = time.time()
    res = token_selection(
        model,
        tokens,
        ns=args.ns,
        n_random=args.n_random,
        query_stride=args.query_stride,
        seed=args.seed,
        verbose=verbose,
    )
    df = res.to_frame()
    params = res.params_frame()
    write_frame(df, out / "selection_heads.csv")
    write_frame(params, out / "bound_params.csv")
    by_n = res.by_n_frame()
    write_frame(by_n, out / "selection_by_n.csv")
    sinks = res.sink_effect_frame()
    write_frame(sinks, out / "sink_effect.csv")
    bounds = res.bound_frame()
    write_frame(bounds, out / "bound_by_n.csv")
    title = f"{args.model}: extreme F-score vs N"
    save_png(plot_selection_vs_n(by_n, df, title), out / "selection_f_vs_n.png")
    selection = res.summary()
    logger.info("selection: %.0f s", time.time() - t0)
    for frame in (by_n, sinks, bounds):
        logger.info("\n%s", _table(frame))

    # ---------------------------------------------------------------- taxonomy
    t0 = time.time()
    tables: dict[str, pd.DataFrame] = {}
    taxonomy: dict[str, dict[str, Any]] = {}
    for corpus in args.corpora:
        toks = (
            tokens
            if corpus == "wikitext2"
            else load_corpus(corpus, model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
        )
        tax = classify_heads(model, toks, batch_size=args.batch_size, corpus=corpus, verbose=verbose)
        tables[corpus] = tax.to_frame()
        taxonomy[corpus] = tax.summary()
        write_frame(tables[corpus], out / f"taxonomy_{corpus}.csv")
    dist = label_distribution(pd.concat(tables.values(), ignore_index=True), by="corpus")
    write_frame(dist, out / "taxonomy_distribution.csv")
    regimes = pd.concat([regime_summary(t).assign(corpus=c) for c, t in tables.items()], ignore_index=True)
    write_frame(regimes, out / "taxonomy_regimes.csv")
    agreement: dict[str, Any] = {}
    if len(tables) >= 2:
        agr = label_agreement(tables)
        write_frame(agr.pairwise, out / "taxonomy_agreement.csv")
        agreement = agr.summary()
        for (a, b), conf in agr.confusion.items():
            logger.info("confusion %s (rows) vs %s (columns):\n%s", a, b, conf.to_string())
    ref_corpus = "wikitext2" if "wikitext2" in tables else next(iter(tables))
    save_png(
        plot_regime_grid(tables[ref_corpus], title=f"{args.model}, {ref_corpus}: head regimes"),
        out / "taxonomy_regimes.png",
    )
    logger.info("taxonomy: %.0f s", time.time() - t0)
    logger.info("\n%s", _table(dist))
    logger.info("\n%s", _table(regimes))
    if agreement:
        logger.info(
            "\n%s\nall agree: %.4f",
            pd.DataFrame(agreement["pairwise"]).to_string(index=False),
            agreement["all_agree"],
        )

    # ---------------------------------------------------------------- summary
    summary: dict[str, Any] = {
        "model": args.model,
        "windows": [int(tokens.shape[0]), int(tokens.shape[1])],
        "position_0_tokens": first_tokens,
        "basis": _BASIS,
        "query_stride": args.query_stride,
        **selection,  # every key of SelectionResult.summary() (its windows are the same)
        "regime_shares": {c: s["shares"] for c, s in taxonomy.items()},
        "retriever_share": {c: s["shares"]["Retriever"] for c, s in taxonomy.items()},
        "alignment": [{"corpus": c, **row} for c, s in taxonomy.items() for row in s["alignment"]],
        "taxonomy": taxonomy,
        "agreement": agreement,
        "seconds": round(time.time() - t_start),
    }
    with atomic_write(out / "summary.json") as f:
        json.dump(summary, f, indent=1)
    for k in _LOGGED:
        logger.info("%s: %s", k, json.dumps(summary[k]))
    logger.info("total: %d s; wrote %s", summary["seconds"], out)
