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
from typing import Any

from mechgeom.report.options import CORPORA, common_arguments
from mechgeom.report.runs import RunDir, run_with_threads

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
#: The driver's selection tables and figure, and the files they go to.
_SELECTION_FILES = {
    "heads": "selection_heads",
    "params": "bound_params",
    "by_n": "selection_by_n",
    "sink_effect": "sink_effect",
    "bounds": "bound_by_n",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechgeom run selection`` (those of ``scripts/run_selection.py``)."""
    common_arguments(parser, out="results/selection", batch_size=8, threads=1)
    parser.add_argument("--n-texts", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--n-random", type=int, default=2, help="random N-subsets per query (the baseline)")
    parser.add_argument("--query-stride", type=int, default=1, help="analyse every k-th query (1: all)")
    parser.add_argument(
        "--corpora", nargs="+", default=["wikitext2", "c4", "gsm8k"], choices=CORPORA, help="taxonomy corpora"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Run the selection analysis of ``args`` and write its files under ``args.out/args.model``; returns 0."""
    return run_with_threads(args, _run)


def _table(frame: Any) -> str:
    return str(frame.to_string(index=False, float_format="%.4f"))


def _run(args: argparse.Namespace) -> None:
    from mechgeom.data import load_corpus
    from mechgeom.models import load_model
    from mechgeom.report.drivers.selection import selection, taxonomy

    t_start = time.time()
    verbose = not args.no_progress
    model = load_model(args.model)
    files = RunDir(args)
    windows = {"n_texts": args.n_texts, "seq_len": args.seq_len, "seed": args.seed}
    tokens = load_corpus("wikitext2", model, **windows)
    first_tokens = sorted({model.to_string(t[:1]) for t in tokens})
    logger.info("%s: %d x %d WikiText-2 windows; position 0 = %s", args.model, *tokens.shape, first_tokens)

    t0 = time.time()
    sel = selection(
        model, tokens, ns=args.ns, n_random=args.n_random, query_stride=args.query_stride, seed=args.seed,
        verbose=verbose, title=f"{args.model}: extreme F-score vs N",
    )  # fmt: skip
    files.write(sel, _SELECTION_FILES, {"f_vs_n": "selection_f_vs_n"})
    logger.info("selection: %.0f s", time.time() - t0)
    for name in ("by_n", "sink_effect", "bounds"):
        logger.info("\n%s", _table(sel.tables[name]))

    t0 = time.time()
    corpora = {c: tokens if c == "wikitext2" else load_corpus(c, model, **windows) for c in args.corpora}
    shown = "wikitext2" if "wikitext2" in corpora else args.corpora[0]
    tax = taxonomy(
        model, corpora, batch_size=args.batch_size, verbose=verbose, shown=shown,
        title=f"{args.model}, {shown}: head regimes",
    )  # fmt: skip
    named = {
        "distribution": "taxonomy_distribution",
        "regimes": "taxonomy_regimes",
        "agreement": "taxonomy_agreement",
    }
    files.write(
        tax, {**{f"labels_{c}": f"taxonomy_{c}" for c in corpora}, **named}, {"regimes": "taxonomy_regimes"}
    )
    logger.info("taxonomy: %.0f s", time.time() - t0)
    for name in ("distribution", "regimes"):
        logger.info("\n%s", _table(tax.tables[name]))

    summary: dict[str, Any] = {
        "model": args.model,
        "windows": [int(tokens.shape[0]), int(tokens.shape[1])],
        "position_0_tokens": first_tokens,
        "basis": _BASIS,
        "query_stride": args.query_stride,
        **sel.data,  # every key of SelectionResult.summary() (its windows are the same)
        **tax.data,
        "seconds": round(time.time() - t_start),
    }
    files.write_summary(summary)
    for k in _LOGGED:
        logger.info("%s: %s", k, json.dumps(summary[k]))
    logger.info("total: %d s; wrote %s", summary["seconds"], files.path)
