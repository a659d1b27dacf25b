"""Figures of token-selection geometry (:mod:`mechgeom.analyses.selection.collector`), as plain matplotlib ``Figure``s.

Both functions draw tables of a :class:`mechgeom.analyses.selection.SelectionResult` (its ``to_frame()`` and
``by_n_frame()``) and return a ``matplotlib.figure.Figure``: no pyplot state, no backend switch, nothing left
open. Save one with :func:`mechgeom.viz.save_png`. Nothing here computes an analysis.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from mechgeom._deprecation import warn_deprecated

__all__ = ["plot_selection_scores", "plot_selection_vs_n"]

_SCORE_COLUMNS = ("f_top", "f_random", "f_nosink", "bound", "bound_ideal")


def _check_columns(frame: pd.DataFrame, columns: tuple[str, ...], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what} lacks column(s) {missing}; use SelectionResult.to_frame()")


def _draw_scores_vs_n(ax: Any, n: Any, table: Any, lines: tuple[tuple[str, str, str], ...]) -> None:
    """The left panel: ``table[col]`` against ``n`` for each ``(col, label, style)`` of ``lines``, log2 ``N``."""
    for col, label, style in lines:
        ax.plot(n, table[col], style, ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N")
    ax.set_ylabel("mean extreme F-score")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _draw_predicted_vs_measured(
    ax: Any, frame: pd.DataFrame, size: float, labels: tuple[str, str, str]
) -> None:
    """The right panel: one point of ``size`` per (head, ``N``), ``bound_ideal`` against the measured ``f_top``,
    coloured by log2 ``N``, with the diagonal; ``labels`` are the x label, the y label and the title."""
    ax.scatter(frame["bound_ideal"], frame["f_top"], s=size, c=np.log2(frame["N"]), cmap="viridis")
    ax.plot([0, 1], [0, 1], color="0.5", lw=0.8, ls="--")
    xlabel, ylabel, title = labels
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


def plot_selection_scores(frame: pd.DataFrame, params: pd.DataFrame | None = None) -> Figure:
    """The report's former selection figure: mean extreme F-score vs ``N`` (left), predicted vs measured (right).

    ``frame`` is ``SelectionResult.to_frame()``. Left: per ``N`` the mean over heads of ``f_top`` (top-``N``),
    ``f_random`` (random ``N``-subsets), ``f_nosink`` (sink excluded) and ``bound`` (the fitted sink-aware
    bound), log2 ``N`` axis. Right: one point per (head, ``N``), the constant-norm prediction ``bound_ideal``
    against the measured ``f_top``, coloured by log2 ``N``, with the diagonal. ``params``
    (``SelectionResult.params_frame()``) is accepted for the report's call and not drawn.

    Deprecated: the report and ``mechgeom run selection`` both draw :func:`plot_selection_vs_n`.
    """
    warn_deprecated("plot_selection_scores(frame, params)", "plot_selection_vs_n(result.by_n_frame(), frame)")
    _check_columns(frame, ("N", *_SCORE_COLUMNS), "selection table")
    fig = Figure(figsize=(9, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    means = frame.groupby("N")[list(_SCORE_COLUMNS)].mean()
    lines = (
        ("f_top", "top-N", "-o"),
        ("f_random", "random N-subsets", "--o"),
        ("f_nosink", "top-N, sink excluded", "-s"),
        ("bound", "sink-aware bound (fitted)", ":"),
    )
    _draw_scores_vs_n(ax1, means.index, means, lines)
    labels = ("constant-norm prediction", "measured F_N (per head)", "predicted vs measured")
    _draw_predicted_vs_measured(ax2, frame, 6, labels)
    fig.tight_layout()
    return fig


def plot_selection_vs_n(by_n: pd.DataFrame, frame: pd.DataFrame, title: str = "") -> Figure:
    """The selection figure (of the report and of ``mechgeom run selection``): the per-``N`` means of ``by_n`` (left), predicted vs measured (right).

    ``by_n`` is ``SelectionResult.by_n_frame()`` (one row per ``N``), ``frame`` is ``to_frame()``. Left:
    ``f_top``, ``f_random``, ``f_nosink``, the constant-norm prediction ``bound_ideal`` and the guaranteed
    ``bound`` against ``N`` (log2 axis, y in ``[0, 1.02]``), titled ``title``. Right: one point per (head,
    ``N``), ``bound_ideal`` against the measured ``f_top``, coloured by log2 ``N``, with the diagonal.
    """
    _check_columns(by_n, ("N", *_SCORE_COLUMNS), "per-N table")
    _check_columns(frame, ("N", "f_top", "bound_ideal"), "selection table")
    fig = Figure(figsize=(9, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    lines = (
        ("f_top", "top-N", "-o"),
        ("f_random", "random N-subsets", "--o"),
        ("f_nosink", "top-N, sink excluded", "-s"),
        ("bound_ideal", "constant-norm prediction", "-.^"),
        ("bound", "sink-aware bound (guaranteed)", ":v"),
    )
    _draw_scores_vs_n(ax1, by_n["N"], by_n, lines)
    ax1.set_ylim(0, 1.02)
    ax1.set_title(title, fontsize=9)
    labels = (
        "constant-norm prediction (per head, N)",
        "measured mean F_N",
        "predicted vs measured (colour: log2 N)",
    )
    _draw_predicted_vs_measured(ax2, frame, 4, labels)
    fig.tight_layout()
    return fig
