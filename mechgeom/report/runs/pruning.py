"""Head pruning: retention curves per order, and the single-head critical-head leaderboard.

Windows: ``--n-texts`` WikiText-2 (test) windows and ``--n-texts`` GSM8K (test) windows of ``--seq-len`` tokens
are the evaluation sets; ``--n-ref`` further WikiText-2 windows (disjoint from the evaluation ones: the same
shuffled document list, the next documents) are the reference set on which every order is built (mean head
output norm, attention entropy, mean-ablation means and the taxonomy labels, all from the same passes of
:func:`mechgeom.analyses.head_stats.head_stats`, and the single-head ΔPPL sweep). The downstream task
(``--task``, ``--n-items`` items) is scored by summed log-likelihood of each choice.

Writes under ``<out>/<model>/``:

- ``heads.csv``: per head ``layer, head, out_norm, entropy, weight_magnitude``, the single-head ``delta_ppl``
  and the taxonomy ``label`` (:func:`mechgeom.analyses.head_orders.head_table`; no label with
  ``--leaderboard-only``);
- ``leaderboard.csv``: the single-head ablation leaderboard (most harmful first) with the MAD outlier flag;
- ``sweep_checkpoint_<mode>.csv``: resumable sweep rows; ``retention_<mode>.csv``: resumable retention rows
  (each a sweep store, with its ``.log.jsonl`` and ``.lock`` beside it: ``docs/sweeps.md``);
- ``retention.csv`` (tidy), ``comparison.csv`` (per corpus/task and retention level, each order's PPL or
  accuracy and the best order), ``retention_summary.csv`` (mean ΔPPL or accuracy per order);
- ``summary.json``: headline numbers (:meth:`~mechgeom.analyses.pruning.SingleHeadResult.summary`,
  :meth:`~mechgeom.analyses.pruning.RetentionCurves.summary`); ``retention.png``.

``--no-sweep`` skips the single-head sweep (no leaderboard, no ``single_head`` order, no ``delta_ppl``
column): a quick run of the other orders.

    flock /tmp/heavy.lock .venv/bin/mechgeom run pruning --model smollm2-135m
    flock /tmp/gemma.lock flock /tmp/heavy.lock .venv/bin/mechgeom run pruning \\
        --model gemma-3-270m --leaderboard-only
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from mechgeom._io import atomic_write, write_frame
from mechgeom.analyses.pruning import (
    ORDERS,
    RETENTION_LEVELS,
    head_orders,
    head_stats,
    head_table,
    retention_curves,
    single_head_sweep,
    sweep_exactness,
)
from mechgeom.data import load_corpus, load_task
from mechgeom.models import load_model
from mechgeom.report.runs import common_arguments, run_with_threads
from mechgeom.viz import plot_retention, save_png

__all__ = ["HELP", "add_arguments", "run"]

logger = logging.getLogger("mechgeom")

HELP = "head pruning: retention curves per order (taxonomy, magnitude, entropy, random, single-head) and critical heads"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechgeom run pruning`` (those of ``scripts/run_pruning.py``)."""
    common_arguments(parser, out="results/pruning", batch_size=8, threads=2)
    p = parser
    p.add_argument("--n-texts", type=int, default=16, help="evaluation windows per corpus")
    p.add_argument("--n-ref", type=int, default=8, help="reference WikiText-2 windows (orders, sweep)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--task", default="winogrande", choices=["winogrande", "boolq", "mmlu", "none"])
    p.add_argument("--n-items", type=int, default=48)
    p.add_argument("--mode", default="zero", choices=["zero", "mean"])
    p.add_argument("--k", type=float, default=5.0, help="MAD multiplier of the critical-head flag")
    p.add_argument(
        "--orders",
        default="all",
        help="comma-separated subset of taxonomy,magnitude,entropy,random,single_head",
    )
    p.add_argument(
        "--levels",
        type=float,
        nargs="+",
        default=list(RETENTION_LEVELS),
        help="retention levels (share of heads kept; default 1.0 0.9 ... 0.1)",
    )
    p.add_argument("--leaderboard-only", action="store_true", help="only the single-head sweep")
    p.add_argument(
        "--no-sweep",
        action="store_true",
        help="no single-head sweep: no leaderboard and no single_head order (a quick run)",
    )
    p.add_argument("--verify-heads", type=int, default=3, help="heads re-run by full forward (0-3)")
    # dest "progress": ``mechgeom -v`` (debug logging) already owns ``verbose``
    p.add_argument("--verbose", "--progress", dest="progress", action="store_true", help="progress bars")


def run(args: argparse.Namespace) -> int:
    """Run the pruning analysis of ``args`` and write its files under ``args.out/args.model``; returns 0."""
    return run_with_threads(args, _run)


def _wanted_orders(text: str) -> list[str] | None:
    if text == "all":
        return None
    wanted = [o.strip() for o in text.split(",") if o.strip()]
    unknown = sorted(set(wanted) - set(ORDERS))
    if unknown or not wanted:
        raise ValueError(f"unknown order(s) {unknown or [text]}; choose from {list(ORDERS)}")
    return wanted


