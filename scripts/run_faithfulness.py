"""Causal faithfulness on real text: ΔPPL curves (comprehensiveness, sufficiency) and downstream accuracy.

For each corpus (WikiText-2, GSM8K windows), :func:`mechgeom.analyses.faithfulness.perplexity_curves` masks the
top/bottom ``ceil(rate * (i+1))`` sources of every query in every layer by each metric's clean ranking.
Then a small :func:`mechgeom.analyses.faithfulness.task_accuracy_curves` sweep on BoolQ/Winogrande/MMLU items.

Writes under ``<out>/<model>/``:

- ``ppl_<corpus>.csv`` (one row per metric, mode, rate) and ``ppl_<corpus>.per_text.csv`` (the resume
  record), figure ``ppl_<corpus>.png``;
- ``tasks.csv``, ``tasks.per_choice.csv``, ``tasks.png``;
- ``summary.json``: settings, timings and the metric ordering per curve (area under the ΔPPL curve).

Every sweep resumes from its record: rerun the same command after an interruption. A larger
``--n-texts`` with the same seed extends an earlier run (the first windows are the same).

    flock /tmp/heavy.lock .venv/bin/python scripts/run_faithfulness.py --n-texts 32
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mechgeom import load_model
from mechgeom._io import atomic_write
from mechgeom.analyses.faithfulness import (
    DEFAULT_RATES,
    FAITHFULNESS_METRICS,
    MODES,
    perplexity_curves,
    task_accuracy_curves,
)
from mechgeom.data import load_corpus, load_task
from mechgeom.viz import plot_curves

#: Paper A's claimed faithfulness order, least to most faithful.
PAPER_ORDER = ["attention", "value_weighted", "value_weighted_normalized", "contribution"]


def ordering(frame: pd.DataFrame, y: str) -> dict[str, Any]:
    """Per mode: each metric's area under ``y`` vs rate (trapezoid) and the metrics from least to most faithful.

    Comprehensiveness: a larger area is more faithful; sufficiency: a smaller area is more faithful.
    """
    out: dict[str, Any] = {}
    for mode in MODES:
        sub = frame[frame["mode"] == mode]
        area = {}
        for metric, d in sub.groupby("metric", sort=False):
            d = d.sort_values("rate")
            x, v = d["rate"].to_numpy(float), d[y].to_numpy(float)
            area[str(metric)] = float(np.sum((x[1:] - x[:-1]) * (v[1:] + v[:-1]) / 2))
        sign = 1 if mode == "comprehensiveness" else -1
        least_to_most = sorted(area, key=lambda m: sign * area[m])
        paper = [m for m in PAPER_ORDER if m in area]
        ranks = [least_to_most.index(m) for m in paper]
        out[mode] = {
            "area": area,
            "least_to_most_faithful": least_to_most,
            "agrees_with_paper_order": ranks == sorted(ranks),
            "random_rank": least_to_most.index("random") if "random" in area else None,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n-texts", type=int, default=32, help="windows per corpus")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default="results/faithfulness")
    p.add_argument("--corpora", nargs="*", default=["wikitext2", "gsm8k"], help="none: skip the ΔPPL sweeps")
    p.add_argument("--metrics", nargs="+", default=list(FAITHFULNESS_METRICS))
    p.add_argument("--rates", nargs="+", type=float, default=list(DEFAULT_RATES))
    p.add_argument("--scope", default="intra", choices=["intra", "inter"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-items", type=int, default=50, help="items per task (0: skip the task sweep)")
    p.add_argument("--tasks", nargs="+", default=["boolq", "winogrande", "mmlu"])
    p.add_argument("--task-metrics", nargs="+", default=["attention", "contribution", "random"])
    p.add_argument("--task-rates", nargs="+", type=float, default=[0.0, 0.3, 0.6])
    p.add_argument("--task-modes", nargs="+", default=["comprehensiveness"])
    p.add_argument("--task-batch-size", type=int, default=4)
    p.add_argument("--task-max-len", type=int, default=384)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    verbose = not args.quiet

    model = load_model(args.model)
    root = Path(args.out) / args.model
    # merge with an earlier invocation's summary (e.g. a separate task run)
    summary_path = root / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.setdefault("corpora", {})
    summary.update(
        {
            "model": args.model,
            "basis": "as loaded (TransformerLens defaults; RMSNorm so W_O is the checkpoint's), no BOS for SmolLM2",
            "seed": args.seed,
            "threads": args.threads,
        }
    )
    for corpus in args.corpora:
        t0 = time.time()
        tokens = load_corpus(corpus, model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
        frame = perplexity_curves(
            model,
            tokens,
            args.metrics,
            args.rates,
            MODES,
            scope=args.scope,
            batch_size=args.batch_size,
            seed=args.seed,
            out=root / f"ppl_{corpus}.csv",
            verbose=verbose,
        )
        plot_curves(
            frame,
            root / f"ppl_{corpus}.png",
            title=f"{args.model} on {corpus}: {args.n_texts} x {args.seq_len} tokens, all layers",
        )
        summary["corpora"][corpus] = {
            "n_texts": args.n_texts,
            "seq_len": args.seq_len,
            "rates": args.rates,
            "metrics": args.metrics,
            "scope": args.scope,
            "layers": "all",
            "clean_ppl": float(frame["clean_ppl"].iloc[0]),
            "seconds": round(time.time() - t0, 1),
            "ordering": ordering(frame, "delta_ppl"),
            "ordering_by_delta_nll": ordering(frame, "delta_nll"),
        }
        print(frame.round(4).to_string(index=False), flush=True)
        print(json.dumps(summary["corpora"][corpus], indent=1), flush=True)
    if args.task_items > 0:
        t0 = time.time()
        items = [it for task in args.tasks for it in load_task(task, n=args.task_items, seed=args.seed)]
        tasks = task_accuracy_curves(
            model,
            items,
            args.task_metrics,
            args.task_rates,
            args.task_modes,
            scope=args.scope,
            batch_size=args.task_batch_size,
            seed=args.seed,
            max_len=args.task_max_len,
            out=root / "tasks.csv",
            verbose=verbose,
        )
        plot_curves(
            tasks, root / "tasks.png", title=f"{args.model}: accuracy on {', '.join(args.tasks)} (all)"
        )
        summary["tasks"] = {
            "items_per_task": args.task_items,
            "metrics": args.task_metrics,
            "rates": args.task_rates,
            "modes": args.task_modes,
            "max_len": args.task_max_len,
            "scope": args.scope,
            "layers": "all",
            "clean_accuracy": tasks.drop_duplicates("task").set_index("task")["clean_accuracy"].to_dict(),
            "seconds": round(time.time() - t0, 1),
        }
        print(tasks.round(4).to_string(index=False), flush=True)
    with atomic_write(summary_path) as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
