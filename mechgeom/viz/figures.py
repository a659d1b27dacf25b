"""Every figure of mechgeom: each function draws a result (or its table) and returns a matplotlib ``Figure``.

The figures are plain ``matplotlib.figure.Figure`` objects, not pyplot-managed: no backend is switched, so
inline plots in a notebook keep working, and nothing stays open. A function that takes ``path`` also writes
the figure there atomically. Nothing here computes an analysis.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from mechgeom._io import atomic_write
from mechgeom.analyses.faithfulness.curves import MODES
from mechgeom.analyses.heads.taxonomy import LABELS, REGIME_COLORS, check_table
from mechgeom.analyses.sinks import SinkAblationResult, convex_norm
from mechgeom.analyses.sinks.statistics import SinkResult
from mechgeom.typing import Tensor

__all__ = [
    "plot_cone_shift",
    "plot_convexity_curves",
    "plot_curves",
    "plot_head_heatmaps",
    "plot_rate_vs_ratio",
    "plot_regime_grid",
    "plot_retention",
    "plot_sink_rate_vs_s_star",
    "save_png",
]


def save_png(fig: Figure, path: str | Path, *, dpi: int = 100) -> Path:
    """Write a figure to ``path`` as PNG through :func:`mechgeom._io.atomic_write`; returns the path."""
    path = Path(path)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    if "matplotlib.pyplot" in sys.modules:  # a pyplot figure would otherwise stay open
        sys.modules["matplotlib.pyplot"].close(fig)
    return path


# --------------------------------------------------------------------------- per-head tables


def plot_head_heatmaps(df: pd.DataFrame, cols: Sequence[tuple[str, str]]) -> Figure:
    """One ``layer x head`` heatmap per ``(column, title)`` of a per-head table (integer ``layer``/``head``),
    side by side with a shared layer axis (e.g. the contribution overview's ``heads`` table)."""
    fig = Figure(figsize=(3.4 * len(cols), 3.6))
    axes = fig.subplots(1, len(cols), sharey=True, squeeze=False)[0]
    for ax, (col, title) in zip(axes, cols, strict=True):
        grid = df.pivot(index="layer", columns="head", values=col)
        im = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", cmap="viridis", origin="lower")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("head")
        fig.colorbar(im, ax=ax, fraction=0.046)
    axes[0].set_ylabel("layer")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- faithfulness (mechgeom.analyses.faithfulness.curves)


def plot_curves(
    frame: pd.DataFrame,
    path: str | Path | None = None,
    *,
    y: str | None = None,
    task: str | None = None,
    title: str | None = None,
    yscale: str | None = None,
) -> Any:
    """Comprehensiveness and sufficiency curves side by side: ``y`` vs removal rate, one line per metric,
    with the bootstrap band (``ci_low``/``ci_high``) shaded.

    ``y`` defaults to ``delta_ppl`` (or ``delta_accuracy`` for a task table; then ``task`` picks the rows,
    default ``"all"`` or the only task). ``yscale`` defaults to ``"symlog"`` for ``delta_ppl`` (ΔPPL spans
    orders of magnitude between low and high removal rates; linear below 1) and ``"linear"`` otherwise.
    Returns the matplotlib ``Figure``; with ``path`` (``.png`` or ``.svg``) it is also saved atomically.
    """
    if frame.empty:
        raise ValueError("empty table: nothing to plot")
    if y is None:
        y = "delta_ppl" if "delta_ppl" in frame.columns else "delta_accuracy"
    if y not in frame.columns:
        raise ValueError(f"column {y!r} is not in the table; columns are {list(frame.columns)}")
    if "task" in frame.columns:
        tasks = list(dict.fromkeys(frame["task"]))
        pick = task if task is not None else ("all" if "all" in tasks else tasks[0])
        if pick not in tasks:
            raise ValueError(f"task {pick!r} is not in the table; tasks are {tasks}")
        frame = frame[frame["task"] == pick]
    if path is not None and Path(path).suffix not in (".png", ".svg"):
        raise ValueError(f"figure path must end in .png or .svg, got {Path(path).name!r}")
    if yscale is None:
        yscale = "symlog" if y == "delta_ppl" else "linear"
    if yscale not in ("linear", "symlog", "log"):
        raise ValueError(f"yscale must be 'linear', 'symlog' or 'log', got {yscale!r}")
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    axes = fig.subplots(1, 2, sharex=True)
    for ax, mode in zip(axes, MODES, strict=True):
        sub = frame[frame["mode"] == mode]
        for metric in dict.fromkeys(sub["metric"]):
            d = sub[sub["metric"] == metric].sort_values("rate")
            style = {"color": "grey", "linestyle": "--"} if metric == "random" else {}
            (line,) = ax.plot(d["rate"], d[y], marker="o", markersize=3, label=metric, **style)
            if {"ci_low", "ci_high"} <= set(d.columns):
                ax.fill_between(
                    d["rate"], d["ci_low"], d["ci_high"], color=line.get_color(), alpha=0.12, lw=0
                )
        ax.set_title(f"{mode} ({'higher' if mode == 'comprehensiveness' else 'lower'} = more faithful)")
        ax.set_xlabel("removal rate")
        ax.set_ylabel(y.replace("_", " "))
        ax.axhline(0, color="black", lw=0.5)
        if yscale == "symlog":
            ax.set_yscale("symlog", linthresh=1.0)
        else:
            ax.set_yscale(yscale)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    if path is not None:
        p = Path(path)
        with atomic_write(p, "wb") as f:
            fig.savefig(f, format=p.suffix[1:], dpi=100)
    return fig


# --------------------------------------------------------------------------- sinks (mechgeom.analyses.sinks.statistics)


def _new_axes(ax: Any, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    """``ax`` and its figure, or a new ``Figure`` (not pyplot-managed: no backend is touched) with one axes."""
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, dpi=100)
    return fig, fig.subplots()


def plot_rate_vs_ratio(result: SinkResult, *, space: Literal["v", "vt"] = "vt", ax: Any = None) -> Figure:
    """Scatter of each head's sink rate against its sink norm ratio (log scale), coloured by layer."""
    df = result.to_frame()
    fig, ax = _new_axes(ax, (5.0, 3.8))
    col = f"norm_ratio_{space}"
    sc = ax.scatter(df["sink_rate"], df[col], c=df["layer"], cmap="viridis", s=14)
    ax.set_yscale("log")
    ax.axhspan(0.1, 1 / 3, color="0.85", zorder=0, label="paper B: 3–10× smaller")
    ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
    ax.set_xlabel("sink rate (mean attention mass on the sink)")
    ax.set_ylabel(f"sink norm ratio ({'value' if space == 'v' else 'projected'} space)")
    ax.legend(loc="best", fontsize=8)
    fig.colorbar(sc, ax=ax, label="layer")
    ax.set_title(result.model_name or "sinks", fontsize=9)
    fig.tight_layout()
    return fig


def plot_convexity_curves(
    result: SinkResult,
    heads: Sequence[tuple[int, int]],
    *,
    measured: dict[tuple[int, int], tuple[Sequence[float], Tensor]] | None = None,
    n_queries: int = 6,
    text: int = 0,
) -> Figure:
    """``‖o(s)‖ / ‖m‖`` against the sink mass ``s`` for a few ``(layer, head)``: thin lines for
    ``n_queries`` queries of ``text``, the measured sink rate (dot) and ``s*`` (cross) of each.
    ``measured[(layer, head)] = (s_values, norms [grid, q])`` overlays the intervention's points."""
    grid = torch.linspace(0, 1, 51, dtype=torch.float64)
    fig = Figure(figsize=(3.0 * len(heads), 2.8), dpi=100)
    axes = fig.subplots(1, len(heads), squeeze=False)
    curve, st = result.norm_curve(grid), result.s_star()
    q_all = torch.nonzero(torch.isfinite(result.sink_mass[text, 0, 0])).flatten()
    q_sel = (
        q_all[torch.linspace(0, len(q_all) - 1, min(n_queries, len(q_all))).long()] if len(q_all) else q_all
    )
    for ax, (layer, head) in zip(axes[0], heads, strict=True):
        li = result.layer_index(layer)
        for k, q in enumerate(q_sel.tolist()):
            idx = (text, li, head, q)
            ref = float(result.sq_mean[idx].sqrt())
            color = f"C{k % 10}"
            ax.plot(grid, curve[idx] / ref, color=color, lw=1)
            for s_pt, marker in ((result.sink_mass[idx], "o"), (st[idx].clamp(0, 1), "x")):
                y = convex_norm(result.sq_sink[idx], result.cross[idx], result.sq_mean[idx], float(s_pt))
                ax.plot([float(s_pt)], [float(y) / ref], marker, color=color, ms=4)
            if measured is not None and (layer, head) in measured:
                s_vals, norms = measured[(layer, head)]
                ax.plot(list(s_vals), (norms[:, q] / ref).tolist(), "s", mfc="none", color=color, ms=5)
        ax.set_title(f"L{layer} H{head}", fontsize=9)
        ax.set_xlabel("sink mass s")
    axes[0][0].set_ylabel("‖o(s)‖ / ‖m‖")
    note = "lines: closed form; dot: measured sink rate; x: s* (clipped to [0, 1])"
    fig.suptitle(note + ("; squares: intervention" if measured else ""), fontsize=8)
    fig.tight_layout()
    return fig


def plot_sink_rate_vs_s_star(result: SinkResult, *, ax: Any = None) -> Figure:
    """Per head: the measured sink rate against the median ``s*`` (diagonal: a head at its norm minimum)."""
    df = result.to_frame().drop_duplicates(["layer", "head"])
    fig, ax = _new_axes(ax, (4.2, 3.8))
    sc = ax.scatter(df["s_star_median"], df["sink_rate"], c=df["layer"], cmap="viridis", s=14)
    ax.plot([0, 1], [0, 1], color="0.5", lw=0.8, ls="--")
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("median s* (norm-minimising sink mass)")
    ax.set_ylabel("measured sink rate")
    fig.colorbar(sc, ax=ax, label="layer")
    fig.tight_layout()
    return fig


def plot_cone_shift(ablation: SinkAblationResult, *, ax: Any = None) -> Figure:
    """Per ablated head: ``cos(o, mu)`` clean (x) against ablated (y), sink ablation vs its control."""
    df = ablation.to_frame()
    df = df[df["ablated"]]
    fig, ax = _new_axes(ax, (4.2, 3.8))
    ax.scatter(
        df["cone_cos_clean"], df["cone_cos_control"], s=10, color="0.6", label="control (random position)"
    )
    ax.scatter(df["cone_cos_clean"], df["cone_cos_sink"], s=10, color="C3", label="sink ablated")
    ax.plot([-1, 1], [-1, 1], color="0.5", lw=0.8, ls="--")
    ax.set_xlabel("cos(o, mu) clean")
    ax.set_ylabel("cos(o, mu) ablated")
    ax.set_title(f"{ablation.mode} ablation, {len(ablation.layers)} layer(s)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- taxonomy (mechgeom.analyses.heads.taxonomy)


def plot_regime_grid(table: pd.DataFrame, *, ax: Any = None, title: str | None = None) -> Any:
    """A layer × head grid coloured by regime (matplotlib); returns the figure."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    check_table(table)
    layers = sorted(table["layer"].unique())
    n_heads = int(table["head"].max()) + 1
    grid = np.full((len(layers), n_heads), np.nan)
    li = {la: i for i, la in enumerate(layers)}
    for la, hd, lab in zip(table["layer"], table["head"], table["label"], strict=True):
        grid[li[la], int(hd)] = LABELS.index(lab)
    if ax is None:
        fig = Figure(figsize=(1.2 + 0.35 * n_heads, 1.0 + 0.22 * len(layers)))
        ax = fig.subplots()
    else:
        fig = ax.figure
    cmap = ListedColormap([REGIME_COLORS[lab] for lab in LABELS])
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(LABELS) - 0.5, aspect="auto", interpolation="nearest")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([str(la) for la in layers], fontsize=6)
    ax.tick_params(axis="x", labelsize=6)
    ax.legend(
        handles=[Patch(color=REGIME_COLORS[lab], label=lab) for lab in LABELS],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=7,
        frameon=False,
    )
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- pruning (mechgeom.analyses.heads.pruning)


def plot_retention(frame: pd.DataFrame, path: str | Path | None = None, *, title: str = "") -> Figure:
    """One panel per corpus (PPL, log scale) and per task (accuracy) against retention.

    Returns the ``Figure``; with ``path`` it is also written there as PNG (atomically)."""
    panels = list(dict.fromkeys(frame["corpus"]))
    fig = Figure(figsize=(4.2 * len(panels), 3.4))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, corpus in zip(axes[0], panels, strict=True):
        sub = frame[frame["corpus"] == corpus]
        is_task = sub["ppl"].isna().all()
        for name, grp in sub.groupby("order", sort=False):
            grp = grp.sort_values("retention")
            ax.plot(
                grp["retention"] * 100,
                grp["accuracy" if is_task else "ppl"],
                marker="o",
                ms=3,
                label=str(name),
            )
        ax.set_xlabel("heads kept (%)")
        ax.set_ylabel("accuracy" if is_task else "perplexity")
        if not is_task:
            ax.set_yscale("log")
        ax.invert_xaxis()
        ax.set_title(corpus)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if path is not None:
        with atomic_write(Path(path), "wb") as f:
            fig.savefig(f, format="png", dpi=80)
    return fig
