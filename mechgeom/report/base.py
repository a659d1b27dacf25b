"""The report's settings, stages and records: what a stage is given and what it returns.

:class:`StageOutput` is also what every analysis driver of :mod:`mechgeom.report.drivers` returns: the report's
stages and the ``mechgeom run`` verbs write the same output under their own file names
(:meth:`StageOutput.renamed`). Light at import: the model and the data load on first use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mechgeom.report.options import PRESETS

if TYPE_CHECKING:
    import pandas as pd
    import torch

logger = logging.getLogger("mechgeom.report")

__all__ = ["PRESETS", "ReportResult", "ReportSettings", "Stage", "StageContext", "StageOutput", "StageRecord"]


# --------------------------------------------------------------------------- settings and results


@dataclass(frozen=True)
class ReportSettings:
    """What a report is computed from; a stage is reused only when these (and its params) match."""

    model: str
    corpus: str
    n_texts: int
    seq_len: int
    seed: int
    quick: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StageOutput:
    """What a stage (or an analysis driver) returns: tables (name -> frame), figures (name -> matplotlib
    figure or PNG bytes), summary lines (plain text), extra HTML (circuitsvis views), notes (plain text)
    and ``data``, the headline numbers as JSON-able values (a run verb's ``summary.json``)."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    views: list[tuple[str, str]] = field(default_factory=list)  # (caption, circuitsvis local_src)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def renamed(self, tables: Mapping[str, str], figures: Mapping[str, str]) -> StageOutput:
        """The tables and figures named in ``tables`` / ``figures`` (driver name -> file stem), in that
        order and under the new names; the summary, views, notes and data as they are. A name the
        driver did not produce is left out (e.g. the sweep table of a run without the sweep)."""
        return StageOutput(
            tables={new: self.tables[old] for old, new in tables.items() if old in self.tables},
            figures={new: self.figures[old] for old, new in figures.items() if old in self.figures},
            summary=list(self.summary),
            views=list(self.views),
            notes=list(self.notes),
            data=dict(self.data),
        )


@dataclass
class StageRecord:
    """One stage as the report shows it."""

    name: str
    title: str
    status: str  # "computed" | "reused" | "skipped" | "failed"
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    fragment: str = ""
    reason: str = ""


@dataclass
class ReportResult:
    """Where the report went and what each stage did."""

    out_dir: Path
    html_path: Path
    settings: ReportSettings
    stages: list[StageRecord]

    @property
    def ok(self) -> bool:
        return all(s.status != "failed" for s in self.stages)

    def status(self) -> dict[str, str]:
        return {s.name: s.status for s in self.stages}


class StageContext:
    """The model and the token windows, loaded on first use (a fully reused report loads nothing)."""

    def __init__(
        self,
        settings: ReportSettings,
        out_dir: Path,
        *,
        model: Any = None,
        tokens: torch.Tensor | None = None,
        device: str = "cpu",
        verbose: bool = True,
    ) -> None:
        self.settings = settings
        self.device = device
        self.verbose = verbose
        self._model = model
        self._tokens: torch.Tensor | None = tokens
        self.out_dir = out_dir
        self.stage_key = ""
        self._passes: dict[tuple[Any, ...], dict[str, Any]] = {}

    def partial_path(self, name: str, suffix: str) -> Path:
        """A checkpoint file of the running stage, tied to its settings (``partial/<name>-<key><suffix>``):
        a sweep that records finished rows there resumes after an interruption."""
        return self.out_dir / "partial" / f"{name}-{self.stage_key}{suffix}"

    @property
    def model(self) -> Any:
        if self._model is None:
            from mechgeom.models import load_model

            t0 = time.perf_counter()
            self._model = load_model(self.settings.model, device=self.device)
            logger.info("loaded %s in %.1f s", self.settings.model, time.perf_counter() - t0)
        return self._model

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            from mechgeom.data import load_corpus

            s = self.settings
            self._tokens = load_corpus(
                s.corpus, self.model, n_texts=s.n_texts, seq_len=s.seq_len, seed=s.seed
            )
        return self._tokens

    def sinks_and_labels(self, n_texts: int, sink_positions: Any = None) -> dict[str, Any]:
        """``{"sinks": SinkResult, "taxonomy": TaxonomyResult}`` of the first ``n_texts`` windows from ONE
        forward pass per batch (:func:`mechgeom.collect` over a ``SinkCollector`` and a
        ``TaxonomyCollector``), run by whichever of the sinks and taxonomy stages asks first and kept for
        the other (a stage reused from disk asks for nothing)."""
        key = (n_texts, None if sink_positions is None else tuple(sink_positions))
        if key not in self._passes:
            from mechgeom.analyses.base import collect
            from mechgeom.analyses.heads.taxonomy import TaxonomyCollector
            from mechgeom.analyses.sinks import SinkCollector

            m = self.model
            cols = [
                SinkCollector(m, sink_positions=sink_positions),
                TaxonomyCollector(m, sink_positions=sink_positions, corpus=self.settings.corpus),
            ]
            sinks, labels = collect(
                m, self.tokens[:n_texts], cols, desc="sinks and taxonomy", verbose=self.verbose
            )
            self._passes[key] = {"sinks": sinks, "taxonomy": labels}
        return self._passes[key]

    def str_tokens(self, row: int = 0) -> list[str]:
        from mechgeom.hooks.validation import token_strings

        toks = self.tokens[row]
        strings = token_strings(self.model, toks[None])
        return [f"t{int(t)}" for t in toks] if strings is None else strings[0]


@dataclass(frozen=True)
class Stage:
    """One section of the report: the module it needs, its settings and the function that runs it."""

    name: str
    title: str
    module: str
    params: Callable[[ReportSettings], dict[str, Any]]
    run: Callable[[StageContext, dict[str, Any]], StageOutput]
    description: str = ""
