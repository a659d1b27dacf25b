"""Causal faithfulness on real text: ΔPPL curves (comprehensiveness, sufficiency) and downstream accuracy.

For each corpus (WikiText-2, GSM8K windows), :func:`mechgeom.analyses.faithfulness.perplexity_curves` masks the
top/bottom ``ceil(rate * (i+1))`` sources of every query in every layer by each metric's clean ranking.
Then a small :func:`mechgeom.analyses.faithfulness.task_accuracy_curves` sweep on BoolQ/Winogrande/MMLU items.

Writes under ``<out>/<model>/``:

- ``ppl_<corpus>.csv`` (one row per metric, mode, rate) and ``ppl_<corpus>.per_text.csv`` (the resume
  record), figure ``ppl_<corpus>.png``;
- ``tasks.csv``, ``tasks.per_choice.csv``, ``tasks.png``;
- ``summary.json``: settings, timings, the metric ordering per curve (area under the ΔPPL and ΔNLL
  curves, :func:`mechgeom.analyses.faithfulness.area_ordering`) and paper A's claimed order judged on the
  mean ΔPPL (:func:`mechgeom.analyses.faithfulness.faithfulness_summary`).

Every sweep resumes from its record: rerun the same command after an interruption. A larger
``--n-texts`` with the same seed extends an earlier run (the first windows are the same).

    flock /tmp/heavy.lock .venv/bin/mechgeom run faithfulness --n-texts 32
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from mechgeom.report.options import DEFAULT_RATES, FAITHFULNESS_METRICS, common_arguments
from mechgeom.report.runs import RunDir, run_with_threads

__all__ = ["HELP", "add_arguments", "run"]

logger = logging.getLogger("mechgeom")

HELP = "causal faithfulness: ΔPPL curves (comprehensiveness, sufficiency) and downstream task accuracy"

_BASIS = "as loaded (TransformerLens defaults; RMSNorm so W_O is the checkpoint's), no BOS for SmolLM2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechgeom run faithfulness`` (those of ``scripts/run_faithfulness.py``)."""
    common_arguments(parser, out="results/faithfulness", batch_size=8, threads=1)
    p = parser
    p.add_argument("--n-texts", type=int, default=32, help="windows per corpus")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--corpora", nargs="*", default=["wikitext2", "gsm8k"], help="none: skip the ΔPPL sweeps")
    p.add_argument("--metrics", nargs="+", default=list(FAITHFULNESS_METRICS))
    p.add_argument("--rates", nargs="+", type=float, default=list(DEFAULT_RATES))
    p.add_argument("--scope", default="intra", choices=["intra", "inter"])
    p.add_argument("--task-items", type=int, default=50, help="items per task (0: skip the task sweep)")
    p.add_argument("--tasks", nargs="+", default=["boolq", "winogrande", "mmlu"])
    p.add_argument("--task-metrics", nargs="+", default=["attention", "contribution", "random"])
    p.add_argument("--task-rates", nargs="+", type=float, default=[0.0, 0.3, 0.6])
    p.add_argument("--task-modes", nargs="+", default=["comprehensiveness"])
    p.add_argument("--task-batch-size", type=int, default=4)
    p.add_argument("--task-max-len", type=int, default=384)
    p.add_argument("--quiet", action="store_true")


def _corpus(args: argparse.Namespace, model: Any, files: RunDir, corpus: str) -> dict[str, Any]:
    """One corpus: the ΔPPL sweep (its table and record written by the sweep's checkpoint), its figure
    and its summary entry."""
    from mechgeom.data import load_corpus
    from mechgeom.report.drivers.faithfulness import perplexity

    t0 = time.time()
    tokens = load_corpus(corpus, model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
    out = perplexity(
        model, tokens, metrics=args.metrics, rates=args.rates, scope=args.scope, batch_size=args.batch_size,
        seed=args.seed, checkpoint=files / f"ppl_{corpus}.csv", verbose=not args.quiet,
        title=f"{args.model} on {corpus}: {args.n_texts} x {args.seq_len} tokens, all layers",
    )  # fmt: skip
    files.write(out, {}, {"curves": f"ppl_{corpus}"})
    logger.info("%s", out.tables["curves"].round(4).to_string(index=False))
    return {**out.data, "seconds": round(time.time() - t0, 1)}


def _tasks(args: argparse.Namespace, model: Any, files: RunDir) -> dict[str, Any]:
    """The task-accuracy sweep (its table and record written by the sweep's checkpoint), its figure and
    its summary entry."""
    from mechgeom.data import load_task
    from mechgeom.report.drivers.faithfulness import tasks

    t0 = time.time()
    items = [it for task in args.tasks for it in load_task(task, n=args.task_items, seed=args.seed)]
    out = tasks(
        model, items, metrics=args.task_metrics, rates=args.task_rates, modes=args.task_modes, scope=args.scope,
        batch_size=args.task_batch_size, seed=args.seed, max_len=args.task_max_len,
        checkpoint=files / "tasks.csv", verbose=not args.quiet,
        title=f"{args.model}: accuracy on {', '.join(args.tasks)} (all)",
    )  # fmt: skip
    files.write(out, {}, {"curves": "tasks"})
    logger.info("%s", out.tables["curves"].round(4).to_string(index=False))
    return {"items_per_task": args.task_items, **out.data, "seconds": round(time.time() - t0, 1)}


def run(args: argparse.Namespace) -> int:
    """Run the sweeps of ``args`` and write their tables, figures and ``summary.json``; returns 0."""
    return run_with_threads(args, _run)


def _run(args: argparse.Namespace) -> None:
    from mechgeom.models import load_model

    model = load_model(args.model)
    files = RunDir(args)
    summary = files.read_summary()  # merged with an earlier invocation's (e.g. a separate task run)
    summary.setdefault("corpora", {})
    summary.update({"model": args.model, "basis": _BASIS, "seed": args.seed, "threads": args.threads})
    for corpus in args.corpora:
        summary["corpora"][corpus] = _corpus(args, model, files, corpus)
    if args.task_items > 0:
        summary["tasks"] = _tasks(args, model, files)
    files.write_summary(summary)
    logger.info("wrote %s", files.path)
