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
from typing import Any

from mechgeom.report.options import (
    CORPORA,
    DEFAULT_RATES,
    FAITHFULNESS_METRICS,
    MODES,
    TASKS,
    common_arguments,
    layer_list,
    names,
    positive,
    rates,
    seq_len,
)

__all__ = ["SWEEPS", "add_arguments", "run"]

logger = logging.getLogger("mechgeom")

SWEEPS = ("faithfulness", "tasks", "pruning")
TASK_RATES = (0.0, 0.3, 0.6, 0.9)


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    common_arguments(p, out=None, batch_size=None, threads=1)
    p.add_argument("--engine", choices=["local", "ray"], default="local")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster ('auto' or an address)")
    p.add_argument("--workers", type=positive, default=1, help="Ray actors (model replicas)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per Ray actor")
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
def _executor(args: argparse.Namespace) -> Iterator[Any]:
    """None (this process, ``workers x threads`` torch threads) or a Ray executor held for the run."""
    if args.engine == "local":
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(args.workers * args.threads)
        try:
            yield None
        finally:
            torch.set_num_threads(before)
        return
    from mechgeom.sweep import ModelRef, RayExecutor

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


def _options(args: argparse.Namespace, executor: Any) -> dict[str, Any]:
    """The options every sweep passes to its driver: the seed, the executor, the progress bar, and the
    batch size when given (else the analysis' own default)."""
    size = {} if args.batch_size is None else {"batch_size": args.batch_size}
    return {"seed": args.seed, "executor": executor, "verbose": not args.quiet, **size}


def _faithfulness(args: argparse.Namespace, model: Any, executor: Any) -> Any:
    import pandas as pd

    from mechgeom.data import load_corpus
    from mechgeom.report.drivers.faithfulness import perplexity

    frames = []
    for corpus in args.corpus:
        tokens = load_corpus(corpus, model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
        logger.info("faithfulness on %s: %s tokens, engine %s", corpus, tuple(tokens.shape), args.engine)
        out = perplexity(
            model, tokens, metrics=args.metrics, rates=args.rates, modes=args.modes,
            checkpoint=args.out / f"faithfulness_{corpus}.csv", **_options(args, executor),
        )  # fmt: skip
        frames.append(out.tables["curves"].assign(seq_len=args.seq_len).assign(corpus=corpus))
    frame = pd.concat(frames, ignore_index=True)
    return frame[["corpus", *(c for c in frame.columns if c != "corpus")]]


def _tasks(args: argparse.Namespace, model: Any, executor: Any) -> Any:
    from mechgeom.data import load_task
    from mechgeom.report.drivers.faithfulness import tasks

    items = [it for task in args.tasks for it in load_task(task, n=args.n_items, seed=args.seed)]
    logger.info("tasks %s: %d items, engine %s", ",".join(args.tasks), len(items), args.engine)
    out = tasks(
        model, items, metrics=args.metrics, rates=args.rates, modes=args.modes,
        max_len=min(args.max_len, int(model.cfg.n_ctx)), checkpoint=args.out / "tasks.csv",
        **_options(args, executor),
    )  # fmt: skip
    baselines = out.tables["baselines"].drop(columns="n_items")
    return out.tables["curves"].merge(baselines, on="task", how="left")


def _pruning(args: argparse.Namespace, model: Any, executor: Any) -> Any:
    from mechgeom.data import load_corpus
    from mechgeom.report.drivers.pruning import single_head

    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
    logger.info("single-head sweep: %s tokens, engine %s", tuple(tokens.shape), args.engine)
    n_heads = int(model.cfg.n_heads)
    heads = None if args.layers is None else [(layer, h) for layer in args.layers for h in range(n_heads)]
    options = {k: v for k, v in _options(args, executor).items() if k != "seed"}
    _, out = single_head(
        model,
        tokens,
        heads=heads,
        mode=args.ablation,
        checkpoint=args.out / "single_head.per_text.csv",
        **options,
    )
    return out.tables["single_head"]


#: Each sweep's driver call and the table it writes.
_SWEEPS = {
    "faithfulness": (_faithfulness, "faithfulness.csv"),
    "tasks": (_tasks, "tasks.csv"),
    "pruning": (_pruning, "single_head.csv"),
}


def run(args: argparse.Namespace) -> Any:
    """Run ``mechgeom sweep <args.sweep>``; returns the table's path."""
    from mechgeom._io import write_frame
    from mechgeom.models import load_model

    args.out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)  # the driver tokenises, checks the settings and names the fingerprint
    body, name = _SWEEPS[args.sweep]
    with _executor(args) as executor:
        frame = body(args, model, executor)
    path = args.out / name
    write_frame(frame, path)
    return path
