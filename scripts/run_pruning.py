"""Head pruning: retention curves per order, and the single-head critical-head leaderboard.

Windows: ``--n-texts`` WikiText-2 (test) windows and ``--n-texts`` GSM8K (test) windows of ``--seq-len`` tokens
are the evaluation sets; ``--n-ref`` further WikiText-2 windows (disjoint from the evaluation ones: the same
shuffled document list, the next documents) are the reference set on which every order is built (mean head
output norm, attention entropy, mean-ablation means, the taxonomy labels and the single-head ΔPPL sweep).
The downstream task (``--task``, ``--n-items`` items) is scored by summed log-likelihood of each choice.

Writes under ``<out>/<model>/``:

- ``heads.csv``: per head ``layer, head, out_norm, entropy, weight_magnitude, label`` (label if the taxonomy
  module is available) and the single-head ``delta_ppl``;
- ``leaderboard.csv``: the single-head ablation leaderboard (most harmful first) with the MAD outlier flag;
- ``sweep_checkpoint.csv``: resumable sweep rows; ``retention.csv``: resumable retention rows (tidy);
- ``comparison.csv``: per corpus/task and retention level, each order's PPL (accuracy) and the best order;
- ``summary.json``: headline numbers; ``retention.png``.

    flock /tmp/heavy.lock .venv/bin/python scripts/run_pruning.py --model smollm2-135m
    flock /tmp/gemma.lock flock /tmp/heavy.lock .venv/bin/python scripts/run_pruning.py \\
        --model gemma-3-270m --leaderboard-only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mechgeom import load_model
from mechgeom._io import atomic_write, write_frame
from mechgeom.analyses.evaluation import text_nll
from mechgeom.analyses.pruning import (
    ORDERS,
    head_ablation_hooks,
    head_orders,
    head_stats,
    retention_curves,
    single_head_sweep,
    weight_magnitude,
)
from mechgeom.data import load_corpus, load_task
from mechgeom.viz import plot_retention

log = logging.getLogger("run_pruning")


def _taxonomy_table(model: Any, tokens: torch.Tensor) -> pd.DataFrame | None:
    """Per-head labels from :mod:`mechgeom.analyses.taxonomy` when that module exists, else None."""
    try:
        from mechgeom.analyses.taxonomy import classify_heads  # type: ignore[import-not-found]
    except ImportError:
        log.warning("mechgeom.analyses.taxonomy is not available: the taxonomy order is skipped")
        return None
    frame = classify_heads(model, tokens).to_frame()
    return frame.drop_duplicates(["layer", "head"]).reset_index(drop=True)


def _comparison(frame: pd.DataFrame) -> pd.DataFrame:
    """Per corpus/task and retention < 100%: each order's PPL (or accuracy) side by side, and the best order."""
    rows = []
    for (corpus, retention), grp in frame[frame["retention"] < 1.0].groupby(
        ["corpus", "retention"], sort=False
    ):
        is_task = grp["ppl"].isna().all()
        metric = "accuracy" if is_task else "ppl"
        vals = dict(zip(grp["order"], grp[metric], strict=True))
        best = (max if is_task else min)(vals, key=vals.__getitem__)
        rows.append({"corpus": corpus, "retention": retention, "metric": metric, **vals, "best": best})
    return pd.DataFrame(rows)


