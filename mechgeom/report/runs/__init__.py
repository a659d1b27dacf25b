"""``mechgeom run <analysis>``: one full analysis on one model, written under ``results/<analysis>/<model>/``.

Each module here is the command-line front of one analysis: its options (``HELP``, ``add_arguments``) and
``run(args) -> int``, which loads the model and the windows, calls the analysis' driver
(:mod:`mechgeom.report.drivers`, the same code as the report's stage) and writes the driver's output under
this verb's file names (:class:`RunDir`), with a ``summary.json``. ``scripts/run_<analysis>.py`` are thin
wrappers over the same verbs. The modules import nothing heavy until ``run`` is called, so the parser of
``mechgeom`` builds without torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mechgeom.report.base import StageOutput

__all__ = ["RUNS", "RunDir", "run_module", "run_with_threads"]

#: The analyses of ``mechgeom run``.
RUNS = ("faithfulness", "sinks", "selection", "pruning", "encoder")

logger = logging.getLogger("mechgeom")


def run_module(name: str) -> ModuleType:
    """The module of ``mechgeom run <name>``."""
    if name not in RUNS:
        raise ValueError(f"unknown analysis {name!r}; choose one of {', '.join(RUNS)}")
    return importlib.import_module(f"mechgeom.report.runs.{name}")


def run_with_threads(args: argparse.Namespace, body: Callable[[argparse.Namespace], None]) -> int:
    """``body(args)`` with torch limited to ``args.threads`` threads (restored afterwards); returns 0."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        body(args)
    finally:
        torch.set_num_threads(threads)
    return 0


class RunDir:
    """Where a run verb writes: ``<args.out>/<args.model>/``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.path = Path(args.out) / args.model

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def write(
        self,
        output: StageOutput,
        tables: Mapping[str, str],
        figures: Mapping[str, str] | None = None,
        *,
        dpi: int = 100,
    ) -> None:
        """Write the driver's ``tables`` and ``figures`` (driver name -> file stem) that it produced, as
        ``<stem>.csv`` and ``<stem>.png``, each atomically."""
        from mechgeom._io import write_frame
        from mechgeom.viz import save_png

        named = output.renamed(tables, figures or {})
        for stem, frame in named.tables.items():
            write_frame(frame, self.path / f"{stem}.csv")
        for stem, fig in named.figures.items():
            save_png(fig, self.path / f"{stem}.png", dpi=dpi)

    def write_summary(self, summary: dict[str, Any], *, indent: int = 1) -> Path:
        """``summary.json`` (atomically; NumPy numbers as floats)."""
        from mechgeom._io import atomic_write

        path = self.path / "summary.json"
        with atomic_write(path) as f:
            json.dump(summary, f, indent=indent, default=float)
        return path

    def read_summary(self) -> dict[str, Any]:
        """The ``summary.json`` of an earlier run, or ``{}``."""
        path = self.path / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}
