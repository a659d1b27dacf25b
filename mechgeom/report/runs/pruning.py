"""Head pruning: retention curves per order, and the single-head critical-head leaderboard.

Windows: ``--n-texts`` WikiText-2 (test) windows and ``--n-texts`` GSM8K (test) windows of ``--seq-len`` tokens
are the evaluation sets; ``--n-ref`` further WikiText-2 windows (disjoint from the evaluation ones: the same
shuffled document list, the next documents) are the reference set on which every order is built (mean head
output norm, attention entropy, mean-ablation means and the taxonomy labels, all from the same passes of
:func:`mechgeom.analyses.heads.stats.head_stats`, and the single-head ΔPPL sweep). The downstream task
(``--task``, ``--n-items`` items) is scored by summed log-likelihood of each choice.

Writes under ``<out>/<model>/``:

- ``heads.csv``: per head ``layer, head, out_norm, entropy, weight_magnitude``, the single-head ``delta_ppl``
  and the taxonomy ``label`` (:func:`mechgeom.analyses.heads.orders.head_table`; no label with
  ``--leaderboard-only``);
- ``leaderboard.csv``: the single-head ablation leaderboard (most harmful first) with the MAD outlier flag;
- ``sweep_checkpoint_<mode>.csv``: resumable sweep rows; ``retention_<mode>.csv``: resumable retention rows
  (each a sweep store, with its ``.log.jsonl`` and ``.lock`` beside it: ``docs/sweeps.md``);
- ``retention.csv`` (tidy), ``comparison.csv`` (per corpus/task and retention level, each order's PPL or
  accuracy and the best order), ``retention_summary.csv`` (mean ΔPPL or accuracy per order);
- ``summary.json``: headline numbers (:meth:`~mechgeom.analyses.heads.pruning.SingleHeadResult.summary`,
  :meth:`~mechgeom.analyses.heads.pruning.RetentionCurves.summary`); ``retention.png``.

``--no-sweep`` skips the single-head sweep (no leaderboard, no ``single_head`` order, no ``delta_ppl``
column): a quick run of the other orders.

    flock /tmp/heavy.lock .venv/bin/mechgeom run pruning --model smollm2-135m
    flock /tmp/gemma.lock flock /tmp/heavy.lock .venv/bin/mechgeom run pruning \\
        --model gemma-3-270m --leaderboard-only
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from mechgeom.report.options import HEAD_ORDERS, RETENTION_LEVELS, common_arguments
from mechgeom.report.runs import RunDir, run_with_threads

__all__ = ["HELP", "add_arguments", "run"]

logger = logging.getLogger("mechgeom")

HELP = "head pruning: retention curves per order (taxonomy, magnitude, entropy, random, single-head) and critical heads"

#: The driver's tables, and the files they go to (the leaderboard is the single-head sweep's table).
_FILES = {
    "single_head": "leaderboard",
    **{t: t for t in ("heads", "retention", "comparison", "retention_summary")},
}


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
    p.add_argument("--orders", default="all", help=f"comma-separated subset of {','.join(HEAD_ORDERS)}")
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
    unknown = sorted(set(wanted) - set(HEAD_ORDERS))
    if unknown or not wanted:
        raise ValueError(f"unknown order(s) {unknown or [text]}; choose from {list(HEAD_ORDERS)}")
    return wanted


def _windows(args: argparse.Namespace, model: Any) -> tuple[Any, dict[str, Any], Any]:
    """The reference windows, the evaluation corpora (none for a leaderboard) and the task."""
    from mechgeom.data import load_corpus, load_task

    size = {"seq_len": args.seq_len, "seed": args.seed}
    wiki = load_corpus("wikitext2", model, n_texts=args.n_texts + args.n_ref, **size)
    ref, corpora = wiki[args.n_texts :], {"wikitext2": wiki[: args.n_texts]}
    if args.leaderboard_only:
        return ref, {}, None
    corpora["gsm8k"] = load_corpus("gsm8k", model, n_texts=args.n_texts, **size)
    task = None if args.task == "none" else (args.task, load_task(args.task, n=args.n_items, seed=args.seed))
    return ref, corpora, task


def _run(args: argparse.Namespace) -> None:
    from mechgeom.models import load_model
    from mechgeom.report.drivers.pruning import pruning

    wanted = _wanted_orders(args.orders)
    if args.no_sweep and args.leaderboard_only:
        raise ValueError("--no-sweep and --leaderboard-only leave nothing to run")
    files = RunDir(args)
    files.path.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model = load_model(args.model)
    n_heads = int(model.cfg.n_layers * model.cfg.n_heads)
    ref, corpora, task = _windows(args, model)
    evals = tuple(corpora["wikitext2"].shape) if corpora else ()
    logger.info("model %s: %d heads; ref %s, eval %s", args.model, n_heads, tuple(ref.shape), evals)
    out = pruning(
        model, ref, corpora, mode=args.mode, levels=args.levels, sweep=not args.no_sweep,
        retention=not args.leaderboard_only, orders=wanted, task=task, k=args.k, verify_heads=args.verify_heads,
        seed=args.seed, batch_size=args.batch_size, sweep_checkpoint=files / f"sweep_checkpoint_{args.mode}.csv",
        retention_checkpoint=files / f"retention_{args.mode}.csv",
        on_order=lambda f: logger.info("order done; %d rows", len(f)), verbose=args.progress,
        title=f"{args.model}: heads removed by order ({args.mode})",
    )  # fmt: skip
    files.write(out, _FILES, {"retention": "retention"}, dpi=80)
    summary: dict[str, Any] = {
        "model": args.model,
        "n_heads": n_heads,
        "mode": args.mode,
        "reference": f"{args.n_ref} WikiText-2 windows x {args.seq_len} tokens (seed {args.seed})",
        **out.data,
    }
    if corpora:
        summary["evaluation"] = (
            f"{args.n_texts} WikiText-2 + {args.n_texts} GSM8K windows x {args.seq_len} tokens; "
            f"{args.task} ({args.n_items} items)"
        )
    summary["timings"]["total_s"] = time.perf_counter() - t_start
    summary["threads"] = args.threads
    files.write_summary(summary, indent=2)
    for line in out.summary:
        logger.info("%s", line)
    logger.info("wrote %s in %.0f s", files.path, summary["timings"]["total_s"])