def _taxonomy_wins(comp: pd.DataFrame) -> dict[str, Any]:
    """How often the taxonomy order beats each baseline (lower PPL / higher accuracy), per corpus/task."""
    out: dict[str, Any] = {}
    if "taxonomy" not in comp.columns:
        return out
    for corpus, grp in comp.groupby("corpus", sort=False):
        higher_better = grp["metric"].iloc[0] == "accuracy"
        per: dict[str, Any] = {}
        for base in ("magnitude", "entropy", "random", "single_head"):
            if base not in grp.columns:
                continue
            better = grp["taxonomy"] > grp[base] if higher_better else grp["taxonomy"] < grp[base]
            per[base] = {
                "taxonomy_better_at": [float(r) for r in grp.loc[better, "retention"]],
                "n_levels": len(grp),
            }
        out[str(corpus)] = per
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-texts", type=int, default=16, help="evaluation windows per corpus")
    ap.add_argument("--n-ref", type=int, default=8, help="reference WikiText-2 windows (orders, sweep)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--task", default="winogrande", choices=["winogrande", "boolq", "mmlu", "none"])
    ap.add_argument("--n-items", type=int, default=48)
    ap.add_argument("--mode", default="zero", choices=["zero", "mean"])
    ap.add_argument("--k", type=float, default=5.0, help="MAD multiplier of the critical-head flag")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--orders",
        default="all",
        help="comma-separated subset of taxonomy,magnitude,entropy,random,single_head",
    )
    ap.add_argument("--leaderboard-only", action="store_true", help="only the single-head sweep")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verify-heads", type=int, default=3, help="heads re-run by full forward (0-3)")
    ap.add_argument("--out", default="results/pruning")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
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
    log.info("model %s: %d heads; ref %s, eval %s", args.model, n_heads, tuple(ref.shape), tuple(evals.shape))

    t0 = time.perf_counter()
    stats = head_stats(model, ref, batch_size=args.batch_size)
    timings["head_stats_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sweep = single_head_sweep(
        model,
        ref,
        mode=args.mode,
        means=stats,
        batch_size=args.batch_size,
        checkpoint=out / f"sweep_checkpoint_{args.mode}.csv",
        verbose=args.verbose,
    )
    timings["sweep_s"] = time.perf_counter() - t0
    # exactness check of the start_at_layer sweep on this model: a few heads through the full forward
    n_layers = model.cfg.n_layers
    check = [(0, 0), (n_layers // 2, 1), (n_layers - 1, model.cfg.n_heads - 1)][: args.verify_heads]
    gaps = [
        float(
            (
                text_nll(
                    model,
                    ref,
                    head_ablation_hooks(model, [lh], mode=args.mode, means=stats),
                    batch_size=args.batch_size,
                )
                - sweep.nll[lh]
            )
            .abs()
            .max()
        )
        for lh in check
    ]
    board = sweep.to_frame(k=args.k)
    write_frame(board, out / "leaderboard.csv")
    top = board.iloc[0]
    summary: dict[str, Any] = {
        "model": args.model,
        "n_heads": int(n_heads),
        "mode": args.mode,
        "reference": f"{args.n_ref} WikiText-2 windows x {args.seq_len} tokens (seed {args.seed})",
        "clean_ppl_ref": sweep.clean_ppl,
        "start_at_layer_check": {"heads": check, "max_abs_nll_gap": max(gaps) if gaps else None},
        "leaderboard": {
            "k": args.k,
            "median_delta_ppl": float(board["delta_ppl"].median()),
            "mad_scaled": float((board["threshold"].iloc[0] - board["delta_ppl"].median()) / args.k),
            "threshold": float(board["threshold"].iloc[0]),
            "top": {
                "layer": int(top["layer"]),
                "head": int(top["head"]),
                "delta_ppl": float(top["delta_ppl"]),
                "ratio_to_median": float(top["ratio_to_median"]),
                "robust_z": float(top["robust_z"]),
            },
            "top5": board.head(5)[["layer", "head", "delta_ppl", "robust_z"]].to_dict("records"),
            "critical": board[board["critical"]][["layer", "head", "delta_ppl", "robust_z"]].to_dict(
                "records"
            ),
        },
    }

    heads = stats.to_frame()
    heads["weight_magnitude"] = weight_magnitude(model).flatten().numpy()
    heads["delta_ppl"] = sweep.delta_ppl.flatten().numpy()
    taxonomy = None
    if not args.leaderboard_only:
        t0 = time.perf_counter()
        taxonomy = _taxonomy_table(model, ref)
        timings["taxonomy_s"] = time.perf_counter() - t0
        if taxonomy is not None:
            heads = heads.merge(taxonomy[["layer", "head", "label"]], on=["layer", "head"], how="left")
            summary["taxonomy_counts"] = {str(k): int(v) for k, v in taxonomy["label"].value_counts().items()}
    write_frame(heads, out / "heads.csv")

    if not args.leaderboard_only:
        orders = head_orders(model, stats, taxonomy=taxonomy, sweep=sweep, seed=args.seed)
        if args.orders != "all":
            wanted = args.orders.split(",")
            unknown = set(wanted) - set(ORDERS)
            if unknown:
                raise SystemExit(f"unknown order(s) {sorted(unknown)}; choose from {list(ORDERS)}")
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
            mode=args.mode,
            means=stats,
            task=task,
            batch_size=args.batch_size,
            checkpoint=out / f"retention_{args.mode}.csv",
            on_order=lambda f: log.info("order done; %d rows", len(f)),
            verbose=args.verbose,
        )
        timings["retention_s"] = time.perf_counter() - t0
        frame = curves.to_frame()
        write_frame(frame, out / "retention.csv")
        comp = _comparison(frame)
        write_frame(comp, out / "comparison.csv")
        write_frame(curves.summary(), out / "retention_summary.csv")
        plot_retention(
            frame, out / "retention.png", title=f"{args.model}: heads removed by order ({args.mode})"
        )
        summary["evaluation"] = (
            f"{args.n_texts} WikiText-2 + {args.n_texts} GSM8K windows x {args.seq_len} tokens; "
            f"{args.task} ({args.n_items} items)"
        )
        summary["orders"] = list(frame["order"].unique())
        summary["mean_delta_ppl"] = {
            f"{r.corpus}/{r.order}": (r.mean_accuracy if np.isnan(r.mean_delta_ppl) else r.mean_delta_ppl)
            for r in curves.summary().itertuples()
        }
        summary["taxonomy_wins"] = _taxonomy_wins(comp)
    timings["total_s"] = time.perf_counter() - t_start
    summary["timings"] = timings
    summary["threads"] = torch.get_num_threads()
    with atomic_write(out / "summary.json") as f:
        json.dump(summary, f, indent=2, default=float)
    log.info("wrote %s in %.0f s", out, timings["total_s"])


if __name__ == "__main__":
    main()
