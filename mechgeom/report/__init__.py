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

The package only composes: each analysis has one driver (:mod:`mechgeom.report.drivers`) that the report's
stage, ``mechgeom run <analysis>`` (:mod:`mechgeom.report.runs`) and ``mechgeom sweep``
(:mod:`mechgeom.report.sweeps`) all call; the numbers come from the analyses and their ``summary()``, the
figures from :mod:`mechgeom.viz`. Modules: :mod:`~mechgeom.report.options` (the command line's vocabulary),
:mod:`~mechgeom.report.base` (settings, stages, records), :mod:`~mechgeom.report.html` (the page),
:mod:`~mechgeom.report.stages` and :mod:`~mechgeom.report.encoder_stages` (the stages),
:mod:`~mechgeom.report.build` (the driver on :mod:`mechgeom.sweep`).

Names are imported on first use, so ``import mechgeom.report.options`` (the command line) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mechgeom._lazy import lazy_exports

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "PRESETS": "mechgeom.report.options",
    "ReportResult": "mechgeom.report.base",
    "ReportSettings": "mechgeom.report.base",
    "Stage": "mechgeom.report.base",
    "StageContext": "mechgeom.report.base",
    "StageOutput": "mechgeom.report.base",
    "StageRecord": "mechgeom.report.base",
    "build_report": "mechgeom.report.build",
    "stage_store": "mechgeom.report.build",
    "contributions_html": "mechgeom.report.html",
    "figure_png": "mechgeom.report.html",
    "html_document": "mechgeom.report.html",
    "STAGES": "mechgeom.report.stages",
    "faithfulness_order": "mechgeom.report.drivers.faithfulness",
    "spread_layers": "mechgeom.report.drivers.selection",
}
_SUBMODULES = ("base", "build", "drivers", "encoder_stages", "html", "options", "runs", "stages", "sweeps")

__all__ = [*sorted(_EXPORTS), "build"]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS, _SUBMODULES)


if TYPE_CHECKING:  # the same names, for type checkers and editors
    from mechgeom.report import build as build
    from mechgeom.report.base import (
        ReportResult as ReportResult,
        ReportSettings as ReportSettings,
        Stage as Stage,
        StageContext as StageContext,
        StageOutput as StageOutput,
        StageRecord as StageRecord,
    )
    from mechgeom.report.build import build_report as build_report, stage_store as stage_store
    from mechgeom.report.drivers.faithfulness import faithfulness_order as faithfulness_order
    from mechgeom.report.drivers.selection import spread_layers as spread_layers
    from mechgeom.report.html import (
        contributions_html as contributions_html,
        figure_png as figure_png,
        html_document as html_document,
    )
    from mechgeom.report.options import PRESETS as PRESETS
    from mechgeom.report.stages import STAGES as STAGES
