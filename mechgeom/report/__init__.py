"""The report: every analysis on one model and corpus, in one offline HTML file plus one table per analysis.

:func:`build_report` runs the stages of :data:`STAGES` in order (contribution weights vs attention,
faithfulness curves, sinks and convexity, selection geometry, head taxonomy, pruning) and writes, under
``out_dir``:

- ``report.html``: one self-contained page that renders offline: figures are embedded as base64 PNG,
  circuitsvis views carry the bundled JavaScript once (``local_src``, no CDN), tables are HTML;
- ``<stage>.csv`` (and a few companion tables): the numbers behind each section;
- ``figures/*.png``: the same figures as files;
- ``stages/stages.csv``: the stage store of the sweep engine (one row per finished stage: its settings,
  parameters, files and time) and ``stages/<stage>.html``, the rendered section. A rerun with the same
  settings reuses a stage whose row and files are present (an interrupted run resumes where it stopped); a
  stage whose settings differ is recomputed and its row replaced.

A stage whose analysis module is not installed is shown as "not available" and skipped; a stage that
raises is shown as failed (the other stages still run) and is recomputed on the next run. Every file goes
through :mod:`mechgeom._io`'s atomic writes, so an interruption never leaves a half-written file.

The package only composes: the numbers come from the analyses and their ``summary()``; the figures from
:mod:`mechgeom.viz`. Modules: :mod:`~mechgeom.report.base` (settings, stages, records),
:mod:`~mechgeom.report.html` (the page), :mod:`~mechgeom.report.stages` (the six stages),
:mod:`~mechgeom.report.build` (the driver on :mod:`mechgeom.sweep`) and :mod:`mechgeom.report.runs` (the
``mechgeom run <analysis>`` verbs).
"""

from __future__ import annotations

from mechgeom.report import build
from mechgeom.report.base import (
    PRESETS,
    ReportResult,
    ReportSettings,
    Stage,
    StageContext,
    StageOutput,
    StageRecord,
)
from mechgeom.report.build import build_report, stage_store
from mechgeom.report.html import (
    contributions_html,
    figure_png,
    html_document,
)
from mechgeom.report.stages import STAGES, faithfulness_order, spread_layers

__all__ = [
    "PRESETS",
    "STAGES",
    "ReportResult",
    "ReportSettings",
    "Stage",
    "StageContext",
    "StageOutput",
    "StageRecord",
    "build",
    "build_report",
    "contributions_html",
    "faithfulness_order",
    "figure_png",
    "html_document",
    "spread_layers",
    "stage_store",
]
