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
import logging
import time
from typing import Any

from mechgeom.report.options import CORPORA, common_arguments
from mechgeom.report.runs import RunDir, run_with_threads

__all__ = ["HELP", "add_arguments", "run"]

HELP = "an encoder (MiniLM): [CLS]/[SEP] sinks over every corpus and embedding faithfulness (1 - cos)"

logger = logging.getLogger("mechgeom")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechgeom run encoder``."""
    common_arguments(parser, out="results/encoder", batch_size=8, threads=1, model="minilm-l6")
    parser.add_argument("--n-texts", type=int, default=48, help="windows per corpus for the sinks")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--faithfulness-texts", type=int, default=32)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.1, 0.25, 0.5, 0.75, 0.9])


def run(args: argparse.Namespace) -> int:
    """Run the encoder analysis of ``args`` and write its files under ``args.out/args.model``; returns 0."""
    return run_with_threads(args, _run)


def _run(args: argparse.Namespace) -> None:
    from mechgeom.data import load_corpus
    from mechgeom.models import load_model
    from mechgeom.report.drivers.contributions import special_tokens
    from mechgeom.report.drivers.faithfulness import embedding
    from mechgeom.report.drivers.sinks import encoder_sinks

    t_start = time.time()
    model = load_model(args.model)
    files = RunDir(args)
    size = {"seq_len": args.seq_len, "seed": args.seed}
    corpora = {c: load_corpus(c, model, n_texts=args.n_texts, **size) for c in CORPORA}
    sinks = encoder_sinks(model, corpora, batch_size=args.batch_size)
    files.write(sinks, {"heads": "sinks_heads", "by_corpus": "sinks_by_corpus"})
    logger.info("%s: sinks on %d windows of %s", args.model, args.n_texts, ", ".join(corpora))

    first = CORPORA[0]
    tokens = load_corpus(first, model, n_texts=args.faithfulness_texts, **size)
    special = special_tokens(model, tokens[: args.batch_size])
    files.write(special, {"special_tokens": "special_tokens"})

    t0 = time.time()
    curves = embedding(
        model, tokens, rates=args.rates, batch_size=args.batch_size, seed=args.seed, verbose=True,
        title=f"{args.model} on {first}: 1 − cos(embedding)",
    )  # fmt: skip
    files.write(curves, {"curves": "faithfulness"}, {"curves": "faithfulness_curves"})
    logger.info("embedding faithfulness: %.0f s", time.time() - t0)
    summary: dict[str, Any] = {
        "model": args.model,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "sinks": sinks.data["sinks"],
        "sinks_by_corpus": sinks.data["sinks_by_corpus"],
        "contributions": special.data,
        "faithfulness": {"corpus": first, **curves.data},
    }
    for mode, judged in summary["faithfulness"]["modes"].items():
        logger.info("%s: paper A's order %s (%s)", mode, judged["verdict"], judged["ranking"])
    summary["runtime_s"] = round(time.time() - t_start, 1)
    files.write_summary(summary, indent=2)
    logger.info("wrote %s (%.0f s)", files.path, summary["runtime_s"])
