"""``mechgeom run <analysis>``: one full analysis on one model, written under ``results/<analysis>/<model>/``.

Each module here composes one analysis (its entry points, ``Result.summary()`` and the figures of
:mod:`mechgeom.viz`) into tables, figures and a ``summary.json``; it computes nothing itself. A module gives
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; ``scripts/run_<analysis>.py`` are
thin wrappers over the same verbs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from types import ModuleType

import torch

__all__ = ["RUNS", "common_arguments", "run_module", "run_with_threads"]

RUNS = ("faithfulness", "sinks", "selection", "pruning", "encoder")


def run_module(name: str) -> ModuleType:
    """The module of ``mechgeom run <name>``."""
    if name not in RUNS:
        raise ValueError(f"unknown analysis {name!r}; choose one of {', '.join(RUNS)}")
    return importlib.import_module(f"mechgeom.report.runs.{name}")


def common_arguments(
    parser: argparse.ArgumentParser, *, out: str, batch_size: int = 8, threads: int = 1
) -> None:
    """The options every run verb has: ``--model``, ``--out`` (default ``out``), ``--seed``, ``--batch-size``
    and ``--threads``."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default=out)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--threads", type=int, default=threads)


def run_with_threads(args: argparse.Namespace, body: Callable[[argparse.Namespace], None]) -> int:
    """``body(args)`` with torch limited to ``args.threads`` threads (restored afterwards); returns 0."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        body(args)
    finally:
        torch.set_num_threads(threads)
    return 0