def _run(args: argparse.Namespace) -> None:
    wanted = _wanted_orders(args.orders)
    if args.no_sweep and args.leaderboard_only:
        raise ValueError("--no-sweep and --leaderboard-only leave nothing to run")
    progress = bool(getattr(args, "progress", False))
    out = Path(args.out) / args.model
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    model = load_model(args.model)
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    wiki = load_corpus(
        "wikitext2", model, n_texts=args.n_texts + args.n_ref, seq_len=args.seq_len, seed=args.seed
    )
    evals, ref = wiki[: args.n_texts], wiki[args.n_texts :]
    logger.info(
        "model %s: %d heads; ref %s, eval %s", args.model, n_heads, tuple(ref.shape), tuple(evals.shape)
    )

    # ---------------------------------------------------------------- reference statistics and the sweep
    t0 = time.perf_counter()
    stats = head_stats(
        model, ref, batch_size=args.batch_size, taxonomy=not args.leaderboard_only, verbose=progress
    )
    timings["head_stats_s"] = time.perf_counter() - t0
    summary: dict[str, Any] = {
        "model": args.model,
        "n_heads": int(n_heads),
        "mode": args.mode,
        "reference": f"{args.n_ref} WikiText-2 windows x {args.seq_len} tokens (seed {args.seed})",
    }
    sweep = None
    if not args.no_sweep:
        t0 = time.perf_counter()
        sweep = single_head_sweep(
            model,
            ref,
            mode=args.mode,
            means=stats,
            batch_size=args.batch_size,
            checkpoint=out / f"sweep_checkpoint_{args.mode}.csv",
            verbose=progress,
        )
        timings["sweep_s"] = time.perf_counter() - t0
        check = sweep_exactness(model, ref, sweep, args.verify_heads, means=stats, batch_size=args.batch_size)
        write_frame(sweep.to_frame(k=args.k), out / "leaderboard.csv")
        board = sweep.summary(k=args.k)
        summary.update(clean_ppl_ref=sweep.clean_ppl, start_at_layer_check=check, leaderboard=board)
        logger.info(
            "single-head sweep: clean PPL %.3f; most harmful L%dH%d (ΔPPL %+.3f); %d critical head(s)",
            sweep.clean_ppl,
            board["top"]["layer"],
            board["top"]["head"],
            board["top"]["delta_ppl"],
            board["n_critical"],
        )
    counts = stats.summary().get("taxonomy_counts")
    if counts is not None:
        summary["taxonomy_counts"] = counts
    write_frame(head_table(model, stats, sweep), out / "heads.csv")

    # ---------------------------------------------------------------- retention curves
    if not args.leaderboard_only:
        orders = head_orders(model, stats, sweep=sweep, seed=args.seed)
        if wanted is not None:
            orders = {k: v for k, v in orders.items() if k in wanted}
        gsm = load_corpus("gsm8k", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
        task = (
            None if args.task == "none" else (args.task, load_task(args.task, n=args.n_items, seed=args.seed))
        )
        t0 = time.perf_counter()
        curves = retention_curves(
            model,
            orders,
            {"wikitext2": evals, "gsm8k": gsm},
            levels=args.levels,
            mode=args.mode,
            means=stats,
            task=task,
            batch_size=args.batch_size,
            checkpoint=out / f"retention_{args.mode}.csv",
            on_order=lambda f: logger.info("order done; %d rows", len(f)),
            verbose=progress,
        )
        timings["retention_s"] = time.perf_counter() - t0
        frame = curves.to_frame()
        write_frame(frame, out / "retention.csv")
        write_frame(curves.comparison(), out / "comparison.csv")
        write_frame(curves.summary_frame(), out / "retention_summary.csv")
        title = f"{args.model}: heads removed by order ({args.mode})"
        save_png(plot_retention(frame, title=title), out / "retention.png", dpi=80)
        retention = curves.summary()
        summary["evaluation"] = (
            f"{args.n_texts} WikiText-2 + {args.n_texts} GSM8K windows x {args.seq_len} tokens; "
            f"{args.task} ({args.n_items} items)"
        )
        summary["orders"] = retention["orders"]
        summary["mean_delta_ppl"] = {
            f"{corpus}/{order}": value
            for corpus, per in retention["by_corpus"].items()
            for order, value in per.items()
        }
        summary["taxonomy_wins"] = retention["taxonomy_wins"]
        summary["retention"] = retention
        logger.info(
            "mean ΔPPL below 100%%: %s",
            ", ".join(f"{o} {v:+.3g}" for o, v in retention["mean_delta_ppl"].items()),
        )
    timings["total_s"] = time.perf_counter() - t_start
    summary["timings"] = timings
    summary["threads"] = torch.get_num_threads()
    with atomic_write(out / "summary.json") as f:
        json.dump(summary, f, indent=2, default=float)
    logger.info("wrote %s in %.0f s", out, timings["total_s"])
