"""An encoder (default MiniLM): ``[CLS]``/``[SEP]`` sinks over every shipped corpus and embedding faithfulness.

Writes under ``<out>/<model>/``:

- ``sinks_heads.csv``: per (corpus, layer, head, sink) statistics (:meth:`SinkResult.to_frame` with a
  ``corpus`` column), sinks named ``"[CLS]"`` and ``"[SEP]"`` and resolved in each window;
- ``sinks_by_corpus.csv``: per (corpus, sink) the means over heads of the attention mass on the token
  (``sink_rate_pos``), its projected value-norm ratio (``norm_ratio_vt``) and its mean cosine to the other
  tokens' values (``cos_sink_tokens``), and the anti-alignment ``cos_sink_mean`` of the sink vector;
- ``special_tokens.csv``: per (layer, head, token) attention vs contribution of ``[CLS]``/``[SEP]`` on the
  first corpus (:meth:`ContributionResult.special_token_frame`);
- ``faithfulness.csv`` and ``faithfulness_curves.png``: ``1 − cos`` of the mean-pooled embedding under
  comprehensiveness and sufficiency for the four metrics and random (:func:`embedding_curves`);
- ``summary.json``: the headline numbers, and paper A's order judged per mode.
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
from mechgeom.analyses.contribution.stats import SUMMARY_METRICS
from mechgeom.analyses.contribution.weights import contribution_weights
from mechgeom.analyses.faithfulness.embedding import embedding_curves
from mechgeom.analyses.sinks.statistics import sink_statistics
from mechgeom.data import CORPORA, load_corpus
from mechgeom.models import load_model
from mechgeom.report.runs import common_arguments, run_with_threads
from mechgeom.viz import plot_curves, save_png

__all__ = ["HELP", "add_arguments", "run"]

HELP = "an encoder (MiniLM): [CLS]/[SEP] sinks over every corpus and embedding faithfulness (1 - cos)"

logger = logging.getLogger("mechgeom")

_SINKS = ["[CLS]", "[SEP]"]
_COLUMNS = ["sink_rate_pos", "norm_ratio_vt", "cos_sink_tokens", "cos_sink_mean"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechgeom run encoder``."""
    common_arguments(parser, out="results/encoder", batch_size=8, threads=1)
    parser.set_defaults(model="minilm-l6")
    parser.add_argument("--n-texts", type=int, default=48, help="windows per corpus for the sinks")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--faithfulness-texts", type=int, default=32)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.1, 0.25, 0.5, 0.75, 0.9])


def run(args: argparse.Namespace) -> int:
    """Run the encoder analysis of ``args`` and write its files under ``args.out/args.model``; returns 0."""
    return run_with_threads(args, _run)


def _run(args: argparse.Namespace) -> None:
    t_start = time.time()
    model = load_model(args.model)
    out = Path(args.out) / args.model
    summary: dict[str, Any] = {"model": args.model, "seq_len": args.seq_len, "seed": args.seed, "sinks": {}}
    heads, rows = [], []
    for corpus in CORPORA:
        tokens = load_corpus(corpus, model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
        stats = sink_statistics(model, tokens, sink_positions=_SINKS, batch_size=args.batch_size)
        frame = stats.to_frame()
        frame.insert(0, "corpus", corpus)
        heads.append(frame)
        for sink, d in frame.groupby("sink", sort=False):
            rows.append(
                {"corpus": corpus, "sink": sink, "n_texts": int(tokens.shape[0]), **d[_COLUMNS].mean()}
            )
        summary["sinks"][corpus] = stats.summary()
        logger.info("%s: sinks on %d windows of %s", args.model, tokens.shape[0], corpus)
    write_frame(pd.concat(heads, ignore_index=True), out / "sinks_heads.csv")
    by_corpus = pd.DataFrame(rows)
    write_frame(by_corpus, out / "sinks_by_corpus.csv")
    summary["sinks_by_corpus"] = by_corpus.to_dict(orient="records")

    first = CORPORA[0]
    tokens = load_corpus(first, model, n_texts=args.faithfulness_texts, seq_len=args.seq_len, seed=args.seed)
    res = contribution_weights(model, tokens[: args.batch_size], intra=SUMMARY_METRICS, inter=SUMMARY_METRICS)
    write_frame(res.special_token_frame(), out / "special_tokens.csv")
    summary["contributions"] = res.summary()

    t0 = time.time()
    curves = embedding_curves(
        model, tokens, rates=args.rates, batch_size=args.batch_size, seed=args.seed, verbose=True
    )
    table = curves.to_frame()
    write_frame(table, out / "faithfulness.csv")
    save_png(
        plot_curves(table, y="effect", title=f"{args.model} on {first}: 1 − cos(embedding)"),
        out / "faithfulness_curves.png",
    )
    summary["faithfulness"] = {"corpus": first, "n_texts": int(tokens.shape[0]), **curves.summary()}
    logger.info("embedding faithfulness: %.0f s", time.time() - t0)
    for mode, judged in summary["faithfulness"]["modes"].items():
        logger.info("%s: paper A's order %s (%s)", mode, judged["verdict"], judged["ranking"])
    summary["runtime_s"] = round(time.time() - t_start, 1)
    with atomic_write(out / "summary.json") as f:
        json.dump(summary, f, indent=2, default=float)
    logger.info("wrote %s (%.0f s)", out, summary["runtime_s"])
