"""``mechgeom sweep {faithfulness,tasks,pruning}``: the engine's sweeps from the command line, on this
process (``--engine local``) or on Ray actors (``--engine ray``), resumable, with the same tables either way.

- ``faithfulness``: :func:`mechgeom.analyses.faithfulness.perplexity_curves` per corpus ->
  ``DIR/faithfulness.csv`` (one row per corpus, metric, mode, rate: ``corpus, metric, mode, rate, ppl,
  delta_ppl, delta_nll, ci_low, ci_high, clean_ppl, n_texts, ...``), beside it the per-text records
  ``DIR/faithfulness_<corpus>.per_text.csv`` (the resume record) and each corpus's own table.
- ``tasks``: :func:`mechgeom.analyses.faithfulness.task_accuracy_curves` on BoolQ, Winogrande and MMLU
  items (16 subjects) -> ``DIR/tasks.csv`` (per task, metric, mode, rate: accuracy, Δaccuracy with its
  bootstrap interval, and the task's ``chance`` and ``majority`` rates), record ``DIR/tasks.per_choice.csv``.
- ``pruning``: :func:`mechgeom.analyses.heads.pruning.single_head_sweep` on WikiText-2 windows ->
  ``DIR/single_head.csv`` (the leaderboard), record ``DIR/single_head.per_text.csv``.

Rerun the same command to resume an interrupted sweep (Ctrl-C included); a larger ``--n-texts`` or
``--n-items`` with the same seed extends an earlier run. Other settings are refused with the difference.

``--engine ray`` runs the items on ``--workers`` actors, each loading ``--model`` once with ``--threads``
torch threads (``num_cpus`` = threads, ``--num-gpus`` each); ``--ray-address auto`` (or an address)
joins a running cluster, otherwise a local one is started for the run and shut down after. On one
machine start it inside ``scripts/isolated.sh`` (a local cluster listens on every interface).
``--engine local`` runs in this process with ``--workers x --threads`` torch threads.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from mechgeom._io import write_frame
from mechgeom.analyses.faithfulness.curves import (
    DEFAULT_RATES,
    FAITHFULNESS_METRICS,
    MODES,
    perplexity_curves,
    task_accuracy_curves,
)
from mechgeom.analyses.heads.pruning import single_head_sweep
from mechgeom.analyses.scoring import task_baselines
from mechgeom.data import CORPORA, TASKS, load_corpus, load_task
from mechgeom.models import load_model
from mechgeom.report.options import layer_list, names, positive, rates, seq_len
from mechgeom.sweep import ModelRef, RayExecutor

__all__ = ["SWEEPS", "add_arguments", "run"]

logger = logging.getLogger("mechgeom")

SWEEPS = ("faithfulness", "tasks", "pruning")
TASK_RATES = (0.0, 0.3, 0.6, 0.9)


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="directory of the tables and resume records")
    p.add_argument("--engine", choices=["local", "ray"], default="local")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster ('auto' or an address)")
    p.add_argument("--workers", type=positive, default=1, help="Ray actors (model replicas)")
    p.add_argument("--threads", type=positive, default=1, help="torch threads per worker")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per Ray actor")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=positive, default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_arguments(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """One sub-command per sweep under ``mechgeom sweep``."""
    metrics = names(FAITHFULNESS_METRICS, "--metrics")
    fa = sub.add_parser("faithfulness", help="ΔPPL curves under source masking, per corpus")
    _engine_arguments(fa)
    fa.add_argument("--corpus", type=names(CORPORA, "--corpus"), default=("wikitext2",), help="a,b")
    fa.add_argument("--n-texts", type=positive, default=16)
    fa.add_argument("--seq-len", type=seq_len, default=256)
    fa.add_argument("--metrics", type=metrics, default=FAITHFULNESS_METRICS)
    fa.add_argument("--rates", type=rates, default=DEFAULT_RATES)
    fa.add_argument("--modes", type=names(MODES, "--modes"), default=MODES)
    ta = sub.add_parser("tasks", help="multiple-choice accuracy under source masking")
    _engine_arguments(ta)
    ta.add_argument("--tasks", type=names(TASKS, "--tasks"), default=TASKS)
    ta.add_argument("--n-items", type=positive, default=200, help="items per task")
    ta.add_argument("--metrics", type=metrics, default=FAITHFULNESS_METRICS)
    ta.add_argument("--rates", type=rates, default=TASK_RATES)
    ta.add_argument("--modes", type=names(MODES, "--modes"), default=("comprehensiveness",))
    ta.add_argument("--max-len", type=positive, default=384, help="prompt + choice tokens at most")
    pr = sub.add_parser("pruning", help="the single-head sweep (leaderboard)")
    _engine_arguments(pr)
    pr.add_argument("--n-texts", type=positive, default=16)
    pr.add_argument("--seq-len", type=seq_len, default=256)
    pr.add_argument("--ablation", choices=["zero"], default="zero", help="head removal: z set to 0")
    pr.add_argument("--layers", type=layer_list, default=None, help="only these layers' heads: 0,5,29")


@contextlib.contextmanager
def _executor(args: argparse.Namespace) -> Iterator[RayExecutor | None]:
    """None (this process, ``workers x threads`` torch threads) or a Ray executor held for the run."""
    if args.engine == "local":
        before = torch.get_num_threads()
        torch.set_num_threads(args.workers * args.threads)
        try:
            yield None
        finally:
            torch.set_num_threads(before)
        return
    ex = RayExecutor(
        ModelRef(args.model),
        workers=args.workers,
        num_cpus=args.threads,
        num_gpus=args.num_gpus,
        threads=args.threads,
        address=args.ray_address,
    )
    with ex:
        yield ex


def _faithfulness(args: argparse.Namespace, model: Any, executor: RayExecutor | None) -> Path:
    frames = []
    for corpus in args.corpus:
        tokens = load_corpus(corpus, model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
        logger.info("faithfulness on %s: %s tokens, engine %s", corpus, tuple(tokens.shape), args.engine)
        frame = perplexity_curves(
            model,
            tokens,
            args.metrics,
            args.rates,
            args.modes,
            batch_size=args.batch_size or 8,
            seed=args.seed,
            checkpoint=args.out / f"faithfulness_{corpus}.csv",
            executor=executor,
            verbose=not args.quiet,
        )
        frame.insert(0, "corpus", corpus)
        frames.append(frame.assign(seq_len=args.seq_len))
    path = args.out / "faithfulness.csv"
    write_frame(pd.concat(frames, ignore_index=True), path)
    return path


def _tasks(args: argparse.Namespace, model: Any, executor: RayExecutor | None) -> Path:
    items = [it for task in args.tasks for it in load_task(task, n=args.n_items, seed=args.seed)]
    logger.info("tasks %s: %d items, engine %s", ",".join(args.tasks), len(items), args.engine)
    frame = task_accuracy_curves(
        model,
        items,
        args.metrics,
        args.rates,
        args.modes,
        batch_size=args.batch_size or 4,
        seed=args.seed,
        max_len=min(args.max_len, int(model.cfg.n_ctx)),
        checkpoint=args.out / "tasks.csv",
        executor=executor,
        verbose=not args.quiet,
    )
    frame = frame.merge(task_baselines(items).drop(columns="n_items"), on="task", how="left")
    path = args.out / "tasks.csv"
    write_frame(frame, path)
    return path


def _pruning(args: argparse.Namespace, model: Any, executor: RayExecutor | None) -> Path:
    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
    logger.info("single-head sweep: %s tokens, engine %s", tuple(tokens.shape), args.engine)
    n_heads = int(model.cfg.n_heads)
    heads = None if args.layers is None else [(layer, h) for layer in args.layers for h in range(n_heads)]
    result = single_head_sweep(
        model,
        tokens,
        heads=heads,
        mode=args.ablation,
        batch_size=args.batch_size or 8,
        checkpoint=args.out / "single_head.per_text.csv",
        executor=executor,
        verbose=not args.quiet,
    )
    path = args.out / "single_head.csv"
    write_frame(result.to_frame(), path)
    return path


def run(args: argparse.Namespace) -> Path:
    """Run ``mechgeom sweep <args.sweep>``; returns the table's path."""
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)  # the driver tokenises, checks the settings and names the fingerprint
    body = {"faithfulness": _faithfulness, "tasks": _tasks, "pruning": _pruning}[args.sweep]
    with _executor(args) as executor:
        return body(args, model, executor)
